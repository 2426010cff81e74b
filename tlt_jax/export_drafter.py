"""Export a workdir's drafter as an EAGLE checkpoint for SGLang / vLLM (`tlt_jax.drafter.eagle_format`,
`tlt_jax.drafter.eagle3_format`).

    python -m tlt_jax.export_drafter --workdir W --out DIR [--engine sglang|vllm] [--force] [--dtype bfloat16]
                                     [--full-vocab]
    python -m tlt_jax.export_drafter --from-dir EXPORT --out DIR --engine vllm [--full-vocab] [--force]

`--engine` picks the layout of the serving engine's EAGLE-1 loader (default sglang; they differ in fc.bias and
in what they make of a reduced draft vocabulary: eagle_format's docstring). `--from-dir` converts an export
(e.g. a periodic one, W/exports/step_N/drafter, written in SGLang's layout) to the other engine's layout.

The drafter is the newest one in W's checkpoints:
    an RL workdir   W/checkpoints/<latest>: the spot trainer's weights, or the rollout drafter's when no
                    spot trainer trained it ("drafter" in the checkpoint tree)
    a warm-up       W/drafter/<step> (a finished warm-up) or W/train_state/<step> (one still training),
                    whichever step is newer
Its target's architecture comes from the drafter checkpoint's metadata (warm-up) or W/config.json's model
section (a model path is opened for its config only). The reduced draft vocabulary is the warm-up's
`drafter/draft_vocab.npy`, or for an RL run the one its rollouts drafted with (config.drafter: init_from's
d2t or token map, else the warm-up workdir of drafter.path). It goes to token_map.pt (SGLang's
`--speculative-token-map`); vLLM's EAGLE-1 has no reduced vocabulary, so `--engine vllm` refuses one unless
`--full-vocab` leaves it out (the drafter then drafts over the full head).

An EAGLE-3 drafter (it owns its head, `lm_head`) is written in the one EAGLE-3 layout both engines read
(`eagle3_format`: d2t / t2d in the weights, the capture points in config.json), whatever `--engine` says;
its capture points come from the warm-up's checkpoint metadata, else the RL run's drafter (init_from, the
warm-up of drafter.path, config.drafter.aux_layers, EAGLE-3's default). Its head is over its draft
vocabulary, so `--full-vocab` cannot drop one, and `--from-dir` has nothing to convert.

Checkpoints are opened read-only and only the drafter's leaves are restored (orbax partial restore): no
policy or optimizer state is read, nothing in W is written or cleaned, so a running job's workdir is safe to
export from. DIR is written atomically (`write_eagle_dir`); a non-empty DIR is replaced only with --force.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import orbax.checkpoint as ocp

from tlt_jax.drafter.draft_vocab import load_draft_vocab
from tlt_jax.drafter.eagle3_format import eagle3_export, is_eagle3_dir, load_eagle3_drafter
from tlt_jax.drafter.eagle_format import (
    ENGINES,
    HF_CONFIG_FILE,
    TLT_SECTION,
    EagleExport,
    draft_vocab_from_maps,
    for_engine,
    read_eagle_dir,
    to_eagle,
    write_eagle_dir,
)
from tlt_jax.drafter.trainer import TRAIN_STATE_DIR
from tlt_jax.drafter.warmup import DRAFTER_DIR, saved_drafter_spec
from tlt_jax.models.build import model_config_from
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.eagle3 import default_aux_layers
from tlt_jax.rl.checkpointing import CHECKPOINT_DIR
from tlt_jax.rl.speculation import drafter_dir, has_drafter
from tlt_jax.utils.export_io import read_only_manager, restore_leaves
from tlt_jax.utils.tracking import CONFIG_FILE

# (folder, the checkpoint-tree prefixes that hold the drafter's params, first match wins, what it is)
_SOURCES = (
    (CHECKPOINT_DIR, ("spot/state/params/", "drafter/"), "RL checkpoint"),
    (DRAFTER_DIR, ("",), "warm-up drafter"),
    (TRAIN_STATE_DIR, ("params/",), "warm-up train state"),
)
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class DrafterSource:
    """Where a workdir's newest drafter is: a checkpoint step and the prefix of its params' leaves."""

    directory: pathlib.Path
    step: int
    prefix: str
    leaves: dict[str, Any]  # saved leaf path (below `prefix`) -> {"shape", "dtype"}
    meta: dict[str, Any]
    kind: str

    def describe(self) -> str:
        what = {"spot/state/params/": "the spot trainer's", "drafter/": "the rollout drafter's"}.get(
            self.prefix
        )
        return f"{self.directory} step {self.step} ({what or self.kind} weights)"


def _source(directory: pathlib.Path, prefixes: Sequence[str], kind: str) -> DrafterSource | None:
    """The latest step of `directory` and the first prefix whose leaves it stores (None: no step there;
    a DrafterSource with prefix "" and no leaves: a step without a drafter)."""
    if not directory.is_dir():
        return None
    mngr = read_only_manager(directory)
    try:
        step = mngr.latest_step()
        if step is None:
            return None
        small = mngr.restore(
            step, args=ocp.args.Composite(layout=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
        )
    finally:
        mngr.close()
    leaves, meta = small["layout"]["leaves"], dict(small["meta"] or {})
    for prefix in prefixes:
        mine = {p[len(prefix) :]: v for p, v in leaves.items() if p.startswith(prefix)}
        if mine:
            return DrafterSource(directory, int(step), prefix, mine, meta, kind)
    return DrafterSource(directory, int(step), "", {}, meta, kind)


def find_drafter(workdir: str | pathlib.Path) -> DrafterSource:
    """The newest drafter checkpoint of `workdir` (see the module docstring), or a clear error."""
    wd = pathlib.Path(workdir)
    rl = _source(wd / _SOURCES[0][0], *_SOURCES[0][1:])
    if rl is not None:
        if not rl.leaves:
            raise ValueError(
                f"{rl.directory} step {rl.step} holds no EAGLE drafter: the run drafted without one "
                "(config.drafter.kind none/ngram) and trained none (config.spot.mode=off). Export the "
                "warm-up workdir its drafter came from instead, if any."
            )
        return rl
    found = [s for s in (_source(wd / d, p, k) for d, p, k in _SOURCES[1:]) if s is not None and s.leaves]
    if not found:
        looked = ", ".join(d + "/<step>" for d, _, _ in _SOURCES)
        raise FileNotFoundError(
            f"{wd} has no drafter checkpoint (looked for {looked}): "
            "point --workdir at a drafter warm-up or an RL run with an EAGLE drafter (kind=eagle, or a "
            "spot trainer), after it saved a checkpoint."
        )
    return max(found, key=lambda s: s.step)  # a tie keeps drafter/ (listed first): the finished warm-up


def read_drafter(src: DrafterSource) -> dict[str, Any]:
    """The drafter's params as a nested dict of numpy arrays (nnx's trailing "value" level dropped), restored
    alone from the checkpoint (the other leaves are never read)."""
    state = restore_leaves(src.directory, src.step, {src.prefix + k: v for k, v in src.leaves.items()})
    for k in src.prefix.split("/")[:-1]:
        state = state[k]
    return _plain(state)


def _plain(tree: Any) -> Any:
    if isinstance(tree, dict):
        if set(tree) == {"value"} and not isinstance(tree["value"], dict):
            return np.asarray(tree["value"])
        return {k: _plain(v) for k, v in tree.items()}
    return np.asarray(tree)


def load_workdir_config(workdir: str | pathlib.Path) -> mlc.ConfigDict:
    """The workdir's config.json (written by every job at its start) as a ConfigDict."""
    path = pathlib.Path(workdir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: --workdir must be the workdir of a drafter warm-up or an RL run "
            "(they write config.json when they start)."
        )
    return mlc.ConfigDict(json.loads(path.read_text()))


