"""Drafter training data: EAGLE alignment and sequence packing with segment ids (static shapes).

Data. A `DrafterSample` is one sequence (prompt + response) with the TARGET's final normed hidden states at
every position (in RL they come from the rollout or the trainer's log-prob forward; in the warm-up from the
engine's recorded states) and a mask of the response tokens. With tokens x_0..x_{L-1} and target features
h_0..h_{L-1} (h_t is computed from x_0..x_t and predicts x_{t+1}), EAGLE trains on the pairs

    input t:  (embed(x_{t+1}), h_t)  at drafter position t + 1
    target t: the feature h_{t+1} and the target's distribution softmax(head(h_{t+1})) over x_{t+2}

for every t whose x_{t+1} is a response token (the drafter runs on exactly these pairs during rollout: the
newest response token with the feature that produced it). Prompt pairs still feed the drafter's causal
attention as context; they carry no loss.

Packing. `pack_samples` puts several samples into each of `rows` rows of `seq_len` tokens (static shapes, so
one compiled step) with per-sample segment ids and positions restarting at 0. The drafter's attention mask is
block-diagonal causal over segments: no token attends across samples (the reference packs under one causal
mask). The alignment above is computed inside the step by shifting within a row
(`eagle_inputs`); a pair whose next token belongs to another segment (a sample's last token) is dropped from
the loss, and it cannot leak into other samples because nothing after it in its own segment exists. A
packed batch therefore gives every sample exactly the loss it would get alone (tests/drafter/test_packing.py).
A static loss-position budget (`max_loss_tokens`, see `loss.LossConfig`) is respected by the packer, so a
step never drops loss pairs and never recompiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.drafter.chain import shift_left


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


def batch_plan(
    samples: Sequence[DrafterSample], seq_len: int, rows: int, seed: int, max_loss: int | None = None
) -> Callable[[int], list[int]]:
    """Step -> sample indices of its packed batch for offline training (the warm-up): epochs of
    `epoch_plan`, each shuffled by (seed, epoch), so any step's batch is recomputed from (seed, step) alone
    (a resumed run continues with the same data order)."""
    lengths = [s.length for s in samples]
    counts = [loss_pairs(s, seq_len) for s in samples]
    plans: dict[int, list[list[int]]] = {}
    offsets = [0]  # first step of each epoch

    def epoch(e: int) -> list[list[int]]:
        if e not in plans:
            plans.clear()
            rng = np.random.default_rng([seed, e])
            plans[e] = epoch_plan(lengths, seq_len, rows, rng, counts, max_loss)
        return plans[e]

    def at(step: int) -> list[int]:
        e = len(offsets) - 1
        while step < offsets[e]:
            e -= 1
        while step >= offsets[e] + len(epoch(e)):
            if e + 1 == len(offsets):
                offsets.append(offsets[e] + len(epoch(e)))
            e += 1
        return epoch(e)[step - offsets[e]]

    return at


def loss_token_budget(samples: Sequence[DrafterSample], seq_len: int, rows: int, setting: int) -> int | None:
    """The step's static loss-position budget: setting > 0 is used as is, 0 means every position (None),
    -1 (auto) sizes it from the data: the share of loss pairs in the packed tokens plus 15% slack, rounded
    up to 64 and at least the largest sample's loss pairs, so batches stay full and nothing is dropped."""
    full = rows * seq_len
    if setting > 0:
        return min(setting, full)
    if setting == 0 or not samples:
        return None
    if setting != -1:
        raise ValueError(f"config.train.max_loss_tokens={setting}: use -1 (auto), 0 (all positions) or > 0")
    tokens = sum(min(s.length, seq_len) for s in samples)
    pairs = [loss_pairs(s, seq_len) for s in samples]
    k = max(int(np.ceil(sum(pairs) / tokens * full * 1.15 / 64)) * 64, max(pairs))
    return None if k >= full else k


def to_device(batch: PackedBatch) -> PackedBatch:
    """Host numpy batch -> device arrays (one transfer per field)."""
    return jax.tree.map(jnp.asarray, batch)
