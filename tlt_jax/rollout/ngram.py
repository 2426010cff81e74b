"""Model-free n-gram drafter (the paper's fallback before the learned drafter is good, and "TLT-Base").

Drafts are copied from text the row has already seen: match the last n tokens (n from `max_ngram` down to
`min_ngram`; the longest match wins) in
  * the row's own prompt,
  * the row's own response so far (reasoning traces repeat themselves), and
  * the responses of its siblings: the other samples of the same prompt (GRPO draws n per prompt, and
    they share much of their text), kept in a device-side `bank` that outlives compaction,
and propose what followed the match. topk = 1 proposes one continuation (a chain); topk > 1 proposes the
continuations of the best matches with distinct first tokens, one branch each (a tree).

Everything is jit-able with static shapes: sources are [B, S, L] arrays (S = 2 + siblings, L = the longest
source) and the search is elementwise compares. The drafts carry no draft probabilities; the verifier uses
target-only tree acceptance, which is exact for any drafted tokens.

Tree layout (as `acceptance.py`): node 0 is the root (the last committed token); branch `b`'s token at
depth t+1 is node 1 + t * topk + b (breadth-first, so the nodes kept under a `tokens_to_verify` budget are the
shallow ones); a node with no continuation is padding (parent -2), and so is everything below it.
"""

from __future__ import annotations

import dataclasses

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.rollout.types import DecodeState, DraftTree

PAD_SRC = -2  # source positions with no token (never equal to a query token)
PAD_QUERY = -1  # query positions with no token (never equal to a source token)


