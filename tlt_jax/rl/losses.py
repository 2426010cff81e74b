"""The update's loss of one micro-batch, as VeRL's actor composes it (verl/workers/actor/dp_actor.py
update_policy): the PPO-clipped policy loss (optionally dual-clipped and weighted by truncated importance
weights against the rollout's own log-probs), minus `entropy_coeff` x the aggregated entropy, plus `kl_coef` x
the aggregated KL estimate to the reference policy; and the update's metrics from its per-micro-batch sums.

Rollout correction (VeRL's `algorithm.rollout_correction`, "decoupled" mode: verl/trainer/ppo/
rollout_corr_helper.py compute_rollout_correction_weights): the engine samples with its own numerics (bf16,
speculative decoding's programs), so the sampling policy pi_rollout differs slightly from the trainer's
pi_old. Each token's (or, at the sequence level, each row's) weight pi_old / pi_rollout, truncated at
`rollout_is_threshold` and held constant, multiplies the token's clipped loss. With fused old log-probs the
update's own forward is pi_old (one update per step), so the weights need no extra pass.

Every option is static (a `PolicyLossConfig` field): a config compiles one loss, and the defaults compile
exactly the loss this module replaced (no extra term, metric or operation).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections as mlc

from tlt_jax.config_sections import RLSection
from tlt_jax.rl import grpo
from tlt_jax.rl.batch import TrainBatch
from tlt_jax.rl.forward import ForwardOut

# VeRL's rollout_is levels ("none": off); its SAFETY_BOUND on the log-ratio before exp
ROLLOUT_IS_LEVELS = ("none", "token", "sequence")
_IS_LOG_BOUND = 20.0
# the KL-in-reward controllers (tlt_jax.rl.kl_reward; VeRL's algorithm.kl_ctrl.type)
KL_CONTROLLERS = ("fixed", "adaptive")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Static settings of the GRPO-family loss (see tlt_jax.rl.grpo and the module docstring)."""

    temperature: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: str = "seq_mean_token_mean"
    max_len: int | None = None  # Dr.GRPO's constant divisor (the max response length)
    kl_coef: float = 0.0
    fuse_old_logprobs: bool = True  # old log-probs = stop_gradient(this forward) (one update per step)
    logits_chunk: int = 0
    clip_ratio_c: float = 0.0  # dual-clip bound for A < 0 (> 1; 0: off)
    entropy_coeff: float = 0.0  # the loss subtracts entropy_coeff x the aggregated entropy
    kl_loss_type: str = "low_var_kl"  # grpo.KL_ESTIMATORS
    rollout_is: str = "none"  # truncated importance sampling against the rollout: none | token | sequence
    rollout_is_threshold: float = 2.0  # the weights' cap


