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


FLOOR_BLOCK_ROWS = 8  # rows per block of the top-p search (cache-sized at V ~ 50k; see _top_p_floor_rows)


def _top_p_floor(probs: jax.Array, top_p: float) -> jax.Array:
    """[..., V] probabilities -> [..., 1] the smallest kept probability of the top-p set.

    Top-p keeps token i iff the mass of the tokens more probable than i is < top_p, i.e. M(p_i) < top_p with
    M(t) = sum_j p_j [p_j > t]. M is non-increasing in t, so the kept set is {i : p_i >= tau} with tau the
    smallest float where M(tau) < top_p (tau is one of the p_j). Non-negative float32 values order like their
    bit patterns, so a lower-bound bisection over the bits finds tau exactly in 31 masked sums over V. The
    textbook version sorts the vocabulary instead: 800 ms per step at batch 64, V = 49,152 on a 2-core CPU
    (13 ms at batch 1) against ~46 ms for this. Tokens tied at tau are all kept (a sort keeps an arbitrary
    subset of them); otherwise the two agree up to the rounding of their mass sums.
    """
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
    lo = jnp.zeros(probs.shape[:-1] + (1,), jnp.int32)
    hi = jnp.max(bits, axis=-1, keepdims=True)  # M(max p) = 0 < top_p

    def step(_, lo_hi):
        lo, hi = lo_hi
        mid = lo + (hi - lo) // 2
        above = jnp.sum(jnp.where(bits > mid, probs, 0.0), axis=-1, keepdims=True)
        ok = above < top_p
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, _ = jax.lax.fori_loop(0, 31, step, (lo, hi))
    return jax.lax.bitcast_convert_type(lo, jnp.float32)


def _top_p_floor_rows(probs: jax.Array, top_p: float, block: int = FLOOR_BLOCK_ROWS) -> jax.Array:
    """`_top_p_floor` over [..., V] in blocks of `block` rows (a sequential `lax.map`), so that the 31 passes
    over a block's probabilities hit the cache instead of memory: at V = 49,152 a verify pass over 64 rows x
    3 tokens took 264 ms vectorised over all rows and takes 56 ms in blocks of 8 (2-core AVX2 CPU). From
    `block` rows on, every block has the same shape (rows are padded), so a row's floor does not depend on
    the size of the batch it is in; fewer rows are one smaller block (batch 1 would pay 8x for padding)."""
    lead, v = probs.shape[:-1], probs.shape[-1]
    flat = probs.reshape(-1, v)
    n = flat.shape[0]
    if n < block:
        return _top_p_floor(flat, top_p).reshape(lead + (1,))
    nb = -(-n // block)
    padded = jnp.pad(flat, ((0, nb * block - n), (0, 0)), constant_values=1.0 / v)
    floors = jax.lax.map(lambda rows: _top_p_floor(rows, top_p), padded.reshape(nb, block, v))
    return floors.reshape(-1, 1)[:n].reshape(lead + (1,))


def target_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """[..., V] logits -> [..., V] float32 probabilities of the sampling distribution.

    Greedy gives a one-hot on the argmax, so acceptance rules see it as the deterministic distribution it is.
    Top-k and top-p are masks by threshold (no sort of the vocabulary; see `_top_p_floor`); logits tied with
    the k-th largest are all kept.
    """
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    if params.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    scaled = logits / params.temperature
    if 0 < params.top_k < v:
        kth = jax.lax.top_k(scaled, params.top_k)[0][..., -1:]
        scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    probs = jax.nn.softmax(scaled, axis=-1)
    if params.top_p < 1.0:
        probs = jnp.where(probs >= _top_p_floor_rows(probs, params.top_p), probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return probs


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
        # no reversed array (`positive[:, ::-1]`): on a vocab-sharded array the partitioner turns a reverse
        # into a collective-permute, which XLA:CPU cannot run inside one data group's branch of the spot tick
        last = jnp.max(jnp.where(positive, jnp.arange(n), 0), axis=-1)
        last = jnp.where(jnp.any(positive, axis=-1), last, n - 1)
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
    (compaction into smaller buckets, sharding and speculative decoding leave each stream alone). The
    distribution is computed for the whole batch (the top-p search runs in cache-sized row blocks, which a
    per-row vmap would undo); only the draw is per row."""
    chex.assert_rank(logits_bv, 2)
    if params.greedy:
        return sample(keys_b[0], logits_bv, params)  # argmax: the keys are not used
    probs = target_probs(logits_bv, params)
    tok = jax.vmap(lambda k, p: categorical(k, p[None])[0])(keys_b, probs)
    return tok, jnp.log(jnp.take_along_axis(probs, tok[:, None], axis=-1)[:, 0])
