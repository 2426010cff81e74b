"""Device layouts known to hang, refused when the config is validated (exit 2, before any process starts
its devices), each with the rule and the fix.

- A model axis that splits a KV head (`num_kv_heads` not a multiple of `config.mesh.model`) with the spot
  trainer on idle devices (`config.spot.mode=idle_devices`): GSPMD then emits collective-permutes inside the
  fused tick's per-data-group branch, and XLA's permute waits for every device of the program, which the
  other groups never reach (tlt_jax/rollout/spmd.py; measured on XLA:CPU: aborted after 40 s; NCCL would
  wait until the job's time limit). Whole KV heads per device emit none.

The KV head count is read without loading weights: the named architecture, `config.model.random`, the HF
directory's config.json or the GGUF file's header. A path that does not exist (or `check_paths` off: a
cluster config checked elsewhere) is the model's own checks' to name, and this check says nothing; a source
that exists but cannot be read (bad JSON, no head count, a broken GGUF) is a ValueError naming it, never a
silent pass that would let a deadlocking layout through.
"""

from __future__ import annotations

import json
import os

import ml_collections as mlc

from tlt_jax.models.build import model_config_from
from tlt_jax.models.config import ModelConfig


def model_kv_heads(config: mlc.ConfigDict, check_paths: bool = True) -> int | None:
    """The policy's number of KV heads from `config.model` without loading it; None when there is nothing to
    read (no such path, or `check_paths` off); a ValueError naming the source when it cannot be read."""
    model = config.model
    path, arch = model.get("path"), model.get("arch", "") or ""
    source = "config.model"
    try:
        if path and check_paths and os.path.isdir(path):
            source = os.path.join(path, "config.json")
            with open(source, encoding="utf-8") as f:
                hf = json.load(f)
            return int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
        if path and check_paths and os.path.isfile(path):
            from tlt_jax.models.gguf import read_gguf

            source = path
            meta = read_gguf(path).metadata
            name = meta["general.architecture"]
            return int(meta.get(f"{name}.attention.head_count_kv") or meta[f"{name}.attention.head_count"])
        if arch and not path:
            source = f"config.model.arch={arch!r}"
            return model_config_from(config).num_kv_heads
        if model.get("random") and not path:
            source = "config.model.random"
            return ModelConfig(**dict(model.random)).num_kv_heads
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"config.mesh.model={config.mesh.model} with config.spot.mode={config.spot.mode}: checking that "
            "the model axis keeps whole KV heads (a split one deadlocks) needs the policy's KV head count; "
            f"reading it from {source} failed ({type(e).__name__}: {e}). Fix that source, or use "
            "--config.spot.mode=between_chunks (no such check needed)."
        ) from e
    return None


def layout_problems(config: mlc.ConfigDict, check_paths: bool = True) -> list[str]:
    """The config's device layouts known to deadlock (module docstring), each with the rule and the fix."""
    model_axis = int(config.mesh.model)
    if config.spot.mode != "idle_devices" or model_axis <= 1:
        return []
    try:
        heads = model_kv_heads(config, check_paths)
    except ValueError as e:  # a source that exists but does not read: a config problem, named
        return [str(e)]
    if heads is None or heads % model_axis == 0:
        return []
    whole = [m for m in range(1, heads + 1) if heads % m == 0]
    return [
        f"config.mesh.model={model_axis} splits the policy's {heads} KV head(s) across devices, and with "
        "config.spot.mode=idle_devices the spot trainer's fused tick then deadlocks (a collective-permute "
        "inside one data group's branch waits for devices that never reach it: tlt_jax/rollout/spmd.py). "
        f"Rule: the model axis must divide the KV heads. Fix: --config.mesh.model= one of {whole}, or "
        "--config.spot.mode=between_chunks (or after_rollout)."
    ]