def target_config(config: mlc.ConfigDict, src: DrafterSource) -> ModelConfig:
    """The architecture the drafter was trained for: the warm-up's checkpoint metadata, else config.model."""
    if src.meta.get("target"):
        return ModelConfig(**src.meta["target"])
    m = config.model
    if m.get("path"):
        from tlt_jax.models.loading import load_model

        return load_model(m.path, dtype=m.dtype).config
    if m.get("arch"):
        return model_config_from(config)
    return ModelConfig(**{**dict(m.random), "dtype": m.dtype})


def workdir_draft_vocab(
    workdir: str | pathlib.Path, config: mlc.ConfigDict, src: DrafterSource, vocab_size: int
) -> np.ndarray | None:
    """The reduced vocabulary the drafter drafts with (see the module docstring), or None for the full one."""
    if src.directory.name != CHECKPOINT_DIR:  # a warm-up: its own draft vocabulary, if it built one
        return load_draft_vocab(workdir)
    section = config.get("drafter") or {}
    if section.get("init_from"):
        tensors, _ = read_eagle_dir(section["init_from"])
        return draft_vocab_from_maps(tensors, vocab_size, f"the EAGLE drafter in {section['init_from']}")
    path = section.get("path") or ""
    if section.get("kind") in ("eagle", "auto") and has_drafter(path):
        return load_draft_vocab(drafter_dir(path))
    return None


