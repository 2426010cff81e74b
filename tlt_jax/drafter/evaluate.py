"""Acceptance-length evaluation of a drafter on held-out target generations (greedy chain drafting).

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

from tlt_jax.drafter.train_step import (
    DrafterSample,
    PackedBatch,
    eagle_inputs,
    epoch_plan,
    first_fit,
    head_logits,
    pack_samples,
    shift_left,
    to_device,
)
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Attention, DecoderLayer, apply_rope, rope_cos_sin


def _project(attn: Attention, x_bnh: jax.Array, positions_bn: jax.Array) -> tuple[jax.Array, ...]:
    """The layer's fused QKV projection and RoPE: q [B, N, Hkv, G, D], k and v [B, N, Hkv, D].

    Mirrors `Attention.__call__` (rows of the fused weight ordered per KV group: G query heads, key, value);
    accepts the fused weight as [Hkv * (G + 2) * D, H] or [Hkv, G + 2, D, H]. The brute-force test against
    the Drafter module keeps the two in step.
    """
    cfg = attn.cfg
    kv, g, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    b, n = x_bnh.shape[:2]
    w = attn.qkv[...]
    qkv = jnp.einsum("bth,oh->bto", x_bnh, w.reshape(-1, w.shape[-1]))
    if attn.qkv_bias is not None:
        qkv = qkv + attn.qkv_bias[...].reshape(-1)
    qkv = qkv.reshape(b, n, kv, g + 2, d)
    cos, sin = rope_cos_sin(positions_bn, cfg.head_dim, cfg.rope_theta)
    return apply_rope(qkv[:, :, :, :g], cos, sin), apply_rope(qkv[:, :, :, g], cos, sin), qkv[:, :, :, g + 1]


def _attend(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    mask_ctx: jax.Array,
    k_chain: jax.Array | None,
    v_chain: jax.Array | None,
) -> jax.Array:
    """Query (b, t) attends to context keys s with mask_ctx[b, t, s] and to its own chain keys [b, t, :J]."""
    d = q.shape[-1]
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    s_ctx = jnp.einsum("btkgd,bskd->bkgts", q, k_ctx, preferred_element_type=jnp.float32) * scale
    s_ctx = jnp.where(mask_ctx[:, None, None], s_ctx, jnp.finfo(jnp.float32).min)
    n_ctx = s_ctx.shape[-1]
    if k_chain is None:
        p = jax.nn.softmax(s_ctx, axis=-1)
        return jnp.einsum(
            "bkgts,bskd->btkgd", p.astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32
        )
    s_ch = jnp.einsum("btkgd,btjkd->bkgtj", q, k_chain, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(jnp.concatenate([s_ctx, s_ch], axis=-1), axis=-1).astype(v_ctx.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", p[..., :n_ctx], v_ctx, preferred_element_type=jnp.float32)
    return out + jnp.einsum("bkgtj,btjkd->btkgd", p[..., n_ctx:], v_chain, preferred_element_type=jnp.float32)


def _finish_layer(layer: DecoderLayer, x_bth: jax.Array, attn_btkgd: jax.Array) -> jax.Array:
    """Output projection, residual and MLP of the drafter's decoder layer (no input norm)."""
    b, t = attn_btkgd.shape[:2]
    w = layer.attn.o_proj[...]
    a = jnp.einsum("bti,hi->bth", attn_btkgd.reshape(b, t, -1).astype(x_bth.dtype), w.reshape(w.shape[0], -1))
    x = x_bth + a
    return x + layer.mlp(layer.post_attn_norm(x))


def _shift(x: jax.Array, n: int, fill: Any) -> jax.Array:
    """x[:, i + n] at index i (fill past the row's end)."""
    for _ in range(n):
        x = shift_left(x, fill)
    return x


def eval_positions(batch: PackedBatch, depth: int) -> jax.Array:
    """[R, S] bool: positions i whose x_{i+1} is a response token and x_{i+depth+1} exists in the segment."""
    seg = batch.segment_ids
    return (_shift(seg, depth + 1, -1) == seg) & (seg > 0) & shift_left(batch.loss_mask, False)


def sample_eval_positions(sample: DrafterSample, depth: int, seq_len: int) -> int:
    """Host-side count of `eval_positions` of one sample packed into rows of `seq_len`."""
    n = min(sample.length, seq_len)
    return int(np.count_nonzero(sample.loss_mask[1 : max(n - depth, 1)]))


