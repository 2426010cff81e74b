"""KL in the reward, as VeRL's `algorithm.use_kl_in_reward` (verl/trainer/ppo/ray_trainer.py apply_kl_penalty,
core_algos.FixedKLController / AdaptiveKLController): each response token's reward is lowered by
beta x kl_t, kl_t the `penalty` estimate (tlt_jax.rl.grpo.kl_estimate) of KL(pi_old || pi_ref) at that token;
GRPO's outcome advantage sums a row's token rewards, so the row's score becomes r - beta x sum_t kl_t.

Where it sits in a step: after the reward and the reference / old log-prob passes (both over every row the
rollout produced), before the group advantages: rewards -> `reward_kl_penalty` -> `step_advantages`. The
adaptive controller carries beta from step to step (Ziegler et al. 2019): the caller keeps it (and its
checkpoint) and passes it back each step.
"""

from __future__ import annotations

import dataclasses

import chex
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np

from tlt_jax.config_sections import RLSection
from tlt_jax.rl import grpo
from tlt_jax.rl.batch import TrainBatch


@dataclasses.dataclass(frozen=True)
class KLInReward:
    """coef: beta (the fixed one, or the adaptive controller's start; 0: off); penalty: the estimator (VeRL's
    algorithm.kl_penalty); ctrl: fixed | adaptive, whose target KL and horizon (rows) set its pace."""

    coef: float = 0.0
    penalty: str = "kl"
    ctrl: str = "fixed"
    target: float = 0.1
    horizon: int = 10000

    @classmethod
    def from_section(cls, rl: RLSection | mlc.ConfigDict) -> KLInReward:
        return cls(
            rl.reward_kl_coef,
            rl.reward_kl_penalty,
            rl.reward_kl_ctrl,
            rl.reward_kl_target,
            rl.reward_kl_horizon,
        )

    def next_coef(self, coef: float, current_kl: float, rows: int) -> float:
        """beta for the next step after a step of `rows` rows whose KL was `current_kl`: the same (fixed),
        or AdaptiveKLController.update's beta x (1 + clip(kl / target - 1, -0.2, 0.2) x rows / horizon)."""
        if self.ctrl == "fixed":
            return coef
        error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        return coef * (1.0 + error * rows / self.horizon)


def kl_penalised_rewards(
    rewards_b: np.ndarray,
    old_logp_bt: np.ndarray,
    ref_logp_bt: np.ndarray,
    mask_bt: np.ndarray,
    coef: float,
    penalty: str = "kl",
) -> tuple[np.ndarray, float]:
    """(rewards [B] - coef x sum over each row's tokens of the KL estimate, the step's KL): VeRL's
    token_level_rewards summed as its GRPO advantage sums them, and its `current_kl` (each row's token mean,
    0 for a row without tokens, averaged over all rows)."""
    b = rewards_b.shape[0]
    chex.assert_shape([old_logp_bt, ref_logp_bt, mask_bt], [(b, None)] * 3)
    mask = jnp.asarray(mask_bt, jnp.float32)
    kld = grpo.kl_estimate(jnp.asarray(old_logp_bt), jnp.asarray(ref_logp_bt), penalty) * mask
    per_row = jnp.sum(kld, axis=-1)
    current_kl = float(jnp.mean(per_row / (jnp.sum(mask, axis=-1) + 1e-8)))
    return np.asarray(rewards_b, np.float32) - np.float32(coef) * np.asarray(per_row), current_kl


def reward_kl_penalty(
    rewards_b: np.ndarray, batch: TrainBatch, rc: KLInReward, coef: float
) -> tuple[np.ndarray, dict[str, float], float]:
    """The step's rewards with the KL penalty, from a host batch whose old and reference log-probs are filled
    (tlt_jax.rl.update.old_logprobs) and whose response mask covers every row (built before any row is
    dropped); `coef`: this step's beta. Returns (rewards, VeRL's metrics actor/reward_kl_penalty and
    actor/reward_kl_penalty_coeff, the next step's beta)."""
    g, n, nb = batch.response_mask.shape
    rows = lambda x: np.asarray(x).reshape(g * n, nb)  # noqa: E731
    rewards, current_kl = kl_penalised_rewards(
        rewards_b, rows(batch.old_logp), rows(batch.ref_logp), rows(batch.response_mask), coef, rc.penalty
    )
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(coef)}
    return rewards, metrics, rc.next_coef(coef, current_kl, g * n)
