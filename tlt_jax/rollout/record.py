"""Appending what a decode step or a verify round produced to the decode state (one code path for both).

A plain step emits one token per live row, a speculative round 1..depth+1; `record_tokens` takes K tokens per
row with a per-row count and handles both, so EOS, the per-row budget and `last_token` follow one rule.

`record_hidden` stores the target's final hidden states of the tokens a step fed (drafter training data that
costs no second target forward) in a bounded window `DecodeState.out_hidden` [B, W, H] per row, whose memory
does not grow with max_new_tokens. Which W response positions a row keeps is its recorded span
(`EngineConfig.hidden_span`, `span_ends`):
- "first": positions 0..W-1 (`DecodeState.hidden_end` None: position p at slot p, the rest dropped);
- "last": the last W positions the row fed (a ring: position p at slot p mod W, each write overwriting the
  position W before it), so a long response keeps its end;
- "random": the ring stops at a per-row end e = s + W, s drawn uniformly from [0, budget - W] with the row's
  own key (`SPAN_SALT` folded into its sequence key): a long response keeps [s, s + W), one that ends before
  e its last W positions. Over rows the kept depths cover the whole response length, which is where the
  drafter is used: the long tail decodes the deep positions of the longest responses.
The end is data ([B] int32), not a shape: every span runs the same programs. "first" with a row's end at W is
the ring that never wraps, so all three are one rule; `kept_positions` is its inverse on the host (which
response positions a fetched row's slots hold), for the harvester.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.rollout.types import DecodeState

HIDDEN_SPANS = ("first", "random", "last")
SPAN_SALT = 0x5BA7  # folded into a row's sequence key for its recorded span's start ("random")


def record_tokens(
    state: DecodeState, tok_bk: jax.Array, logp_bk: jax.Array, n_emit_b: jax.Array, eos_ids: jax.Array
) -> DecodeState:
    """Append the first n_emit[b] of K tokens to each row's output; rows that emitted EOS or reached their
    budget are done. Callers truncate n_emit at the first EOS (inclusive) and at the remaining budget, and
    give 0 for rows that are already done."""
    b, n = state.out_tokens.shape
    kk = tok_bk.shape[1]
    chex.assert_shape([tok_bk, logp_bk], (b, kk))
    chex.assert_shape(n_emit_b, (b,))
    i = jnp.arange(kk, dtype=jnp.int32)[None, :]
    emit = i < n_emit_b[:, None]
    idx = jnp.where(emit, state.num_generated[:, None] + i, n)  # n: out of range -> dropped
    rows = jnp.arange(b)[:, None]
    out_tokens = state.out_tokens.at[rows, idx].set(tok_bk, mode="drop")
    out_logp = state.out_logp.at[rows, idx].set(logp_bk.astype(state.out_logp.dtype), mode="drop")
    num = state.num_generated + n_emit_b
    is_eos = jnp.any(tok_bk[:, :, None] == eos_ids[None, None, :], axis=-1) & emit
    hit = jnp.any(is_eos, axis=-1) | (num >= state.max_new)
    last = jnp.take_along_axis(tok_bk, jnp.clip(n_emit_b - 1, 0)[:, None], axis=1)[:, 0]
    emitted = n_emit_b > 0
    return state.replace(
        out_tokens=out_tokens,
        out_logp=out_logp,
        num_generated=num,
        done=state.done | (emitted & hit),
        last_token=jnp.where(emitted, last, state.last_token),
    )


def truncate_emitted(
    tok_bk: jax.Array, n_out_b: jax.Array, live_b: jax.Array, budget_b: jax.Array, eos_ids: jax.Array
) -> jax.Array:
    """How many of K candidate tokens each row emits: n_out, cut after the first EOS and at the remaining
    budget, 0 for rows that are done."""
    kk = tok_bk.shape[1]
    i = jnp.arange(kk, dtype=jnp.int32)[None, :]
    is_eos = jnp.any(tok_bk[:, :, None] == eos_ids[None, None, :], axis=-1) & (i < n_out_b[:, None])
    first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, kk)
    return jnp.where(live_b, jnp.minimum(jnp.minimum(n_out_b, first_eos), budget_b), 0).astype(jnp.int32)


def span_ends(span: str, keys_b: jax.Array, budget_b: jax.Array, window: int) -> jax.Array | None:
    """[B] int32: the response position before which each row's recorded span ends (module docstring); None
    for "first" (positions < W, the state carries no ends). keys_b: [B, 2] the rows' sequence key data;
    budget_b: [B] their token budgets. A row's end depends on its sequence's key only, never on the batch it
    starts in: a resumed or differently scheduled rollout records the same positions."""
    if span == "first":
        return None
    chex.assert_shape(keys_b, (budget_b.shape[0], 2))
    if span == "last":
        return budget_b.astype(jnp.int32)
    if span != "random":
        raise ValueError(f"hidden_span={span!r}: use one of {HIDDEN_SPANS}")
    keys = jax.vmap(lambda k: jax.random.fold_in(jax.random.wrap_key_data(k), SPAN_SALT))(keys_b)
    bits = jax.vmap(lambda k: jax.random.bits(k, (), jnp.uint32))(keys)
    room = (jnp.maximum(budget_b - window, 0) + 1).astype(jnp.uint32)
    return ((bits % room).astype(jnp.int32) + window).astype(jnp.int32)


def record_hidden(state: DecodeState, hidden_bkh: jax.Array, n_fed_b: jax.Array) -> DecodeState:
    """Store the target's final hidden states of the tokens a step or round fed (call it BEFORE recording the
    tokens it emits): hidden_bkh[:, j] belongs to response token p = num_generated - 1 + j (j = 0 is the
    row's last token), for j < n_fed[b]. Without ends (`state.hidden_end` None) p goes to slot p and
    positions past W = out_hidden.shape[1] are dropped; with ends, positions before the row's end go to slot
    p mod W (only the last W of one call's, so no two writes of a call share a slot). No-op unless the state
    records hidden states (`state.out_hidden`)."""
    if state.out_hidden is None:
        return state
    b, w, h = state.out_hidden.shape
    kk = hidden_bkh.shape[1]
    chex.assert_shape(hidden_bkh, (b, kk, h))
    i = jnp.arange(kk, dtype=jnp.int32)[None, :]
    pos = state.num_generated[:, None] - 1 + i
    if state.hidden_end is None:
        idx = jnp.where(i < n_fed_b[:, None], pos, w)  # w: dropped
    else:
        chex.assert_shape(state.hidden_end, (b,))
        end = jnp.minimum(state.num_generated - 1 + n_fed_b, state.hidden_end)[:, None]
        keep = (i < n_fed_b[:, None]) & (pos < end) & (pos >= end - w)
        idx = jnp.where(keep, pos % w, w)
    out = state.out_hidden.at[jnp.arange(b)[:, None], idx].set(
        hidden_bkh.astype(state.out_hidden.dtype), mode="drop"
    )
    return state.replace(out_hidden=out)


def kept_positions(fed: int, length: int, window: int, end: int | None) -> tuple[int, np.ndarray]:
    """The host's reading of one fetched row's recorded slots: (offset, slots) such that response positions
    offset, offset + 1, ... are at `slots` of its [W, H] array. fed: positions the row fed (num_generated -
    1 on the device); length: its response length as harvested (a stop string may cut it below the device's
    count: positions from length - 1 on are not the response's); end: its span's end (None: "first")."""
    hi = min(fed, window if end is None else end)
    lo = max(hi - window, 0)
    hi = min(hi, max(length - 1, 0))
    return lo, np.arange(lo, max(hi, lo)) % window