def _refuse_non_empty(out: str | pathlib.Path, force: bool) -> None:
    if not force and pathlib.Path(out).is_dir() and any(pathlib.Path(out).iterdir()):
        raise FileExistsError(
            f"--out {out} is not empty: pass --force to replace it, or choose another path."
        )


def export_drafter(
    workdir: str | pathlib.Path,
    out: str | pathlib.Path,
    force: bool = False,
    dtype: str | None = None,
    full_vocab: bool = False,
    engine: str = "sglang",
) -> tuple[pathlib.Path, DrafterSource]:
    """Export `workdir`'s newest drafter to `out` in `engine`'s layout (config.json + model.safetensors, and
    token_map.pt with a reduced vocabulary); returns (out, source)."""
    _refuse_non_empty(out, force)
    config = load_workdir_config(workdir)
    src = find_drafter(workdir)
    target = target_config(config, src)
    params = read_drafter(src)
    if "lm_head" in params:  # EAGLE-3: its own head over its draft vocabulary
        export = _eagle3(params, workdir, config, src, target, dtype, full_vocab)
    else:
        vocab = None if full_vocab else workdir_draft_vocab(workdir, config, src, target.vocab_size)
        export = to_eagle(params, target, vocab, dtype, engine)
    export.config[TLT_SECTION]["source"] = {
        "workdir": str(pathlib.Path(workdir).resolve()),
        "what": src.describe(),
    }
    return write_eagle_dir(out, export, force=force), src


def _eagle3(
    params: dict[str, Any],
    workdir: str | pathlib.Path,
    config: mlc.ConfigDict,
    src: DrafterSource,
    target: ModelConfig,
    dtype: str | None,
    full_vocab: bool,
) -> EagleExport:
    """An EAGLE-3 drafter's export (module docstring): its draft vocabulary and capture points."""
    rows = int(np.shape(params["lm_head"])[0])
    vocab = workdir_draft_vocab(workdir, config, src, target.vocab_size)
    if rows == target.vocab_size:
        vocab = None
    elif full_vocab:
        raise ValueError(
            f"{src.describe()} is an EAGLE-3 drafter whose head covers a draft vocabulary of {rows} tokens: "
            "--full-vocab cannot drop it (both engines read EAGLE-3's d2t map); leave --full-vocab out."
        )
    elif vocab is None or len(vocab) != rows:
        found = "none" if vocab is None else f"{len(vocab)} tokens"
        raise ValueError(
            f"{src.describe()}: the EAGLE-3 head has {rows} rows but the workdir's draft vocabulary is "
            f"{found}: export the workdir the drafter was trained in."
        )
    export = eagle3_export(params, target, workdir_capture_points(config, src, target), vocab)
    name = dtype or str(np.asarray(params["fc"]).dtype)  # default: as trained
    dt = jnp.dtype(name)
    tensors = {k: v.astype(dt) if v.dtype.kind == "f" else v for k, v in export.tensors.items()}
    return dataclasses.replace(export, tensors=tensors, config={**export.config, "torch_dtype": name})


