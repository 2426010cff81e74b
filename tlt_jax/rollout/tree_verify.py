"""Tree verification: one target forward over a drafted tree, lossless acceptance, commit to the caches.

One speculative round per row (all rows of a batch at once, each at its own committed length L):
  1. a draft tree from `eagle_draft` or `ngram.propose` (static shape per strategy);
  2. ONE target forward over the N tree nodes at positions L + depth with the tree mask (a node sees itself
     and its ancestors; `attn_impl` picks the Pallas kernel on GPU);
  3. acceptance on the target's sampling distribution (`SpecMode.acceptance`; argmax matching at temperature
     0), keyed per row by (sequence key, token index) like plain decoding. Coupled acceptance needs the
     distribution only where its walk can go on (nodes with children) and where it stops: with
     `logit_nodes`, the forward's LM head and the sampling run on those nodes only, not on every leaf;
  4. commit: truncate the emitted tokens at EOS and at the row's budget, record them with the log-probs plain
     decoding records, gather the accepted path into contiguous target-cache slots (`commit_path`), and extend
     the drafter's cache with the true target features of the committed tokens.
"""

from __future__ import annotations

from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models.eagle3 import AnyDrafter
from tlt_jax.models.kv_cache import KVCache, commit_path
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.acceptance import (
    PAD,
    TreeAcceptance,
    chain_accept_rejection,
    plain_draws,
    tree_accept,
    tree_accept_coupled,
    tree_accept_greedy,
)
from tlt_jax.rollout.eagle_draft import drafter_advance
from tlt_jax.rollout.record import record_hidden, record_tokens, truncate_emitted
from tlt_jax.rollout.sampling import SamplingParams, target_probs
from tlt_jax.rollout.strategy import AcceptRule
from tlt_jax.rollout.types import DecodeState, DraftTree, row_keys


def tree_visibility(parents_bn: jax.Array, max_depth: int) -> jax.Array:
    """[B, N, N] bool tree mask: node i sees itself and its ancestors (padding nodes see only themselves)."""
    b, n = parents_bn.shape
    eye = jnp.eye(n, dtype=bool)
    par = jnp.where(parents_bn >= 0, parents_bn, jnp.arange(n, dtype=jnp.int32)[None, :])
    vis = jnp.broadcast_to(eye, (b, n, n))
    for _ in range(max_depth):
        vis = eye[None] | jnp.take_along_axis(vis, par[:, :, None], axis=1)
    return vis


@flax.struct.dataclass
class RoundStats:
    """Per-round counts summed over rows (device scalars / a histogram)."""

    emitted: jax.Array  # tokens emitted
    rows: jax.Array  # live rows verified
    hist: jax.Array  # [depth + 2] row counts by tokens emitted


def node_keys(state: DecodeState, depth_bn: jax.Array) -> jax.Array:
    """[B, N] PRNG keys of the token that follows each tree node: the sequence's key folded with that token's
    index (num_generated + the node's depth), exactly the key a plain decode step would use for it."""
    keys = jax.random.wrap_key_data(state.seq_keys)
    idx = state.num_generated[:, None] + depth_bn
    return jax.vmap(lambda k, i: jax.vmap(lambda j: jax.random.fold_in(k, j))(i))(keys, idx)


def _chain_rejection_row(
    key: jax.Array, tok_n: jax.Array, q_dv: jax.Array, p_nv: jax.Array
) -> TreeAcceptance:
    """`chain_accept_rejection` for one row's chain (node 0 = root, node i = draft i), as a TreeAcceptance."""
    res = chain_accept_rejection(key, tok_n[None, 1:], q_dv[None], p_nv[None])
    n_acc = res.num_accepted[0]
    i = jnp.arange(tok_n.shape[0], dtype=jnp.int32)
    return TreeAcceptance(
        num_accepted=n_acc,
        path=jnp.where(i <= n_acc, i, PAD),
        tokens=res.tokens[0],
        bonus=res.bonus[0],
        last_node=n_acc,
    )


