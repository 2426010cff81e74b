"""Export an RL workdir's trained policy as a HF checkpoint that transformers, vLLM and SGLang load.

    python -m tlt_jax.export_policy --workdir W --out DIR [--step N] [--dtype bfloat16] [--force]

The policy is W/checkpoints/<step> (the newest, or --step N): its "params" leaves, restored alone (orbax
partial restore, read-only: nothing in W is written or cleaned, so a running job's workdir is safe to export
from). With config.trainer.train_layers > 0 the frozen layers (embedding, tied head, lower layers) are not in
the checkpoint: they are rebuilt from the model W/config.json names (config.model: a checkpoint path, or a
random model and its seed), exactly as the run built them, and checked against the fingerprint the
checkpoint stores. Layers stored stacked (config.trainer.scan_layers) are split per layer; the fused layouts
are split back into HF names (`tlt_jax.models.hf_export`). DIR gets

    config.json                       LlamaForCausalLM / Qwen2ForCausalLM (config.model.path's own
                                      config.json when it is a HF directory, torch_dtype set to the export's)
    model-0000k-of-0000n.safetensors  shards of at most 5 GB, and model.safetensors.index.json
    tokenizer files                   copied from config.model.path's directory, else written from the run's
                                      tokenizer (a GGUF's, or the tiny models' ByteTokenizer); none for a
                                      random-weight preset (config.model.arch with init=random: no text)
    generation_config.json            the source's, else bos/eos ids from the tokenizer

--dtype defaults to config.model.dtype (the dtype the policy computed in; the checkpoint holds float32
masters). The arrays go through JAX's default device (JAX_PLATFORMS=cpu keeps them on the host, which then
needs room for the base model and the checkpoint's float32 parameters). DIR is written into a temporary
sibling folder and renamed into place; a non-empty DIR is replaced only with --force.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import ml_collections as mlc
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from tlt_jax.models.build import TextCodec, build_model_and_tokenizer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.hf_export import EXPORT_DTYPES, params_to_hf
from tlt_jax.rl.checkpointing import CHECKPOINT_DIR
from tlt_jax.rl.exports import write_policy_dir
from tlt_jax.utils.checkpoint import flatten_paths
from tlt_jax.utils.export_io import read_only_manager, restore_leaves, write_atomically
from tlt_jax.utils.tracking import CONFIG_FILE

_PARAMS, _FROZEN = "params/", "frozen/"


@dataclasses.dataclass(frozen=True)
class PolicySource:
    """A checkpoint step of an RL workdir and the saved leaves of its policy (path -> {"shape", "dtype"})."""

    directory: pathlib.Path
    step: int
    params: dict[str, Any]  # "params/..." leaves, the trained parameters
    frozen: dict[str, Any]  # "frozen/..." leaves, the fingerprint of those not stored (empty: all stored)

    def describe(self) -> str:
        frozen = f", frozen layers rebuilt ({len(self.frozen)} leaves)" if self.frozen else ""
        return f"{self.directory} step {self.step}{frozen}"


def rl_workdir_config(workdir: str | pathlib.Path) -> mlc.ConfigDict:
    """The run's config.json (every job writes it when it starts), or a clear error."""
    path = pathlib.Path(workdir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: --workdir must be the workdir of an RL run (`python -m tlt_jax.main "
            "--workdir W` writes W/config.json when it starts)."
        )
    config = mlc.ConfigDict(json.loads(path.read_text()))
    if config.get("job", "grpo") != "grpo":
        raise ValueError(
            f"{path} is a {config.job!r} job's config: --workdir must be an RL (job=grpo) workdir; a drafter "
            "warm-up's drafter is exported by `python -m tlt_jax.export_drafter`."
        )
    return config


def find_policy(workdir: str | pathlib.Path, step: int | None = None) -> PolicySource:
    """Checkpoint `step` (default: the newest) of `workdir`'s policy, or a clear error."""
    directory = pathlib.Path(workdir) / CHECKPOINT_DIR
    mngr = read_only_manager(directory) if directory.is_dir() else None
    try:
        steps = sorted(mngr.all_steps()) if mngr is not None else []
        if not steps:
            raise FileNotFoundError(
                f"{directory} holds no finalised checkpoint: the run has not saved one yet (it saves every "
                "config.checkpoint_every steps and at the end)."
            )
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise FileNotFoundError(f"{directory} has no checkpoint step {step}; it has {steps}.")
        layout = mngr.restore(step, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))["layout"]
    finally:
        if mngr is not None:
            mngr.close()
    leaves = layout["leaves"]
    params = {p: v for p, v in leaves.items() if p.startswith(_PARAMS)}
    if not params:
        raise ValueError(f"{directory} step {step} holds no policy parameters ('params/' leaves).")
    frozen = {p: v for p, v in leaves.items() if p.startswith(_FROZEN)}
    return PolicySource(directory, step, params, frozen)


def _restore(src: PolicySource, leaves: dict[str, Any]) -> dict[str, np.ndarray]:
    """The saved `leaves` (checkpoint path -> spec) as numpy arrays by path; no other leaf is read."""
    state = restore_leaves(src.directory, src.step, leaves)
    return {p: np.asarray(x) for p, x in flatten_paths(state)[0]}


