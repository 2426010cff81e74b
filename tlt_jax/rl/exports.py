"""Periodic exports: the policy and its drafter as HF directories every `config.export_every` steps.

    W/exports/step_<N>/policy/        export_policy's layout: config.json, safetensors shards + index,
                                      tokenizer files, generation_config.json (transformers, vLLM, SGLang)
    W/exports/step_<N>/drafter/       the drafter in SGLang's EAGLE-1 layout (+ token_map.pt with a reduced
                                      draft vocabulary; drafter/eagle_format.py)
    W/exports/step_<N>/drafter_vllm/  the same weights in vLLM's layout: only with the full vocabulary (vLLM's
                                      EAGLE-1 has none; `python -m tlt_jax.export_drafter --from-dir ...
                                      --engine vllm --full-vocab` converts the SGLang one)

Written at the end of step N (`config.export_every` divides N, and at the last step; 0: never), after its
checkpoint, from the weights in memory: independent of which checkpoints `keep_checkpoints` keeps. As
VeRL saves its `hf_model` every save_freq steps and at the last (verl/trainer/ppo/ray_trainer.py `fit`;
verl/utils/checkpoint/fsdp_checkpoint_manager.py gathers the full state dict on rank 0 for it). step_<N>
appears whole or not at all (`utils.export_io.write_atomically`: a temporary sibling renamed into place);
a step redone after a resume replaces it.

With several processes every process takes part in gathering each array (`sharding.to_host_tree`: a
collective), a stacked layer weight one layer at a time so that no device holds a whole [L, ...] array,
and only process 0 writes. The policy in its compute dtype (config.model.dtype: what export_policy writes
by default), the drafter in its trained dtype.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import ml_collections as mlc
import numpy as np
from absl import logging
from flax import nnx

from tlt_jax import sharding as shd
from tlt_jax.config_schema import GrpoConfig
from tlt_jax.drafter.eagle3_format import check_exportable_capture_points, eagle3_export
from tlt_jax.drafter.eagle_format import EagleExport, fill_eagle_dir, to_eagle
from tlt_jax.drafter.spot_trainer import SpotTrainer
from tlt_jax.models.build import TextCodec
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.hf_export import EXPORT_DTYPES, hf_config, params_to_hf, write_shards
from tlt_jax.models.tokenizer import Tokenizer
from tlt_jax.rl.speculation import ResolvedDrafter
from tlt_jax.rl.trainer import PolicyTrainer
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.utils.checkpoint import flatten_paths
from tlt_jax.utils.export_io import write_atomically

EXPORT_DIR = "exports"
# a HF model directory's files that describe its tokenizer and generation defaults (copied when present)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class PhaseSink(Protocol):
    def set(self, step: int, name: str) -> None: ...


class ExportSource(Protocol):
    """What an export reads from the learner (tlt_jax.rl.learner.Learner)."""

    job: GrpoConfig
    workdir: str
    step: int
    trainer: PolicyTrainer
    spot: SpotTrainer | None
    engine: RolloutEngine
    rollout_drafter: ResolvedDrafter
    tokenizer: TextCodec
    is_main: bool
    phases: PhaseSink


def step_dir(workdir: str | os.PathLike, step: int) -> pathlib.Path:
    return pathlib.Path(workdir) / EXPORT_DIR / f"step_{int(step)}"


def export_due(every: int, step: int, num_steps: int) -> bool:
    """Whether step `step` (>= 1, completed) is exported: `every` > 0 divides it, or it is the last."""
    return every > 0 and step > 0 and (step % every == 0 or step == num_steps)


def check_drafter_exportable(export_every: int, aux_layers: tuple[int, ...], num_layers: int) -> None:
    """At the learner's start, not at the first periodic export hours in: an EAGLE-3 drafter whose capture
    points have no id both serving engines read (`eagle3_format`) cannot be exported."""
    if export_every <= 0 or not aux_layers:
        return
    try:
        check_exportable_capture_points(aux_layers, num_layers)
    except ValueError as e:
        raise ValueError(
            f"config.export_every={export_every} exports the drafter, but its {e}; or set "
            "config.export_every=0"
        ) from None


def after_step(learner: ExportSource, stopping: bool = False) -> pathlib.Path | None:
    """The learner's call after each step's checkpoint: export the step when it is due (every process must
    call it: the gather is collective); returns the export folder (process 0) or None. A run that is
    stopping (`stopping`: a stop request agreed) skips it, within its stop bound, and says how to make it."""
    run = learner.job.run
    if not export_due(run.export_every, learner.step, run.num_steps):
        return None
    if stopping:
        logging.warning(
            "step %d's export skipped: the run is stopping. From its checkpoint: `python -m "
            "tlt_jax.export_policy --workdir %s --step %d --out DIR` and `python -m tlt_jax.export_drafter "
            "--workdir %s --out DIR`",
            learner.step,
            learner.workdir,
            learner.step,
            learner.workdir,
        )
        return None
    return export_step(learner)


def export_step(learner: ExportSource) -> pathlib.Path | None:
    """Write W/exports/step_<step> (module docstring); the path on process 0, None on the others."""
    step, t0 = learner.step, time.perf_counter()
    learner.phases.set(step, "export")
    config, cfg = learner.job.raw, learner.engine.model_config
    dtype = str(config.model.get("dtype", "float32"))
    tensors = params_to_hf(cfg, host_policy(learner.trainer, dtype))
    drafter = host_drafter(learner)
    if not learner.is_main:
        return None
    vocab = learner.engine.draft_vocab if learner.engine.aux_layers else learner.rollout_drafter.draft_vocab
    exports = drafter_exports(
        drafter, cfg, None if vocab is None else np.asarray(vocab), learner.engine.aux_layers
    )
    provenance = {"workdir": str(pathlib.Path(learner.workdir).resolve()), "step": step}

    def fill(tmp: pathlib.Path) -> None:
        write_policy_dir(tmp / "policy", config, cfg, tensors, learner.tokenizer, dtype, provenance)
        for name, export in exports.items():
            export.config["tlt_drafter"]["source"] = {**provenance, "what": "the learner's drafter"}
            fill_eagle_dir(tmp / name, export)

    out = write_atomically(step_dir(learner.workdir, step), True, fill)
    logging.info(
        "exported step %d to %s (%s) in %.1fs",
        step,
        out,
        ", ".join(sorted(["policy", *exports])),
        time.perf_counter() - t0,
    )
    return out


_take = jax.jit(lambda x, i: jax.lax.dynamic_index_in_dim(x, i, keepdims=False))


def host_policy(trainer: PolicyTrainer, dtype: str) -> dict[str, np.ndarray]:
    """Every policy parameter on the host in `dtype`, by export path ('layers/0/attn/qkv'), from the
    trainer's masters (frozen layers included). Stacked layers are gathered one layer at a time."""
    np_dtype = EXPORT_DTYPES[dtype]
    out: dict[str, np.ndarray] = {}
    for path, x in flatten_paths(nnx.to_pure_dict(trainer.params))[0]:
        head, _, rest = path.partition("/")
        if trainer.stacked and head == "layers" and not rest.split("/")[0].isdigit():
            for i in range(x.shape[0]):
                out[f"layers/{i}/{rest}"] = shd.to_host(_take(x, i)).astype(np_dtype)
        else:
            out[path] = shd.to_host(x).astype(np_dtype)
    return out


