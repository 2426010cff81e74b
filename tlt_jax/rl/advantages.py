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


def step_advantages(rewards: np.ndarray, plan: StepPlan, keep: np.ndarray | None = None) -> Advantages:
    """The plan's advantage method over groups of `plan.group` consecutive rows, and the rows the update
    keeps (`keep`, default all: dynamic sampling's filler groups are False, tlt_jax.rl.dynamic_sampling)."""
    r = jnp.asarray(rewards)
    values = np.asarray(
        grpo.group_advantages(r, plan.group, method=plan.advantage, eps=plan.adv_eps, std=plan.adv_std)
    )
    keep = np.ones((plan.rows,), bool) if keep is None else np.asarray(keep, bool)
    if keep.shape != values.shape:
        raise ValueError(f"keep has shape {keep.shape}, the step's advantages {values.shape}")
    return Advantages(values, keep)


def train_batch(rollout: Rollout, adv: Advantages, plan: StepPlan) -> TrainBatch:
    """The step's samples with their advantages in the trainer's layout (dropped rows masked out), and the
    engine's log-probs when the loss weighs tokens by them (`plan.rollout_is`)."""
    return build_train_batch(
        rollout.prompt_tokens,
        rollout.tokens,
        rollout.lengths,
        adv.values,
        adv.keep,
        group_size=plan.group,
        seq_bucket=plan.seq_bucket,
        max_response=plan.max_response,
        rollout_logp_bn=None if plan.rollout_is == "none" else rollout.logprobs,
    )
