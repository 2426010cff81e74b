"""Sampling: the target distribution (temperature, top-k, top-p) and the exact categorical sampler.

Statistical protocol: Pearson chi-square of N draws against the exact probabilities (cells with expected
count < 5 pooled); exact samplers pass at p > 1e-3, and each test also shows it has power by rejecting,
at p < 1e-6, the same distribution with 2% of the mass moved onto its most likely token. Zero-probability
tokens must never be drawn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from tlt_jax.rollout.sampling import SamplingParams, categorical, sample, sample_rows, target_probs

PASS_P, POWER_P = 1e-3, 1e-6


def chi_square_pvalue(draws: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(draws, minlength=len(probs)).astype(np.float64)
    expected = probs / probs.sum() * len(draws)
    zero = expected == 0
    assert counts[zero].sum() == 0, f"drew zero-probability tokens {np.flatnonzero(counts * zero)}"
    c, e = counts[~zero], expected[~zero]
    small = e < 5
    if small.any():
        c, e = np.append(c[~small], c[small].sum()), np.append(e[~small], e[small].sum())
    return float(scipy.stats.chisquare(c, e * c.sum() / e.sum()).pvalue)


def assert_exact_with_power(draws: np.ndarray, probs: np.ndarray) -> None:
    assert chi_square_pvalue(draws, probs) > PASS_P
    off = probs / probs.sum()
    off[np.argmax(off)] += 0.02  # 2% of the mass moved onto one token
    assert chi_square_pvalue(draws, off) < POWER_P, "the test cannot tell a 2%-of-mass error"


def draw_many(weights: np.ndarray, n: int, seed: int, block: int) -> np.ndarray:
    """n independent draws from one weight row (one key per draw, as the engine's per-row streams)."""
    keys = jax.random.split(jax.random.key(seed), n)
    w = jnp.asarray(weights, jnp.float32)[None]
    draw = jax.jit(jax.vmap(lambda k: categorical(k, w, block=block)[0]))
    return np.asarray(draw(keys))


def test_target_probs_hand_values() -> None:
    logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    np.testing.assert_allclose(target_probs(logits, SamplingParams(1.0)), [[0.5, 0.2, 0.15, 0.1, 0.05]], 1e-6)
    np.testing.assert_allclose(
        target_probs(logits, SamplingParams(1.0, top_k=2)), [[5 / 7, 2 / 7, 0, 0, 0]], 1e-6
    )
    # top-p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 joins (mass before it is 0.7 < 0.8); 0.1 does not
    np.testing.assert_allclose(
        target_probs(logits, SamplingParams(1.0, top_p=0.8)),
        [[0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0]],
        1e-6,
    )
    # a tiny top-p keeps the most probable token only
    np.testing.assert_allclose(target_probs(logits, SamplingParams(1.0, top_p=0.01)), [[1, 0, 0, 0, 0]], 1e-6)
    # temperature 0.5 squares the probabilities (before renormalising)
    sq = np.asarray([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    np.testing.assert_allclose(target_probs(logits, SamplingParams(0.5)), [sq / sq.sum()], 1e-5)
    np.testing.assert_array_equal(target_probs(logits, SamplingParams(0.0)), [[1, 0, 0, 0, 0]])


def sorted_reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The textbook definition, by sorting: top-k logits, then the smallest prefix with mass >= top_p."""
    z = logits.astype(np.float64) / temperature
    out = np.zeros_like(z)
    for r in range(z.shape[0]):
        order = np.argsort(-z[r], kind="stable")[: top_k or None]
        p = np.exp(z[r, order] - z[r, order].max())
        p /= p.sum()
        keep = np.cumsum(p) - p < top_p
        out[r, order[keep]] = p[keep] / p[keep].sum()
    return out


@pytest.mark.parametrize("top_k, top_p", [(0, 0.95), (0, 0.5), (50, 0.9), (0, 0.999)])
def test_threshold_masks_equal_the_sorted_definition(top_k: int, top_p: float) -> None:
    """target_probs masks by threshold (a bisection, no sort): the same kept set and probabilities as the
    sort-based definition on 64 rows x 4096 tokens, from flat to peaked rows (logit scales 0.3-8)."""
    rng = np.random.default_rng(top_k + int(top_p * 1000))
    logits = rng.normal(size=(64, 4096)) * np.geomspace(0.3, 8.0, 64)[:, None]
    got = np.asarray(target_probs(jnp.asarray(logits, jnp.float32), SamplingParams(0.9, top_k, top_p)))
    want = sorted_reference(logits.astype(np.float32), 0.9, top_k, top_p)
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-9)


@pytest.mark.parametrize(
    "v, block",
    [
        (100, 32),  # 4 blocks, the last one partial (4 entries)
        (1000, 256),
        (7, 256),  # one block smaller than the block size
    ],
)
def test_categorical_is_exact(v: int, block: int) -> None:
    """100,000 draws per case; weights unnormalised, with zeros (inside and at the ends of blocks)."""
    rng = np.random.default_rng(v)
    w = rng.gamma(0.3, size=v) * 7.0  # heavy-tailed: a few tokens carry most of the mass
    w[rng.random(v) < 0.3] = 0.0
    w[[0, v - 1]] = [0.0, 2.5]  # a zero first entry and mass in the last (partial) block's last slot
    if v > block:
        w[block - 1] = 0.0
    assert_exact_with_power(draw_many(w, 100_000, seed=v, block=block), w)


def test_categorical_edge_cases() -> None:
    key = jax.random.key(0)
    one_hot = np.zeros((3, 600), np.float32)
    one_hot[0, 0] = 1.0
    one_hot[1, 599] = 3.0  # the last entry of a partial block
    one_hot[2, 255] = 1e-30  # tiny but positive mass, alone
    for seed in range(20):
        got = np.asarray(categorical(jax.random.fold_in(key, seed), jnp.asarray(one_hot)))
        np.testing.assert_array_equal(got, [0, 599, 255])
    # rows are independent draws from their own weights; dtype and shape are the engine's
    two = jnp.asarray([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    got = categorical(key, two)
    assert got.dtype == jnp.int32 and got.shape == (2,)
    np.testing.assert_array_equal(got, [1, 0])


def test_sample_rows_draws_the_target_distribution() -> None:
    """The plain decoding sampler (temperature 0.9, top-k 20, top-p 0.95 on V = 32) against target_probs:
    100,000 rows with their own keys, as the engine samples."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, 32)) * 2.0, jnp.float32)
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.95)
    probs = np.asarray(target_probs(logits, sp), np.float64)[0]
    assert 0 < (probs > 0).sum() < 32
    n = 100_000
    keys = jax.random.split(jax.random.key(1), n)
    tok, logp = jax.jit(lambda k, lg: sample_rows(k, jnp.broadcast_to(lg, (n, 32)), sp))(keys, logits)
    tok = np.asarray(tok)
    assert_exact_with_power(tok, probs)
    np.testing.assert_allclose(np.asarray(logp), np.log(probs[tok]), rtol=1e-5)


def test_greedy_sample_is_argmax_with_plain_logprob() -> None:
    logits = jnp.asarray([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
    tok, logp = sample(jax.random.key(0), logits, SamplingParams(0.0))
    np.testing.assert_array_equal(tok, [1, 0])
    np.testing.assert_allclose(logp, jax.nn.log_softmax(logits)[jnp.arange(2), tok], rtol=1e-6)
