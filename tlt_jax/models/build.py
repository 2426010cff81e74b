"""The model section of a config -> (model, tokenizer): a real checkpoint or a tiny random architecture.

Shared by every job (GRPO, the drafter warm-up, sampling) and below them all: it reads only `config.model`
and `config.seed`, so the packages that build models never import the config library.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from flax import nnx

from tlt_jax.kernels.small_m_linear import LINEAR_IMPLS
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.llama import Transformer

DTYPES = ("float32", "bfloat16")


def _linear_impl(config: Any) -> str:
    """`config.model.linear_impl`; "auto" for config files written before the field existed."""
    return config.model.get("linear_impl", "auto")


def model_problems(config: Any, check_paths: bool = True) -> list[str]:
    """Problems of `config.model` (exactly one of path / random, dtype, linear_impl), each with its fix."""
    out = []
    path, random = config.model.path, dict(config.model.random)
    if bool(path) == bool(random):
        out.append(
            "set exactly one of config.model.path (a .gguf file or HF model dir) and config.model.random "
            f"(a tiny architecture); got path={path!r}, random={'set' if random else 'empty'}."
        )
    if path and check_paths and not os.path.exists(path):
        out.append(
            f"config.model.path={path!r} does not exist: pass --config.model.path=/path/to/model.gguf or "
            "an HF directory (`make setup` fetches SmolLM2 to .cache/models/)."
        )
    if random:
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(random) - fields)
        if unknown:
            out.append(
                f"config.model.random has unknown keys {unknown}; ModelConfig fields: {sorted(fields)}."
            )
    if config.model.dtype not in DTYPES:
        out.append(f"config.model.dtype={config.model.dtype!r}: use one of {DTYPES}.")
    if _linear_impl(config) not in LINEAR_IMPLS:
        out.append(f"config.model.linear_impl={_linear_impl(config)!r}: use one of {LINEAR_IMPLS}.")
    return out


def build_model_and_tokenizer(config: Any) -> tuple[Transformer, Any]:
    """The policy model and its tokenizer from `config.model`.

    path: a .gguf file or HF directory via `tlt_jax.models.loading.load_model` (weights, config, tokenizer).
    random: `ModelConfig(**random)` initialised from `config.seed`, with the ByteTokenizer (vocab >= 261).
    """
    from tlt_jax.models.llama import from_hf_tensors
    from tlt_jax.models.loading import load_model
    from tlt_jax.models.tokenizer import ByteTokenizer

    problems = model_problems(config, check_paths=True)
    if problems:
        raise ValueError("invalid config:\n  - " + "\n  - ".join(problems))
    if config.model.path:
        loaded = load_model(config.model.path, dtype=config.model.dtype)
        cfg = loaded.config.replace(linear_impl=_linear_impl(config))
        return from_hf_tensors(cfg, loaded.tensors), loaded.tokenizer
    tokenizer = ByteTokenizer()
    cfg = ModelConfig(
        **{**dict(config.model.random), "dtype": config.model.dtype, "linear_impl": _linear_impl(config)}
    )
    if cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"config.model.random.vocab_size={cfg.vocab_size} is smaller than the ByteTokenizer's "
            f"{tokenizer.vocab_size} ids: set it to >= {tokenizer.vocab_size}."
        )
    return Transformer(cfg, nnx.Rngs(params=config.seed)), tokenizer
