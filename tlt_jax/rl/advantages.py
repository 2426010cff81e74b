"""The RL step's advantage phase: rewards -> per-row group advantages (GRPO / Dr.GRPO: tlt_jax.rl.grpo) and,
with DAPO's dynamic sampling, which rows the update keeps; then the step's `TrainBatch` (tlt_jax.rl.batch).

On the host (NumPy in, NumPy out): the objectives are jnp functions; the batch is built in NumPy.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from tlt_jax.rl import grpo
from tlt_jax.rl.batch import TrainBatch, build_train_batch
from tlt_jax.rl.plan import StepPlan
from tlt_jax.rollout.types import Rollout


@dataclasses.dataclass(frozen=True)
class Advantages:
    """values: [rows] float32 group advantages; keep: [rows] bool, False for rows of dropped groups."""

    values: np.ndarray
    keep: np.ndarray


def step_advantages(rewards: np.ndarray, plan: StepPlan) -> Advantages:
    """The plan's advantage method over groups of `plan.group` consecutive rows, and its keep mask (all
    True unless `plan.dynamic_sampling`, which drops groups whose rewards are all equal)."""
    r = jnp.asarray(rewards)
    values = np.asarray(grpo.group_advantages(r, plan.group, method=plan.advantage, eps=plan.adv_eps))
    if plan.dynamic_sampling:
        keep = np.asarray(grpo.dynamic_sampling_mask(r, plan.group))
    else:
        keep = np.ones((plan.rows,), bool)
    return Advantages(values, keep)


def train_batch(rollout: Rollout, adv: Advantages, plan: StepPlan) -> TrainBatch:
    """The step's samples with their advantages in the trainer's layout (dropped rows masked out)."""
    return build_train_batch(
        rollout.prompt_tokens,
        rollout.tokens,
        rollout.lengths,
        adv.values,
        adv.keep,
        group_size=plan.group,
        seq_bucket=plan.seq_bucket,
        max_response=plan.max_response,
    )