def accept(
    acceptance: str,
    accept_rule: AcceptRule | None,
    state: DecodeState,
    tree: DraftTree,
    logits_bnv: jax.Array,
    sp: SamplingParams,
    max_depth: int,
) -> tuple[TreeAcceptance, jax.Array | None]:
    """Run an acceptance rule (`strategy.ACCEPTANCE`) on the verify logits; returns (acceptance, target
    probs or None)."""
    if sp.greedy:
        argmax = jnp.argmax(logits_bnv, axis=-1).astype(jnp.int32)
        return tree_accept_greedy(tree.tokens, tree.parents, argmax, max_depth), None
    probs = target_probs(logits_bnv, sp)
    if tree.draft_probs is not None:  # a sampled chain: rejection sampling against its draft distributions
        return jax.vmap(_chain_rejection_row)(row_keys(state), tree.tokens, tree.draft_probs, probs), probs
    if acceptance == "coupled":
        keys = node_keys(state, tree.depth)
        return tree_accept_coupled(keys, tree.tokens, tree.parents, probs, max_depth), probs
    rule = accept_rule or tree_accept

    def one(key: jax.Array, tok: jax.Array, par: jax.Array, p: jax.Array) -> TreeAcceptance:
        return jax.tree_util.tree_map(lambda x: x[0], rule(key, tok[None], par[None], p[None], max_depth))

    return jax.vmap(one)(row_keys(state), tree.tokens, tree.parents, probs), probs


def decision_nodes(parents_bn: jax.Array, m: int) -> jax.Array:
    """[B, m] node indices: the nodes with children in index order (the root first), then other nodes.

    A coupled walk moves on only from nodes with children, so their distributions decide acceptance; the
    node where it stops needs one more draw (`accept_and_sample`). Strategies bound the nodes with children
    statically (`Strategy.draft_slots`); a tree with more than m of them stays exact (an internal node left
    out only stops the walk there, and the stop node gets its own draw), it just accepts less."""
    n = parents_bn.shape[1]
    node = jnp.arange(n, dtype=jnp.int32)
    has_child = jnp.any(parents_bn[:, None, :] == node[None, :, None], axis=-1)
    return jnp.argsort(jnp.where(has_child, node, n + node), axis=1)[:, :m].astype(jnp.int32)


def node_draws(keys_bm: jax.Array, logits_bmv: jax.Array, sp: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """([B, M] the tokens plain decoding draws after each node, [B, M] the log-probs it records for them):
    `sampling.sample_rows` per node with the node's own key (argmax and the temperature-1 log-softmax when
    greedy)."""
    if sp.greedy:
        draw = jnp.argmax(logits_bmv, axis=-1).astype(jnp.int32)
        logp = jax.nn.log_softmax(logits_bmv.astype(jnp.float32), axis=-1)
        return draw, jnp.take_along_axis(logp, draw[..., None], axis=-1)[..., 0]
    probs = target_probs(logits_bmv, sp)
    draw = plain_draws(keys_bm, probs)
    return draw, jnp.log(jnp.take_along_axis(probs, draw[..., None], axis=-1)[..., 0])


def _accept_at_nodes(
    target: Transformer,
    state: DecodeState,
    tree: DraftTree,
    logits_bmv: jax.Array,
    hidden_bnh: jax.Array,
    nodes_bm: jax.Array,
    sp: SamplingParams,
    max_depth: int,
) -> tuple[TreeAcceptance, jax.Array]:
    """Coupled (or greedy) acceptance from the logits of `nodes_bm` only: plain decoding's draw at those
    nodes, the walk, then the draw at the stop node when it had none (one head row, skipped when no row
    needs it). Returns (acceptance, [B, D+1] log-probs of the emitted tokens)."""
    b, n = tree.tokens.shape
    chex.assert_shape(nodes_bm, (b, None))
    chex.assert_equal_shape_prefix([nodes_bm, logits_bmv], 2)
    chex.assert_shape(hidden_bnh, (b, n, None))
    rows, sel = jnp.arange(b), (jnp.arange(b)[:, None], nodes_bm)
    keys = node_keys(state, tree.depth)
    draw_m, lp_m = node_draws(keys[sel], logits_bmv, sp)
    draw = jnp.full((b, n), -1, jnp.int32).at[sel].set(draw_m)  # -1: no draw (never a drafted token)
    lp = jnp.zeros((b, n), jnp.float32).at[sel].set(lp_m)
    acc = tree_accept_greedy(tree.tokens, tree.parents, draw, max_depth)
    last = acc.last_node
    have = draw[rows, last] >= 0

    def stop_draw() -> tuple[jax.Array, jax.Array]:
        out = node_draws(keys[rows, last][:, None], target.logits(hidden_bnh[rows, last][:, None]), sp)
        return out[0][:, 0], out[1][:, 0]

    def no_draw() -> tuple[jax.Array, jax.Array]:
        return jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.float32)

    extra_tok, extra_lp = jax.lax.cond(jnp.all(have), no_draw, stop_draw)
    bonus = jnp.where(have, acc.bonus, extra_tok)
    at_bonus = jnp.arange(max_depth + 1)[None, :] == acc.num_accepted[:, None]
    on_path = lp[rows[:, None], jnp.clip(acc.path, 0)]
    logp = jnp.where(at_bonus, jnp.where(have, lp[rows, last], extra_lp)[:, None], on_path)
    acc = acc.replace(tokens=jnp.where(at_bonus, bonus[:, None], acc.tokens), bonus=bonus)
    return acc, logp


