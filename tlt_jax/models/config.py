"""Model configuration for the Llama/Qwen2 decoder family (frozen: hashable, usable as a static jit arg)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tlt_jax.kernels.small_m_linear import LINEAR_IMPLS


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama/Qwen2-family decoder.

    `qkv_bias` is True for Qwen2 (biases on q/k/v projections) and False for Llama.
    `dtype` is the compute/parameter dtype name ("float32" or "bfloat16").
    `linear_impl` picks how the projections run (`tlt_jax.kernels.small_m_linear`): "auto" (the CPU small-M
    kernel on a single CPU device, XLA otherwise), "xla", or "cpu_ffi". It changes speed, not results
    (beyond float rounding).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 8192
    architecture: str = "llama"
    dtype: str = "float32"
    linear_impl: str = "auto"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA)."
            )
        if self.architecture not in ("llama", "qwen2"):
            raise ValueError(f"Unsupported architecture {self.architecture!r}: expected 'llama' or 'qwen2'.")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"Unsupported dtype {self.dtype!r}: expected 'float32' or 'bfloat16'.")
        if self.linear_impl not in LINEAR_IMPLS:
            raise ValueError(f"Unsupported linear_impl {self.linear_impl!r}: use 'auto', 'xla' or 'cpu_ffi'.")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        """Number of parameters (the tied head counted once)."""
        h, f = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        layer = attn + 3 * h * f + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + h


def tiny_config(architecture: str = "llama", **kw: Any) -> ModelConfig:
    """A tiny random model for unit tests (seconds to compile on CPU)."""
    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_embeddings=architecture == "llama",
        qkv_bias=architecture == "qwen2",
        architecture=architecture,
    )
    base.update(kw)
    return ModelConfig(**base)
