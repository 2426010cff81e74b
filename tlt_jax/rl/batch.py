"""The GRPO step's samples on the host: the `TrainBatch` layout, micro-batch loss weights, and micro-batches
sorted by response length so each pays only for its own padding.

Layout (static shapes): each row is `[left-padded prompt | right-padded response]`, the prompt in columns
[0, Tp) and the response in [Tp, Tp + Nb), both rounded up to a bucket (`seq_bucket`), so the trainer compiles
one program per (Tp, Nb) bucket pair and reuses it.

Why length-sorted micro-batches (`length_sorted_micro`): on a long-tail task one response at the cap sets
the whole step's Nb, and every other row pays a forward and backward over that padding: in `configs/tlt.py`
a step of 32 rows with median 60 tokens is padded to 384 whenever any row hits the cap (most steps). Sorting
the groups by their longest response and giving each micro-batch its own Nb bucket trains on the same
tokens with the same loss weights (no loss depends on Nb: Dr.GRPO divides by the constant max length) for
a fraction of the compute; the trainer accumulates the micro-batches' gradients and applies them once.
"""

from __future__ import annotations

import dataclasses

import chex
import flax.struct
import jax
import numpy as np

from tlt_jax.rl import grpo


@flax.struct.dataclass
class TrainBatch:
    """One step's samples, group-major: G prompts x n responses (leading [G], or [K, G/K] once split)."""

    prompt: jax.Array  # [G, Tp] int32, right-padded
    prompt_len: jax.Array  # [G] int32 (>= 1)
    response: jax.Array  # [G, n, Nb] int32, right-padded
    response_mask: jax.Array  # [G, n, Nb] float32: 1 on response tokens that enter the loss
    advantages: jax.Array  # [G, n] float32
    old_logp: jax.Array  # [G, n, Nb] float32 (ignored when the update fuses old log-probs)
    ref_logp: jax.Array  # [G, n, Nb] float32 (ignored without a KL term)
    # [G, n, Nb] float32 the rollout engine's log-probs of the sampled tokens (truncated importance sampling,
    # tlt_jax.rl.losses); None when the loss does not use them (nothing carried to the devices)
    rollout_logp: jax.Array | None = None

    @property
    def group_size(self) -> int:
        return self.response.shape[-2]

    @property
    def num_response(self) -> int:
        return self.response.shape[-1]

    def rows(self, x: jax.Array) -> jax.Array:
        """[..., G, n, ...] per-sample array -> [..., G * n, ...] rows (prompt-major, as the rollout)."""
        lead = self.prompt.ndim - 2
        shape = x.shape[:lead] + (-1,) + x.shape[lead + 2 :]
        return x.reshape(shape)


