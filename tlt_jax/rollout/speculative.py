"""Lossless speculative decoding for rollouts: strategies, EAGLE-2-style tree drafting, verify, commit.

One speculative round per row (all rows of a batch at once, each at its own committed length L):
  1. draft a tree (static shape per strategy): the learned EAGLE drafter (`eagle_draft`) or the model-free
     n-gram drafter (`tlt_jax.rollout.ngram`);
  2. verify: ONE target forward over the N tree nodes at positions L + depth with the tree mask (node sees
     itself and its ancestors; `attn_impl` picks the Pallas kernel on GPU), then `tree_accept` on the target's
     sampling distribution (`tree_accept_greedy` at temperature 0), keyed per row by (sequence key, token
     index) like plain decoding;
  3. commit: truncate the emitted tokens at EOS and at the row's budget, record them with the same log-probs
     plain decoding records, gather the accepted path into contiguous target-cache slots (`commit_path`),
     and extend the drafter's cache with the true target features of the committed tokens.

EAGLE drafter alignment (see `tlt_jax.models.drafter`): drafter slot t holds the pair (x_{t+1}, h_t) at
position t+1. With L committed target tokens and `last_token` = x_L sampled from h_{L-1}, the drafter cache
holds slots t < L - 1 and `SpecAux.hidden` = h_{L-1}; the pending pair (x_L, h_{L-1}) is fed first in the
next plain step or round. Plain decoding keeps this invariant too (one cheap drafter position per step, no
LM head), so speculation can switch on at any chunk boundary without a catch-up pass.

Drafter cache after a round: the draft's own tree entries were computed from DRAFTED features; they are
rewritten by a drafter forward over the committed pairs with the TARGET's hidden states from the verify pass
(EAGLE's / SGLang's "draft extend"), so the drafter cache always equals a drafter pass over the committed
text (tested). This costs one drafter forward of depth+1 positions without the LM head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.kernels.small_m_linear import linear
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.kv_cache import KVCache, commit_path
from tlt_jax.models.llama import Transformer, causal_mask, rope_cos_sin
from tlt_jax.rollout.acceptance import (
    PAD,
    TreeAcceptance,
    chain_accept_rejection,
    tree_accept,
    tree_accept_greedy,
)
from tlt_jax.rollout.sampling import SamplingParams, categorical, target_probs
from tlt_jax.rollout.types import ChunkRecord, DecodeState, DraftTree, row_keys

DRAFTERS = ("eagle", "ngram")
AcceptRule = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, int], TreeAcceptance]


# ---------------------------------------------------------------------------------------------------------
# Strategies and configuration


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A speculative strategy `draft_depth_topk_tokens_to_verify` (e.g. "8_4_48"); topk 1 is a chain.

    tokens_to_verify counts the root (the last committed token), as SGLang's num_draft_tokens does, so a chain
    of depth d verifies d + 1 tokens. A tree cannot be deeper than tokens_to_verify - 1 nodes:
    `max_depth = min(draft_depth, tokens_to_verify - 1)` is the depth actually drafted.
    """

    draft_depth: int
    topk: int
    tokens_to_verify: int

    def __post_init__(self) -> None:
        if self.draft_depth < 1 or self.topk < 1 or self.tokens_to_verify < 2:
            raise ValueError(
                f"strategy {self.name}: need draft_depth >= 1, topk >= 1 and tokens_to_verify >= 2 "
                "(the root + at least one draft)"
            )
        if self.tokens_to_verify - 1 > self.num_candidates:
            raise ValueError(
                f"strategy {self.name}: tokens_to_verify - 1 = {self.tokens_to_verify - 1} exceeds the "
                f"{self.num_candidates} nodes a depth-{self.max_depth} top-{self.topk} draft produces"
            )

    @classmethod
    def parse(cls, text: str | Strategy) -> Strategy:
        """ "8_4_48" -> Strategy(8, 4, 48)."""
        if isinstance(text, Strategy):
            return text
        parts = str(text).strip().split("_")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(
                f"strategy {text!r}: expected 'draft_depth_topk_tokens_to_verify', e.g. '8_4_48'"
            )
        return cls(*(int(p) for p in parts))

    @property
    def name(self) -> str:
        return f"{self.draft_depth}_{self.topk}_{self.tokens_to_verify}"

    def __str__(self) -> str:
        return self.name

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def max_depth(self) -> int:
        return min(self.draft_depth, self.tokens_to_verify - 1)

    @property
    def num_candidates(self) -> int:
        """Nodes an EAGLE-2 draft scores: topk at depth 1, topk^2 at each later depth."""
        d = min(self.draft_depth, self.tokens_to_verify - 1)
        return self.topk + (d - 1) * self.topk * self.topk

    @property
    def draft_slots(self) -> int:
        """Drafter KV slots one EAGLE draft writes: the root pair + topk per expanded depth."""
        return 1 + (self.max_depth - 1) * self.topk

    @property
    def tokens_per_round(self) -> int:
        """Most tokens a row emits in one round (accepted drafts + bonus)."""
        return self.max_depth + 1

    @property
    def lookahead(self) -> int:
        """Cache slots past the committed length one round writes (target verify, drafter draft/extend)."""
        return max(self.tokens_to_verify, self.draft_slots, self.max_depth + 1)


