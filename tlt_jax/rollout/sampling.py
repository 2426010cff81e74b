"""Temperature / top-k / top-p: logits -> the exact distribution we sample from.

One module used by plain decoding and by speculative verification, so that the target distribution `p` the
lossless acceptance rule preserves is bit-for-bit the distribution plain decoding samples from.
Order (as in HF and SGLang): divide by temperature, keep the top-k logits, then the smallest set of the
remaining tokens whose probability mass reaches top_p (the most probable token is always kept); renormalise.
Temperature 0 means greedy (argmax).
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static sampling settings (hashable: a jit static argument)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables top-p

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _top_p_keep(sorted_probs: jax.Array, top_p: float) -> jax.Array:
    """Keep mask over probabilities sorted in descending order: the smallest prefix with mass >= top_p."""
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    return mass_before < top_p


def target_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """[..., V] logits -> [..., V] float32 probabilities of the sampling distribution.

    Greedy gives a one-hot on the argmax, so acceptance rules see it as the deterministic distribution it is.
    """
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    if params.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    scaled = logits / params.temperature
    if params.top_k == 0 and params.top_p >= 1.0:
        return jax.nn.softmax(scaled, axis=-1)
    k = params.top_k if 0 < params.top_k < v else v
    vals, idx = jax.lax.top_k(scaled, k)  # sorted descending
    probs_k = jax.nn.softmax(vals, axis=-1)
    if params.top_p < 1.0:
        probs_k = jnp.where(_top_p_keep(probs_k, params.top_p), probs_k, 0.0)
        probs_k = probs_k / jnp.sum(probs_k, axis=-1, keepdims=True)
    flat_p = probs_k.reshape(-1, k)
    flat_i = idx.reshape(-1, k)
    out = jnp.zeros((flat_p.shape[0], v), jnp.float32)
    out = out.at[jnp.arange(flat_p.shape[0])[:, None], flat_i].set(flat_p)
    return out.reshape(logits.shape)


def categorical(key: jax.Array, weights_bv: jax.Array, block: int = 256) -> jax.Array:
    """Draw one index per row with probability weights[b, i] / sum(weights[b]) (unnormalised, >= 0).

    Inverse-CDF sampling with ONE uniform per row, searched in two levels (block masses, then one block),
    so the cost is a pass over the weights. `jax.random.categorical` (Gumbel-max) draws a uniform and takes
    two logs per vocabulary entry: 1.6 ms per row at V = 49,152 on this CPU, which was 7% of a batch-1
    SmolLM2 decode step and 16% at batch 64. Zero-weight entries are never drawn; a row must have some mass.
    """
    chex.assert_rank(weights_bv, 2)
    b, v = weights_bv.shape
    block = min(block, v)
    nb = -(-v // block)
    w = jnp.pad(weights_bv.astype(jnp.float32), ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
    mass = jnp.sum(w, axis=-1)  # [B, nb]
    cum = jnp.cumsum(mass, axis=-1)
    u = jax.random.uniform(key, (b,), jnp.float32) * cum[:, -1]

    def first_above(c: jax.Array, x: jax.Array, positive: jax.Array) -> jax.Array:
        """Index of the first c > x (c non-decreasing); if rounding left none, the last positive entry."""
        n = c.shape[-1]
        i = jnp.sum(c <= x[:, None], axis=-1)
        last = n - 1 - jnp.argmax(positive[:, ::-1], axis=-1)
        return jnp.where(i < n, i, last).astype(jnp.int32)

    i = first_above(cum, u, mass > 0)
    start = jnp.where(i > 0, jnp.take_along_axis(cum, jnp.maximum(i - 1, 0)[:, None], axis=1)[:, 0], 0.0)
    wi = jnp.take_along_axis(w, i[:, None, None], axis=1)[:, 0]  # [B, block]
    j = first_above(jnp.cumsum(wi, axis=-1), u - start, wi > 0)
    return i * block + j


def sample(key: jax.Array, logits_bv: jax.Array, params: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row. Returns (tokens [B] int32, log-prob of each token [B] float32).

    The log-prob is under the sampling distribution (after temperature/top-k/top-p); for greedy it is the
    model's plain log-softmax at temperature 1, the quantity RL trainers compare against.
    """
    chex.assert_rank(logits_bv, 2)
    if params.greedy:
        tokens = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        logp = jax.nn.log_softmax(logits_bv.astype(jnp.float32), axis=-1)
        return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    probs = target_probs(logits_bv, params)
    tokens = categorical(key, probs)
    return tokens, jnp.log(jnp.take_along_axis(probs, tokens[:, None], axis=-1)[:, 0])  # one log per row


def sample_rows(
    keys_b: jax.Array, logits_bv: jax.Array, params: SamplingParams
) -> tuple[jax.Array, jax.Array]:
    """`sample` with one PRNG key per row, so a row's draws do not depend on which batch it runs in
    (compaction into smaller buckets, sharding and speculative decoding leave each stream alone)."""
    tok, lp = jax.vmap(lambda k, lg: sample(k, lg[None], params))(keys_b, logits_bv)
    return tok[:, 0], lp[:, 0]
