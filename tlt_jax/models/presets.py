"""Named architectures of the paper's targets (Qwen2.5 0.5B / 1.5B / 7B / 32B): shapes only, no weights.

The shapes are those of the models' Hugging Face configs (`config.json` of Qwen/Qwen2.5-*): Qwen2 blocks with
q/k/v biases, GQA, rope theta 1e6, RMSNorm eps 1e-6; the two small models tie the LM head to the embedding.
`config.model.arch` names one: with `config.model.path` it checks the checkpoint's shapes, with
`config.model.init=random` it builds the architecture with random weights (`tlt_jax.models.random_init`),
which times everything a forward pass does (the time of a pass does not depend on the weights' values).
"""

from __future__ import annotations

from typing import Any

from tlt_jax.models.config import ModelConfig

_QWEN2 = dict(
    architecture="qwen2",
    qkv_bias=True,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    dtype="bfloat16",
)

ARCHS: dict[str, ModelConfig] = {
    "qwen2_5_0_5b": ModelConfig(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        tie_embeddings=True,
        **_QWEN2,
    ),
    "qwen2_5_1_5b": ModelConfig(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        tie_embeddings=True,
        **_QWEN2,
    ),
    "qwen2_5_7b": ModelConfig(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        tie_embeddings=False,
        **_QWEN2,
    ),
    "qwen2_5_32b": ModelConfig(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=False,
        **_QWEN2,
    ),
}

# The checkpoints each preset is the shape of, and their parameter counts as published with the weights (the
# Hub's safetensors totals: 0.49B / 1.54B / 7.62B / 32.8B; the tied head counted once).
HF_NAMES = {
    "qwen2_5_0_5b": "Qwen/Qwen2.5-0.5B",
    "qwen2_5_1_5b": "Qwen/Qwen2.5-1.5B",
    "qwen2_5_7b": "Qwen/Qwen2.5-7B",
    "qwen2_5_32b": "Qwen/Qwen2.5-32B",
}
PUBLISHED_PARAMS = {
    "qwen2_5_0_5b": 494_032_768,
    "qwen2_5_1_5b": 1_543_714_304,
    "qwen2_5_7b": 7_615_616_512,
    "qwen2_5_32b": 32_763_876_352,
}
# Qwen2.5's stop tokens: <|im_end|> (end of a chat turn) and <|endoftext|>
EOS_TOKEN_IDS = (151645, 151643)

# fields a checkpoint must agree on with the preset it claims to be (dtype, linear_impl and the position
# limit are run settings, not shapes)
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_embeddings",
    "qkv_bias",
    "architecture",
)


def arch_config(name: str, **overrides: Any) -> ModelConfig:
    """The ModelConfig of preset `name`, with `overrides` (ModelConfig fields: dtype, num_layers, ...)."""
    if name not in ARCHS:
        raise ValueError(f"unknown model arch {name!r}: use one of {sorted(ARCHS)}.")
    return ARCHS[name].replace(**overrides)


def shape_mismatches(name: str, cfg: ModelConfig) -> list[str]:
    """The shape fields in which `cfg` (a loaded checkpoint's) differs from preset `name`."""
    ref = arch_config(name)
    return [
        f"{f}={getattr(cfg, f)!r} (the preset has {getattr(ref, f)!r})"
        for f in SHAPE_FIELDS
        if getattr(cfg, f) != getattr(ref, f)
    ]