DRAFTER_WEIGHT_DTYPES = ("auto", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative rollouts. `threshold`: SD turns on once at most this many rows are running and have been
    for `min_steps_below` decode steps (the reference uses 32 and 10); with threshold >= the batch and
    min_steps_below=0 the whole rollout is speculative. `drafter`: "eagle" (needs `RolloutEngine(drafter=)`)
    or "ngram" (model-free). The n-gram drafter matches up to `ngram_max` tokens (at least `ngram_min`) in the
    prompt, the row's response and up to `ngram_siblings` sibling responses of the same prompt.
    `chain_rejection`: learned-drafter chains (topk = 1) sample their drafts and verify them by rejection
    sampling at temperature > 0 (higher acceptance when the drafter's distribution is close to the target's).
    `drafter_weight_dtype`: the dtype the engine keeps the drafter's weight matrices (and its reduced LM head)
    in: "float32", "bfloat16", or "auto" = bfloat16 where the target's matmuls run the CPU kernel (which
    widens bfloat16 exactly and computes in fp32, so a draft step streams half the bytes), else the drafter's
    own dtype. Drafts are proposals and a sampled chain's q is the distribution actually sampled, so any
    dtype keeps SD lossless; it only moves the acceptance rate (measured: unchanged, docs/benchmarks.md).
    """

    enabled: bool = False
    drafter: str = "eagle"
    strategy: str = "3_1_4"
    threshold: int = 32
    min_steps_below: int = 10
    ngram_max: int = 4
    ngram_min: int = 1
    ngram_siblings: int = 16
    chain_rejection: bool = True
    drafter_weight_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"SpecConfig.drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        Strategy.parse(self.strategy)
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("SpecConfig: need 1 <= ngram_min <= ngram_max")
        if self.threshold < 0 or self.min_steps_below < 0 or self.ngram_siblings < 0:
            raise ValueError("SpecConfig: threshold, min_steps_below and ngram_siblings must be >= 0")
        if self.drafter_weight_dtype not in DRAFTER_WEIGHT_DTYPES:
            raise ValueError(
                f"SpecConfig.drafter_weight_dtype must be one of {DRAFTER_WEIGHT_DTYPES}, "
                f"got {self.drafter_weight_dtype!r}"
            )


@dataclasses.dataclass(frozen=True)
class SpecMode:
    """A registered speculative mode: a drafter kind and a strategy (what the engine compiles a chunk for).

    accept_rule: the sampling-time acceptance rule (default `tree_accept`); any replacement must keep its
    signature and be lossless. Greedy rounds always use `tree_accept_greedy`.
    rejection: at temperature > 0, draw a chain's drafts from the drafter's distribution and verify them by
    rejection sampling (`chain_accept_rejection`), not argmax drafts + `tree_accept` (see `eagle_draft`).
    """

    drafter: str
    strategy: Strategy
    accept_rule: AcceptRule | None = None
    label: str = ""
    rejection: bool = False

    def __post_init__(self) -> None:
        if self.rejection and not (
            self.drafter == "eagle" and self.strategy.is_chain and self.accept_rule is None
        ):
            raise ValueError(
                "rejection-sampling verification needs the learned drafter, a chain strategy (topk = 1) and "
                f"no custom accept_rule; got drafter={self.drafter!r}, strategy {self.strategy}"
            )

    @property
    def name(self) -> str:
        base = self.strategy.name if self.drafter == "eagle" else f"ngram_{self.strategy.name}"
        return f"{base}_{self.label}" if self.label else base

    @property
    def tokens_per_step(self) -> int:
        return self.strategy.tokens_per_round

    @property
    def lookahead(self) -> int:
        return self.strategy.lookahead


# ---------------------------------------------------------------------------------------------------------
# Mode selection (the hook the BEG-MAB bandit plugs into)


class ModeSelector(Protocol):
    """Chooses the mode of the next chunk and learns from its outcome.

    `select(running, batch_bucket)` runs on the host before each chunk ("plain" or a registered mode name);
    `observe(record, running_steps)` runs after it with the chunk's record (seconds, new_tokens, accept
    stats: `record.tokens_per_second` is the bandit's reward) and the running-row count of every step/round.
    """

    def select(self, running: int, batch_bucket: int) -> str: ...

    def observe(self, record: ChunkRecord, running_steps: Sequence[int]) -> None: ...


class ThresholdSelector:
    """The paper's switch: plain decoding until at most `threshold` rows run for `min_steps_below` consecutive
    decode steps, then `mode` for the rest of the rollout. One instance per rollout (it counts steps)."""

    def __init__(self, mode: str, threshold: int, min_steps_below: int = 0):
        self.mode, self.threshold, self.min_steps_below = mode, threshold, min_steps_below
        self.steps_below = 0
        self.on = False

    def select(self, running: int, batch_bucket: int) -> str:
        del batch_bucket
        if not self.on and running <= self.threshold and self.steps_below >= self.min_steps_below:
            self.on = True
        return self.mode if self.on else "plain"

    def observe(self, record: ChunkRecord, running_steps: Sequence[int]) -> None:
        del record
        for r in running_steps:
            self.steps_below = self.steps_below + 1 if r <= self.threshold else 0


class CallableSelector:
    """Adapts a plain `fn(running) -> mode` to the ModeSelector protocol."""

    def __init__(self, fn: Callable[[int], str]):
        self.fn = fn

    def select(self, running: int, batch_bucket: int) -> str:
        del batch_bucket
        return self.fn(running)

    def observe(self, record: ChunkRecord, running_steps: Sequence[int]) -> None:
        del record, running_steps


# ---------------------------------------------------------------------------------------------------------
# Drafter cache maintenance (prefill, plain steps, after verification)


def drafter_advance(
    drafter: Drafter,
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
    drafter: Drafter,
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


# ---------------------------------------------------------------------------------------------------------
# EAGLE-2 tree drafting


def tree_visibility(parents_bn: jax.Array, max_depth: int) -> jax.Array:
    """[B, N, N] bool tree mask: node i sees itself and its ancestors (padding nodes see only themselves)."""
    b, n = parents_bn.shape
    eye = jnp.eye(n, dtype=bool)
    par = jnp.where(parents_bn >= 0, parents_bn, jnp.arange(n, dtype=jnp.int32)[None, :])
    vis = jnp.broadcast_to(eye, (b, n, n))
    for _ in range(max_depth):
        vis = eye[None] | jnp.take_along_axis(vis, par[:, :, None], axis=1)
    return vis


def eagle_draft(
    target: Transformer,
    drafter: Drafter,
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
    chex.assert_shape(root_hidden_bh, (b, drafter.cfg.hidden_size))
    chex.assert_equal(dcache.batch_size, b)
    d, k, n = strategy.max_depth, strategy.topk, strategy.tokens_to_verify
    nd, num_c = strategy.draft_slots, strategy.num_candidates
    layer = drafter.layer
    cfg = drafter.cfg
    base = dcache.lengths
    slot_depth = np.concatenate([[0], np.repeat(np.arange(1, d), k)]).astype(np.int32)
    cos, sin = rope_cos_sin(
        base[:, None] + 1 + jnp.asarray(slot_depth)[None, :], cfg.head_dim, cfg.rope_theta
    )
    fc = drafter.fc[...]
    rows = jnp.arange(b)
    sampled = sample_keys is not None
    if sampled and (k != 1 or sp is None or sp.greedy):
        raise ValueError(f"sampled drafting needs a chain (topk=1, got {k}) and sampling parameters at T > 0")

    def forward(
        buf: dict, off: jax.Array | int, tok_bt: jax.Array, feat_bth: jax.Array, parent_slot_bt: jax.Array
    ):
        """Feed T draft nodes at slots [off, off + T): returns (their drafter outputs [B, T, H], buffers)."""
        t = tok_bt.shape[1]
        emb = target.embed_tokens(tok_bt)
        x_new = linear(jnp.concatenate([emb, feat_bth.astype(emb.dtype)], -1), fc, cfg.linear_impl)
        x_buf = jax.lax.dynamic_update_slice_in_dim(buf["x"], x_new.astype(buf["x"].dtype), off, axis=1)
        own = jax.nn.one_hot(off + jnp.arange(t), nd, dtype=bool)[None]
        rows_vis = jnp.take_along_axis(buf["vis"], parent_slot_bt[:, :, None], axis=1) | own
        vis = jax.lax.dynamic_update_slice_in_dim(buf["vis"], rows_vis, off, axis=1)
        h = layer.input_norm(x_buf) if layer.input_norm is not None else x_buf
        a, kc, vc = layer.attn(h, cos, sin, buf["k"], buf["v"], base, vis, attn_impl)
        x = x_new + jax.lax.dynamic_slice_in_dim(a, off, t, axis=1)
        return x + layer.mlp(layer.post_attn_norm(x)), {"x": x_buf, "vis": vis, "k": kc, "v": vc}

    if (draft_vocab is None) != (draft_head is None):
        raise ValueError("eagle_draft: pass draft_vocab and draft_head together")
    vocab_size = target.cfg.vocab_size

    def draft_logits(h: jax.Array) -> jax.Array:
        """The drafter's LM head: the target's (shared), over the draft vocabulary if one is set."""
        if draft_head is None:
            return target.logits(h)
        return linear(h, draft_head, target.cfg.linear_impl, preferred_element_type=jnp.float32)

    def to_token(idx: jax.Array) -> jax.Array:
        return (idx if draft_vocab is None else draft_vocab[idx]).astype(jnp.int32)

    def top_children(h_bth: jax.Array) -> tuple[jax.Array, jax.Array]:
        logp = jax.nn.log_softmax(draft_logits(h_bth), axis=-1)
        vals, idx = jax.lax.top_k(logp, k)
        return vals, to_token(idx)

    def sampled_child(h_bh: jax.Array, depth: int | jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One draft per row drawn from q (key: the row's key folded with the depth): (log q, token, q)."""
        q = target_probs(draft_logits(h_bh), sp)  # [B, V] or [B, Vd]
        keys = jax.vmap(jax.random.fold_in, (0, None))(sample_keys, depth)
        idx = jax.vmap(lambda kk, w: categorical(kk, w[None])[0])(keys, q).astype(jnp.int32)
        lq = jnp.log(q[rows, idx])
        if draft_vocab is not None:  # q over the whole vocabulary: zero outside the draft vocabulary
            q = jnp.zeros((b, vocab_size), jnp.float32).at[:, draft_vocab].set(q)
        return lq, to_token(idx), q

    buf = {
        "x": jnp.zeros((b, nd, cfg.hidden_size), jnp.dtype(cfg.dtype)),  # activations (weights may be bf16)
        "vis": jnp.broadcast_to(jnp.eye(nd, dtype=bool), (b, nd, nd)),
        "k": dcache.k[0],
        "v": dcache.v[0],
    }
    h0, buf = forward(buf, 0, root_token_b[:, None], root_hidden_bh[:, None], jnp.zeros((b, 1), jnp.int32))
    if sampled:
        lq, tok, q = sampled_child(h0[:, 0], 0)
        vals, idx = lq[:, None], tok[:, None]
    else:
        vals, idx = top_children(h0[:, 0])  # [B, k]: the root's children, the depth-1 frontier
    cand = {  # all scored candidates, in depth order (parents before children); parent -1 = the root
        "tok": jnp.zeros((b, num_c), jnp.int32).at[:, :k].set(idx),
        "score": jnp.full((b, num_c), -jnp.inf, jnp.float32).at[:, :k].set(vals),
        "parent": jnp.full((b, num_c), -1, jnp.int32),
    }
    if sampled:  # the draft distribution of each depth, for rejection sampling
        cand["q"] = jnp.zeros((b, d, q.shape[-1]), jnp.float32).at[:, 0].set(q)
    front = {
        "tok": idx,
        "score": vals,
        "feat": jnp.broadcast_to(h0, (b, k, h0.shape[-1])),
        "slot": jnp.zeros((b, k), jnp.int32),  # the drafter slot of each frontier node's parent
        "cand": jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k)),
    }

    def expand(j: jax.Array, carry: tuple) -> tuple:
        """Forward j >= 1: feed the depth-j frontier, score its k*k children, keep the best k."""
        buf, cand, front = carry
        off = 1 + (j - 1) * k
        c_start = k + (j - 1) * k * k
        h, buf = forward(buf, off, front["tok"], front["feat"], front["slot"])  # [B, k, H]
        if sampled:
            lq, t1, q = sampled_child(h[:, 0], j)
            vals, idx = lq[:, None, None], t1[:, None, None]
        else:
            vals, idx = top_children(h)  # [B, k, k]
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
        if sampled:
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

    # one compiled body for every depth: compile time does not grow with the strategy's depth
    buf, cand, _ = jax.lax.fori_loop(1, d, expand, (buf, cand, front))
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
    tree = DraftTree(
        tokens=tokens,
        parents=parents.astype(jnp.int32),
        depth=depth,
        draft_probs=cand["q"][:, : n - 1] if sampled else None,
    )
    return tree, KVCache(k=(buf["k"],), v=(buf["v"],), lengths=dcache.lengths)