def host_drafter(learner: ExportSource) -> dict[str, Any] | None:
    """The drafter's params on the host (the spot trainer's, else the rollout drafter's), or None."""
    params = learner.spot.params if learner.spot is not None else learner.engine.drafter_params
    if params is None:
        return None
    return shd.to_host_tree(nnx.to_pure_dict(params))


def drafter_exports(
    params: Mapping[str, Any] | None,
    cfg: ModelConfig,
    draft_vocab: np.ndarray | None,
    aux_layers: tuple[int, ...] = (),
) -> dict[str, EagleExport]:
    """The drafter's export folders: "drafter" (SGLang's layout) and, with the full vocabulary,
    "drafter_vllm"; none without a drafter. An EAGLE-3 drafter (its own head; `aux_layers` its capture
    points): "drafter" in the EAGLE-3 layout SGLang and vLLM both read (`drafter.eagle3_format`)."""
    if params is None:
        return {}
    if "lm_head" in params:
        return {"drafter": eagle3_export(params, cfg, tuple(aux_layers), draft_vocab)}
    out = {"drafter": to_eagle(params, cfg, draft_vocab, engine="sglang")}
    if draft_vocab is None:
        out["drafter_vllm"] = to_eagle(params, cfg, None, engine="vllm")
    return out


# ---- the policy's HF directory (also `python -m tlt_jax.export_policy`) ------------------------------------
def write_policy_dir(
    directory: pathlib.Path,
    config: mlc.ConfigDict,
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray],
    codec: TextCodec,
    dtype: str,
    provenance: Mapping[str, Any],
) -> str:
    """Write the policy's HF directory into `directory` (created): safetensors shards, the tokenizer files,
    generation_config.json and config.json (config.model.path's own when it is a HF directory, else built
    from `cfg`; "tlt_jax_export" says where it came from). Returns what tokenizer was written."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = codec if isinstance(codec, Tokenizer) else None  # a random preset's has no text to save
    eos = [int(i) for i in codec.eos_token_ids]
    write_shards(directory, tensors)
    written = _write_tokenizer(directory, config, tokenizer)
    _generation_config(directory, tokenizer, eos)
    hf = _model_config(config, cfg, dtype, tokenizer, eos)
    hf["tlt_jax_export"] = dict(provenance)
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return written


def _write_tokenizer(directory: pathlib.Path, config: mlc.ConfigDict, tokenizer: Tokenizer | None) -> str:
    """The tokenizer files (config.model.path's directory's, else the run's tokenizer) into `directory`."""
    path = config.model.get("path")
    if path and os.path.isdir(path):
        copied = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]
        for name in copied:
            shutil.copy2(os.path.join(path, name), directory / name)
        return f"tokenizer files copied from {path}"
    if tokenizer is None:
        return "no tokenizer (a random-weight preset has no text)"
    tokenizer.save(directory)
    return f"the run's {type(tokenizer).__name__}"


def _generation_config(directory: pathlib.Path, tokenizer: Tokenizer | None, eos: list[int]) -> None:
    """generation_config.json: the one the tokenizer files brought, with bos/eos ids where it lacks them."""
    file = directory / "generation_config.json"
    gen = json.loads(file.read_text()) if file.is_file() else {}
    gen.setdefault("eos_token_id", eos[0] if len(eos) == 1 else eos)
    if tokenizer is not None and tokenizer.bos_token_id is not None:
        gen.setdefault("bos_token_id", tokenizer.bos_token_id)
    file.write_text(json.dumps(gen, indent=2) + "\n")


def _model_config(
    config: mlc.ConfigDict, cfg: ModelConfig, dtype: str, tokenizer: Tokenizer | None, eos: list[int]
) -> dict[str, Any]:
    """config.json: the source directory's own (dtype updated), else built from `cfg`."""
    path = config.model.get("path")
    source = pathlib.Path(path or "") / "config.json"
    if path and source.is_file():
        out = json.loads(source.read_text())
        out["torch_dtype"] = dtype
        if "dtype" in out:  # transformers >= 5 writes this name
            out["dtype"] = dtype
        return out
    return hf_config(cfg, dtype, None if tokenizer is None else tokenizer.bos_token_id, eos)
