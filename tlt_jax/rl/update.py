"""The RL step's policy update: the log-probs the loss needs, then PPO-clipped updates over mini-batches.

Log-probs first (`old_logprobs`): the frozen reference policy's, for a KL term (in the loss, `kl_coef > 0`,
or in the reward), and the old policy's, unless the update fuses them (one update per step: old =
stop_gradient of the update's own forward). Then `update_policy`: `ppo_epochs` passes of `mini_batches`
optimizer steps each (VeRL's ppo_epochs; the groups regrouped at random each epoch with
`mini_batch_shuffle`, as its actor.shuffle), each over micro-batches sorted by response length and padded to
their own bucket (tlt_jax.rl.batch.length_sorted_micro: same loss, less padding).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from tlt_jax.rl.batch import TrainBatch, length_sorted_micro
from tlt_jax.rl.plan import StepPlan
from tlt_jax.rl.trainer import PolicyTrainer
from tlt_jax.sharding import to_host, to_host_tree


@dataclasses.dataclass(frozen=True)
class UpdateResult:
    """metrics: one dict per mini-batch trained; skipped: mini-batches with every group filtered out;
    trained_cols: response columns the update computed (each micro-batch at its own width); num_response: the
    step batch's response columns; train_logp: [rows, num_response] the trainer's old log-probs (zeros where
    the update neither fused nor computed them)."""

    metrics: list[dict[str, float]]
    skipped: int
    trained_cols: int
    num_response: int
    train_logp: np.ndarray


def select_groups(batch: TrainBatch, groups: slice | np.ndarray) -> TrainBatch:
    """The batch's groups `groups` (its leading axis: a slice, or group indices)."""
    return jax.tree_util.tree_map(lambda x: x[groups], batch)


def old_logprobs(trainer: PolicyTrainer, batch: TrainBatch, plan: StepPlan) -> tuple[TrainBatch, np.ndarray]:
    """The reference (KL) and old (unfused) log-probs the loss needs, in `batch`; and the old log-probs
    [rows, response] for the engine-gap metric (zeros when the update fuses them)."""
    train_logp = np.zeros((plan.rows, batch.num_response), np.float32)
    fused = trainer.loss.fuse_old_logprobs
    if plan.needs_reference or not fused:
        micro = trainer.put_micro(batch)
        if plan.needs_reference:
            ref = trainer.logprobs(micro, params=trainer.ref_params).logp
            batch = batch.replace(ref_logp=to_host(ref).reshape(batch.ref_logp.shape))
        if not fused:
            old = to_host(trainer.logprobs(micro).logp)  # rows may span processes
            batch = batch.replace(old_logp=old.reshape(batch.old_logp.shape))
            train_logp = old.reshape(plan.rows, -1)
    return batch, train_logp


def mini_batch_groups(plan: StepPlan) -> list[np.ndarray]:
    """The step's groups of each optimizer update, in order: `ppo_epochs` passes over `mini_batches`
    mini-batches of consecutive groups, or (`mini_batch_shuffle`) of a random permutation of the groups
    drawn per epoch from a generator seeded with `shuffle_seed` (the same every step, as VeRL's
    data_loader_seed: a resumed run regroups as the uninterrupted one)."""
    groups, per_mini = plan.rows // plan.group, plan.mini_rows // plan.group
    rng = np.random.default_rng(plan.shuffle_seed)
    out = []
    for _ in range(plan.ppo_epochs):
        order = rng.permutation(groups) if plan.mini_batch_shuffle else np.arange(groups)
        out += [order[m * per_mini : (m + 1) * per_mini] for m in range(plan.mini_batches)]
    return out


def update_policy(
    trainer: PolicyTrainer, batch: TrainBatch, lengths: np.ndarray, train_logp: np.ndarray, plan: StepPlan
) -> UpdateResult:
    """One optimizer step per mini-batch of `plan.mini_rows` rows (`lengths`: the rows' response lengths),
    `plan.ppo_epochs` times over the step (`mini_batch_groups`). A mini-batch whose groups were all filtered
    (dynamic sampling) is skipped: nothing to learn from. With fused old log-probs (one update per step), the
    update's own fill `train_logp` (in place, returned in the result)."""
    fused = trainer.loss.fuse_old_logprobs
    if fused and plan.ppo_epochs > 1:
        raise ValueError(
            f"ppo_epochs={plan.ppo_epochs} with fused old log-probs: a second epoch would take its old "
            "log-probs from the updated policy; build the trainer with fuse_old_logprobs=False "
            "(tlt_jax.rl.config.policy_loss_config does for ppo_epochs > 1)."
        )
    update_metrics: list[dict[str, float]] = []
    skipped, trained_cols = 0, 0
    for groups in mini_batch_groups(plan):
        rows = (groups[:, None] * plan.group + np.arange(plan.group)).reshape(-1)
        mini = select_groups(batch, groups)
        parts = length_sorted_micro(
            mini, lengths[rows], trainer.micro_batch_size, plan.seq_bucket, plan.loss_agg, plan.loss_agg_scope
        )
        if parts.weights.sum() == 0:
            skipped += 1
            continue
        micro = [trainer.put_micro(mb) for mb in parts.micro]
        um, logps = trainer.update(micro, [w[None] for w in parts.weights])
        update_metrics.append(um)
        trained_cols += sum(mb.response.size for mb in parts.micro)
        if fused:
            train_logp[rows] = parts.unsort(list(to_host_tree(list(logps))), batch.num_response)
    return UpdateResult(update_metrics, skipped, trained_cols, batch.num_response, train_logp)