# ---------------------------------------------------------------------------------------------------------
# Verification and commit


def record_many(
    state: DecodeState, tok_bk: jax.Array, logp_bk: jax.Array, n_emit_b: jax.Array, eos_ids: jax.Array
) -> DecodeState:
    """Append the first n_emit[b] of K tokens to each row's output; rows that emitted EOS or reached their
    budget are done. (Callers truncate n_emit at the first EOS and at the budget.)"""
    b, n = state.out_tokens.shape
    kk = tok_bk.shape[1]
    i = jnp.arange(kk, dtype=jnp.int32)[None, :]
    emit = i < n_emit_b[:, None]
    idx = jnp.where(emit, state.num_generated[:, None] + i, n)  # n: out of range -> dropped
    rows = jnp.arange(b)[:, None]
    out_tokens = state.out_tokens.at[rows, idx].set(tok_bk, mode="drop")
    out_logp = state.out_logp.at[rows, idx].set(logp_bk, mode="drop")
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


def record_hidden(state: DecodeState, hidden_bkh: jax.Array, n_fed_b: jax.Array) -> DecodeState:
    """Store the target's final hidden states of the tokens a step or round fed (before recording the
    tokens it emits): hidden_bkh[:, j] belongs to response token num_generated - 1 + j (j = 0 is the row's
    last token), for j < n_fed[b]. No-op unless the state records hidden states (`state.out_hidden`)."""
    if state.out_hidden is None:
        return state
    b, n, h = state.out_hidden.shape
    kk = hidden_bkh.shape[1]
    chex.assert_shape(hidden_bkh, (b, kk, h))
    i = jnp.arange(kk, dtype=jnp.int32)[None, :]
    idx = jnp.where(i < n_fed_b[:, None], state.num_generated[:, None] - 1 + i, n)  # n: dropped
    out = state.out_hidden.at[jnp.arange(b)[:, None], idx].set(
        hidden_bkh.astype(state.out_hidden.dtype), mode="drop"
    )
    return state.replace(out_hidden=out)


