"""EAGLE drafting for speculative rollouts: the drafter's cache upkeep and EAGLE-2 dynamic tree drafting.

EAGLE drafter alignment (see `tlt_jax.models.drafter`): drafter slot t holds the pair (x_{t+1}, h_t) at
position t+1. With L committed target tokens and `last_token` = x_L sampled from h_{L-1}, the drafter cache
holds slots t < L - 1 and `SpecAux.hidden` = h_{L-1}; the pending pair (x_L, h_{L-1}) is fed first in the
next plain step or round. Plain decoding keeps this invariant too (one cheap drafter position per step, no
LM head), so speculation can switch on at any chunk boundary without a catch-up pass.

After a verify round the draft's own tree entries (computed from DRAFTED features) are rewritten by a drafter
forward over the committed pairs with the TARGET's hidden states from the verify pass (EAGLE's / SGLang's
"draft extend", `drafter_advance` from `tree_verify.verify_round`), so the drafter cache always equals a
drafter pass over the committed text (tested).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.kernels.small_m_linear import linear
from tlt_jax.models.eagle3 import AnyDrafter
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import Transformer, causal_mask, rope_cos_sin
from tlt_jax.rollout.sampling import SamplingParams, categorical, target_probs
from tlt_jax.rollout.strategy import Strategy
from tlt_jax.rollout.types import DraftTree


def drafter_advance(
    drafter: AnyDrafter,
    target: Transformer,
    dcache: KVCache,
    tokens_bt: jax.Array,
    feats_bth: jax.Array,
    num_b: jax.Array,
    attn_impl: str,
) -> KVCache:
    """Write T drafter pairs (x_{t+1} = tokens, h_t = feats) at the drafter's next slots, commit `num_b`.

    Positions follow the alignment (slot s at position s + 1). No LM head: only K/V are needed, and the
    layer's output is dead code that XLA drops.
    """
    b, t = tokens_bt.shape
    chex.assert_shape(feats_bth, (b, t, None))
    pos = dcache.lengths[:, None] + 1 + jnp.arange(t, dtype=jnp.int32)[None, :]
    _, dcache = drafter(
        target.embed_tokens(tokens_bt), feats_bth, pos, dcache, causal_mask(b, t), attn_impl=attn_impl
    )
    return dcache.advance(num_b)


def drafter_prefill(
    drafter: AnyDrafter,
    target: Transformer,
    dcache: KVCache,
    tokens_pt: jax.Array,
    hidden_pth: jax.Array,
    lens_p: jax.Array,
    attn_impl: str,
) -> KVCache:
    """Drafter pass over a prompt: pairs (x_{t+1}, h_t) for t < len - 1, from the target's prefill hiddens."""
    nxt = jnp.concatenate([tokens_pt[:, 1:], jnp.zeros_like(tokens_pt[:, :1])], axis=1)
    return drafter_advance(drafter, target, dcache, nxt, hidden_pth, lens_p - 1, attn_impl)


