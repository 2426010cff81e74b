"""GRPO / Dr.GRPO / DAPO objectives against hand-computed values."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rl.grpo import (
    ADVANTAGE_METHODS,
    LOSS_AGGREGATIONS,
    aggregate_loss,
    dynamic_sampling_mask,
    group_advantages,
    kl_penalty_loss,
    low_var_kl,
    policy_loss,
)

# ---------------------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------------------

# Two groups of n=4: [1, 2, 3, 6] (mean 3, deviations -2 -1 0 3, population var 14/4 = 3.5, std 1.8708287)
# and [1, 0, 0, 1] (mean 0.5, std 0.5).
REWARDS = jnp.array([1.0, 2.0, 3.0, 6.0, 1.0, 0.0, 0.0, 1.0])


def test_grpo_advantages_hand_values() -> None:
    adv = group_advantages(REWARDS, 4, method="grpo", eps=0.0)
    expected = [-1.0690450, -0.5345225, 0.0, 1.6035675, 1.0, -1.0, -1.0, 1.0]
    np.testing.assert_allclose(adv, expected, rtol=1e-6, atol=1e-6)
    with_eps = group_advantages(REWARDS, 4, method="grpo", eps=0.5)  # std + eps: 2.3708287 and 1.0
    np.testing.assert_allclose(with_eps[:4], [-0.8435869, -0.4217934, 0.0, 1.2653803], rtol=1e-6)
    np.testing.assert_allclose(with_eps[4:], [0.5, -0.5, -0.5, 0.5], rtol=1e-6)


def test_drgrpo_advantages_hand_values() -> None:
    adv = group_advantages(REWARDS, 4, method="drgrpo")
    np.testing.assert_allclose(adv, [-2.0, -1.0, 0.0, 3.0, 0.5, -0.5, -0.5, 0.5], atol=1e-7)


def test_equal_rewards_give_zero_advantage() -> None:
    # float32 mean(0.05, 0.05, 0.05) != 0.05: without an exact-zero rule, (r - mean) / (0 + eps) is ~ -0.0037.
    rewards = jnp.array([0.05, 0.05, 0.05, 1.0, 1.0, 1.0])
    for method in ADVANTAGE_METHODS:
        np.testing.assert_array_equal(group_advantages(rewards, 3, method=method), np.zeros(6))


def test_advantages_jit_and_errors() -> None:
    jitted = jax.jit(group_advantages, static_argnames=("group_size", "method"))
    np.testing.assert_allclose(
        jitted(REWARDS, 4, method="drgrpo"), group_advantages(REWARDS, 4, method="drgrpo")
    )
    with pytest.raises(ValueError, match=r"unknown advantage method 'ppo'.*\['drgrpo', 'grpo'\]"):
        group_advantages(REWARDS, 4, method="ppo")
    with pytest.raises(ValueError, match="not a multiple of group_size=3"):
        group_advantages(REWARDS, 3)
    assert sorted(ADVANTAGE_METHODS) == ["drgrpo", "grpo"]


def test_dynamic_sampling_mask() -> None:
    rewards = jnp.array([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.05, 0.05, 0.05, 0.0, 0.0, 0.01])
    mask = dynamic_sampling_mask(rewards, 3)
    assert mask.dtype == jnp.bool_
    np.testing.assert_array_equal(mask, [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3)


# ---------------------------------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------------------------------


def _one_token(ratio: float, adv: float, **kw):
    logp_new = jnp.array([[math.log(ratio)]])
    logp_old = jnp.zeros((1, 1))
    return policy_loss(logp_new, logp_old, jnp.array([adv]), jnp.ones((1, 1)), **kw)


def test_clip_higher_asymmetry() -> None:
    # ratio 1.25, A = 1: clip_high 0.2 caps the ratio at 1.2 (loss -1.2, clipped); 0.28 leaves it (-1.25).
    loss, m = _one_token(1.25, 1.0, clip_low=0.2, clip_high=0.2)
    assert float(loss) == pytest.approx(-1.2, abs=1e-6)
    assert float(m["clip_frac"]) == 1.0
    loss, m = _one_token(1.25, 1.0, clip_low=0.2, clip_high=0.28)
    assert float(loss) == pytest.approx(-1.25, abs=1e-6)
    assert float(m["clip_frac"]) == 0.0
    assert float(m["ratio_mean"]) == pytest.approx(1.25, abs=1e-6)
    assert float(m["approx_kl"]) == pytest.approx(-math.log(1.25), abs=1e-6)  # mean(logp_old - logp_new)


def test_clip_low_and_pessimism() -> None:
    # ratio 0.7, A = -1: max(0.7, clip(0.7, 0.8, 1.2) = 0.8) = 0.8 (clipped, pessimistic).
    loss, m = _one_token(0.7, -1.0)
    assert float(loss) == pytest.approx(0.8, abs=1e-6) and float(m["clip_frac"]) == 1.0
    # ratio 0.7, A = +1: max(-0.7, -0.8) = -0.7: a lower ratio with A > 0 is never clipped.
    loss, m = _one_token(0.7, 1.0)
    assert float(loss) == pytest.approx(-0.7, abs=1e-6) and float(m["clip_frac"]) == 0.0


# Ratio 1 everywhere, so each token's loss is -A. Row 0: A = 1, 1 token; row 1: A = -1, 3 tokens.
LOGP = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]])
ADV = jnp.array([1.0, -1.0])
MASK = jnp.array([[1, 0, 0], [1, 1, 1]], dtype=jnp.float32)


@pytest.mark.parametrize(
    "aggregation,max_len,expected",
    [
        ("token_mean", None, 0.5),  # (-1 + 1 + 1 + 1) / 4 tokens
        ("seq_mean_token_mean", None, 0.0),  # mean(-1/1, 3/3)
        ("seq_mean_token_sum_norm", 4, 0.25),  # (-1 + 3) / (2 rows * 4)
        ("seq_mean_token_sum_norm", None, 1.0 / 3.0),  # (-1 + 3) / (2 rows * T=3)
    ],
)
def test_aggregations_differ_on_unequal_lengths(
    aggregation: str, max_len: int | None, expected: float
) -> None:
    loss, m = policy_loss(LOGP, LOGP, ADV, MASK, aggregation=aggregation, max_len=max_len)
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert float(m["ratio_mean"]) == pytest.approx(1.0) and float(m["clip_frac"]) == 0.0


def test_padding_contributes_nothing_and_empty_mask_is_safe() -> None:
    noisy = LOGP.at[0, 1:].set(jnp.array([50.0, -50.0]))  # garbage at padded positions of row 0
    for agg in LOSS_AGGREGATIONS:
        clean, m_clean = policy_loss(LOGP, LOGP, ADV, MASK, aggregation=agg)
        dirty, m_dirty = policy_loss(noisy, LOGP, ADV, MASK, aggregation=agg)
        assert float(clean) == float(dirty)
        assert {k: float(v) for k, v in m_clean.items()} == {k: float(v) for k, v in m_dirty.items()}
        loss, metrics = policy_loss(noisy, LOGP, ADV, jnp.zeros_like(MASK), aggregation=agg)
        assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())
    # A fully masked row (dropped by dynamic sampling) does not dilute the GRPO sequence mean: row 1 only.
    only_row1 = MASK.at[0].set(0.0)
    loss, _ = policy_loss(LOGP, LOGP, ADV, only_row1, aggregation="seq_mean_token_mean")
    assert float(loss) == pytest.approx(1.0)


def test_policy_loss_gradient_hand_value() -> None:
    # A = 2, ratios 1.1 (inside the clip range) and 1.25 (clipped at 1.2 with A > 0), token_mean over 2
    # tokens. loss = (-2 * 1.1 + -2 * 1.2) / 2 = -2.3. d loss / d logp_new = -A * ratio / 2 = -1.1 for token 0
    # and 0 for the clipped token 1 (the clipped branch is constant in logp_new).
    logp_new = jnp.log(jnp.array([[1.1, 1.25]]))
    logp_old = jnp.zeros((1, 2))

    def f(lp):
        return policy_loss(lp, logp_old, jnp.array([2.0]), jnp.ones((1, 2)))[0]

    loss, grad = jax.value_and_grad(f)(logp_new)
    assert float(loss) == pytest.approx(-2.3, abs=1e-6)
    np.testing.assert_allclose(grad, [[-1.1, 0.0]], atol=1e-6)


@pytest.mark.parametrize("aggregation", sorted(LOSS_AGGREGATIONS))
def test_policy_loss_gradient_matches_finite_differences(aggregation: str) -> None:
    logp_old = jnp.array([[-1.0, -2.0, -0.5, -1.5], [-0.3, -0.7, -1.1, -2.0]])
    delta = jnp.array([[0.05, -0.1, 0.4, 0.0], [-0.05, 0.1, -0.5, 0.02]])  # ratios inside / outside the clip
    logp_new = logp_old + delta
    adv = jnp.array([0.7, -1.3])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=jnp.float32)

    def f(lp):
        return policy_loss(lp, logp_old, adv, mask, clip_high=0.28, aggregation=aggregation, max_len=6)[0]

    grad = np.asarray(jax.jit(jax.grad(f))(logp_new))
    h = 1e-3
    steps = h * jnp.eye(8).reshape(8, 2, 4)  # one perturbed token per row
    f_batched = jax.jit(jax.vmap(f))
    numeric = np.asarray((f_batched(logp_new + steps) - f_batched(logp_new - steps)) / (2 * h)).reshape(2, 4)
    np.testing.assert_allclose(grad, numeric, atol=2e-3)
    assert grad[0, 3] == 0.0  # padding gets no gradient
    assert grad[0, 2] == 0.0 and grad[1, 2] == 0.0  # ratio e^0.4 > 1.28 with A > 0; e^-0.5 < 0.8 with A < 0


def test_policy_loss_jit_matches_eager() -> None:
    jitted = jax.jit(policy_loss, static_argnames=("aggregation", "max_len"))
    logp_new = LOGP + jnp.array([[0.1, 0.0, 0.0], [-0.2, 0.3, 0.05]])
    for agg in LOSS_AGGREGATIONS:
        eager, _ = policy_loss(logp_new, LOGP, ADV, MASK, aggregation=agg, max_len=5)
        jit_loss, _ = jitted(logp_new, LOGP, ADV, MASK, aggregation=agg, max_len=5)
        assert float(eager) == pytest.approx(float(jit_loss), abs=1e-6)


def test_unknown_aggregation_and_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"unknown loss aggregation 'mean'.*seq_mean_token_mean"):
        policy_loss(LOGP, LOGP, ADV, MASK, aggregation="mean")
    with pytest.raises(AssertionError):
        policy_loss(LOGP, LOGP, jnp.ones(3), MASK)
    with pytest.raises(ValueError, match="max_len"):
        aggregate_loss(LOGP, MASK, "seq_mean_token_sum_norm", max_len=0)


# ---------------------------------------------------------------------------------------------------------
# KL
# ---------------------------------------------------------------------------------------------------------


def test_low_var_kl_values() -> None:
    logp = jnp.zeros((1, 5))
    ref = jnp.array([[math.log(2.0), -1.0, 0.0, 5.0, -30.0]])
    # x = ref - logp: e^x - x - 1 -> 2 - ln2 - 1 = 0.3068528; e^-1 + 1 - 1 = 0.3678794; 0;
    # e^5 - 6 = 142.41 -> clamped to 10; x clamped to -20: e^-20 + 20 - 1 = 19.0 -> clamped to 10.
    np.testing.assert_allclose(low_var_kl(logp, ref), [[0.3068528, 0.3678794, 0.0, 10.0, 10.0]], rtol=1e-6)
    # d/d logp (e^(ref - logp) - (ref - logp) - 1) = 1 - e^(ref - logp): 1 - 2 = -1 at ref = ln 2.
    grad = jax.grad(lambda lp: low_var_kl(lp, ref).sum())(logp)
    np.testing.assert_allclose(grad[0, :3], [-1.0, 1.0 - math.exp(-1.0), 0.0], atol=1e-6)
    assert float(grad[0, 3]) == 0.0  # beyond the clamp


def test_kl_penalty_loss_aggregations() -> None:
    logp = jnp.zeros((2, 2))
    ref = jnp.array([[math.log(2.0), 0.0], [-1.0, 5.0]])
    mask = jnp.array([[1, 1], [1, 0]])
    # per-token [[0.3068528, 0], [0.3678794, (10, masked)]]
    assert float(kl_penalty_loss(logp, ref, mask)) == pytest.approx((0.3068528 + 0.3678794) / 3, rel=1e-6)
    seq = kl_penalty_loss(logp, ref, mask, aggregation="seq_mean_token_mean")
    assert float(seq) == pytest.approx((0.3068528 / 2 + 0.3678794) / 2, rel=1e-6)
    assert float(kl_penalty_loss(logp, ref, jnp.zeros((2, 2)))) == 0.0
