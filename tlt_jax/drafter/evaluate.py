"""Acceptance-length evaluation of a drafter on held-out target generations (greedy and sampled chains).

For every response position of a held-out sequence the drafter drafts a chain of `depth` tokens greedily,
exactly as EAGLE drafts during rollout:

    step 1:  input (embed(x_{t+1}), h_t)        at position t + 1  -> h^_1, d_1 = argmax head(h^_1)
    step j:  input (embed(d_{j-1}), h^_{j-1})   at position t + j  -> h^_j, d_j = argmax head(h^_j)

Step 1 uses the TARGET's feature h_t; later steps the drafter's own predicted features. Every step attends to
the drafter's context (the true pairs 0..t of its own sample, like its KV cache in rollout) plus the chain's
earlier drafted entries. Draft d_j is checked against the target's greedy choice given the true prefix,
g_{t+j} = argmax head(h_{t+j}) (from the target features we already have), and the accepted count is the
number of leading matches. A position counts when x_{t+1} is a response token and x_{t+depth+1} exists, so
every counted position can accept the full depth.

Reported: mean accepted length = mean accepted drafts + 1 (the tokens per verify round of greedy chain SD),
the per-position acceptance rates P(drafts 1..j all accepted) (the paper's per-position plot) and the
histogram of accepted counts. With held-out data generated greedily (`eval.temperature=0` in the warm-up),
g_{t+j} is the next token itself, so this is exactly the accepted length greedy chain speculative decoding
would get; with sampled data (the warm-up's default, the RL distribution) it is the usual teacher-forced
estimate: every chain starts from a sampled prefix, later drafts are scored against the target's argmax.

Sampled acceptance. Rollouts sample at the RL temperature, and the engine's learned-drafter chains draw their
drafts from the drafter's q and verify them by rejection sampling: draft j is accepted with probability
1 - TV(p, q) (both warped by the sampling settings). With `sampling` set, the evaluator also reports the
expected tokens per round of such chains, 1 + sum_j prod_{l <= j} alpha_l, where alpha_l is step l's
1 - TV computed exactly over the vocabulary along the true continuation (`sampled_acceptance`). On sampled
data this, not the greedy check, is what decides the speed of speculative rollouts.

All positions of a packed batch are drafted in parallel with static shapes: step 1 runs over whole rows (it
is the drafter's context), the chain steps only at the evaluation positions gathered per row
([rows, positions_per_row, depth]), so the LM head is skipped at prompt and padding positions. The chain
steps reuse the drafter's own weights through a small attention that adds the per-position chain keys to the
block-diagonal causal context (the Drafter module's cache path cannot express per-position prefixes); a
brute-force test against the Drafter module keeps the two in step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.drafter.chain import ChainContext, draft_logits, shift_by, shift_left, take_rows
from tlt_jax.drafter.loss import final_state, head_logits
from tlt_jax.drafter.packing import (
    DrafterSample,
    EagleInputs,
    PackedBatch,
    eagle_inputs,
    epoch_plan,
    first_fit,
    pack_samples,
    to_device,
)
from tlt_jax.models.eagle3 import AnyDrafter
from tlt_jax.rollout.sampling import SamplingParams, target_probs


def eval_positions(batch: PackedBatch, depth: int) -> jax.Array:
    """[R, S] bool: positions i whose x_{i+1} is a response token and x_{i+depth+1} exists in the segment."""
    seg = batch.segment_ids
    return (shift_by(seg, depth + 1, -1) == seg) & (seg > 0) & shift_left(batch.loss_mask, False)


def sample_eval_positions(sample: DrafterSample, depth: int, seq_len: int) -> int:
    """Host-side count of `eval_positions` of one sample packed into rows of `seq_len`."""
    n = min(sample.length, seq_len)
    return int(np.count_nonzero(sample.loss_mask[1 : max(n - depth, 1)]))


def _eval_index(batch: PackedBatch, depth: int, positions_per_row: int | None) -> tuple[jax.Array, jax.Array]:
    """(base index [R, P], selected [R, P]) of the evaluation positions: every index (P = S) or the first
    P evaluation positions of each row."""
    r, s = batch.tokens.shape
    valid = eval_positions(batch, depth)
    if positions_per_row is None:
        return jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (r, s)), valid
    p = positions_per_row
    idx = jax.vmap(lambda v: jnp.nonzero(v, size=p, fill_value=0)[0])(valid).astype(jnp.int32)
    return idx, jnp.arange(p)[None, :] < jnp.sum(valid, axis=1, keepdims=True)


def draft_chains(
    drafter: AnyDrafter,
    batch: PackedBatch,
    embed_w: jax.Array,
    head_w: jax.Array,
    depth: int,
    positions_per_row: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy chains of `depth` drafts: (tokens [R, P, depth], position index [R, P], selected [R, P]).

    Index i of a row drafts from the pair (x_{i+1}, h_i) of its segment (see `eagle_inputs`). With
    `positions_per_row=None` every position is drafted (P = S, selected = `eval_positions`); with P set, only
    the first P evaluation positions of each row are (step 1 still runs over the whole row: it is the
    drafter's context), which skips the LM head at prompt and padding positions.
    """
    ctx, _ = _context(drafter, batch, embed_w)
    idx, sel = _eval_index(batch, depth, positions_per_row)
    return _greedy_drafts(ctx, idx, head_w, depth), idx, sel


