"""GRPO-family objectives in pure jnp: group advantages, PPO clipped policy loss, KL estimators.

Layout: a batch holds P prompts x n samples, flattened prompt-major ([p0s0, p0s1, ..., p1s0, ...]), so a
group is n consecutive rows. Token tensors are [B, T] (B = P*n rows, T response positions) with a mask that
is 1 on response tokens and 0 on padding; padding never contributes to a loss or metric.

Variants (selected by name, so configs stay strings):
- GRPO (DeepSeekMath): advantage (r - mean_g) / (std_g + eps), loss "seq_mean_token_mean".
- Dr.GRPO (Liu et al. 2025): advantage r - mean_g (no std), loss "seq_mean_token_sum_norm" (sum over tokens /
  a constant max length) so neither the length nor the group's spread rescales a sequence's gradient.
- DAPO (Yu et al. 2025): "token_mean" aggregation, asymmetric clip (clip_high e.g. 0.28 > clip_low 0.2), and
  dynamic sampling (drop groups whose rewards are all equal: their advantages are zero anyway).
- VeRL's actor options (verl/trainer/ppo/core_algos.py, compute_policy_loss_vanilla / kl_penalty): dual-clip
  (`clip_ratio_c`), per-token importance weights on the clipped loss (rollout correction), and the KL
  estimators kl (k1), abs, mse (k2), low_var_kl (k3).
All functions are jit-able; string and length options are static (pass them via `static_argnames`).
"""

from __future__ import annotations

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp

# log-ratio clamp before exp (as VeRL does) so a stale or corrupted log-prob cannot overflow the ratio.
_LOG_RATIO_CLAMP = 20.0
# low_var_kl clamps (VeRL's `kl_penalty(..., "low_var_kl")`): log-ratio to [-20, 20], estimate to [-10, 10].
_KL_LOG_RATIO_CLAMP = 20.0
_KL_VALUE_CLAMP = 10.0


def _grouped(rewards: jax.Array, group_size: int) -> jax.Array:
    chex.assert_rank(rewards, 1)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.shape[0]} entries, not a multiple of group_size={group_size}: "
            "pass P*n rewards ordered prompt-major (n samples of prompt 0, then of prompt 1, ...)"
        )
    return rewards.reshape(-1, group_size).astype(jnp.float32)


def _deviations(grouped: jax.Array) -> jax.Array:
    """r - mean_g, exactly 0 in groups whose rewards are all equal.

    A float32 mean of equal values can differ from them by an ulp (mean of three 0.05 is not 0.05); divided
    by (std + eps) ~ eps that rounding error would become a spurious advantage of ~1e-2.
    """
    dev = grouped - jnp.mean(grouped, axis=1, keepdims=True)
    uniform = jnp.max(grouped, axis=1, keepdims=True) == jnp.min(grouped, axis=1, keepdims=True)
    return jnp.where(uniform, 0.0, dev)


def _grpo_advantages(grouped: jax.Array, eps: float, ddof: int) -> jax.Array:
    # ddof 0 (population std, the default): a group's normalised advantages then have unit RMS exactly.
    # ddof 1 is VeRL's torch.std (unbiased; compute_grpo_outcome_advantage): every advantage is
    # sqrt(n / (n - 1)) times the population one up to eps, i.e. an effective learning-rate factor.
    std = jnp.std(grouped, axis=1, keepdims=True, ddof=ddof)
    return _deviations(grouped) / (std + eps)


def _drgrpo_advantages(grouped: jax.Array, eps: float, ddof: int) -> jax.Array:
    del eps, ddof
    return _deviations(grouped)


ADVANTAGE_METHODS: dict[str, Callable[[jax.Array, float, int], jax.Array]] = {
    "grpo": _grpo_advantages,
    "drgrpo": _drgrpo_advantages,
}
# the std that "grpo" divides by: its ddof (VeRL: torch.std, "unbiased")
ADV_STDS: dict[str, int] = {"population": 0, "unbiased": 1}