@flax.struct.dataclass
class Verdict:
    """What acceptance hands to the commit: per row, the committed path and its tokens.

    path: [B, D+1] node of each committed position (root first; clipped to valid nodes past the end);
    tokens, logp: [B, D+1] the emitted tokens and the log-probs plain decoding records for them;
    n_emit: [B] how many of them the row emits (EOS, budget and done rows applied)."""

    path: jax.Array
    tokens: jax.Array
    logp: jax.Array
    n_emit: jax.Array


def verify_forward(
    target: Transformer,
    state: DecodeState,
    tree: DraftTree,
    *,
    max_depth: int,
    attn_impl: str,
    nodes_bm: jax.Array | None = None,
) -> Any:
    """Phase 2 of a round: ONE target forward over the N tree nodes at positions L + depth, tree mask.
    Returns the model output (logits [B, N, V], or [B, M, V] at `nodes_bm` only; hidden [B, N, H]; the
    cache with the nodes' K/V written)."""
    b, n = tree.tokens.shape
    chex.assert_shape([tree.parents, tree.depth], (b, n))
    cache = state.cache
    return target(
        tree.tokens,
        cache.lengths[:, None] + tree.depth,
        cache,
        tree_visibility(tree.parents, max_depth),
        logits_index_bk=nodes_bm,
        attn_impl=attn_impl,
    )


def accept_and_sample(
    target: Transformer,
    state: DecodeState,
    tree: DraftTree,
    logits: jax.Array,
    hidden_bnh: jax.Array,
    sp: SamplingParams,
    eos_ids: jax.Array,
    *,
    max_depth: int,
    acceptance: str = "coupled",
    accept_rule: AcceptRule | None = None,
    nodes_bm: jax.Array | None = None,
) -> Verdict:
    """Phase 3 of a round: the acceptance walk and the bonus draw on the verify logits, the recorded
    log-probs, and the per-row emitted counts (truncated at EOS and at the row's budget).

    logits: [B, N, V] at every node, or [B, M, V] at `nodes_bm` (coupled or greedy acceptance only; the
    stop node's draw, when it is not among them, takes one more head row from `hidden_bnh`)."""
    if nodes_bm is not None:
        if (acceptance != "coupled" and not sp.greedy) or tree.draft_probs is not None:
            raise ValueError(
                f"logits at some nodes only: {acceptance!r} acceptance needs every node's distribution "
                "(use coupled acceptance, or nodes_bm=None)"
            )
        acc, logp = _accept_at_nodes(target, state, tree, logits, hidden_bnh, nodes_bm, sp, max_depth)
    else:
        rows = jnp.arange(tree.tokens.shape[0])
        acc, probs = accept(acceptance, accept_rule, state, tree, logits, sp, max_depth)
        path = jnp.clip(acc.path, 0)
        if probs is None:  # greedy: plain decoding records the model's log-softmax at temperature 1
            logp_all = jax.nn.log_softmax(logits[rows[:, None], path].astype(jnp.float32), axis=-1)
        else:  # ... and the log of the sampling distribution otherwise
            logp_all = jnp.log(probs[rows[:, None], path])
        logp = jnp.take_along_axis(logp_all, jnp.clip(acc.tokens, 0)[:, :, None], axis=-1)[:, :, 0]
    path = jnp.clip(acc.path, 0)  # [B, D+1] node of each committed position (root first)
    tok = jnp.clip(acc.tokens, 0)  # [B, D+1] emitted tokens
    live = ~state.done
    n_emit = truncate_emitted(tok, acc.num_accepted + 1, live, state.max_new - state.num_generated, eos_ids)
    return Verdict(path=path, tokens=tok, logp=logp, n_emit=n_emit)