def sampled_acceptance(
    drafter: AnyDrafter,
    batch: PackedBatch,
    embed_w: jax.Array,
    head_w: jax.Array,
    depth: int,
    sp: SamplingParams,
    positions_per_row: int | None = None,
    draft_vocab: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-step acceptance probabilities of rejection-sampled chains: (alpha [R, P, depth], selected).

    With drafts sampled from q and verified by rejection sampling against the target's p (both warped by
    `sp`), a draft is accepted with probability sum_x min(p(x), q(x)) = 1 - TV(p, q). Step j's q comes from
    the drafter chain fed with the TRUE tokens x_{i+2..i+j} (an accepted draft is a target sample; teacher
    forcing is the usual estimate of the chain's later steps) and p = warp(head(h_{i+j})). With
    `draft_vocab` q lives on those tokens only (the engine's reduced drafter head).
    """
    ctx, e = _context(drafter, batch, embed_w)
    idx, sel = _eval_index(batch, depth, positions_per_row)
    return _sampled_alphas(ctx, e, batch, idx, head_w, depth, sp, draft_vocab), sel


def _context(drafter: AnyDrafter, batch: PackedBatch, embed_w: jax.Array) -> tuple[ChainContext, EagleInputs]:
    e = eagle_inputs(batch)
    return ChainContext(drafter, embed_w, e.next_tokens, e.hidden_in, e.positions, e.mask), e


def _check_draft_vocab(drafter: AnyDrafter, head_w: jax.Array, draft_vocab: jax.Array | None) -> None:
    """EAGLE-3's head columns are the `draft_vocab` tokens: a reduced head needs their ids (its columns are
    not token ids), or every draft and acceptance would be silently wrong."""
    if drafter.arch == "eagle3" and draft_vocab is None and drafter.draft_vocab_size != head_w.shape[0]:
        raise ValueError(
            f"the EAGLE-3 drafter's head covers {drafter.draft_vocab_size} of the target's {head_w.shape[0]} "
            "tokens: pass its draft_vocab (the token ids of its rows, drafter/draft_vocab.npy) to evaluate it"
        )


def _greedy_drafts(
    ctx: ChainContext, idx: jax.Array, head_w: jax.Array, depth: int, draft_vocab: jax.Array | None = None
) -> jax.Array:
    """[R, P, depth] argmax drafts; each draft is also the next step's input token (one head per step).
    EAGLE-3 drafts with its own head, whose columns are the `draft_vocab` tokens (all of them without it)."""
    _check_draft_vocab(ctx.drafter, head_w, draft_vocab)
    drafts: list[jax.Array] = []
    own = ctx.drafter.arch == "eagle3"

    def argmax_next(_: int, h: jax.Array) -> jax.Array:
        col = jnp.argmax(draft_logits(ctx.drafter, h, head_w), axis=-1).astype(jnp.int32)
        drafts.append(draft_vocab[col] if own and draft_vocab is not None else col)
        return drafts[-1]

    argmax_next(depth, ctx.steps(idx, depth, argmax_next)[-1])
    return jnp.stack(drafts, axis=-1)


def _sampled_alphas(
    ctx: ChainContext,
    e: EagleInputs,
    batch: PackedBatch,
    idx: jax.Array,
    head_w: jax.Array,
    depth: int,
    sp: SamplingParams,
    draft_vocab: jax.Array | None,
) -> jax.Array:
    """[R, P, depth] per-step 1 - TV(p, q) along the true continuation (see `sampled_acceptance`)."""
    _check_draft_vocab(ctx.drafter, head_w, draft_vocab)
    feats = ctx.teacher_forced(e.next_tokens, idx, depth)
    head_q = head_w if draft_vocab is None else head_w[draft_vocab]
    hidden = final_state(batch.hidden.astype(jnp.float32), ctx.drafter)
    alphas = []
    for j, h in enumerate(feats, start=1):
        p = target_probs(head_logits(take_rows(shift_by(hidden, j, 0.0), idx), head_w), sp)
        if draft_vocab is not None:
            p = p[..., draft_vocab]
        q = target_probs(draft_logits(ctx.drafter, h, head_q), sp)
        alphas.append(jnp.sum(jnp.minimum(p, q), axis=-1))
    return jnp.stack(alphas, axis=-1)


def acceptance_counts(
    drafter: AnyDrafter,
    batch: PackedBatch,
    embed_w: jax.Array,
    head_w: jax.Array,
    depth: int,
    positions_per_row: int | None = None,
    sp: SamplingParams | None = None,
    draft_vocab: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Sums over one packed batch (see the module docstring): positions, accepted drafts, per-depth
    acceptance counts [depth], histogram of accepted counts [depth + 1], target greedy consistency, and
    positions dropped because a row had more than `positions_per_row` (0 when the caller sized it). With
    `sp` (not greedy) also the expected accepted drafts of rejection-sampled chains (float sums
    `sampled_accepted`, `sampled_at_depth`: P(drafts 1..j all accepted) = the product of the alphas)."""
    r, s = batch.tokens.shape
    chex.assert_shape(batch.segment_ids, (r, s))
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    ctx, e = _context(drafter, batch, embed_w)  # step 1 and the context keys, shared by both estimates
    idx, sel = _eval_index(batch, depth, positions_per_row)
    drafts = _greedy_drafts(ctx, idx, head_w, depth, draft_vocab)
    final = final_state(batch.hidden.astype(jnp.float32), drafter)
    greedy = jnp.argmax(head_logits(final, head_w), axis=-1).astype(jnp.int32)
    targets = jnp.stack([take_rows(shift_by(greedy, j, -1), idx) for j in range(1, depth + 1)], axis=-1)
    run = jnp.cumprod((drafts == targets).astype(jnp.int32), axis=-1)  # all of 1..j accepted
    accepted = jnp.sum(run, axis=-1)
    vf = sel.astype(jnp.int32)
    seg = batch.segment_ids
    same_next = (shift_left(seg, -1) == seg) & (seg > 0) & shift_left(batch.loss_mask, False)
    out = {
        "num_positions": jnp.sum(vf),
        "accepted": jnp.sum(accepted * vf),
        "accepted_at_depth": jnp.sum(run * vf[..., None], axis=(0, 1)),
        "histogram": jnp.sum(
            jax.nn.one_hot(accepted, depth + 1, dtype=jnp.int32) * vf[..., None], axis=(0, 1)
        ),
        "greedy_consistent": jnp.sum((greedy == shift_left(batch.tokens, -1)) & same_next),
        "greedy_positions": jnp.sum(same_next),
        "dropped": jnp.sum(eval_positions(batch, depth)) - jnp.sum(vf),
    }
    if sp is not None and not sp.greedy:
        alpha = _sampled_alphas(ctx, e, batch, idx, head_w, depth, sp, draft_vocab)
        reach = jnp.cumprod(alpha, axis=-1) * vf[..., None].astype(jnp.float32)
        out["sampled_at_depth"] = jnp.sum(reach, axis=(0, 1))
        out["sampled_accepted"] = jnp.sum(reach)
    return out


@dataclasses.dataclass
class AcceptanceResult:
    """Acceptance of greedy chain drafting of `depth` tokens (see the module docstring)."""

    depth: int
    num_positions: int
    mean_accepted: float  # accepted drafts per verify round
    accept_length: float  # mean_accepted + 1: tokens per verify round
    per_position: list[float]  # P(drafts 1..j all accepted), j = 1..depth
    conditional: list[float]  # P(draft j accepted | drafts 1..j-1 accepted)
    histogram: list[int]  # positions with 0..depth accepted drafts
    target_greedy_match: (
        float  # fraction of response tokens equal to the target's argmax (1.0 for greedy data)
    )
    # Rejection-sampled chains at `sampled_temperature` (None when not evaluated): expected tokens per verify
    # round and P(drafts 1..j all accepted), from the per-step 1 - TV(p, q) (see `sampled_acceptance`).
    sampled_accept_length: float | None = None
    sampled_per_position: list[float] | None = None
    sampled_temperature: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Flat metrics for a tracker."""
        out = {f"{prefix}accept_length": self.accept_length, f"{prefix}positions": float(self.num_positions)}
        out.update({f"{prefix}accept_pos{j + 1}": p for j, p in enumerate(self.per_position)})
        if self.sampled_accept_length is not None:
            out[f"{prefix}sampled_accept_length"] = self.sampled_accept_length
            out.update(
                {f"{prefix}sampled_pos{j + 1}": p for j, p in enumerate(self.sampled_per_position or [])}
            )
        return out


class AcceptanceEvaluator:
    """Jitted acceptance evaluation for one drafter graph and depth; shapes fixed by (rows, seq_len).

    Each call packs the samples in order and drafts only at evaluation positions, gathered per row up to the
    largest row count of the call (rounded up to 16, so calls on the same data share one compiled program).
    With `sampling` (temperature > 0) it also estimates the acceptance of rejection-sampled chains at those
    settings, optionally with the drafter head restricted to `draft_vocab`.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        depth: int,
        seq_len: int,
        rows: int,
        sampling: SamplingParams | None = None,
        draft_vocab: np.ndarray | None = None,
    ):
        self.graphdef = graphdef
        self.depth, self.seq_len, self.rows = int(depth), int(seq_len), int(rows)
        self.sampling = sampling if sampling is not None and not sampling.greedy else None
        self.draft_vocab = None if draft_vocab is None else jnp.asarray(draft_vocab, jnp.int32)
        self._fns: dict[int, Any] = {}

    def _fn(self, positions_per_row: int) -> Any:
        if positions_per_row not in self._fns:
            graphdef, depth, sp = self.graphdef, self.depth, self.sampling

            def fn(params, batch, embed_w, head_w, vocab):  # noqa: ANN001, ANN202
                drafter = nnx.merge(graphdef, params)
                return acceptance_counts(drafter, batch, embed_w, head_w, depth, positions_per_row, sp, vocab)

            self._fns[positions_per_row] = jax.jit(fn)
        return self._fns[positions_per_row]

    def __call__(
        self, params: nnx.State, samples: Sequence[DrafterSample], embed_w: jax.Array, head_w: jax.Array
    ) -> AcceptanceResult:
        if not samples:
            raise ValueError("acceptance evaluation needs at least one held-out sample")
        lengths = [s.length for s in samples]
        counts = [sample_eval_positions(s, self.depth, self.seq_len) for s in samples]
        plan = epoch_plan(lengths, self.seq_len, self.rows)
        most = 1
        for idx in plan:
            per_row = np.zeros((self.rows,), np.int64)
            for j, r, _ in first_fit([lengths[i] for i in idx], self.seq_len, self.rows):
                per_row[r] += counts[idx[j]]
            most = max(most, int(per_row.max()))
        fn = self._fn(min(self.seq_len, -(-most // 16) * 16))
        totals: dict[str, np.ndarray] = {}
        hidden_size = samples[0].hidden_size
        for idx in plan:
            batch, _ = pack_samples([samples[i] for i in idx], self.seq_len, self.rows, hidden_size)
            out = jax.device_get(fn(params, to_device(batch), embed_w, head_w, self.draft_vocab))
            for k, v in out.items():
                v = np.asarray(v)
                totals[k] = totals.get(k, 0) + v.astype(np.float64 if v.dtype.kind == "f" else np.int64)
        if int(totals["dropped"]):
            raise AssertionError(
                f"{int(totals['dropped'])} evaluation positions dropped: host/device mismatch"
            )
        res = summarize(totals, self.depth)
        if self.sampling is not None:
            res.sampled_temperature = self.sampling.temperature
        return res


def summarize(totals: dict[str, Any], depth: int) -> AcceptanceResult:
    """Summed `acceptance_counts` -> rates."""
    n = int(totals["num_positions"])
    at = np.asarray(totals["accepted_at_depth"], np.float64)
    per_pos = (at / max(n, 1)).tolist()
    prev = np.concatenate([[float(n)], at[:-1]])
    cond = np.where(prev > 0, at / np.maximum(prev, 1), 0.0).tolist()
    mean_acc = float(totals["accepted"]) / max(n, 1)
    return AcceptanceResult(
        depth=depth,
        num_positions=n,
        mean_accepted=mean_acc,
        accept_length=mean_acc + 1.0,
        per_position=per_pos,
        conditional=cond,
        histogram=[int(x) for x in np.asarray(totals["histogram"])],
        target_greedy_match=float(totals["greedy_consistent"]) / max(int(totals["greedy_positions"]), 1),
        sampled_accept_length=(
            1.0 + float(totals["sampled_accepted"]) / max(n, 1) if "sampled_accepted" in totals else None
        ),
        sampled_per_position=(
            (np.asarray(totals["sampled_at_depth"]) / max(n, 1)).tolist()
            if "sampled_at_depth" in totals
            else None
        ),
    )


def evaluate_acceptance(
    drafter: AnyDrafter,
    samples: Sequence[DrafterSample],
    embed_w: jax.Array,
    head_w: jax.Array,
    depth: int = 6,
    seq_len: int = 512,
    rows: int = 4,
) -> AcceptanceResult:
    """One-shot convenience wrapper around `AcceptanceEvaluator` (compiles once per call)."""
    graphdef, params = nnx.split(drafter, nnx.Param)
    return AcceptanceEvaluator(graphdef, depth, seq_len, rows)(params, samples, embed_w, head_w)