def group_advantages(
    rewards: jax.Array,
    group_size: int,
    *,
    method: str = "grpo",
    eps: float = 1e-6,
    std: str = "population",
) -> jax.Array:
    """Per-sample advantages [P*n] from rewards [P*n], normalised within each group of `group_size` samples.

    "grpo": (r - mean_g) / (std_g + eps), std_g the population std (`std="population"`) or VeRL's unbiased
    one (`std="unbiased"`); a group with equal rewards gets 0.
    "drgrpo": r - mean_g (Dr.GRPO drops the std division, which over-weights near-uniform groups; VeRL's
    norm_adv_by_std_in_grpo=False). `group_size`, `method` and `std` are static under jit.
    """
    if method not in ADVANTAGE_METHODS:
        raise ValueError(f"unknown advantage method {method!r}; valid methods: {sorted(ADVANTAGE_METHODS)}")
    if std not in ADV_STDS:
        raise ValueError(f"unknown advantage std {std!r}; valid: {sorted(ADV_STDS)}")
    if std == "unbiased" and group_size < 2:
        raise ValueError("the unbiased std needs groups of >= 2 samples (group_size=1 divides by 0)")
    grouped = _grouped(rewards, group_size)
    return ADVANTAGE_METHODS[method](grouped, eps, ADV_STDS[std]).reshape(-1)


def dynamic_sampling_mask(rewards: jax.Array, group_size: int) -> jax.Array:
    """DAPO dynamic sampling: [P*n] bool, True for samples of groups whose rewards are not all equal.

    Groups with zero reward variance (all right or all wrong) give zero advantage and no learning signal.
    Equality is exact (max == min): verifier rewards are discrete, so no tolerance is needed.
    """
    grouped = _grouped(rewards, group_size)
    keep = jnp.max(grouped, axis=1) > jnp.min(grouped, axis=1)
    return jnp.repeat(keep, group_size)


def _token_mean(loss_bt: jax.Array, mask_bt: jax.Array, max_len: int | None) -> jax.Array:
    del max_len
    return jnp.sum(loss_bt * mask_bt) / jnp.maximum(jnp.sum(mask_bt), 1.0)


def _seq_mean_token_mean(loss_bt: jax.Array, mask_bt: jax.Array, max_len: int | None) -> jax.Array:
    del max_len
    tokens_b = jnp.sum(mask_bt, axis=-1)
    seq_b = jnp.sum(loss_bt * mask_bt, axis=-1) / jnp.maximum(tokens_b, 1.0)
    has_tokens = (tokens_b > 0).astype(loss_bt.dtype)
    # Mean over sequences that have at least one response token: fully masked rows (e.g. dropped by dynamic
    # sampling) neither contribute nor dilute the mean.
    return jnp.sum(seq_b * has_tokens) / jnp.maximum(jnp.sum(has_tokens), 1.0)


def _seq_mean_token_sum_norm(loss_bt: jax.Array, mask_bt: jax.Array, max_len: int | None) -> jax.Array:
    # Dr.GRPO: mean over the B rows of (sum over tokens / max_len). The divisor B*max_len is a constant (pass
    # the configured max response length; default T), so a token's weight never depends on its sequence's
    # length. VeRL's "seq-mean-token-sum-norm" divides the sum by T only (not by B): a constant factor B.
    norm = loss_bt.shape[-1] if max_len is None else max_len
    return jnp.sum(loss_bt * mask_bt) / (loss_bt.shape[0] * norm)


def _seq_mean_token_sum(loss_bt: jax.Array, mask_bt: jax.Array, max_len: int | None) -> jax.Array:
    # VeRL's "seq-mean-token-sum" (core_algos.agg_loss): each sequence's token sum, then the mean over the
    # sequences with tokens; a long sequence weighs more (no length normalisation at all)
    del max_len
    has_tokens = (jnp.sum(mask_bt, axis=-1) > 0).astype(loss_bt.dtype)
    return jnp.sum(loss_bt * mask_bt) / jnp.maximum(jnp.sum(has_tokens), 1.0)


LOSS_AGGREGATIONS: dict[str, Callable[[jax.Array, jax.Array, int | None], jax.Array]] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum": _seq_mean_token_sum,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


