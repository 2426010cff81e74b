"""Where the GPU suite keeps what must outlive one device call, and how each call picks it up again.

On the lent GPU machine every command runs in a fresh copy of the repository: a path carried with one command
(`.gpu_bundle/a`) is gone at the next, and so is anything a phase wrote inside the repository. Files outside
it (under /root or /tmp) stay for as long as the machine is held. So the suite keeps its state outside the
repository: the stashed bundle parts, the assembled model, the installed wheels, the tuned block sizes, the
drafter, every phase's result and the XLA / inductor compilation caches. Any call resumes from what is there.

The folder: `--state-dir`, else `$TLT_GPU_STATE`, else /root/keep/gpu_suite, else <tmp>/tlt_gpu_suite (the
first that can be created and written); a dry run keeps its own under --out. Layout:

    bundle/a, bundle/b      the carried bundle parts, copied here as each arrives (`stash_bundle`)
    models/<gguf>           the model assembled from them (once per lease); the repository's
                            .cache/models/<gguf> is made a link to it in every call that needs it
    site/                   the bundle's wheels, installed once per bundle manifest
    results/<phase>.json    each phase's latest result (the report covers the whole lease)
    jax_cache/, torch_cache/, tuned_block_sizes.json, drafter/, <phase>.json|xml ...
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
import uuid

from gpu import bundle

ROOT = pathlib.Path(__file__).resolve().parents[1]
STATE_ENV = "TLT_GPU_STATE"
DEFAULT_STATE = pathlib.Path("/root/keep/gpu_suite")
FALLBACK_STATE = pathlib.Path(tempfile.gettempdir()) / "tlt_gpu_suite"
PARTS = ("a", "b")


def inside_repo(path: pathlib.Path) -> bool:
    """Whether `path` lies in this repository (where a device call's files do not survive the call)."""
    return path.resolve().is_relative_to(ROOT)


def writable(path: pathlib.Path) -> bool:
    """Whether `path` can be created (if missing) and written to."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{uuid.uuid4().hex}"
        probe.write_text("")
        probe.unlink()
        return True
    except OSError:
        return False


def choose_state_dir(explicit: str, dry: bool, out: pathlib.Path) -> tuple[pathlib.Path, str]:
    """The state folder and why it was chosen (see the module docstring for the order)."""
    if explicit:
        return pathlib.Path(explicit).resolve(), "--state-dir"
    if dry:
        return out / "state", "a dry run's own, under --out"
    if os.environ.get(STATE_ENV):
        return pathlib.Path(os.environ[STATE_ENV]).resolve(), f"${STATE_ENV}"
    for cand in (DEFAULT_STATE, FALLBACK_STATE):
        if writable(cand):
            return cand, "default" if cand == DEFAULT_STATE else f"{DEFAULT_STATE} is not writable"
    raise OSError(f"neither {DEFAULT_STATE} nor {FALLBACK_STATE} is writable: pass --state-dir")


def _manifest(part: pathlib.Path) -> str:
    path = part / bundle.MANIFEST
    return path.read_text() if path.is_file() else ""


def _same_part(src: pathlib.Path, dst: pathlib.Path) -> bool:
    """The stash already holds this part: same manifest, every file present with the same size (the hashes
    are checked when the model is assembled and the wheels installed)."""
    if not _manifest(dst) or _manifest(src) != _manifest(dst):
        return False
    for f in src.rglob("*"):
        g = dst / f.relative_to(src)
        if f.is_file() and not (g.is_file() and g.stat().st_size == f.stat().st_size):
            return False
    return True


def stash_bundle(carried: pathlib.Path, stash: pathlib.Path) -> dict[str, str]:
    """Copy each bundle part that arrived with this call (`carried`/a, /b) into `stash`, where the next calls
    find it; a stashed part of another bundle build (a different manifest) is dropped, since parts of two
    builds cannot be combined. Returns what happened to each part."""
    notes: dict[str, str] = {}
    arrived = [p for p in PARTS if _manifest(carried / p)]
    for part in PARTS:
        src, dst = carried / part, stash / part
        if part not in arrived:
            notes[part] = "stashed by an earlier call" if _manifest(dst) else "not here yet"
            continue
        if dst.exists() and src.resolve() == dst.resolve():
            notes[part] = "carried folder is the stash"
            continue
        if _same_part(src, dst):
            notes[part] = "already stashed"
            continue
        tmp = stash / f".{part}.incoming"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        shutil.rmtree(dst, ignore_errors=True)
        os.replace(tmp, dst)
        notes[part] = "stashed"
    if arrived:
        newest = _manifest(carried / arrived[0])
        for part in PARTS:
            if part not in arrived and _manifest(stash / part) and _manifest(stash / part) != newest:
                shutil.rmtree(stash / part)
                notes[part] = "dropped: from another bundle build"
    return notes


def link_model(model: pathlib.Path, repo_path: pathlib.Path) -> str:
    """Make the repository's model path (where the scripts read it) point at the assembled `model` in the
    state folder; a file already there that is byte-identical (sha256) is left alone. Returns what it did."""
    if repo_path.is_symlink() and repo_path.resolve() == model.resolve():
        return "linked already"
    if repo_path.is_file() and not repo_path.is_symlink():
        if bundle.sha256(repo_path) == bundle.sha256(model):
            return "the repository's own copy is identical"
    repo_path.parent.mkdir(parents=True, exist_ok=True)
    repo_path.unlink(missing_ok=True)
    repo_path.symlink_to(model.resolve())
    return "linked"


def assemble_and_link(stash: pathlib.Path, state: pathlib.Path, repo_path: pathlib.Path) -> dict:
    """The model from the stashed parts into state/models (a no-op once it matches the manifest), then linked
    from `repo_path`. Raises bundle.BundleError when a part is missing or corrupt."""
    info = bundle.assemble_model(stash, state / "models" / repo_path.name)
    info["repo_path"] = f"{repo_path}: {link_model(pathlib.Path(info['path']), repo_path)}"
    return info