@flax.struct.dataclass
class RoundStats:
    """Per-round counts summed over rows (device scalars / a histogram)."""

    emitted: jax.Array  # tokens emitted
    rows: jax.Array  # live rows verified
    hist: jax.Array  # [depth + 2] row counts by tokens emitted


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
    accept_rule: AcceptRule | None = None,
    drafter_cache: KVCache | None = None,
) -> tuple[DecodeState, RoundStats]:
    """Verify each row's draft tree with one target forward, accept losslessly, commit, update caches.

    drafter_cache: the drafter cache to extend (the one `eagle_draft` returned; defaults to the state's).
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
    if sp.greedy:
        argmax = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
        acc = tree_accept_greedy(tree.tokens, tree.parents, argmax, max_depth)
    elif tree.draft_probs is not None:  # a sampled chain: rejection sampling against its draft distributions
        probs = target_probs(out.logits, sp)
        acc = jax.vmap(_chain_rejection_row)(row_keys(state), tree.tokens, tree.draft_probs, probs)
    else:
        probs = target_probs(out.logits, sp)
        rule = accept_rule or tree_accept

        def one(key: jax.Array, tok: jax.Array, par: jax.Array, p: jax.Array) -> TreeAcceptance:
            res = rule(key, tok[None], par[None], p[None], max_depth)
            return jax.tree_util.tree_map(lambda x: x[0], res)

        acc = jax.vmap(one)(row_keys(state), tree.tokens, tree.parents, probs)

    path = jnp.clip(acc.path, 0)  # [B, D+1] node of each committed position (root first)
    tok = jnp.clip(acc.tokens, 0)  # [B, D+1] emitted tokens
    if sp.greedy:  # plain decoding records the model's log-softmax at temperature 1
        logp_all = jax.nn.log_softmax(out.logits[rows[:, None], path], axis=-1)
    else:  # ... and log of the sampling distribution otherwise
        logp_all = jnp.log(probs[rows[:, None], path])
    logp = jnp.take_along_axis(logp_all, tok[:, :, None], axis=-1)[:, :, 0]

    # truncate at the first EOS (inclusive) and at the remaining budget
    k_out = tok.shape[1]
    i = jnp.arange(k_out, dtype=jnp.int32)[None, :]
    n_out = acc.num_accepted + 1
    is_eos = jnp.any(tok[:, :, None] == eos_ids[None, None, :], axis=-1) & (i < n_out[:, None])
    first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, k_out)
    budget = state.max_new - state.num_generated
    n_emit = jnp.where(live, jnp.minimum(jnp.minimum(n_out, first_eos), budget), 0).astype(jnp.int32)

    # the fed tokens of the committed path (root = the row's last token, then the accepted drafts)
    state = record_hidden(state, out.hidden[rows[:, None], path], n_emit)
    new_state = record_many(state, tok, logp, n_emit, eos_ids)
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