def eagle_draft(
    target: Transformer,
    drafter: AnyDrafter,
    dcache: KVCache,
    root_token_b: jax.Array,
    root_hidden_bh: jax.Array,
    strategy: Strategy,
    attn_impl: str,
    *,
    sample_keys: jax.Array | None = None,
    sp: SamplingParams | None = None,
    draft_vocab: jax.Array | None = None,
    draft_head: jax.Array | None = None,
) -> tuple[DraftTree, KVCache]:
    """EAGLE-2 dynamic tree: expand the top-k children of the frontier by cumulative draft log-probability.

    Sampled chains (`sample_keys` [B] and `sp` given; topk must be 1): instead of the drafter's argmax, each
    draft is drawn from q = `target_probs(drafter logits, sp)` (the target's temperature, top-k and top-p
    applied to the drafter), and the tree carries the q's for rejection-sampling verification (Leviathan et
    al.): a draft is kept with probability min(1, p/q), so the expected acceptance per position is
    sum_x min(p(x), q(x)) = 1 - TV(p, q) instead of p(argmax q), the ceiling of target-only verification.

    Reduced draft vocabulary (`draft_vocab` [Vd] token ids and `draft_head` = the target head's rows for them,
    gathered once per chunk): the drafter's LM head, most of a draft step's cost at SmolLM2's 49k vocabulary,
    runs over the Vd most frequent tokens only (FR-Spec / EAGLE-3's idea), so drafts are always in-vocabulary
    tokens. Verification is unchanged and lossless: a draft is only a proposal, and a sampled chain's q is the
    distribution it was really drawn from (zero outside the subset).

    Forward 0 feeds the pending pair (root token x_L, h_{L-1}); its output gives the root's top-k children
    (the depth-1 frontier). Forward j >= 1 feeds the frontier (k nodes, each paired with the drafter feature
    that predicted it), scores their top-k children by cumulative log-prob (draft probs = softmax of the
    target's head on the drafter output) and keeps the k best of the k^2 as the next frontier. Finally the
    tokens_to_verify - 1 highest-scoring candidates of all depths form the verify tree (a child never scores
    above its parent, and ties keep the lower index, so kept nodes keep their ancestors; a defensive pass
    turns any orphan into padding).

    Draft-time attention: each drafted slot sees the committed drafter prefix plus its own tree ancestors.
    The drafter's K/V for all draft slots are re-projected every forward from a small buffer of layer inputs
    (the attention contract only masks the new tokens), while fc, MLP and LM head run on the frontier only.
    Returns the verify tree and the drafter cache with draft entries written past its length (garbage that
    the commit overwrites; lengths unchanged).
    """
    b = root_token_b.shape[0]
    chex.assert_shape(root_hidden_bh, (b, None))  # the target's drafter states (H; EAGLE-3: (K + 1) H)
    chex.assert_equal(dcache.batch_size, b)
    ctx = _DraftContext(
        target, drafter, dcache, strategy, attn_impl, sample_keys, sp, draft_vocab, draft_head
    )
    buf = ctx.initial_buffers(dcache)
    h0, buf = ctx.forward(
        buf, 0, root_token_b[:, None], root_hidden_bh[:, None], jnp.zeros((b, 1), jnp.int32)
    )
    cand, front = ctx.root_frontier(h0)
    # one compiled body for every depth: compile time does not grow with the strategy's depth (a depth-1
    # tree has no frontier forward: its body, traced even for zero trips, would not fit the 1-slot buffer)
    if strategy.max_depth > 1:
        buf, cand, _ = jax.lax.fori_loop(1, strategy.max_depth, ctx.expand, (buf, cand, front))
    tree = _verify_tree(cand, root_token_b, strategy, ctx.rows, ctx.sampled)
    return tree, KVCache(k=(buf["k"],), v=(buf["v"],), lengths=dcache.lengths)