def workdir_capture_points(
    config: mlc.ConfigDict, src: DrafterSource, target: ModelConfig
) -> tuple[int, ...]:
    """An EAGLE-3 drafter's capture points: the warm-up checkpoint's metadata, else what the RL run drafted
    with (init_from's config, drafter.path's warm-up metadata, config.drafter.aux_layers), else EAGLE-3's
    default (2, L // 2, L - 3)."""
    spec = src.meta.get("drafter") or {}
    if spec.get("aux_layers"):
        return tuple(int(i) for i in spec["aux_layers"])
    section = config.get("drafter") or {}
    init_from, path = section.get("init_from") or "", section.get("path") or ""
    if init_from and is_eagle3_dir(init_from):
        return tuple(load_eagle3_drafter(init_from, target)[0].aux_layers)
    if section.get("kind") in ("eagle", "auto") and has_drafter(path):
        spec = saved_drafter_spec(drafter_dir(path))
        if spec.get("aux_layers"):
            return tuple(int(i) for i in spec["aux_layers"])
    return tuple(section.get("aux_layers") or ()) or default_aux_layers(target.num_layers)


def convert_drafter(
    src: str | pathlib.Path,
    out: str | pathlib.Path,
    engine: str,
    full_vocab: bool = False,
    force: bool = False,
) -> tuple[pathlib.Path, EagleExport]:
    """The EAGLE-1 export in `src` (ours) rewritten for `engine` into `out` (eagle_format.for_engine)."""
    _refuse_non_empty(out, force)
    if is_eagle3_dir(src):
        raise ValueError(
            f"{src} is an EAGLE-3 export: SGLang and vLLM both read it as it is, there is nothing to convert."
        )
    tensors, hf_config = read_eagle_dir(src)
    export = for_engine(tensors, hf_config, engine, full_vocab)
    return write_eagle_dir(out, export, force=force), export


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", help="a drafter warm-up or RL workdir")
    source.add_argument("--from-dir", help="an EAGLE export to convert to --engine's layout")
    ap.add_argument("--out", required=True, help="the export directory (config.json + model.safetensors)")
    ap.add_argument("--engine", choices=ENGINES, default="sglang", help="the serving engine's layout")
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out")
    ap.add_argument("--dtype", choices=_DTYPES, default=None, help="tensor dtype (default: as trained)")
    ap.add_argument("--full-vocab", action="store_true", help="leave out the reduced draft vocabulary")
    args = ap.parse_args(argv)
    try:
        if args.from_dir:
            out, _ = convert_drafter(args.from_dir, args.out, args.engine, args.full_vocab, args.force)
            what = f"converted from {args.from_dir}"
        else:
            out, src = export_drafter(
                args.workdir, args.out, args.force, args.dtype, args.full_vocab, args.engine
            )
            what = f"from {src.describe()}"
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    cfg = json.loads((out / HF_CONFIG_FILE).read_text())
    size = cfg.get("draft_vocab_size")
    vocab = f"draft vocabulary {size} (token_map.pt)" if size else "full vocabulary"
    layout = (
        "EAGLE-3 drafter for sglang and vllm"
        if "Eagle3" in str(cfg["architectures"])
        else (f"EAGLE-1 drafter for {args.engine}")
    )
    print(
        f"{out}: {layout} {what}; hidden {cfg['hidden_size']}, "
        f"{cfg['torch_dtype']}, {vocab} of {cfg['vocab_size']}"
    )


if __name__ == "__main__":
    main()
