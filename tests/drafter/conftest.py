"""Shared drafter-test data: a tiny random target and its real hidden states on random token sequences."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter import train_step as ts
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.llama import Transformer


@pytest.fixture(scope="session")
def three_samples():
    """`make(cfg, seed)` -> (target, samples): three random sequences (lengths 13, 11, 15; prompts 4, 3, 5)
    with the target's hidden states, so two share a 32-token row when packed (segment isolation is tested)."""

    def make(cfg: ModelConfig, seed: int) -> tuple[Transformer, list[ts.DrafterSample]]:
        target = Transformer(cfg, nnx.Rngs(0))
        rng = np.random.default_rng(seed)
        lengths, prompts = [13, 11, 15], [4, 3, 5]
        toks = rng.integers(0, cfg.vocab_size, size=(3, 16)).astype(np.int32)
        fwd = nnx.jit(
            lambda m, x: m(x, jnp.broadcast_to(jnp.arange(16), x.shape), compute_logits=False).hidden
        )
        hidden = np.asarray(fwd(target, jnp.asarray(toks)))
        samples = [
            ts.sample_from_sequence(toks[i, :p].tolist(), toks[i, p:n].tolist(), hidden[i, :n])
            for i, (n, p) in enumerate(zip(lengths, prompts, strict=True))
        ]
        return target, samples

    return make