def rollout_is_weights(
    old_bt: jax.Array, rollout_bt: jax.Array, mask_bt: jax.Array, level: str, threshold: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Truncated importance weights [B, T] min(pi_old / pi_rollout, threshold) (0 on padding), and their
    statistics before truncation as sums over the micro-batch (`is_metrics` turns them into VeRL's
    rollout_corr/rollout_is_* metrics). "token": one weight per token; "sequence": exp(sum of the row's
    token log-ratios) on each of its tokens. Log-ratios are bounded to +-20 before exp, as VeRL's."""
    if level not in ROLLOUT_IS_LEVELS[1:]:
        raise ValueError(f"unknown rollout_is level {level!r}; valid: {ROLLOUT_IS_LEVELS[1:]}")
    mask = mask_bt.astype(jnp.float32)
    log_ratio = jax.lax.stop_gradient(old_bt - rollout_bt) * mask
    if level == "sequence":
        log_ratio = jnp.broadcast_to(jnp.sum(log_ratio, axis=-1, keepdims=True), mask.shape)
    w = jnp.exp(jnp.clip(log_ratio, -_IS_LOG_BOUND, _IS_LOG_BOUND)) * mask
    valid = mask > 0
    # VeRL counts weights beyond the bounds per token at the token level, per sequence at the sequence level
    # (here: the rows with a token; every token of a row carries the row's weight)
    units_w, units = (w, mask) if level == "token" else (w[:, 0], (jnp.sum(mask, axis=-1) > 0) * 1.0)
    clamped = jnp.clip(w, 1.0 / threshold, threshold)  # VeRL's effective sample size uses these
    stats = {
        "is_sum": jnp.sum(w),
        "is_max": jnp.max(jnp.where(valid, w, 0.0)),
        "is_min": jnp.min(jnp.where(valid, w, jnp.inf)),
        "is_units": jnp.sum(units),
        "is_high": jnp.sum(units * (units_w > threshold)),
        "is_low": jnp.sum(units * (units_w < 1.0 / threshold)),
        "is_ess_sum": jnp.sum(clamped * mask),
        "is_ess_sq": jnp.sum(jnp.square(clamped) * mask),
    }
    return jnp.minimum(w, threshold), stats


def micro_loss(
    out: ForwardOut, mb: TrainBatch, lc: PolicyLossConfig, weight: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """weight x (policy loss - entropy_coeff x entropy + kl_coef x KL) of one micro-batch from its forward
    `out`, and its statistics (sums over the micro-batch; "logp": the forward's log-probs)."""
    mask = mb.rows(mb.response_mask)
    old = jax.lax.stop_gradient(out.logp) if lc.fuse_old_logprobs else mb.rows(mb.old_logp)
    is_w, is_stats = None, {}
    if lc.rollout_is != "none":
        if mb.rollout_logp is None:
            raise ValueError(
                "rollout_is needs the rollout's log-probs in the batch (TrainBatch.rollout_logp)"
            )
        is_w, is_stats = rollout_is_weights(
            old, mb.rows(mb.rollout_logp), mask, lc.rollout_is, lc.rollout_is_threshold
        )
    pg, pm = grpo.policy_loss(
        out.logp,
        old,
        mb.rows(mb.advantages),
        mask,
        clip_low=lc.clip_low,
        clip_high=lc.clip_high,
        aggregation=lc.aggregation,
        max_len=lc.max_len,
        clip_ratio_c=lc.clip_ratio_c,
        is_weights_bt=is_w,
    )
    kl = jnp.zeros((), jnp.float32)
    if lc.kl_coef > 0:
        kl = grpo.kl_penalty_loss(
            out.logp,
            mb.rows(mb.ref_logp),
            mask,
            aggregation=lc.aggregation,
            max_len=lc.max_len,
            estimator=lc.kl_loss_type,
        )
    tokens = jnp.sum(mask)
    aux = {
        "pg_loss": pg * weight,
        "kl": kl * weight,
        "tokens": tokens,
        # token sums (the host divides by the total token count)
        "clip_frac_sum": pm["clip_frac"] * tokens,
        "approx_kl_sum": pm["approx_kl"] * tokens,
        "entropy_sum": jnp.sum(out.entropy * mask),
        "logp": jax.lax.stop_gradient(out.logp),
        **is_stats,
    }
    loss = pg
    if lc.clip_ratio_c:
        aux["clip_frac_lower_sum"] = pm["clip_frac_lower"] * tokens
    if lc.entropy_coeff:  # VeRL: policy_loss -= entropy_coeff * agg_loss(entropy, loss_agg_mode)
        entropy = grpo.aggregate_loss(out.entropy, mask, lc.aggregation, lc.max_len)
        loss = loss - lc.entropy_coeff * entropy
        aux["entropy_loss"] = jax.lax.stop_gradient(entropy) * weight
    return (loss + lc.kl_coef * kl) * weight, aux


def reduce_stat(name: str, values: jax.Array) -> jax.Array:
    """A statistic over micro-batches (or parts): `*_max` by max, `*_min` by min, the rest summed."""
    if name.endswith("_max"):
        return jnp.max(values)
    if name.endswith("_min"):
        return jnp.min(values)
    return jnp.sum(values)


def merge_stats(acc: dict[str, jax.Array], new: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """`acc` with one part's reduced statistics `new` folded in (`reduce_stat`'s rule per name)."""
    return {k: reduce_stat(k, jnp.stack([acc[k], v])) if k in acc else v for k, v in new.items()}


def is_metrics(s: dict[str, float]) -> dict[str, float]:
    """VeRL's rollout_corr/rollout_is_* metrics (compute_is_metrics) from `rollout_is_weights`' sums: the
    untruncated weights' token mean, max, min, the share of tokens (sequences, at the sequence level) above
    the cap and below 1 / cap, and the effective sample size of the weights clamped to [1 / cap, cap]."""
    tokens = max(s["tokens"], 1.0)
    ess = s["is_ess_sum"] ** 2 / max(tokens * s["is_ess_sq"], 1e-30)
    return {
        "rollout_corr/rollout_is_mean": s["is_sum"] / tokens,
        "rollout_corr/rollout_is_max": s["is_max"],
        "rollout_corr/rollout_is_min": s["is_min"] if s["tokens"] > 0 else 0.0,
        "rollout_corr/rollout_is_ratio_fraction_high": s["is_high"] / max(s["is_units"], 1.0),
        "rollout_corr/rollout_is_ratio_fraction_low": s["is_low"] / max(s["is_units"], 1.0),
        "rollout_corr/rollout_is_eff_sample_size": ess,
    }


def update_metrics(s: dict[str, float]) -> dict[str, float]:
    """One update's metrics from its statistics summed over micro-batches (and its norms): loss/pg, loss/kl,
    policy/clip_frac, policy/approx_kl, policy/entropy (token means), optim/grad_norm, optim/update_norm;
    with the options on, loss/entropy (the aggregated entropy in the loss), policy/clip_frac_lower
    (dual-clip) and the rollout_corr/ weights (`is_metrics`)."""
    tokens = max(s["tokens"], 1.0)
    metrics = {
        "loss/pg": s["pg_loss"],
        "loss/kl": s["kl"],
        "policy/clip_frac": s["clip_frac_sum"] / tokens,
        "policy/approx_kl": s["approx_kl_sum"] / tokens,
        "policy/entropy": s["entropy_sum"] / tokens,
        "optim/grad_norm": s["grad_norm"],
        "optim/update_norm": s["update_norm"],
    }
    if "entropy_loss" in s:
        metrics["loss/entropy"] = s["entropy_loss"]
    if "clip_frac_lower_sum" in s:
        metrics["policy/clip_frac_lower"] = s["clip_frac_lower_sum"] / tokens
    if "is_sum" in s:
        metrics.update(is_metrics(s))
    return metrics


def loss_option_problems(rl: RLSection | mlc.ConfigDict) -> list[str]:
    """The loss options' checks the section's ranges do not cover (names, bounds, combinations)."""
    out = []
    if rl.clip_ratio_c and rl.clip_ratio_c <= 1:
        out.append(
            f"config.rl.clip_ratio_c={rl.clip_ratio_c}: dual-clip's bound must be > 1 (VeRL's 3.0), or 0 "
            "for no dual-clip."
        )
    for key in ("kl_loss_type", "reward_kl_penalty"):
        if getattr(rl, key) not in grpo.KL_ESTIMATORS:
            out.append(f"config.rl.{key}={getattr(rl, key)!r}: use one of {sorted(grpo.KL_ESTIMATORS)}.")
    if rl.adv_std not in grpo.ADV_STDS:
        out.append(f"config.rl.adv_std={rl.adv_std!r}: use one of {sorted(grpo.ADV_STDS)}.")
    if rl.rollout_is not in ROLLOUT_IS_LEVELS:
        out.append(f"config.rl.rollout_is={rl.rollout_is!r}: use one of {ROLLOUT_IS_LEVELS}.")
    if rl.rollout_is_threshold <= 0:
        out.append(
            f"config.rl.rollout_is_threshold={rl.rollout_is_threshold}: the weights' cap must be > 0 "
            "(VeRL's 2.0)."
        )
    if rl.reward_kl_ctrl not in KL_CONTROLLERS:
        out.append(f"config.rl.reward_kl_ctrl={rl.reward_kl_ctrl!r}: use one of {KL_CONTROLLERS}.")
    elif rl.reward_kl_ctrl == "adaptive" and rl.reward_kl_target <= 0:
        out.append(
            f"config.rl.reward_kl_target={rl.reward_kl_target}: the adaptive controller's target KL must "
            "be > 0 (VeRL's 0.1)."
        )
    return out