def build_sources(
    prompt_bt: jax.Array,
    prompt_len_b: jax.Array,
    out_tokens_bn: jax.Array,
    num_generated_b: jax.Array,
    seq_id_b: jax.Array,
    bank_rn: jax.Array,
    bank_len_r: jax.Array,
    group_size: int,
    max_ngram: int,
    max_siblings: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Assemble each row's search sources and its query.

    Sources per row (S = 2 + min(group_size - 1, max_siblings)): [0] the prompt, [1..] sibling responses
    (sequence ids g*n + (j+1+i) mod n, from the bank), [S-1] the row's own response. Responses are prefixed
    with the prompt's last `max_ngram` tokens, so a match may straddle the prompt/response boundary.

    Returns (src [B, S, L] int32, src_len [B, S] int32, priority [S] int32, query [B, max_ngram] int32),
    where the query is the last max_ngram tokens of prompt + response (PAD_QUERY where there are none).
    """
    chex.assert_rank([prompt_bt, out_tokens_bn, bank_rn], 2)
    b, tp = prompt_bt.shape
    n = out_tokens_bn.shape[1]
    m = max_ngram
    # prompt tail [B, M]: prompt[len - M + i], PAD_SRC before the prompt starts
    tail_idx = prompt_len_b[:, None] - m + jnp.arange(m, dtype=jnp.int32)[None, :]
    tail = jnp.take_along_axis(prompt_bt, jnp.clip(tail_idx, 0, tp - 1), axis=1)
    tail = jnp.where(tail_idx >= 0, tail, PAD_SRC)
    own = jnp.concatenate([tail, out_tokens_bn], axis=1)  # [B, M + N]
    own_len = m + num_generated_b

    n_sib = min(group_size - 1, max_siblings)
    live_row = seq_id_b >= 0
    g, j = seq_id_b // group_size, seq_id_b % group_size
    sib_ids = (
        g[:, None] * group_size + (j[:, None] + 1 + jnp.arange(n_sib)[None, :]) % group_size
    )  # [B, n_sib]
    sib_ids = jnp.where(live_row[:, None], sib_ids, 0)
    sib = jnp.concatenate(
        [jnp.broadcast_to(tail[:, None, :], (b, n_sib, m)), bank_rn[sib_ids]], axis=2
    )  # [B, n_sib, M + N]
    sib_len = jnp.where(live_row[:, None], m + bank_len_r[sib_ids], 0)

    width = max(tp, m + n)

    def pad_to(x: jax.Array) -> jax.Array:
        extra = width - x.shape[-1]
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)], constant_values=PAD_SRC)

    src = jnp.concatenate([pad_to(prompt_bt)[:, None], pad_to(sib), pad_to(own)[:, None]], axis=1)
    src_len = jnp.concatenate([prompt_len_b[:, None], sib_len, own_len[:, None]], axis=1).astype(jnp.int32)
    # inside each source, positions past its length hold stale tokens: blank them so nothing matches there
    pos = jnp.arange(width, dtype=jnp.int32)[None, None, :]
    src = jnp.where(pos < src_len[:, :, None], src, PAD_SRC).astype(jnp.int32)
    priority = jnp.asarray([0] + [1] * n_sib + [2], jnp.int32)

    q_idx = own_len[:, None] - m + jnp.arange(m, dtype=jnp.int32)[None, :]
    query = jnp.take_along_axis(own, q_idx, axis=1)
    query = jnp.where(query == PAD_SRC, PAD_QUERY, query).astype(jnp.int32)
    return src, src_len, priority, query


def match_lengths(src_bsl: jax.Array, query_bm: jax.Array) -> jax.Array:
    """[B, S, L] int32: how many trailing query tokens match the source ending at each position (<= M)."""
    m = query_bm.shape[1]
    width = src_bsl.shape[2]
    padded = jnp.pad(src_bsl, ((0, 0), (0, 0), (m, 0)), constant_values=PAD_SRC)
    run = jnp.ones(src_bsl.shape, bool)
    total = jnp.zeros(src_bsl.shape, jnp.int32)
    for i in range(m):  # compare src[j - i] with query[M - 1 - i]
        shifted = padded[:, :, m - i : m - i + width]
        run = run & (shifted == query_bm[:, None, None, m - 1 - i])
        total = total + run.astype(jnp.int32)
    return total


def propose(
    src_bsl: jax.Array,
    src_len_bs: jax.Array,
    priority_s: jax.Array,
    query_bm: jax.Array,
    root_token_b: jax.Array,
    *,
    depth: int,
    topk: int,
    num_nodes: int,
    min_ngram: int = 1,
) -> DraftTree:
    """Draft a tree of `num_nodes` nodes (root included) from the best n-gram matches.

    A match at position j of source s is usable when at least `min_ngram` trailing query tokens match there
    and the source continues after j. Matches are ranked by match length, then how many of the `depth`
    continuation tokens exist, then source (own response > siblings > prompt), then recency (later j).
    Branch b is the continuation of the best match whose first token differs from branches 0..b-1
    (distinct first tokens, so the tree's root children are distinct).
    """
    chex.assert_rank([src_bsl, src_len_bs, query_bm], [3, 2, 2])
    b, s, width = src_bsl.shape
    ell = match_lengths(src_bsl, query_bm)
    j = jnp.arange(width, dtype=jnp.int32)[None, None, :]
    cont = jnp.minimum(src_len_bs[:, :, None] - j - 1, depth)  # continuation tokens available after j
    usable = (ell >= min_ngram) & (cont >= 1)
    # lexicographic rank: match length, continuation length, source priority, recency (int32: fine for
    # sources up to ~1M tokens with ngram/depth <= 16)
    score = ((ell * (depth + 1) + cont) * 3 + priority_s[None, :, None]) * width + j
    score = jnp.where(usable, score, -1).reshape(b, s * width)
    nxt = jnp.concatenate([src_bsl[:, :, 1:], jnp.full((b, s, 1), PAD_SRC, jnp.int32)], axis=2)
    first_tok = nxt.reshape(b, s * width)
    rows = jnp.arange(b)

    t = jnp.arange(depth, dtype=jnp.int32)
    branch_tok, branch_ok = [], []
    for _ in range(topk):
        best = jnp.argmax(score, axis=1)
        found = score[rows, best] >= 0
        bs, bj = best // width, best % width
        idx = bj[:, None] + 1 + t[None, :]  # [B, depth]
        ok = found[:, None] & (idx < src_len_bs[rows, bs][:, None])
        tok = src_bsl[rows[:, None], bs[:, None], jnp.clip(idx, 0, width - 1)]
        branch_tok.append(jnp.where(ok, tok, 0))
        branch_ok.append(ok)
        taken = first_tok[rows, best]
        score = jnp.where(found[:, None] & (first_tok == taken[:, None]), -1, score)
    cont_tok = jnp.stack(branch_tok, axis=1)  # [B, topk, depth]
    cont_ok = jnp.stack(branch_ok, axis=1)

    # static breadth-first layout: node i >= 1 is (depth t, branch br) with i = 1 + t * topk + br
    nodes = np.arange(1, num_nodes)
    t_of, br_of = (nodes - 1) // topk, (nodes - 1) % topk
    if len(nodes) and t_of.max() >= depth:
        raise ValueError(
            f"num_nodes={num_nodes} exceeds the {1 + topk * depth} nodes of depth {depth}, topk {topk}"
        )
    par_static = np.where(t_of == 0, 0, 1 + (t_of - 1) * topk + br_of).astype(np.int32)
    tok = cont_tok[:, br_of, t_of]  # [B, N - 1]
    ok = cont_ok[:, br_of, t_of]
    parents = jnp.where(ok, jnp.asarray(par_static)[None, :], -2)
    tokens = jnp.concatenate([root_token_b[:, None], jnp.where(ok, tok, 0)], axis=1).astype(jnp.int32)
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parents], axis=1).astype(jnp.int32)
    depth_bn = jnp.concatenate(
        [jnp.zeros((b, 1), jnp.int32), jnp.where(ok, jnp.asarray(t_of + 1, jnp.int32)[None, :], 0)], axis=1
    )
    return DraftTree(tokens=tokens, parents=parents, depth=depth_bn)


def update_bank(
    bank_rn: jax.Array,
    bank_len_r: jax.Array,
    out_tokens_bn: jax.Array,
    num_generated_b: jax.Array,
    seq_id_b: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Copy each row's response so far into the bank at its sequence id (padding rows, id -1, are dropped)."""
    r = bank_rn.shape[0]
    ids = jnp.where(seq_id_b >= 0, seq_id_b, r)  # out of range -> dropped
    bank = bank_rn.at[ids].set(out_tokens_bn, mode="drop")
    bank_len = bank_len_r.at[ids].set(num_generated_b, mode="drop")
    return bank, bank_len


@dataclasses.dataclass(frozen=True)
class NgramParams:
    """The n-gram drafter's static settings (`SpecConfig.ngram_*`)."""

    max_ngram: int = 4
    min_ngram: int = 1
    siblings: int = 16


@flax.struct.dataclass
class NgramBank:
    """Every sequence's response so far, by sequence id (prompt index * n + sample index): the n-gram
    drafter's sibling corpus. It lives outside the decode state, so rows dropped by compaction stay in it."""

    tokens: jax.Array  # [R, N]
    lengths: jax.Array  # [R]
    group_size: int = flax.struct.field(pytree_node=False)

    @classmethod
    def empty(cls, num_sequences: int, group_size: int, max_new_tokens: int) -> NgramBank:
        """An empty bank for a rollout of num_sequences = prompts * group_size sequences."""
        return cls(
            tokens=jnp.zeros((num_sequences, max_new_tokens), jnp.int32),
            lengths=jnp.zeros((num_sequences,), jnp.int32),
            group_size=group_size,
        )

    def update(self, state: DecodeState) -> NgramBank:
        """Copy the state's responses into the bank (before compaction drops finished rows)."""
        tokens, lengths = update_bank(
            self.tokens, self.lengths, state.out_tokens, state.num_generated, state.aux.seq_id
        )
        return self.replace(tokens=tokens, lengths=lengths)


def draft_ngram(
    state: DecodeState, bank: NgramBank, depth: int, topk: int, num_nodes: int, params: NgramParams
) -> DraftTree:
    """An n-gram draft tree for every row of `state` from its prompt, its response and its siblings'."""
    aux = state.aux
    src, src_len, prio, query = build_sources(
        aux.prompt,
        aux.prompt_len,
        state.out_tokens,
        state.num_generated,
        aux.seq_id,
        bank.tokens,
        bank.lengths,
        bank.group_size,
        params.max_ngram,
        params.siblings,
    )
    return propose(
        src,
        src_len,
        prio,
        query,
        state.last_token,
        depth=depth,
        topk=topk,
        num_nodes=num_nodes,
        min_ngram=params.min_ngram,
    )