def round_up(x: int, m: int) -> int:
    return -(-max(int(x), 1) // m) * m


def build_train_batch(
    prompts: list[list[int]],
    responses_bn: np.ndarray,
    lengths_b: np.ndarray,
    advantages_b: np.ndarray,
    keep_b: np.ndarray,
    *,
    group_size: int,
    seq_bucket: int,
    max_response: int | None = None,
    rollout_logp_bn: np.ndarray | None = None,
) -> TrainBatch:
    """Host-side (numpy) TrainBatch from a rollout of B = G * n rows (prompt-major groups: `prompts[i]` is
    the prompt of row i). Prompt and response lengths are rounded up to multiples of `seq_bucket` (the
    response length capped at `max_response`, the rollout's max_new_tokens, so a cap below the next multiple
    is one shape, not two); rows with keep=False get an all-zero response mask. `rollout_logp_bn`: the
    engine's log-probs [B, >= longest response] (laid out like the responses; None: not carried)."""
    b = len(prompts)
    chex.assert_shape([lengths_b, advantages_b, keep_b], [(b,)] * 3)
    if b % group_size:
        raise ValueError(f"{b} rows are not a whole number of groups of {group_size}")
    g, n = b // group_size, group_size
    group_prompts = [prompts[i * n] for i in range(g)]
    for i in range(b):
        if prompts[i] != group_prompts[i // n]:
            raise ValueError(
                f"row {i} does not share the prompt of its group {i // n}: rows must be prompt-major"
            )
    tp = round_up(max(len(p) for p in group_prompts), seq_bucket)
    nb = round_up(int(lengths_b.max()), seq_bucket)
    if max_response is not None:
        if int(lengths_b.max()) > max_response:
            raise ValueError(
                f"a response of {int(lengths_b.max())} tokens exceeds max_response={max_response}"
            )
        nb = min(nb, max_response)
    prompt = np.zeros((g, tp), np.int32)
    for i, p in enumerate(group_prompts):
        prompt[i, : len(p)] = p
    response = np.zeros((b, nb), np.int32)
    m = min(nb, responses_bn.shape[1])
    response[:, :m] = responses_bn[:, :m]
    valid = np.arange(nb)[None, :] < lengths_b[:, None]
    response = np.where(valid, response, 0)
    zeros = np.zeros((g, n, nb), np.float32)
    rollout_logp = None
    if rollout_logp_bn is not None:
        chex.assert_shape(rollout_logp_bn, (b, None))
        rollout_logp = np.zeros((b, nb), np.float32)
        w = min(nb, rollout_logp_bn.shape[1])
        rollout_logp[:, :w] = rollout_logp_bn[:, :w]
        rollout_logp = np.where(valid, rollout_logp, 0.0).astype(np.float32).reshape(g, n, nb)
    return TrainBatch(
        prompt=prompt,
        prompt_len=np.asarray([len(p) for p in group_prompts], np.int32),
        response=response.reshape(g, n, nb),
        response_mask=(valid & keep_b[:, None]).astype(np.float32).reshape(g, n, nb),
        advantages=np.asarray(advantages_b, np.float32).reshape(g, n),
        old_logp=zeros,
        ref_logp=zeros,
        rollout_logp=rollout_logp,
    )


def with_advantages(batch: TrainBatch, advantages_b: np.ndarray, keep_b: np.ndarray) -> TrainBatch:
    """`batch` (built with every row kept) with per-row advantages [B] and the rows of `keep_b` = False
    masked out: for a step that needs the batch's log-probs before its advantages (KL in the reward)."""
    g, n = batch.advantages.shape
    chex.assert_shape([advantages_b, keep_b], [(g * n,)] * 2)
    mask = np.asarray(batch.response_mask) * np.asarray(keep_b, np.float32).reshape(g, n, 1)
    return batch.replace(
        advantages=np.asarray(advantages_b, np.float32).reshape(g, n), response_mask=mask.astype(np.float32)
    )


def micro_problem(rows: int, group: int, micro_batch_size: int) -> str | None:
    """Why `micro_batch_size` rows cannot split a mini-batch of `rows` rows in groups of `group` (None when
    they can): a micro-batch holds whole groups, or a whole sub-group of one (a divisor of the group)."""
    m = micro_batch_size
    if m >= 1 and rows % m == 0 and (m % group == 0 or group % m == 0):
        return None
    options = [d for d in range(1, rows + 1) if rows % d == 0 and (d % group == 0 or group % d == 0)]
    return (
        f"config.trainer.micro_batch_size={m} must divide the mini-batch of {rows} rows (prompts_per_step * "
        f"samples_per_prompt / mini_batches) and be a multiple or a divisor of samples_per_prompt={group} "
        f"(micro-batches hold whole groups, or whole sub-groups of one); valid: {options}."
    )


def regroup(batch: TrainBatch, micro_batch_size: int) -> TrainBatch:
    """Host batch [G, n, ...] -> [G * n / s, s, ...] sub-groups of s = micro_batch_size samples each with
    its group's prompt, when micro-batches are smaller than a group (s < n; else the batch as it is). Rows
    keep their order; each sub-group's prompt is recomputed in its own micro-batch (a 1K-token prompt
    against 32K-token responses: cheap), which is what lets a long-response update run fewer rows at once."""
    g, n = batch.response.shape[:2]
    if micro_batch_size >= n:
        return batch
    r, s = n // micro_batch_size, micro_batch_size
    per_row = lambda x: np.asarray(x).reshape((g * r, s) + x.shape[2:])  # noqa: E731
    per_group = lambda x: np.repeat(np.asarray(x), r, axis=0)  # noqa: E731
    return TrainBatch(
        prompt=per_group(batch.prompt),
        prompt_len=per_group(batch.prompt_len),
        response=per_row(batch.response),
        response_mask=per_row(batch.response_mask),
        advantages=per_row(batch.advantages),
        old_logp=per_row(batch.old_logp),
        ref_logp=per_row(batch.ref_logp),
        rollout_logp=None if batch.rollout_logp is None else per_row(batch.rollout_logp),
    )


def split_micro(batch: TrainBatch, num_micro: int) -> TrainBatch:
    """[G, ...] leaves -> [num_micro, G / num_micro, ...] (consecutive groups per micro-batch)."""
    return jax.tree_util.tree_map(lambda x: x.reshape((num_micro, -1) + x.shape[1:]), batch)


def micro_weights(mask_kgnt: np.ndarray, aggregation: str, scope: str = "mini_batch") -> np.ndarray:
    """Each micro-batch's share of its mini-batch's loss. scope "mini_batch": sum_k w_k * loss_k ==
    loss(mini-batch), every token (sequence) of the mini-batch weighs the same, as VeRL 0.9.1's workers
    aggregate (agg_loss with the mini-batch's batch_num_tokens / global_batch_size). "micro_batch": 1 / K
    each, the mean of the micro-batches' own aggregates (VeRL's legacy dp_actor: loss / grad accumulation).

    mask: [K, G/K, n, Nb] response masks of the K micro-batches.
    """
    k = mask_kgnt.shape[0]
    mask = mask_kgnt.reshape(k, -1, mask_kgnt.shape[-1])
    if scope == "micro_batch":  # a mini-batch with no token trains nothing either way
        return np.full((k,), 1.0 / k if mask.sum() > 0 else 0.0, np.float32)
    if scope != "mini_batch":
        raise ValueError(f"unknown loss_agg_scope {scope!r}; valid: mini_batch, micro_batch")
    if aggregation == "token_mean":
        counts = mask.sum(axis=(1, 2))
    elif aggregation in ("seq_mean_token_mean", "seq_mean_token_sum"):
        counts = (mask.sum(axis=2) > 0).sum(axis=1)
    elif aggregation == "seq_mean_token_sum_norm":
        counts = np.full((k,), mask.shape[1])
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; valid: {sorted(grpo.LOSS_AGGREGATIONS)}")
    counts = counts.astype(np.float64)
    total = counts.sum()
    return (counts / total if total > 0 else counts).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class SortedMicro:
    """A mini-batch as micro-batches of whole groups sorted by length, each cut to its own Nb bucket.

    micro: host TrainBatches of `micro_batch_size` rows each ([G_k, ...]; Nb differs between them)
    weights: [K] each micro-batch's share of the mini-batch's loss (`micro_weights`)
    groups: [K, G_k] the mini-batch's group indices in each micro-batch (to put per-row results back)
    """

    micro: list[TrainBatch]
    weights: np.ndarray
    groups: np.ndarray

    def unsort(self, per_micro: list[np.ndarray], width: int) -> np.ndarray:
        """Per-micro-batch row arrays [G_k * n, Nb_k] -> [G * n, width] rows in the mini-batch's order,
        zero-padded beyond each micro-batch's Nb."""
        k, gk = self.groups.shape
        n = self.micro[0].group_size
        out = np.zeros((k * gk * n, width), np.float32)
        for groups, x in zip(self.groups, per_micro, strict=True):
            x = np.asarray(x).reshape(gk, n, -1)
            for j, g in enumerate(groups):
                out[g * n : (g + 1) * n, : x.shape[-1]] = x[j, :, :width]
        return out


def length_sorted_micro(
    batch: TrainBatch,
    lengths: np.ndarray,
    micro_batch_size: int,
    seq_bucket: int,
    aggregation: str,
    scope: str = "mini_batch",
) -> SortedMicro:
    """Split a host mini-batch [G, ...] into micro-batches of `micro_batch_size` rows (whole groups, or
    sub-groups: `regroup`), the groups sorted by their longest response (`lengths`: [G * n] response tokens
    per row, longest first) and each micro-batch's response columns cut to the bucket of its own longest
    response. The loss weights are those of the full-width batch (padding carries no token, so the cut
    changes no loss)."""
    g, n, nb = batch.response_mask.shape
    chex.assert_shape(lengths, (g * n,))
    problem = micro_problem(g * n, n, micro_batch_size)
    if problem:
        raise ValueError(problem)
    batch = regroup(batch, micro_batch_size)
    g, n, nb = batch.response_mask.shape
    mask = np.asarray(batch.response_mask)
    lengths = np.asarray(lengths).reshape(g, n).max(-1)  # a group's longest response
    if lengths.max() > nb:
        raise ValueError(f"a response of {int(lengths.max())} tokens does not fit the batch's {nb} columns")
    order = np.argsort(-lengths, kind="stable")
    k = g * n // micro_batch_size
    groups = order.reshape(k, -1)
    weights = micro_weights(mask[groups], aggregation, scope)
    micro = []
    for idx in groups:
        width = min(round_up(int(lengths[idx].max()), seq_bucket), nb)
        # the [G, n, Nb] leaves (response, its mask, old / reference log-probs) are cut to the width
        micro.append(
            jax.tree_util.tree_map(
                lambda x, w=width: x[idx][..., :w] if x.ndim == 3 else x[idx],  # noqa: B023
                batch,
            )
        )
    return SortedMicro(micro=micro, weights=weights, groups=groups)
