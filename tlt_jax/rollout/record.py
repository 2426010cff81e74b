"""Appending what a decode step or a verify round produced to the decode state (one code path for both).

A plain step emits one token per live row, a speculative round 1..depth+1; `record_tokens` takes K tokens per
row with a per-row count and handles both, so EOS, the per-row budget and `last_token` follow one rule.
`record_hidden` stores the target's final hidden states of the tokens a step fed, in a bounded window of the
first W response positions (`DecodeState.out_hidden` [B, W, H]): drafter training data that costs no second
target forward and whose memory does not grow with max_new_tokens (TLT keeps <= 512 response tokens per
drafter sample).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from tlt_jax.rollout.types import DecodeState


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


def record_hidden(state: DecodeState, hidden_bkh: jax.Array, n_fed_b: jax.Array) -> DecodeState:
    """Store the target's final hidden states of the tokens a step or round fed (call it BEFORE recording the
    tokens it emits): hidden_bkh[:, j] belongs to response token num_generated - 1 + j (j = 0 is the row's
    last token), for j < n_fed[b]; positions past the window W = out_hidden.shape[1] are dropped. No-op
    unless the state records hidden states (`state.out_hidden`)."""
    if state.out_hidden is None:
        return state
    b, w, h = state.out_hidden.shape
    kk = hidden_bkh.shape[1]
    chex.assert_shape(hidden_bkh, (b, kk, h))
    i = jnp.arange(kk, dtype=jnp.int32)[None, :]
    idx = jnp.where(i < n_fed_b[:, None], state.num_generated[:, None] - 1 + i, w)  # w: dropped
    out = state.out_hidden.at[jnp.arange(b)[:, None], idx].set(
        hidden_bkh.astype(state.out_hidden.dtype), mode="drop"
    )
    return state.replace(out_hidden=out)
