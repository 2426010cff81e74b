"""Tree verification: one target forward over a drafted tree, lossless acceptance, commit to the caches.

One speculative round per row (all rows of a batch at once, each at its own committed length L):
  1. a draft tree from `eagle_draft` or `ngram.propose` (static shape per strategy);
  2. ONE target forward over the N tree nodes at positions L + depth with the tree mask (a node sees itself
     and its ancestors; `attn_impl` picks the Pallas kernel on GPU);
  3. acceptance on the target's sampling distribution (`SpecMode.acceptance`; argmax matching at temperature
     0), keyed per row by (sequence key, token index) like plain decoding;
  4. commit: truncate the emitted tokens at EOS and at the row's budget, record them with the log-probs plain
     decoding records, gather the accepted path into contiguous target-cache slots (`commit_path`), and extend
     the drafter's cache with the true target features of the committed tokens.
"""

from __future__ import annotations

import chex
import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models.drafter import Drafter
from tlt_jax.models.kv_cache import KVCache, commit_path
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.acceptance import (
    PAD,
    TreeAcceptance,
    chain_accept_rejection,
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


def verify_round(
    target: Transformer,
    drafter: Drafter | None,
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
) -> tuple[DecodeState, RoundStats]:
    """Verify each row's draft tree with one target forward, accept losslessly, commit, update caches.

    max_depth: the deepest draft depth (static; trees of several strategies sharing a program use their
    maximum: a shallower tree simply has no deeper children). acceptance / accept_rule: the rule at
    temperature > 0 (`SpecMode`). drafter_cache: the drafter cache to extend (the one `eagle_draft`
    returned; defaults to the state's).
    """
    b, n = tree.tokens.shape
    chex.assert_shape([tree.parents, tree.depth], (b, n))
    rows = jnp.arange(b)
    live = ~state.done
    cache = state.cache
    out = target(
        tree.tokens,
        cache.lengths[:, None] + tree.depth,
        cache,
        tree_visibility(tree.parents, max_depth),
        attn_impl=attn_impl,
    )
    acc, probs = accept(acceptance, accept_rule, state, tree, out.logits, sp, max_depth)

    path = jnp.clip(acc.path, 0)  # [B, D+1] node of each committed position (root first)
    tok = jnp.clip(acc.tokens, 0)  # [B, D+1] emitted tokens
    if probs is None:  # greedy: plain decoding records the model's log-softmax at temperature 1
        logp_all = jax.nn.log_softmax(out.logits[rows[:, None], path].astype(jnp.float32), axis=-1)
    else:  # ... and the log of the sampling distribution otherwise
        logp_all = jnp.log(probs[rows[:, None], path])
    logp = jnp.take_along_axis(logp_all, tok[:, :, None], axis=-1)[:, :, 0]
    n_emit = truncate_emitted(tok, acc.num_accepted + 1, live, state.max_new - state.num_generated, eos_ids)

    # the fed tokens of the committed path (root = the row's last token, then the accepted drafts)
    state = record_hidden(state, out.hidden[rows[:, None], path], n_emit)
    new_state = record_tokens(state, tok, logp, n_emit, eos_ids)
    new_state = new_state.replace(cache=commit_path(out.cache, path, n_emit))
    aux = state.aux
    if aux is not None and aux.hidden is not None:
        last_node = path[rows, jnp.clip(n_emit - 1, 0)]
        hidden = jnp.where((n_emit > 0)[:, None], out.hidden[rows, last_node], aux.hidden)
        new_aux = aux.replace(hidden=hidden)
        if aux.drafter_cache is not None:
            if drafter is None:
                raise ValueError("the state carries a drafter cache but no drafter was given")
            dcache = drafter_cache if drafter_cache is not None else aux.drafter_cache
            pair_tok = jnp.concatenate([state.last_token[:, None], tok[:, :max_depth]], axis=1)
            pair_feat = jnp.concatenate(
                [aux.hidden[:, None], out.hidden[rows[:, None], path[:, :max_depth]]], axis=1
            )
            new_aux = new_aux.replace(
                drafter_cache=drafter_advance(drafter, target, dcache, pair_tok, pair_feat, n_emit, attn_impl)
            )
        new_state = new_state.replace(aux=new_aux)
    hist = jnp.sum(jax.nn.one_hot(n_emit, max_depth + 2, dtype=jnp.int32) * live[:, None], axis=0)
    stats = RoundStats(emitted=jnp.sum(n_emit), rows=jnp.sum(live.astype(jnp.int32)), hist=hist)
    return new_state, stats
