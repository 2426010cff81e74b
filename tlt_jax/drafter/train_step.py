"""Drafter training: EAGLE data alignment, sequence packing with segment ids, the loss, a jitted optax step.

Data. A `DrafterSample` is one sequence (prompt + response) with the TARGET's final normed hidden states at
every position (in RL they come from the trainer's log-prob forward; in the warm-up from a target forward)
and a mask of the response tokens. With tokens x_0..x_{L-1} and target features h_0..h_{L-1} (h_t is computed
from x_0..x_t and predicts x_{t+1}), EAGLE trains on the pairs

    input t:  (embed(x_{t+1}), h_t)  at drafter position t + 1
    target t: the feature h_{t+1} and the target's distribution softmax(head(h_{t+1})) over x_{t+2}

for every t whose x_{t+1} is a response token (the drafter runs on exactly these pairs during rollout: the
newest response token with the feature that produced it). Prompt pairs still feed the drafter's causal
attention as context; they carry no loss.

Packing. `pack_samples` puts several samples into each of `rows` rows of `seq_len` tokens (static shapes, so
one compiled step) with per-sample segment ids and positions restarting at 0. The drafter's attention mask is
block-diagonal causal over segments: no token attends across samples (the reference packs under one causal
mask; TLT_REFERENCE.md). The alignment above is computed inside the step by shifting within a row; a pair
whose next token belongs to another segment (a sample's last token) is dropped from the loss, and it cannot
leak into other samples because nothing after it in its own segment exists.

Loss (EAGLE-1; the paper: 0.5/0.5 online, 1.0/0.1 for the offline warm-up; both weights are config):

    w_feat * SmoothL1(h_draft, h_{t+1}) + w_ce * softCE(softmax(head(h_{t+1})), log_softmax(head(h_draft)))

averaged over the response pairs of the batch (SmoothL1 averaged over the hidden axis, as EAGLE does). The
embedding and LM head are the TARGET's, passed in as arrays under `stop_gradient`: only the drafter's own
parameters (`fc` and its decoder layer) get gradients and optimizer state. The drafter layer runs through
`tlt_jax.drafter.chain` (its own weights; a brute-force test keeps it equal to the `Drafter` module), which
also gives the training-time test (`LossConfig.ttt_steps`): the same loss at chain steps 2, 3, ... where
the drafter's input is its own previous feature, weighted ttt_weight^(j-1) and added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tlt_jax.drafter.chain import ChainContext, shift_by, shift_left, take_rows
from tlt_jax.models.drafter import Drafter


@dataclasses.dataclass(frozen=True)
class DrafterSample:
    """One training sequence: tokens [L], target hidden states [L, H], response mask [L].

    `hidden` may be float16 on the host (halves buffer and cache memory); it is packed as float32.
    """

    tokens: np.ndarray
    hidden: np.ndarray
    loss_mask: np.ndarray

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.loss_mask.shape != self.tokens.shape:
            raise ValueError(
                f"DrafterSample: tokens must be [L] and loss_mask [L], got {self.tokens.shape} and "
                f"{self.loss_mask.shape}"
            )
        if self.hidden.ndim != 2 or self.hidden.shape[0] != self.tokens.shape[0]:
            raise ValueError(
                f"DrafterSample: hidden must be [L={self.tokens.shape[0]}, H], got {self.hidden.shape}"
            )

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_response(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    @property
    def hidden_size(self) -> int:
        return int(self.hidden.shape[1])


def sample_from_sequence(prompt: Sequence[int], response: Sequence[int], hidden: np.ndarray) -> DrafterSample:
    """A `DrafterSample` from a prompt, its response and the target features of prompt + response."""
    tokens = np.asarray(list(prompt) + list(response), np.int32)
    mask = np.zeros(tokens.shape, bool)
    mask[len(prompt) :] = True
    return DrafterSample(tokens=tokens, hidden=np.asarray(hidden), loss_mask=mask)


@flax.struct.dataclass
class PackedBatch:
    """`rows` rows of `seq_len` packed tokens. segment_ids: 0 = padding, 1, 2, ... = samples of the row."""

    tokens: Any  # [R, S] int32
    hidden: Any  # [R, S, H] float32
    segment_ids: Any  # [R, S] int32
    positions: Any  # [R, S] int32, restarting at 0 in every segment
    loss_mask: Any  # [R, S] bool (response tokens)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)  # type: ignore[return-value]

    def num_loss_tokens(self) -> int:
        """Response pairs that carry loss (host-side count; the step computes the same on device)."""
        seg = np.asarray(self.segment_ids)
        nxt_seg = np.concatenate([seg[:, 1:], np.full((seg.shape[0], 1), -1, seg.dtype)], axis=1)
        nxt_mask = np.concatenate([np.asarray(self.loss_mask)[:, 1:], np.zeros((seg.shape[0], 1), bool)], 1)
        return int(np.count_nonzero((nxt_seg == seg) & (seg > 0) & nxt_mask))


def loss_pairs(sample: DrafterSample, seq_len: int) -> int:
    """Pairs of `sample` that carry loss once packed (truncated to `seq_len`): response tokens x_{t+1}."""
    return int(np.count_nonzero(sample.loss_mask[1 : min(sample.length, seq_len)]))


def first_fit(
    lengths: Sequence[int],
    seq_len: int,
    rows: int,
    loss_counts: Sequence[int] | None = None,
    max_loss_tokens: int | None = None,
) -> list[tuple[int, int, int]]:
    """First-fit placement of sequences (lengths clipped to seq_len) into rows: [(index, row, start)].

    Sequences are taken in the given order, each into the first row with room; those that fit nowhere are
    skipped (packed into a later batch by the caller). With `max_loss_tokens`, a sequence is also skipped
    when the batch's loss pairs (`loss_counts`) would exceed it (the step's static loss-position budget).
    """
    fill = [0] * rows
    loss = 0
    out = []
    for i, length in enumerate(lengths):
        n = min(int(length), seq_len)
        c = int(loss_counts[i]) if loss_counts is not None else 0
        if max_loss_tokens is not None and loss + c > max_loss_tokens:
            continue
        r = next((r for r in range(rows) if fill[r] + n <= seq_len), None)
        if r is None:
            continue
        out.append((i, r, fill[r]))
        fill[r] += n
        loss += c
        if all(f >= seq_len - 1 for f in fill):
            break
    return out


def epoch_plan(
    lengths: Sequence[int],
    seq_len: int,
    rows: int,
    rng: np.random.Generator | None = None,
    loss_counts: Sequence[int] | None = None,
    max_loss_tokens: int | None = None,
) -> list[list[int]]:
    """Sample indices of each packed batch of one epoch (shuffled by `rng`, else in order); every index
    appears in exactly one batch. Cheap (lengths only), so a resumed run can recompute its data order."""
    if seq_len < 2 or rows < 1:
        raise ValueError(f"packing needs seq_len >= 2 and rows >= 1, got {seq_len}, {rows}")
    if (
        max_loss_tokens is not None
        and loss_counts is not None
        and max(loss_counts, default=0) > max_loss_tokens
    ):
        raise ValueError(
            f"a sample has {max(loss_counts)} loss tokens, more than max_loss_tokens={max_loss_tokens}: "
            "raise it (it must hold the longest response) or lower seq_len."
        )
    order = [int(i) for i in rng.permutation(len(lengths))] if rng is not None else list(range(len(lengths)))
    batches = []
    while order:
        counts = [loss_counts[i] for i in order] if loss_counts is not None else None
        placed = first_fit([lengths[i] for i in order], seq_len, rows, counts, max_loss_tokens)
        taken = {j for j, _, _ in placed}
        batches.append([order[j] for j in sorted(taken)])
        order = [i for j, i in enumerate(order) if j not in taken]
    return batches


def pack_samples(
    samples: Sequence[DrafterSample],
    seq_len: int,
    rows: int,
    hidden_size: int | None = None,
    max_loss_tokens: int | None = None,
) -> tuple[PackedBatch, list[int]]:
    """Pack samples first-fit into `rows` rows of `seq_len` tokens; returns (numpy batch, packed indices).

    Samples are taken in the given order, each into the first row with room; samples that fit nowhere (or
    would push the batch's loss pairs over `max_loss_tokens`) are left out: the caller packs them into a
    later batch. A sample longer than `seq_len` is truncated to its first `seq_len` tokens (it then fills a
    row on its own). Empty rows are padding (segment 0, no loss).
    """
    if seq_len < 2 or rows < 1:
        raise ValueError(f"pack_samples needs seq_len >= 2 and rows >= 1, got {seq_len}, {rows}")
    if hidden_size is None:
        if not samples:
            raise ValueError("pack_samples: no samples and no hidden_size: cannot shape an empty batch")
        hidden_size = samples[0].hidden_size
    tokens = np.zeros((rows, seq_len), np.int32)
    hidden = np.zeros((rows, seq_len, hidden_size), np.float32)
    seg = np.zeros((rows, seq_len), np.int32)
    pos = np.zeros((rows, seq_len), np.int32)
    mask = np.zeros((rows, seq_len), bool)
    packed: list[int] = []
    counts = [loss_pairs(s, seq_len) for s in samples] if max_loss_tokens is not None else None
    for i, r, a in first_fit([s.length for s in samples], seq_len, rows, counts, max_loss_tokens):
        s = samples[i]
        if s.hidden_size != hidden_size:
            raise ValueError(f"sample {i} has hidden size {s.hidden_size}, expected {hidden_size}")
        n = min(s.length, seq_len)
        tokens[r, a : a + n] = s.tokens[:n]
        hidden[r, a : a + n] = s.hidden[:n]
        seg[r, a : a + n] = seg[r].max() + 1
        pos[r, a : a + n] = np.arange(n, dtype=np.int32)
        mask[r, a : a + n] = s.loss_mask[:n]
        packed.append(i)
    return PackedBatch(tokens=tokens, hidden=hidden, segment_ids=seg, positions=pos, loss_mask=mask), packed


def iterate_packed(
    samples: Sequence[DrafterSample],
    seq_len: int,
    rows: int,
    rng: np.random.Generator | None = None,
    max_loss_tokens: int | None = None,
) -> Iterator[PackedBatch]:
    """One epoch of packed batches (shuffled by `rng`, else in order): every sample lands in exactly one."""
    hidden_size = samples[0].hidden_size if samples else None
    counts = [loss_pairs(s, seq_len) for s in samples]
    for idx in epoch_plan([s.length for s in samples], seq_len, rows, rng, counts, max_loss_tokens):
        batch, packed = pack_samples([samples[i] for i in idx], seq_len, rows, hidden_size, max_loss_tokens)
        assert len(packed) == len(idx)  # the plan placed exactly these
        yield batch


def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """[R, S, S] block-diagonal causal mask: i attends to j <= i of the same (non-padding) segment."""
    s = segment_ids.shape[-1]
    same = segment_ids[..., :, None] == segment_ids[..., None, :]
    causal = jnp.tril(jnp.ones((s, s), bool))
    return same & causal & (segment_ids[..., :, None] > 0)


@flax.struct.dataclass
class EagleInputs:
    """The EAGLE-aligned view of a packed batch (see the module docstring); index i is pair t = i."""

    next_tokens: jax.Array  # [R, S] x_{t+1}
    hidden_in: jax.Array  # [R, S, H] h_t
    hidden_target: jax.Array  # [R, S, H] h_{t+1}
    positions: jax.Array  # [R, S] drafter position t + 1
    mask: jax.Array  # [R, S, S] block-diagonal causal
    valid: jax.Array  # [R, S] bool: pair carries loss (x_{t+1} is a response token of the same sample)


def eagle_inputs(batch: PackedBatch) -> EagleInputs:
    """Shift a packed batch into EAGLE pairs within each row (pairs never span two segments)."""
    r, s = batch.tokens.shape
    chex.assert_shape([batch.segment_ids, batch.positions, batch.loss_mask], (r, s))
    chex.assert_rank(batch.hidden, 3)
    seg = batch.segment_ids
    same = (shift_left(seg, -1) == seg) & (seg > 0)
    hidden = batch.hidden.astype(jnp.float32)
    return EagleInputs(
        next_tokens=shift_left(batch.tokens, 0),
        hidden_in=hidden,
        hidden_target=shift_left(hidden, 0.0),
        positions=batch.positions + 1,
        mask=segment_causal_mask(seg),
        valid=same & shift_left(batch.loss_mask, False),
    )


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Loss weights (paper: online 0.5/0.5, offline warm-up 1.0/0.1) and the SmoothL1 beta.

    max_loss_tokens: compute the LM-head terms only at this many loss positions per batch (gathered with a
    static size) instead of at all rows * seq_len positions. The two [positions, vocab] head products are
    most of a step's cost and prompt/padding positions carry no loss, so this is the main lever on CPU. The
    packer must respect it (`pack_samples(..., max_loss_tokens=)`); positions past it would be dropped
    (counted in the `dropped_tokens` metric). None: every position.
    ce_tokens: compute the soft CE (and top-1) on this many valid pairs drawn at random each step (the
    feature loss still covers all of them): an unbiased CE estimate at a fraction of the head cost.
    feature_noise: EAGLE's data augmentation: uniform noise of this width (U(-a/2, a/2)) added to the INPUT
    features h_t during training, so the drafter tolerates its own imperfect features at later chain steps.
    ttt_steps: the "training-time test" (EAGLE-3, HASS): also train chain steps 2..ttt_steps + 1, where the
    drafter's input feature is its OWN prediction from the previous step (as in rollout) and the token the
    true next one (teacher forcing: an accepted draft is a target sample); see `chain_step_losses`. Without
    it the drafter only ever sees target features and its acceptance falls off after the first draft. Each
    step runs at `ttt_positions` random loss positions per row and its loss is weighted ttt_weight^(j-1).
    """

    w_feat: float = 0.5
    w_ce: float = 0.5
    smooth_l1_beta: float = 1.0
    max_loss_tokens: int | None = None
    ce_tokens: int | None = None
    feature_noise: float = 0.0
    ttt_steps: int = 0
    ttt_positions: int = 64
    ttt_weight: float = 1.0


def head_logits(hidden: jax.Array, head_w: jax.Array) -> jax.Array:
    """The target's LM head on features: float32 logits [..., V] (head_w is [V, H], as Transformer's)."""
    return jnp.einsum("...h,vh->...v", hidden, head_w, preferred_element_type=jnp.float32)


def per_pair_losses(
    drafter: Drafter,
    batch: PackedBatch,
    embed_w: jax.Array,
    head_w: jax.Array,
    beta: float = 1.0,
    max_loss_tokens: int | None = None,
    ce_tokens: int | None = None,
    rng: jax.Array | None = None,
    feature_noise: float = 0.0,
    ttt_steps: int = 0,
    ttt_positions: int = 64,
) -> dict[str, jax.Array]:
    """Per-pair losses of a packed batch.

    Returns feat / valid ([R, S], or [max_loss_tokens] when set: the valid pairs gathered first, then padding
    with valid=False) and ce / top1 / ce_valid (the same positions, or `ce_tokens` of the valid pairs drawn
    uniformly without replacement with `rng` when set: an unbiased estimate of the mean CE at a fraction of
    the LM-head cost). embed_w [V, H] and head_w [V, H] are the target's embedding and LM head; they are
    stop-gradient here. With `ttt_steps`, also `chain` (a list, one dict per chain step 2..ttt_steps + 1,
    from `chain_step_losses`).
    """
    embed_w = jax.lax.stop_gradient(embed_w)
    head_w = jax.lax.stop_gradient(head_w)
    e = eagle_inputs(batch)
    key = rng if rng is not None else jax.random.key(0)
    key_noise, key_ce, key_ttt = jax.random.split(key, 3)
    h_in = e.hidden_in
    if feature_noise > 0:
        h_in = h_in + feature_noise * (jax.random.uniform(key_noise, h_in.shape, h_in.dtype) - 0.5)
    ctx = ChainContext(drafter, embed_w, e.next_tokens, h_in, e.positions, e.mask)
    h_draft = ctx.h.astype(jnp.float32)
    target, valid = e.hidden_target, e.valid
    dropped = jnp.zeros((), jnp.int32)
    if max_loss_tokens is not None:
        flat = valid.reshape(-1)
        n_valid = jnp.sum(flat.astype(jnp.int32))
        idx = jnp.nonzero(flat, size=max_loss_tokens, fill_value=0)[0]
        h_draft = h_draft.reshape(-1, h_draft.shape[-1])[idx]
        target = target.reshape(-1, target.shape[-1])[idx]
        valid = jnp.arange(max_loss_tokens) < n_valid
        dropped = jnp.maximum(n_valid - max_loss_tokens, 0)
    feat = _feature_loss(h_draft, target, beta)
    h_ce, t_ce, ce_valid = h_draft, target, valid
    if ce_tokens is not None:
        h_flat, t_flat, v_flat = (x.reshape(-1, *x.shape[valid.ndim :]) for x in (h_draft, target, valid))
        if ce_tokens > v_flat.shape[0]:
            raise ValueError(f"ce_tokens={ce_tokens} exceeds the {v_flat.shape[0]} loss positions of a batch")
        scores = jnp.where(v_flat, jax.random.uniform(key_ce, v_flat.shape), -1.0)
        pick = jax.lax.top_k(scores, ce_tokens)[1]
        h_ce, t_ce, ce_valid = h_flat[pick], t_flat[pick], v_flat[pick]
    ce, top1 = _soft_ce(h_ce, t_ce, head_w)
    out = {"feat": feat, "valid": valid, "ce": ce, "top1": top1, "ce_valid": ce_valid, "dropped": dropped}
    if ttt_steps > 0:
        out["chain"] = chain_step_losses(ctx, e, head_w, ttt_steps, ttt_positions, key_ttt, beta)
    return out


def _feature_loss(h_draft: jax.Array, target: jax.Array, beta: float) -> jax.Array:
    """SmoothL1 per position, averaged over the hidden axis (EAGLE)."""
    return jnp.mean(optax.huber_loss(h_draft.astype(jnp.float32), target, delta=beta) / beta, axis=-1)


def _soft_ce(h_draft: jax.Array, target: jax.Array, head_w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Soft cross-entropy of the drafter's distribution against the target's, and top-1 agreement."""
    t_logits = jax.lax.stop_gradient(head_logits(target, head_w))
    d_logits = head_logits(h_draft.astype(jnp.float32), head_w)
    p = jax.nn.softmax(t_logits, axis=-1)
    ce = -jnp.sum(p * jax.nn.log_softmax(d_logits, axis=-1), axis=-1)
    return ce, jnp.argmax(d_logits, axis=-1) == jnp.argmax(t_logits, axis=-1)


def chain_step_losses(
    ctx: ChainContext,
    e: EagleInputs,
    head_w: jax.Array,
    steps: int,
    positions_per_row: int,
    key: jax.Array,
    beta: float = 1.0,
) -> list[dict[str, jax.Array]]:
    """Losses of chain steps 2..steps + 1 (the training-time test) at random loss positions of each row.

    Base index i (a valid pair) runs the chain of `tlt_jax.drafter.chain` with the true tokens x_{i+2}, ...
    and the drafter's own features; step j predicts the target feature h_{i+j} and the distribution of
    x_{i+j+1}, and carries loss while pair i + j - 1 is a valid pair of the same sample. Positions are drawn
    uniformly per row (without replacement) among those whose step 2 is valid; gradients flow through the
    chain (the drafter learns to produce features its own next step can use).
    Returns per step: feat, ce, top1 and valid, each [R, P].
    """
    r, s = e.valid.shape
    p = min(positions_per_row, s)
    ok = e.valid & shift_left(e.valid, False)
    scores = jnp.where(ok, jax.random.uniform(key, ok.shape), -1.0)
    idx = jax.lax.top_k(scores, p)[1].astype(jnp.int32)  # [R, P]
    sel = take_rows(ok, idx)
    feats = ctx.teacher_forced(e.next_tokens, idx, steps + 1)[1:]
    out = []
    for j, h in enumerate(feats, start=2):
        target = take_rows(shift_by(e.hidden_target, j - 1, 0.0), idx)
        valid = sel & take_rows(shift_by(e.valid, j - 1, False), idx)
        ce, top1 = _soft_ce(h, target, head_w)
        out.append({"feat": _feature_loss(h, target, beta), "ce": ce, "top1": top1, "valid": valid})
    return out


def loss_and_metrics(
    params: nnx.State,
    graphdef: nnx.GraphDef,
    batch: PackedBatch,
    embed_w: jax.Array,
    head_w: jax.Array,
    loss_cfg: LossConfig,
    rng: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The batch loss (means over valid pairs) and its metrics; differentiable w.r.t. `params` only."""
    drafter = nnx.merge(graphdef, params)
    t = per_pair_losses(
        drafter,
        batch,
        embed_w,
        head_w,
        loss_cfg.smooth_l1_beta,
        loss_cfg.max_loss_tokens,
        loss_cfg.ce_tokens,
        rng,
        loss_cfg.feature_noise,
        loss_cfg.ttt_steps,
        loss_cfg.ttt_positions,
    )
    valid = t["valid"].astype(jnp.float32)
    n = jnp.sum(valid)
    feat = _masked_mean(t["feat"], valid)
    ce = _masked_mean(t["ce"], t["ce_valid"])
    acc = _masked_mean(t["top1"], t["ce_valid"])
    loss = loss_cfg.w_feat * feat + loss_cfg.w_ce * ce
    metrics = {"feat_loss": feat, "ce": ce, "top1_acc": acc, "num_tokens": n}
    for j, c in enumerate(t.get("chain", []), start=2):
        feat_j, ce_j = _masked_mean(c["feat"], c["valid"]), _masked_mean(c["ce"], c["valid"])
        loss = loss + loss_cfg.ttt_weight ** (j - 1) * (loss_cfg.w_feat * feat_j + loss_cfg.w_ce * ce_j)
        metrics.update({f"feat_loss_step{j}": feat_j, f"ce_step{j}": ce_j})
        metrics[f"top1_acc_step{j}"] = _masked_mean(c["top1"], c["valid"])
    metrics["loss"] = loss
    metrics["dropped_tokens"] = t["dropped"].astype(jnp.float32)
    return loss, metrics


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    m = mask.astype(jnp.float32)
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


# ----------------------------------------------------------------------------------------------------------
# Optimizer and the jitted step


def make_schedule(
    lr: float, total_steps: int, warmup_steps: int, schedule: str = "cosine", end_lr_ratio: float = 0.1
) -> optax.Schedule:
    """Linear warm-up to `lr`, then cosine decay to `end_lr_ratio * lr` at `total_steps` (or constant)."""
    if total_steps < 1 or warmup_steps < 0:
        raise ValueError(f"need total_steps >= 1 and warmup_steps >= 0, got {total_steps}, {warmup_steps}")
    warmup_steps = min(warmup_steps, total_steps)
    warm = optax.linear_schedule(0.0 if warmup_steps else lr, lr, max(warmup_steps, 1))
    if schedule == "constant":
        rest = optax.constant_schedule(lr)
    elif schedule == "cosine":
        rest = optax.cosine_decay_schedule(lr, max(total_steps - warmup_steps, 1), alpha=end_lr_ratio)
    else:
        raise ValueError(f"unknown lr schedule {schedule!r}: use 'cosine' or 'constant'")
    return optax.join_schedules([warm, rest], [warmup_steps])


def make_optimizer(
    schedule: optax.Schedule,
    weight_decay: float = 0.0,
    clip_norm: float = 0.5,
    b1: float = 0.9,
    b2: float = 0.95,
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (decay on matrices only, not on norm weights)."""
    chain = [optax.clip_by_global_norm(clip_norm)] if clip_norm and clip_norm > 0 else []
    chain.append(
        optax.adamw(
            schedule,
            b1=b1,
            b2=b2,
            weight_decay=weight_decay,
            mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
        )
    )
    return optax.chain(*chain)


def optimizer_from_config(
    train_cfg: Mapping[str, Any] | Any,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimizer, schedule) from a config with lr, steps, warmup, weight_decay, clip_norm (+ optional b1,
    b2, schedule, end_lr_ratio)."""
    get = train_cfg.get
    sched = make_schedule(
        float(train_cfg["lr"]),
        int(train_cfg["steps"]),
        int(train_cfg["warmup"]),
        str(get("schedule", "cosine")),
        float(get("end_lr_ratio", 0.1)),
    )
    tx = make_optimizer(
        sched,
        float(get("weight_decay", 0.0)),
        float(get("clip_norm", 0.5)),
        float(get("b1", 0.9)),
        float(get("b2", 0.95)),
    )
    return tx, sched


@flax.struct.dataclass
class TrainState:
    """The drafter's trainable params (nnx.Param state), their optimizer state and the step count."""

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


def init_train_state(drafter: Drafter, tx: optax.GradientTransformation) -> tuple[nnx.GraphDef, TrainState]:
    """Split the drafter into (graphdef, TrainState). The drafter holds only its own params (no target
    embedding/head), so everything in `params` is trainable."""
    graphdef, params = nnx.split(drafter, nnx.Param)
    return graphdef, TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def train_step(
    state: TrainState,
    batch: PackedBatch,
    embed_w: jax.Array,
    head_w: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    loss_cfg: LossConfig,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a packed batch (pure; jit it with `make_train_step`)."""
    grad_fn = jax.value_and_grad(loss_and_metrics, has_aux=True)
    rng = jax.random.fold_in(jax.random.key(0x5EED), state.step)
    (_, metrics), grads = grad_fn(state.params, graphdef, batch, embed_w, head_w, loss_cfg, rng)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, grad_norm=optax.global_norm(grads))
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def make_train_step(
    graphdef: nnx.GraphDef, tx: optax.GradientTransformation, loss_cfg: LossConfig
) -> Callable[[TrainState, PackedBatch, jax.Array, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """`train_step` jitted for fixed (graphdef, optimizer, loss weights); the state is donated."""

    def step(state, batch, embed_w, head_w):  # noqa: ANN001, ANN202
        return train_step(state, batch, embed_w, head_w, graphdef=graphdef, tx=tx, loss_cfg=loss_cfg)

    return jax.jit(step, donate_argnums=(0,))


def make_eval_loss(
    graphdef: nnx.GraphDef, loss_cfg: LossConfig
) -> Callable[[nnx.State, PackedBatch, jax.Array, jax.Array], dict[str, jax.Array]]:
    """Jitted loss metrics without an update (held-out loss)."""

    def fn(params, batch, embed_w, head_w):  # noqa: ANN001, ANN202
        return loss_and_metrics(params, graphdef, batch, embed_w, head_w, loss_cfg)[1]

    return jax.jit(fn)


def to_device(batch: PackedBatch) -> PackedBatch:
    """Host numpy batch -> device arrays (one transfer per field)."""
    return jax.tree.map(jnp.asarray, batch)
