"""GRPO / Dr.GRPO / DAPO objectives and VeRL's loss options (tlt_jax.rl.losses, kl_reward) against
hand-computed values."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rl.batch import TrainBatch, with_advantages
from tlt_jax.rl.forward import ForwardOut
from tlt_jax.rl.grpo import (
    ADVANTAGE_METHODS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    aggregate_loss,
    dynamic_sampling_mask,
    group_advantages,
    kl_estimate,
    kl_penalty_loss,
    low_var_kl,
    policy_loss,
)
from tlt_jax.rl.kl_reward import KLInReward, kl_penalised_rewards, reward_kl_penalty
from tlt_jax.rl.losses import (
    PolicyLossConfig,
    is_metrics,
    merge_stats,
    micro_loss,
    rollout_is_weights,
    update_metrics,
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


def test_unbiased_std_advantages_hand_values() -> None:
    # VeRL's torch.std: [1, 2, 3, 6] has unbiased var 14/3, std 2.1602469; [1, 0, 0, 1] var 1/3, 0.5773503.
    adv = group_advantages(REWARDS, 4, method="grpo", eps=0.0, std="unbiased")
    expected = [-0.9258201, -0.4629100, 0.0, 1.3887301, 0.8660254, -0.8660254, -0.8660254, 0.8660254]
    np.testing.assert_allclose(adv, expected, rtol=1e-6, atol=1e-6)
    # drgrpo divides by no std: the convention changes nothing
    np.testing.assert_array_equal(
        group_advantages(REWARDS, 4, method="drgrpo", std="unbiased"),
        group_advantages(REWARDS, 4, method="drgrpo"),
    )
    with pytest.raises(ValueError, match=r"unknown advantage std 'sample'.*\['population', 'unbiased'\]"):
        group_advantages(REWARDS, 4, std="sample")
    with pytest.raises(ValueError, match="groups of >= 2"):
        group_advantages(REWARDS, 1, std="unbiased")


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


def test_dual_clip_caps_negative_advantages() -> None:
    # ratio 5, A = -1: the PPO term is max(-A * 5, -A * clip(5, 0.8, 1.2)) = 5; dual-clip caps it at
    # -A * clip_ratio_c = 3 (a constant: no gradient), where plain PPO's 5 has d/dlogp = -A * ratio = 5.
    logp_old = jnp.zeros((1, 1))

    def one(logp_new: jax.Array, adv: float, **kw: float) -> tuple[jax.Array, dict[str, jax.Array]]:
        return policy_loss(logp_new, logp_old, jnp.array([adv]), jnp.ones((1, 1)), **kw)

    five = jnp.array([[math.log(5.0)]])
    (loss, m), grad = jax.value_and_grad(one, has_aux=True)(five, -1.0, clip_ratio_c=3.0)
    assert float(loss) == pytest.approx(3.0, abs=1e-6) and float(grad[0, 0]) == 0.0
    assert float(m["clip_frac_lower"]) == 1.0
    (loss, m), grad = jax.value_and_grad(one, has_aux=True)(five, -1.0)
    assert float(loss) == pytest.approx(5.0, abs=1e-5) and float(grad[0, 0]) == pytest.approx(5.0, abs=1e-5)
    assert "clip_frac_lower" not in m
    # below the cap (ratio 2: loss 2 < 3) and for A > 0 (ratio 5: -1.2) dual-clip changes nothing
    loss, m = one(jnp.array([[math.log(2.0)]]), -1.0, clip_ratio_c=3.0)
    assert float(loss) == pytest.approx(2.0, abs=1e-6) and float(m["clip_frac_lower"]) == 0.0
    loss, m = one(five, 1.0, clip_ratio_c=3.0)
    assert float(loss) == pytest.approx(-1.2, abs=1e-6) and float(m["clip_frac_lower"]) == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c=1.0: dual-clip needs a bound > 1"):
        one(five, -1.0, clip_ratio_c=1.0)


def test_importance_weights_scale_each_tokens_loss() -> None:
    # ratio 1 everywhere: token losses -A = [[-1, -1], [1, 1]], times the weights [[2, 0.5], [1, 0.25]] ->
    # [[-2, -0.5], [1, 0.25]], token mean -1.25 / 4; d/dlogp = -A * w * ratio / 4; the weights get none.
    logp, adv, mask = jnp.zeros((2, 2)), jnp.array([1.0, -1.0]), jnp.ones((2, 2))
    w = jnp.array([[2.0, 0.5], [1.0, 0.25]])

    def f(lp: jax.Array, weights: jax.Array) -> jax.Array:
        return policy_loss(lp, logp, adv, mask, is_weights_bt=weights)[0]

    loss, (g_logp, g_w) = jax.value_and_grad(f, argnums=(0, 1))(logp, w)
    assert float(loss) == pytest.approx(-1.25 / 4, abs=1e-7)
    np.testing.assert_allclose(g_logp, [[-0.5, -0.125], [0.25, 0.0625]], atol=1e-7)
    assert not np.asarray(g_w).any()


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


def test_kl_estimators_hand_values() -> None:
    # logp 0 and ref ln2, -1, 0: k1 = logp - ref = -ln2, 1, 0; abs = ln2, 1, 0; k2 = (logp - ref)^2 / 2 =
    # 0.2402265, 0.5, 0; k3 as test_low_var_kl_values. Only k3 is clamped (VeRL's kl_penalty_forward).
    logp, ref = jnp.zeros((1, 4)), jnp.array([[math.log(2.0), -1.0, 0.0, -30.0]])
    want = {
        "kl": [-0.6931472, 1.0, 0.0, 30.0],
        "abs": [0.6931472, 1.0, 0.0, 30.0],
        "mse": [0.2402265, 0.5, 0.0, 450.0],
        "low_var_kl": [0.3068528, 0.3678794, 0.0, 10.0],
    }
    aliases = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
    for name, values in want.items():
        np.testing.assert_allclose(kl_estimate(logp, ref, name)[0], values, rtol=1e-6, err_msg=name)
        if name in aliases:
            np.testing.assert_array_equal(kl_estimate(logp, ref, aliases[name]), kl_estimate(logp, ref, name))
    # gradients in logp: k1 1, abs sign(logp - ref), k2 logp - ref
    for name, g in (("kl", [1, 1, 1]), ("abs", [-1, 1]), ("mse", [-0.6931472, 1.0, 0.0])):
        grad = jax.grad(lambda lp, e=name: kl_estimate(lp, ref, e).sum())(logp)
        np.testing.assert_allclose(grad[0, : len(g)], g, rtol=1e-6, err_msg=name)
    # the loss term: k1's token mean over the 3 valid tokens (-ln2 + 1 + 0) / 3
    mask = jnp.array([[1, 1, 1, 0]])
    loss = kl_penalty_loss(logp, ref, mask, estimator="kl")
    assert float(loss) == pytest.approx((1.0 - math.log(2.0)) / 3, rel=1e-6)
    with pytest.raises(ValueError, match=r"unknown KL estimator 'full'.*'low_var_kl'"):
        kl_estimate(logp, ref, "full")
    base = ["abs", "k1", "k2", "k3", "kl", "low_var_kl", "mse"]
    assert sorted(KL_ESTIMATORS) == sorted(base + [f"{name}+" for name in base])


def test_kl_penalty_loss_aggregations() -> None:
    logp = jnp.zeros((2, 2))
    ref = jnp.array([[math.log(2.0), 0.0], [-1.0, 5.0]])
    mask = jnp.array([[1, 1], [1, 0]])
    # per-token [[0.3068528, 0], [0.3678794, (10, masked)]]
    assert float(kl_penalty_loss(logp, ref, mask)) == pytest.approx((0.3068528 + 0.3678794) / 3, rel=1e-6)
    seq = kl_penalty_loss(logp, ref, mask, aggregation="seq_mean_token_mean")
    assert float(seq) == pytest.approx((0.3068528 / 2 + 0.3678794) / 2, rel=1e-6)
    assert float(kl_penalty_loss(logp, ref, jnp.zeros((2, 2)))) == 0.0


# ---------------------------------------------------------------------------------------------------------
# The update's loss of a micro-batch (tlt_jax.rl.losses), rollout correction, KL in the reward
# ---------------------------------------------------------------------------------------------------------


def _micro(rollout_logp: jax.Array | None = None) -> TrainBatch:
    """One group of 2 rows x 2 columns: row 0 A = 1 (2 tokens), row 1 A = -1 (1 token, then padding)."""
    return TrainBatch(
        prompt=jnp.ones((1, 1), jnp.int32),
        prompt_len=jnp.ones((1,), jnp.int32),
        response=jnp.ones((1, 2, 2), jnp.int32),
        response_mask=jnp.array([[[1.0, 1.0], [1.0, 0.0]]]),
        advantages=jnp.array([[1.0, -1.0]]),
        old_logp=jnp.zeros((1, 2, 2)),
        ref_logp=jnp.array([[[-1.0, 0.0], [0.0, 0.0]]]),
        rollout_logp=rollout_logp,
    )


def test_micro_loss_composes_the_terms_as_verl() -> None:
    """weight x (pg - entropy_coeff x entropy + kl_coef x KL), every term token_mean over the 3 tokens, the
    old log-probs fused (ratio 1: pg tokens -A), weighted by truncated IS weights. Hand values: rollout
    log-probs -ln3, ln2, 0 -> weights pi_old / pi_rollout 3 (-> cap 2), 0.5, 1: pg = (-2 - 0.5 + 1) / 3;
    entropy (1 + 2 + 3) / 3 = 2 (the padding's 9 ignored); k2 = (0 - (-1))^2 / 2 = 0.5 at token 0: 0.5 / 3."""
    batch = _micro(jnp.array([[[-math.log(3.0), math.log(2.0)], [0.0, 0.0]]]))
    lc = PolicyLossConfig(
        aggregation="token_mean",
        kl_coef=0.3,
        kl_loss_type="mse",
        entropy_coeff=0.1,
        clip_ratio_c=3.0,
        rollout_is="token",
        rollout_is_threshold=2.0,
    )

    def f(logp: jax.Array, entropy: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        return micro_loss(ForwardOut(logp=logp, entropy=entropy, hidden=None), batch, lc, jnp.float32(0.5))

    entropy = jnp.array([[1.0, 2.0], [3.0, 9.0]])
    (loss, aux), (g_logp, g_ent) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        jnp.zeros((2, 2)), entropy
    )
    assert float(loss) == pytest.approx(0.5 * (-1.5 / 3 - 0.1 * 2.0 + 0.3 * 0.5 / 3), abs=1e-6)
    # d/dlogp: -A x w / 3 (pg) + 0.3 x (logp - ref) / 3 (k2), times 0.5; d/dentropy: -0.1 / 3 x 0.5
    np.testing.assert_allclose(g_logp, 0.5 * np.array([[-2 / 3 + 0.1, -0.5 / 3], [1 / 3, 0.0]]), atol=1e-6)
    np.testing.assert_allclose(g_ent, -0.05 / 3 * np.array([[1, 1], [1, 0]]), atol=1e-7)
    want = {"pg_loss": 0.5 * -0.5, "kl": 0.5 * 0.5 / 3, "entropy_loss": 0.5 * 2.0, "tokens": 3.0}
    want |= {"clip_frac_lower_sum": 0.0, "is_sum": 4.5, "is_max": 3.0, "is_min": 0.5, "is_high": 1.0}
    for k, v in want.items():
        assert float(aux[k]) == pytest.approx(v, abs=1e-6), k
    # the defaults compute the loss and statistics they always did: no extra term, no extra statistic
    _, plain = micro_loss(ForwardOut(jnp.zeros((2, 2)), entropy, None), batch, PolicyLossConfig(), 1.0)
    assert set(plain) == {"pg_loss", "kl", "tokens", "clip_frac_sum", "approx_kl_sum", "entropy_sum", "logp"}
    with pytest.raises(ValueError, match="rollout_is needs the rollout's log-probs"):
        micro_loss(ForwardOut(jnp.zeros((2, 2)), entropy, None), _micro(), lc, 1.0)


def test_rollout_is_weights_token_and_sequence() -> None:
    # log(pi_old / pi_rollout): row 0 ln 3, ln 0.4, ln 1.5; row 1 ln 1.2, ln 1.25, padding (ln 7, ignored)
    ratios = np.array([[3.0, 0.4, 1.5], [1.2, 1.25, 7.0]])
    old, rollout = jnp.asarray(np.log(ratios), jnp.float32), jnp.zeros((2, 3))
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w, s = rollout_is_weights(old, rollout, mask, "token", 2.0)
    np.testing.assert_allclose(w, [[2.0, 0.4, 1.5], [1.2, 1.25, 0.0]], rtol=1e-6)
    # untruncated: sum 7.35 over 5 tokens, max 3, min 0.4; 1 token above 2, 1 below 1/2; ESS of the weights
    # clamped to [0.5, 2] (2, 0.5, 1.5, 1.2, 1.25): 6.45^2 / (5 x 9.5025) = 0.8756090
    m = is_metrics({k: float(v) for k, v in s.items()} | {"tokens": 5.0})
    want = {"mean": 1.47, "max": 3.0, "min": 0.4, "ratio_fraction_high": 0.2, "ratio_fraction_low": 0.2}
    for k, v in (want | {"eff_sample_size": 0.8756090}).items():
        assert m[f"rollout_corr/rollout_is_{k}"] == pytest.approx(v, rel=1e-5), k
    # sequence level: the products 3 x 0.4 x 1.5 = 1.8 and 1.2 x 1.25 = 1.5 on every token of the row
    w, s = rollout_is_weights(old, rollout, mask, "sequence", 1.6)
    np.testing.assert_allclose(w, [[1.6] * 3, [1.5, 1.5, 0.0]], rtol=1e-6)
    assert float(s["is_units"]) == 2.0 and float(s["is_high"]) == 1.0  # one of the 2 sequences above 1.6
    with pytest.raises(ValueError, match="unknown rollout_is level 'geometric'"):
        rollout_is_weights(old, rollout, mask, "geometric", 2.0)


def test_update_metrics_reduce_max_min_and_sums() -> None:
    a = {"tokens": jnp.float32(2.0), "is_max": jnp.float32(3.0), "is_min": jnp.float32(0.5)}
    b = {"tokens": jnp.float32(4.0), "is_max": jnp.float32(1.0), "is_min": jnp.float32(0.25)}
    merged = merge_stats(merge_stats({}, a), b)
    assert {k: float(v) for k, v in merged.items()} == {"tokens": 6.0, "is_max": 3.0, "is_min": 0.25}
    s = {"pg_loss": 1.0, "kl": 0.0, "tokens": 4.0, "clip_frac_sum": 1.0, "approx_kl_sum": 0.4}
    s |= {"entropy_sum": 8.0, "grad_norm": 2.0, "update_norm": 0.1, "clip_frac_lower_sum": 2.0}
    m = update_metrics(s | {"entropy_loss": 1.5})
    assert m["policy/entropy"] == 2.0 and m["loss/entropy"] == 1.5 and m["policy/clip_frac_lower"] == 0.5
    assert not any(k.startswith("rollout_corr/") for k in m)


def test_kl_in_the_reward_hand_values() -> None:
    # k1 = old - ref: row 0 ln2 and 0, row 1 1 (its second column is padding): sums ln2 and 1
    rewards = np.array([1.0, 0.0], np.float32)
    old, ref = np.zeros((2, 2)), np.array([[-math.log(2.0), 0.0], [-1.0, -50.0]])
    mask = np.array([[1, 1], [1, 0]])
    got, current = kl_penalised_rewards(rewards, old, ref, mask, 0.1, "kl")
    np.testing.assert_allclose(got, [1.0 - 0.1 * math.log(2.0), -0.1], rtol=1e-6)
    assert current == pytest.approx((math.log(2.0) / 2 + 1.0) / 2, rel=1e-6)  # rows' token means, averaged
    # the adaptive controller: beta x (1 + clip(kl / target - 1, -0.2, 0.2) x rows / horizon)
    adaptive = KLInReward(coef=0.1, ctrl="adaptive", target=0.8, horizon=10)
    assert adaptive.next_coef(0.1, current, 2) == pytest.approx(0.1 * (1 + (current / 0.8 - 1) * 2 / 10))
    assert adaptive.next_coef(0.1, 5.0, 2) == pytest.approx(0.1 * 1.04)  # the error clipped at 0.2
    assert KLInReward(coef=0.1).next_coef(0.1, 5.0, 2) == 0.1
    # from a host batch (the update's log-prob phase filled old and reference log-probs)
    batch = _micro().replace(old_logp=old.reshape(1, 2, 2), ref_logp=ref.reshape(1, 2, 2))
    got2, metrics, beta = reward_kl_penalty(rewards, batch, adaptive, 0.1)
    np.testing.assert_array_equal(got2, got)
    assert metrics == {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": 0.1}
    assert beta == adaptive.next_coef(0.1, current, 2)
    # then the advantages of the penalised rewards go into the batch, dropped rows masked out
    after = with_advantages(batch, np.array([0.5, -0.5]), np.array([True, False]))
    np.testing.assert_array_equal(after.advantages, [[0.5, -0.5]])
    np.testing.assert_array_equal(after.response_mask, [[[1, 1], [0, 0]]])