def aggregate_loss(
    loss_bt: jax.Array, mask_bt: jax.Array, aggregation: str = "token_mean", max_len: int | None = None
) -> jax.Array:
    """Reduce per-token losses [B, T] to a scalar with a named aggregation (see LOSS_AGGREGATIONS).

    "token_mean": sum over all valid tokens / their count (DAPO token-level).
    "seq_mean_token_mean": per-sequence token mean, then mean over sequences with tokens (GRPO).
    "seq_mean_token_sum": per-sequence token sum, then mean over sequences with tokens (VeRL's).
    "seq_mean_token_sum_norm": sum over tokens / (B * max_len) (Dr.GRPO; max_len defaults to T).
    Empty masks give 0.
    """
    if aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; valid: {sorted(LOSS_AGGREGATIONS)}")
    chex.assert_rank([loss_bt, mask_bt], 2)
    chex.assert_equal_shape([loss_bt, mask_bt])
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be >= 1 (the constant Dr.GRPO divisor), got {max_len}")
    return LOSS_AGGREGATIONS[aggregation](loss_bt, mask_bt.astype(loss_bt.dtype), max_len)


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def policy_loss(
    logp_new_bt: jax.Array,
    logp_old_bt: jax.Array,
    advantages_b: jax.Array,
    mask_bt: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: str = "token_mean",
    max_len: int | None = None,
    clip_ratio_c: float = 0.0,
    is_weights_bt: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate: per token max(-A*r, -A*clip(r, 1-clip_low, 1+clip_high)), then aggregated.

    r = exp(logp_new - logp_old) (log-ratio clamped to +-20 before exp). The per-sequence advantage
    broadcasts over its tokens. DAPO's clip-higher is clip_high > clip_low. `clip_ratio_c` > 1 (0: off) is
    dual-clip PPO (Ye et al. 2019; VeRL's compute_policy_loss_vanilla): tokens with A < 0 are capped at
    -A * clip_ratio_c, so a huge ratio on a bad token cannot blow up the loss. `is_weights_bt` (constants,
    e.g. truncated importance weights against the rollout's log-probs) multiply each token's clipped loss
    before aggregation, as VeRL applies rollout_is_weights. Returns (loss, metrics) with metrics over valid
    tokens: clip_frac (fraction where the clipped term is the active one), approx_kl (mean of logp_old -
    logp_new), ratio_mean, and with dual-clip clip_frac_lower (VeRL's pg_clipfrac_lower: A < 0 tokens
    whose clipped loss exceeds the cap).
    """
    chex.assert_rank([logp_new_bt, logp_old_bt, mask_bt, advantages_b], [2, 2, 2, 1])
    chex.assert_equal_shape([logp_new_bt, logp_old_bt, mask_bt])
    chex.assert_equal_shape_prefix([logp_new_bt, advantages_b], 1)
    if clip_ratio_c and clip_ratio_c <= 1.0:
        raise ValueError(
            f"clip_ratio_c={clip_ratio_c}: dual-clip needs a bound > 1 (VeRL: 3.0), or 0 for off"
        )
    dtype = logp_new_bt.dtype
    mask = mask_bt.astype(dtype)
    adv = advantages_b.astype(dtype)[:, None]
    log_ratio = jnp.clip(logp_new_bt - logp_old_bt, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_bt = jnp.maximum(unclipped, clipped)
    metrics = {
        "clip_frac": _masked_mean((clipped > unclipped).astype(dtype), mask),
        "approx_kl": _masked_mean(-log_ratio, mask),
        "ratio_mean": _masked_mean(ratio, mask),
    }
    if clip_ratio_c:
        cap = -adv * clip_ratio_c
        negative = jnp.broadcast_to(adv < 0, loss_bt.shape)
        metrics["clip_frac_lower"] = _masked_mean(((loss_bt > cap) & negative).astype(dtype), mask)
        loss_bt = jnp.where(negative, jnp.minimum(cap, loss_bt), loss_bt)
    if is_weights_bt is not None:
        chex.assert_equal_shape([is_weights_bt, loss_bt])
        loss_bt = loss_bt * jax.lax.stop_gradient(is_weights_bt.astype(dtype))
    return aggregate_loss(loss_bt, mask, aggregation, max_len), metrics


def _k1(logp: jax.Array, ref: jax.Array) -> jax.Array:
    return logp - ref


def _abs(logp: jax.Array, ref: jax.Array) -> jax.Array:
    return jnp.abs(logp - ref)


def _k2(logp: jax.Array, ref: jax.Array) -> jax.Array:
    return 0.5 * jnp.square(logp - ref)


def low_var_kl(logp_bt: jax.Array, ref_logp_bt: jax.Array) -> jax.Array:
    """Per-token k3 estimate of KL(policy || ref): exp(ref - logp) - (ref - logp) - 1, as VeRL's low_var_kl.

    Non-negative and unbiased for samples from the policy, with lower variance than logp - ref. As in VeRL
    the log-ratio is clamped to [-20, 20] and the estimate to [-10, 10] (no gradient beyond the clamps).
    """
    chex.assert_equal_shape([logp_bt, ref_logp_bt])
    log_ratio = jnp.clip(ref_logp_bt - logp_bt, -_KL_LOG_RATIO_CLAMP, _KL_LOG_RATIO_CLAMP)
    kl = jnp.exp(log_ratio) - log_ratio - 1.0
    return jnp.clip(kl, -_KL_VALUE_CLAMP, _KL_VALUE_CLAMP)


def _straight_through(forward: Callable[[jax.Array, jax.Array], jax.Array]) -> Callable:
    """VeRL 0.9.1's "<name>+" (core_algos.kl_penalty): the value of `forward`, the gradient of k2
    ((logp - ref)^2 / 2, whose expected gradient is the KL's; k1's and k3's are not)."""

    def estimate(logp: jax.Array, ref: jax.Array) -> jax.Array:
        k2 = _k2(logp, ref)
        return k2 - jax.lax.stop_gradient(k2) + jax.lax.stop_gradient(forward(logp, ref))

    return estimate


# VeRL's kl_penalty names (verl/trainer/ppo/core_algos.py kl_penalty_forward; http://joschu.net/blog/kl-approx.html):
# only low_var_kl is clamped (VeRL clamps no other). "full" (the exact KL over the vocabulary) is not here:
# VeRL raises NotImplementedError on it too. A "+" suffix (VeRL 0.9.1) keeps the value, takes k2's gradient.
_KL_BASE: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "kl": _k1,
    "k1": _k1,
    "abs": _abs,
    "mse": _k2,
    "k2": _k2,
    "low_var_kl": low_var_kl,
    "k3": low_var_kl,
}
KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    **_KL_BASE,
    **{f"{name}+": fn if fn is _k2 else _straight_through(fn) for name, fn in _KL_BASE.items()},
}


def kl_estimate(logp_bt: jax.Array, ref_logp_bt: jax.Array, estimator: str = "low_var_kl") -> jax.Array:
    """Per-token estimate of KL(policy || ref) from the sampled tokens' log-probs, by VeRL's name: "kl"/"k1"
    logp - ref (unbiased, can be negative), "abs" |logp - ref|, "mse"/"k2" (logp - ref)^2 / 2, "low_var_kl"/
    "k3" (`low_var_kl`); with a "+" suffix, that value with k2's gradient. `estimator` is static under jit."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {sorted(KL_ESTIMATORS)}")
    chex.assert_equal_shape([logp_bt, ref_logp_bt])
    return KL_ESTIMATORS[estimator](logp_bt, ref_logp_bt)


def kl_penalty_loss(
    logp_bt: jax.Array,
    ref_logp_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    aggregation: str = "token_mean",
    max_len: int | None = None,
    estimator: str = "low_var_kl",
) -> jax.Array:
    """The aggregated KL estimate over valid tokens (multiply by the KL coefficient, e.g. 0.001, and add), as
    VeRL's use_kl_loss: agg_loss(kl_penalty(logp, ref, kl_loss_type), loss_agg_mode)."""
    chex.assert_rank([logp_bt, ref_logp_bt, mask_bt], 2)
    return aggregate_loss(kl_estimate(logp_bt, ref_logp_bt, estimator), mask_bt, aggregation, max_len)
