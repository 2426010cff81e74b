"""Shared drafter-test data: a tiny random target and its real hidden states on random token sequences."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter import packing
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.llama import Transformer


@pytest.fixture(scope="session")
def three_samples():
    """`make(cfg, seed)` -> (target, samples): three random sequences (lengths 13, 11, 15; prompts 4, 3, 5)
    with the target's hidden states, so two share a 32-token row when packed (segment isolation is tested)."""

    def make(cfg: ModelConfig, seed: int) -> tuple[Transformer, list[packing.DrafterSample]]:
        target = Transformer(cfg, nnx.Rngs(0))
        rng = np.random.default_rng(seed)
        lengths, prompts = [13, 11, 15], [4, 3, 5]
        toks = rng.integers(0, cfg.vocab_size, size=(3, 16)).astype(np.int32)
        fwd = nnx.jit(
            lambda m, x: m(x, jnp.broadcast_to(jnp.arange(16), x.shape), compute_logits=False).hidden
        )
        hidden = np.asarray(fwd(target, jnp.asarray(toks)))
        samples = [
            packing.sample_from_sequence(toks[i, :p].tolist(), toks[i, p:n].tolist(), hidden[i, :n])
            for i, (n, p) in enumerate(zip(lengths, prompts, strict=True))
        ]
        return target, samples

    return make


@pytest.fixture(scope="session")
def random_samples():
    """`make(target, lengths, prompt_lens, seed)` -> samples: random token sequences (<= 32 tokens) with the
    target's real hidden states (one batched causal forward, so a prefix's states ignore the rest)."""
    fwd = nnx.jit(
        lambda m, x: m(x, jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape), compute_logits=False).hidden
    )

    def make(target: Transformer, lengths, prompt_lens, seed: int = 0) -> list[packing.DrafterSample]:
        rng = np.random.default_rng(seed)
        toks = rng.integers(0, target.cfg.vocab_size, size=(len(lengths), 32)).astype(np.int32)
        hidden = np.asarray(fwd(target, jnp.asarray(toks)))
        return [
            packing.sample_from_sequence(toks[i, :p].tolist(), toks[i, p:n].tolist(), hidden[i, :n])
            for i, (n, p) in enumerate(zip(lengths, prompt_lens, strict=True))
        ]

    return make