def _take_rows(x: jax.Array, idx_rp: jax.Array) -> jax.Array:
    """x[r, idx[r, p], ...] for x [R, S, ...] -> [R, P, ...]."""
    idx = idx_rp.reshape(idx_rp.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def draft_chains(
    drafter: Drafter,
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
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    e = eagle_inputs(batch)
    r, s = batch.tokens.shape
    layer = drafter.layer
    fc = drafter.fc[...]

    def fuse(tokens: jax.Array, feats: jax.Array) -> jax.Array:
        emb = jnp.take(embed_w, tokens, axis=0)
        x = jnp.concatenate([emb, feats.astype(emb.dtype)], axis=-1)
        return jnp.einsum("bti,hi->bth", x, fc)

    x = fuse(e.next_tokens, e.hidden_in)
    q, k_ctx, v_ctx = _project(layer.attn, x, e.positions)
    h = _finish_layer(layer, x, _attend(q, k_ctx, v_ctx, e.mask, None, None))
    valid = eval_positions(batch, depth)
    if positions_per_row is None:
        idx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (r, s))
        sel, pos, mask = valid, e.positions, e.mask
    else:
        p = positions_per_row
        idx = jax.vmap(lambda v: jnp.nonzero(v, size=p, fill_value=0)[0])(valid).astype(jnp.int32)
        sel = jnp.arange(p)[None, :] < jnp.sum(valid, axis=1, keepdims=True)
        h, pos, mask = _take_rows(h, idx), _take_rows(e.positions, idx), _take_rows(e.mask, idx)
    d = jnp.argmax(head_logits(h, head_w), axis=-1).astype(jnp.int32)
    drafts, k_ch, v_ch = [d], [], []
    for j in range(2, depth + 1):
        x = fuse(d, h)
        q, k, v = _project(layer.attn, x, pos + (j - 1))
        k_ch.append(k)
        v_ch.append(v)
        out = _attend(q, k_ctx, v_ctx, mask, jnp.stack(k_ch, axis=2), jnp.stack(v_ch, axis=2))
        h = _finish_layer(layer, x, out)
        d = jnp.argmax(head_logits(h, head_w), axis=-1).astype(jnp.int32)
        drafts.append(d)
    return jnp.stack(drafts, axis=-1), idx, sel


def acceptance_counts(
    drafter: Drafter,
    batch: PackedBatch,
    embed_w: jax.Array,
    head_w: jax.Array,
    depth: int,
    positions_per_row: int | None = None,
) -> dict[str, jax.Array]:
    """Sums over one packed batch (see the module docstring): positions, accepted drafts, per-depth
    acceptance counts [depth], histogram of accepted counts [depth + 1], target greedy consistency, and
    positions dropped because a row had more than `positions_per_row` (0 when the caller sized it)."""
    r, s = batch.tokens.shape
    chex.assert_shape(batch.segment_ids, (r, s))
    drafts, idx, sel = draft_chains(drafter, batch, embed_w, head_w, depth, positions_per_row)
    greedy = jnp.argmax(head_logits(batch.hidden.astype(jnp.float32), head_w), axis=-1).astype(jnp.int32)
    targets = jnp.stack([_take_rows(_shift(greedy, j, -1), idx) for j in range(1, depth + 1)], axis=-1)
    run = jnp.cumprod((drafts == targets).astype(jnp.int32), axis=-1)  # all of 1..j accepted
    accepted = jnp.sum(run, axis=-1)
    vf = sel.astype(jnp.int32)
    seg = batch.segment_ids
    same_next = (shift_left(seg, -1) == seg) & (seg > 0) & shift_left(batch.loss_mask, False)
    return {
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Flat metrics for a tracker."""
        out = {f"{prefix}accept_length": self.accept_length, f"{prefix}positions": float(self.num_positions)}
        out.update({f"{prefix}accept_pos{j + 1}": p for j, p in enumerate(self.per_position)})
        return out


class AcceptanceEvaluator:
    """Jitted acceptance evaluation for one drafter graph and depth; shapes fixed by (rows, seq_len).

    Each call packs the samples in order and drafts only at evaluation positions, gathered per row up to the
    largest row count of the call (rounded up to 16, so calls on the same data share one compiled program).
    """

    def __init__(self, graphdef: nnx.GraphDef, depth: int, seq_len: int, rows: int):
        self.graphdef = graphdef
        self.depth, self.seq_len, self.rows = int(depth), int(seq_len), int(rows)
        self._fns: dict[int, Any] = {}

    def _fn(self, positions_per_row: int) -> Any:
        if positions_per_row not in self._fns:
            graphdef, depth = self.graphdef, self.depth

            def fn(params, batch, embed_w, head_w):  # noqa: ANN001, ANN202
                drafter = nnx.merge(graphdef, params)
                return acceptance_counts(drafter, batch, embed_w, head_w, depth, positions_per_row)

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
            out = jax.device_get(fn(params, to_device(batch), embed_w, head_w))
            for k, v in out.items():
                totals[k] = totals.get(k, 0) + np.asarray(v, np.int64)
        if int(totals["dropped"]):
            raise AssertionError(
                f"{int(totals['dropped'])} evaluation positions dropped: host/device mismatch"
            )
        return summarize(totals, self.depth)


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
    )


def evaluate_acceptance(
    drafter: Drafter,
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