def commit(
    target: Transformer,
    drafter: AnyDrafter | None,
    state: DecodeState,
    hidden_bnh: jax.Array,
    cache: KVCache,
    verdict: Verdict,
    eos_ids: jax.Array,
    *,
    max_depth: int,
    attn_impl: str,
    drafter_cache: KVCache | None = None,
) -> tuple[DecodeState, RoundStats]:
    """Phase 4 of a round: record the emitted tokens (and hidden states), gather the accepted path into
    contiguous target-cache slots, extend the drafter cache with the committed pairs' target features.

    hidden_bnh / cache: the verify forward's drafter states (`ModelOutput.drafter_states`: the final hidden
    states; EAGLE-3: [aux layers ; final]) and its cache (nodes' K/V written)."""
    b = state.done.shape[0]
    rows = jnp.arange(b)
    live = ~state.done
    path, tok, n_emit = verdict.path, verdict.tokens, verdict.n_emit
    # the fed tokens of the committed path (root = the row's last token, then the accepted drafts)
    state = record_hidden(state, hidden_bnh[rows[:, None], path], n_emit)
    new_state = record_tokens(state, tok, verdict.logp, n_emit, eos_ids)
    new_state = new_state.replace(cache=commit_path(cache, path, n_emit))
    aux = state.aux
    if aux is not None and aux.hidden is not None:
        last_node = path[rows, jnp.clip(n_emit - 1, 0)]
        hidden = jnp.where((n_emit > 0)[:, None], hidden_bnh[rows, last_node], aux.hidden)
        new_aux = aux.replace(hidden=hidden)
        if aux.drafter_cache is not None:
            if drafter is None:
                raise ValueError("the state carries a drafter cache but no drafter was given")
            dcache = drafter_cache if drafter_cache is not None else aux.drafter_cache
            pair_tok = jnp.concatenate([state.last_token[:, None], tok[:, :max_depth]], axis=1)
            pair_feat = jnp.concatenate(
                [aux.hidden[:, None], hidden_bnh[rows[:, None], path[:, :max_depth]]], axis=1
            )
            new_aux = new_aux.replace(
                drafter_cache=drafter_advance(drafter, target, dcache, pair_tok, pair_feat, n_emit, attn_impl)
            )
        new_state = new_state.replace(aux=new_aux)
    hist = jnp.sum(jax.nn.one_hot(n_emit, max_depth + 2, dtype=jnp.int32) * live[:, None], axis=0)
    stats = RoundStats(emitted=jnp.sum(n_emit), rows=jnp.sum(live.astype(jnp.int32)), hist=hist)
    return new_state, stats


def verify_round(
    target: Transformer,
    drafter: AnyDrafter | None,
    state: DecodeState,
    tree: DraftTree,
    sp: SamplingParams,
    eos_ids: jax.Array,
    *,
    max_depth: int,
    attn_impl: str,
    acceptance: str = "coupled",
    accept_rule: AcceptRule | None = None,
    drafter_cache: KVCache | None = None,
    logit_nodes: int | None = None,
) -> tuple[DecodeState, RoundStats]:
    """Verify each row's draft tree with one target forward, accept losslessly, commit, update caches
    (`verify_forward`, `accept_and_sample`, `commit`: the phases `experiments/bench/verify_breakdown.py`
    times).

    max_depth: the deepest draft depth (static; trees of several strategies sharing a program use their
    maximum: a shallower tree simply has no deeper children). acceptance / accept_rule: the rule at
    temperature > 0 (`SpecMode`). drafter_cache: the drafter cache to extend (the one `eagle_draft`
    returned; defaults to the state's). logit_nodes: compute the LM head and the draws at this many nodes
    only (`decision_nodes`; coupled or greedy acceptance), None: at every node.
    """
    nodes = None if logit_nodes is None else decision_nodes(tree.parents, logit_nodes)
    out = verify_forward(target, state, tree, max_depth=max_depth, attn_impl=attn_impl, nodes_bm=nodes)
    kw = {"max_depth": max_depth, "acceptance": acceptance, "accept_rule": accept_rule, "nodes_bm": nodes}
    verdict = accept_and_sample(target, state, tree, out.logits, out.hidden, sp, eos_ids, **kw)
    return commit(
        target,
        drafter,
        state,
        out.drafter_states,
        out.cache,
        verdict,
        eos_ids,
        max_depth=max_depth,
        attn_impl=attn_impl,
        drafter_cache=drafter_cache,
    )