class _DraftContext:
    """What every drafter forward of one `eagle_draft` call shares, and the steps that use it.

    Built once per call, at trace time: the draft slots' RoPE tables (slot s of depth d sits at position
    base + 1 + d), the drafter's fc weight and layer, the row indices, and how a drafter output becomes child
    tokens (the top-k of the draft head, or one sampled draw per row). The methods are `eagle_draft`'s steps
    in the order it calls them: `initial_buffers`, `forward` (the root), `root_frontier`, `expand` (the
    loop body of depths 1..max_depth-1).
    """

    def __init__(
        self,
        target: Transformer,
        drafter: AnyDrafter,
        dcache: KVCache,
        strategy: Strategy,
        attn_impl: str,
        sample_keys: jax.Array | None,
        sp: SamplingParams | None,
        draft_vocab: jax.Array | None,
        draft_head: jax.Array | None,
    ):
        self.target, self.attn_impl = target, attn_impl
        self.b = dcache.batch_size
        self.d, self.k = strategy.max_depth, strategy.topk
        self.nd, self.num_c = strategy.draft_slots, strategy.num_candidates
        self.drafter, self.layer, self.cfg = drafter, drafter.layer, drafter.cfg
        self.base = dcache.lengths
        slot_depth = np.concatenate([[0], np.repeat(np.arange(1, self.d), self.k)]).astype(np.int32)
        self.cos, self.sin = rope_cos_sin(
            self.base[:, None] + 1 + jnp.asarray(slot_depth)[None, :], self.cfg.head_dim, self.cfg.rope_theta
        )
        self.rows = jnp.arange(self.b)
        self.sample_keys, self.sp = sample_keys, sp
        self.sampled = sample_keys is not None
        if self.sampled and (self.k != 1 or sp is None or sp.greedy):
            raise ValueError(
                f"sampled drafting needs a chain (topk=1, got {self.k}) and sampling parameters at T > 0"
            )
        self.own_head = drafter.arch == "eagle3"  # EAGLE-3 drafts over its own head's Vd tokens
        if self.own_head:
            vd = drafter.draft_vocab_size
            if draft_vocab is None and vd != target.cfg.vocab_size:
                raise ValueError(
                    f"eagle_draft: an EAGLE-3 head over {vd} tokens needs its draft vocabulary (d2t) ids"
                )
            if draft_vocab is not None:
                chex.assert_shape(draft_vocab, (vd,))
            draft_head = None
        elif (draft_vocab is None) != (draft_head is None):
            raise ValueError("eagle_draft: pass draft_vocab and draft_head together")
        self.draft_vocab, self.draft_head = draft_vocab, draft_head
        self.vocab_size = target.cfg.vocab_size

    def initial_buffers(self, dcache: KVCache) -> dict:
        """The draft slots' attention inputs (activations in cfg.dtype; the weights may be bf16; H wide,
        EAGLE-3's 2H), visibility (each slot sees itself) and the drafter's K/V cache."""
        b, nd, cfg = self.b, self.nd, self.cfg
        return {
            "x": jnp.zeros((b, nd, self.layer.attn.qkv.shape[-1]), jnp.dtype(cfg.dtype)),
            "vis": jnp.broadcast_to(jnp.eye(nd, dtype=bool), (b, nd, nd)),
            "k": dcache.k[0],
            "v": dcache.v[0],
        }

    def forward(
        self,
        buf: dict,
        off: jax.Array | int,
        tok_bt: jax.Array,
        feat_bth: jax.Array,
        parent_slot_bt: jax.Array,
    ) -> tuple[jax.Array, dict]:
        """Feed T draft nodes at slots [off, off + T): returns (their drafter outputs [B, T, H], buffers)."""
        layer, t = self.layer, tok_bt.shape[1]
        emb = self.target.embed_tokens(tok_bt)
        x_new, resid = self.drafter.layer_inputs(emb, feat_bth, self.cfg.linear_impl)
        x_buf = jax.lax.dynamic_update_slice_in_dim(buf["x"], x_new.astype(buf["x"].dtype), off, axis=1)
        own = jax.nn.one_hot(off + jnp.arange(t), self.nd, dtype=bool)[None]
        rows_vis = jnp.take_along_axis(buf["vis"], parent_slot_bt[:, :, None], axis=1) | own
        vis = jax.lax.dynamic_update_slice_in_dim(buf["vis"], rows_vis, off, axis=1)
        a, kc, vc = layer.attn(x_buf, self.cos, self.sin, buf["k"], buf["v"], self.base, vis, self.attn_impl)
        x = resid.astype(a.dtype) + jax.lax.dynamic_slice_in_dim(a, off, t, axis=1)
        return x + layer.mlp(layer.post_attn_norm(x)), {"x": x_buf, "vis": vis, "k": kc, "v": vc}

    def draft_logits(self, h: jax.Array) -> jax.Array:
        """The drafter's LM head: the target's (shared), over the draft vocabulary if one is set; EAGLE-3's
        own (its final norm and head over its Vd tokens)."""
        if self.own_head:
            return self.drafter.logits(h, self.target.cfg.linear_impl)
        if self.draft_head is None:
            return self.target.logits(h)
        return linear(h, self.draft_head, self.target.cfg.linear_impl, preferred_element_type=jnp.float32)

    def to_token(self, idx: jax.Array) -> jax.Array:
        """Draft-head column -> token id (the identity without a draft vocabulary)."""
        return (idx if self.draft_vocab is None else self.draft_vocab[idx]).astype(jnp.int32)

    def top_children(self, h_bth: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The k most likely children of each node: (their draft log-probs, their tokens)."""
        logp = jax.nn.log_softmax(self.draft_logits(h_bth), axis=-1)
        vals, idx = jax.lax.top_k(logp, self.k)
        return vals, self.to_token(idx)

    def sampled_child(
        self, h_bh: jax.Array, depth: int | jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One draft per row drawn from q (key: the row's key folded with the depth): (log q, token, q)."""
        q = target_probs(self.draft_logits(h_bh), self.sp)  # [B, V] or [B, Vd]
        keys = jax.vmap(jax.random.fold_in, (0, None))(self.sample_keys, depth)
        idx = jax.vmap(lambda kk, w: categorical(kk, w[None])[0])(keys, q).astype(jnp.int32)
        lq = jnp.log(q[self.rows, idx])
        if self.draft_vocab is not None:  # q over the whole vocabulary: zero outside the draft vocabulary
            q = jnp.zeros((self.b, self.vocab_size), jnp.float32).at[:, self.draft_vocab].set(q)
        return lq, self.to_token(idx), q

    def root_frontier(self, h0: jax.Array) -> tuple[dict, dict]:
        """From forward 0's output: the candidate table (the root's children, scored) and the frontier."""
        b, k = self.b, self.k
        if self.sampled:
            lq, tok, q = self.sampled_child(h0[:, 0], 0)
            vals, idx = lq[:, None], tok[:, None]
        else:
            vals, idx = self.top_children(h0[:, 0])  # [B, k]: the root's children, the depth-1 frontier
        cand = {  # all scored candidates, in depth order (parents before children); parent -1 = the root
            "tok": jnp.zeros((b, self.num_c), jnp.int32).at[:, :k].set(idx),
            "score": jnp.full((b, self.num_c), -jnp.inf, jnp.float32).at[:, :k].set(vals),
            "parent": jnp.full((b, self.num_c), -1, jnp.int32),
        }
        if self.sampled:  # the draft distribution of each depth, for rejection sampling
            cand["q"] = jnp.zeros((b, self.d, q.shape[-1]), jnp.float32).at[:, 0].set(q)
        front = {
            "tok": idx,
            "score": vals,
            "feat": jnp.broadcast_to(h0, (b, k, h0.shape[-1])),
            "slot": jnp.zeros((b, k), jnp.int32),  # the drafter slot of each frontier node's parent
            "cand": jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k)),
        }
        return cand, front

    def expand(self, j: jax.Array, carry: tuple) -> tuple:
        """Forward j >= 1: feed the depth-j frontier, score its k*k children, keep the best k."""
        buf, cand, front = carry
        b, k, rows = self.b, self.k, self.rows
        off = 1 + (j - 1) * k
        c_start = k + (j - 1) * k * k
        h, buf = self.forward(buf, off, front["tok"], front["feat"], front["slot"])  # [B, k, H]
        if self.sampled:
            lq, t1, q = self.sampled_child(h[:, 0], j)
            vals, idx = lq[:, None, None], t1[:, None, None]
        else:
            vals, idx = self.top_children(h)  # [B, k, k]
        score = (front["score"][:, :, None] + vals).reshape(b, k * k)
        tok = idx.reshape(b, k * k)
        parent = jnp.repeat(front["cand"], k, axis=1)
        cand = {
            **cand,
            **{
                name: jax.lax.dynamic_update_slice_in_dim(cand[name], val, c_start, axis=1)
                for name, val in (("tok", tok), ("score", score), ("parent", parent))
            },
        }
        if self.sampled:
            cand["q"] = jax.lax.dynamic_update_slice_in_dim(cand["q"], q[:, None], j, axis=1)
        _, sel = jax.lax.top_k(score, k)
        front = {
            "tok": tok[rows[:, None], sel],
            "score": score[rows[:, None], sel],
            "feat": h[rows[:, None], sel // k],
            "slot": (off + sel // k).astype(jnp.int32),
            "cand": (c_start + sel).astype(jnp.int32),
        }
        return buf, cand, front


def _verify_tree(
    cand: dict, root_token_b: jax.Array, strategy: Strategy, rows: jax.Array, sampled: bool
) -> DraftTree:
    """The verify tree: the root plus the tokens_to_verify - 1 highest-scoring candidates of all depths, in
    candidate (topological) order; a kept node whose parent was not kept becomes padding (defensive: a child
    never scores above its parent, and ties keep the lower index)."""
    b = root_token_b.shape[0]
    d, k, n, num_c = strategy.max_depth, strategy.topk, strategy.tokens_to_verify, strategy.num_candidates
    c_depth = [np.full(k, 1)] + [np.full(k * k, j + 1) for j in range(1, d)]
    all_tok, all_score, all_parent = cand["tok"], cand["score"], cand["parent"]
    all_depth = jnp.asarray(np.concatenate(c_depth), jnp.int32)
    _, sel = jax.lax.top_k(all_score, n - 1)
    sel = jnp.sort(sel, axis=1)  # candidate order is topological (parents before children)
    inv = jnp.full((b, num_c), -2, jnp.int32).at[rows[:, None], sel].set(jnp.arange(1, n, dtype=jnp.int32))
    pc = all_parent[rows[:, None], sel]
    par = jnp.where(pc < 0, 0, inv[rows[:, None], jnp.clip(pc, 0)])
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), par], axis=1)
    for _ in range(d):  # orphans (parent not kept) and their descendants become padding
        pp = jnp.take_along_axis(parents, jnp.clip(parents, 0), axis=1)
        parents = jnp.where((parents >= 0) & (pp == -2), -2, parents)
    tokens = jnp.concatenate([root_token_b[:, None], all_tok[rows[:, None], sel]], axis=1).astype(jnp.int32)
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), all_depth[sel]], axis=1)
    depth = jnp.where(parents == -2, 0, depth)
    # a sampled chain keeps all d drafts in depth order (n - 1 = d, every score is finite), so node i + 1 was
    # drawn from cand["q"][:, i]
    return DraftTree(
        tokens=tokens,
        parents=parents.astype(jnp.int32),
        depth=depth,
        draft_probs=cand["q"][:, : n - 1] if sampled else None,
    )