def _param_path(saved: str, prefix: str) -> str:
    """'params/layers/0/attn/qkv/value' -> 'layers/0/attn/qkv' (`hf_export.param_shapes`' paths)."""
    return saved[len(prefix) :].removesuffix("/value")


def _per_layer(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A stacked checkpoint's 'layers/attn/qkv' [L, ...] as 'layers/<i>/attn/qkv' (the unrolled layout the
    export and the rebuilt model name); other paths as they are."""
    out = {}
    for path, x in flat.items():
        head, _, rest = path.partition("/")
        if head == "layers" and not rest.split("/")[0].isdigit():
            out.update({f"layers/{i}/{rest}": x[i] for i in range(x.shape[0])})
        else:
            out[path] = x
    return out


def _check_frozen(src: PolicySource, rebuilt: dict[str, np.ndarray]) -> None:
    """The rebuilt frozen layers against the checkpoint's fingerprint ([sum, sum of squares] per leaf)."""
    saved = {_param_path(p, _FROZEN): v for p, v in _restore(src, src.frozen).items()}
    bad = []
    for path, fp in saved.items():
        x = rebuilt[path].astype(np.float32)
        if not np.allclose([x.sum(), (x * x).sum()], fp, rtol=1e-4, atol=1e-6):
            bad.append(path)
    if bad:
        raise ValueError(
            f"{src.describe()}: the frozen layers rebuilt from config.model differ from the run's at "
            f"{', '.join(bad[:4])}: the model file named in the workdir's config.json changed since the run "
            "(restore it, or point config.json's model.path at the run's model)."
        )


def policy_params(
    config: mlc.ConfigDict, src: PolicySource
) -> tuple[ModelConfig, dict[str, np.ndarray], TextCodec]:
    """The policy's architecture, every parameter by path (trained ones from the checkpoint, frozen ones
    rebuilt from config.model and checked) and the run's tokenizer."""
    model, tokenizer = build_model_and_tokenizer(config)
    cfg = model.cfg
    flat = {
        _param_path(p, ""): np.asarray(x)
        for p, x in flatten_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
    }
    del model
    trained = _per_layer({_param_path(p, _PARAMS): x for p, x in _restore(src, src.params).items()})
    unknown = sorted(set(trained) - set(flat))
    if unknown:
        raise ValueError(
            f"{src.describe()} holds parameters {unknown[:4]} that the model of the workdir's config.json "
            f"({cfg.architecture}, {cfg.num_layers} layers) does not have: config.json's model changed."
        )
    if src.frozen:
        _check_frozen(src, {k: v for k, v in flat.items() if k not in trained})
    elif set(trained) != set(flat):
        missing = sorted(set(flat) - set(trained))
        raise ValueError(f"{src.describe()} lacks the parameters {missing[:4]} and stores no frozen layers.")
    flat.update(trained)
    return cfg, flat, tokenizer


def export_policy(
    workdir: str | pathlib.Path,
    out: str | pathlib.Path,
    step: int | None = None,
    dtype: str | None = None,
    force: bool = False,
) -> tuple[pathlib.Path, PolicySource, str]:
    """Export `workdir`'s policy (checkpoint `step`, default the newest) to `out` as a HF checkpoint; returns
    (out, the checkpoint, what tokenizer was written)."""
    target = pathlib.Path(out)
    if not force and target.is_dir() and any(target.iterdir()):
        raise FileExistsError(
            f"--out {out} is not empty: pass --force to replace it, or choose another path."
        )
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {sorted(EXPORT_DTYPES)}.")
    config = rl_workdir_config(workdir)
    src = find_policy(workdir, step)
    cfg, flat, codec = policy_params(config, src)
    dtype = dtype or config.model.get("dtype", "float32")
    tensors = {k: v.astype(EXPORT_DTYPES[dtype]) for k, v in params_to_hf(cfg, flat).items()}
    del flat
    provenance = {"workdir": str(pathlib.Path(workdir).resolve()), "step": src.step}
    written: list[str] = []

    def fill(tmp: pathlib.Path) -> None:
        written.append(write_policy_dir(tmp, config, cfg, tensors, codec, dtype, provenance))

    return write_atomically(out, force, fill), src, written[0]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="an RL run's workdir (holds config.json, checkpoints/)")
    ap.add_argument("--out", required=True, help="the export directory (a HF model directory)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    ap.add_argument(
        "--dtype", choices=sorted(EXPORT_DTYPES), default=None, help="default: config.model.dtype"
    )
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out")
    args = ap.parse_args(argv)
    try:
        out, src, tok = export_policy(args.workdir, args.out, args.step, args.dtype, args.force)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    cfg = json.loads((out / "config.json").read_text())
    print(
        f"{out}: {cfg['architectures'][0]} from {src.describe()}; {cfg['num_hidden_layers']} layers, hidden "
        f"{cfg['hidden_size']}, {cfg['torch_dtype']}; {tok}"
    )


if __name__ == "__main__":
    main()
