"""Tests of tlt_jax/rollout/speculative.py: strategies, tree masks, EAGLE-2 drafting, cache commits.

The drafting tests compare `eagle_draft` (all draft slots in one buffer, tree-masked) with the plainest
possible reference: the real `Drafter` module run one position at a time along each node's ancestor path.
The cache test runs real speculative rounds through the engine and compares the target and drafter KV
caches with a fresh forward pass over the committed tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout import speculative as spec
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.sampling import SamplingParams

CFG = tiny_config(num_layers=2, tie_embeddings=False)


# ---- strategies and selectors ----------------------------------------------------------------------------


def test_strategy_parse_format_and_derived_sizes():
    s = spec.Strategy.parse("8_4_48")
    assert (s.draft_depth, s.topk, s.tokens_to_verify) == (8, 4, 48)
    assert s.name == str(s) == "8_4_48" and not s.is_chain
    assert s.max_depth == 8 and s.tokens_per_round == 9
    assert s.num_candidates == 4 + 7 * 16 and s.draft_slots == 1 + 7 * 4
    assert s.lookahead == 48
    chain = spec.Strategy.parse("4_1_4")  # 3 drafts fit in 4 verify tokens (the root counts)
    assert chain.is_chain and chain.max_depth == 3 and chain.tokens_per_round == 4
    assert spec.Strategy.parse(chain) is chain
    for bad in ("8_4", "a_b_c", "0_1_4", "3_1_1", "2_1_8"):  # 2_1_8: a depth-2 chain has 2 nodes, not 7
        with pytest.raises(ValueError):
            spec.Strategy.parse(bad)


def test_threshold_selector_counts_consecutive_steps_below():
    from tlt_jax.rollout.types import ChunkRecord

    rec = ChunkRecord("plain", 8, 64, 4, 8, 0.1)
    sel = spec.ThresholdSelector("3_1_4", threshold=4, min_steps_below=3)
    assert sel.select(8, 8) == "plain"
    sel.observe(rec, [8, 6, 4, 3])  # two steps at or below 4
    assert sel.select(3, 4) == "plain"
    sel.observe(rec, [3, 5, 4])  # the 5 resets the count: one step below
    assert sel.select(4, 4) == "plain"
    sel.observe(rec, [4, 4])
    assert sel.select(4, 4) == "3_1_4"
    assert sel.select(9, 16) == "3_1_4"  # stays on for the rest of the rollout


def test_tree_visibility_is_ancestors_or_self():
    #   0 -> 1 -> 3 ; 0 -> 2 ; 4 is padding
    parents = jnp.asarray([[-1, 0, 0, 1, -2]], jnp.int32)
    vis = np.asarray(spec.tree_visibility(parents, max_depth=2))[0]
    want = np.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [1, 1, 0, 1, 0],
            [0, 0, 0, 0, 1],
        ],
        bool,
    )
    np.testing.assert_array_equal(vis, want)


# ---- EAGLE-2 drafting against a one-position-at-a-time reference -----------------------------------------


@pytest.fixture(scope="module")
def models():
    target = Transformer(CFG, nnx.Rngs(0))
    target.lm_head[...] = target.lm_head[...] * 10.0  # peaked next-token distributions: drafts get accepted
    drafter = Drafter(CFG, nnx.Rngs(1))
    # a confident drafter (no top-k ties) whose attention matters: a wrong draft-time mask changes its output
    drafter.fc[...] = drafter.fc[...] * 8.0
    drafter.layer.attn.qkv[...] = drafter.layer.attn.qkv[...] * 10.0
    drafter.layer.attn.o_proj[...] = drafter.layer.attn.o_proj[...] * 30.0
    return target, drafter


def _prefix_drafter_cache(target, drafter, b: int, lens: list[int], seed: int = 0):
    """A drafter cache holding `lens[b] - 1` committed pairs of random text, plus the pending pair."""
    rng = np.random.default_rng(seed)
    t = max(lens)
    toks = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, t)), jnp.int32)
    lens_a = jnp.asarray(lens, jnp.int32)
    out = target(toks, jnp.broadcast_to(jnp.arange(t), (b, t)))
    dcache = spec.drafter_prefill(
        drafter, target, drafter.init_cache(b, 32), toks, out.hidden, lens_a, "reference"
    )
    root_tok = toks[jnp.arange(b), lens_a - 1]  # stands in for x_L (any token works for this test)
    root_hidden = out.hidden[jnp.arange(b), lens_a - 1]
    return dcache, root_tok, root_hidden


@functools.partial(jax.jit, static_argnums=(0, 1))
def _ref_step(tgraph, dgraph, tparams, dparams, dcache, tok_b, feat_bh):
    """One drafter position (the real Drafter call): returns (h_draft, log-probs, cache advanced by 1)."""
    target, drafter = nnx.merge(tgraph, tparams), nnx.merge(dgraph, dparams)
    pos = dcache.lengths[:, None] + 1
    h, dcache = drafter(target.embed_tokens(tok_b[:, None]), feat_bh[:, None], pos, dcache)
    return h[:, 0], jax.nn.log_softmax(target.logits(h[:, 0]), axis=-1), dcache.advance(1)


def _path_logps(models, dcache, root_tok, root_hidden, path_tokens: list[int], row: int):
    """Draft log-prob vectors along a path (root first), one drafter position at a time."""
    target, drafter = models
    tg, tp = nnx.split(target)
    dg, dp = nnx.split(drafter)
    one = jax.tree_util.tree_map(lambda x: x[row : row + 1], dcache)
    h, logp, one = _ref_step(tg, dg, tp, dp, one, root_tok[row : row + 1], root_hidden[row : row + 1])
    out = [np.asarray(logp[0])]
    for tok in path_tokens:
        h, logp, one = _ref_step(tg, dg, tp, dp, one, jnp.asarray([tok], jnp.int32), h)
        out.append(np.asarray(logp[0]))
    return out


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _draft(tgraph, dgraph, strategy, tparams, dparams, dcache, root_tok, root_hidden):
    target, drafter = nnx.merge(tgraph, tparams), nnx.merge(dgraph, dparams)
    return spec.eagle_draft(target, drafter, dcache, root_tok, root_hidden, strategy, "reference")


def _run_draft(models, strategy: str, dcache, root_tok, root_hidden):
    target, drafter = models
    tg, tp = nnx.split(target)
    dg, dp = nnx.split(drafter)
    tree, after = _draft(tg, dg, spec.Strategy.parse(strategy), tp, dp, dcache, root_tok, root_hidden)
    return jax.tree_util.tree_map(np.asarray, tree), after


def test_eagle_chain_equals_sequential_greedy_drafting(models):
    lens = [5, 9]  # rows at different committed lengths
    dcache, root_tok, root_hidden = _prefix_drafter_cache(*models, b=2, lens=lens)
    tree, after = _run_draft(models, "3_1_4", dcache, root_tok, root_hidden)
    np.testing.assert_array_equal(np.asarray(after.lengths), np.asarray(dcache.lengths))  # nothing committed
    for row in range(2):
        np.testing.assert_array_equal(tree.parents[row], [-1, 0, 1, 2])
        np.testing.assert_array_equal(tree.depth[row], [0, 1, 2, 3])
        path: list[int] = []
        for _ in range(3):  # greedy chain: argmax of the draft distribution along the chain so far
            logps = _path_logps(models, dcache, root_tok, root_hidden, path, row)
            path.append(int(np.argmax(logps[-1])))
        assert tree.tokens[row, 1:].tolist() == path
        assert tree.tokens[row, 0] == int(root_tok[row])


def test_eagle_tree_nodes_are_topk_children_along_their_own_path(models):
    """Each kept node is one of the top-k draft tokens at its parent, where the parent's distribution is
    computed by the reference along the node's ancestors only (so the tree mask isolated the branches)."""
    dcache, root_tok, root_hidden = _prefix_drafter_cache(*models, b=2, lens=[4, 7], seed=1)
    k = 3
    tree, _ = _run_draft(models, f"3_{k}_7", dcache, root_tok, root_hidden)
    for row in range(2):
        par, tok, dep = tree.parents[row], tree.tokens[row], tree.depth[row]
        assert par[0] == -1 and (par[1:] >= 0).all(), "a confident drafter leaves no padding"
        scores = {0: 0.0}
        for i in range(1, len(par)):
            assert par[i] < i and dep[i] == dep[par[i]] + 1
            path, j = [], par[i]
            while j > 0:
                path.append(int(tok[j]))
                j = par[j]
            logps = _path_logps(models, dcache, root_tok, root_hidden, path[::-1], row)
            top = np.argsort(-logps[-1])[:k]
            assert tok[i] in top, (row, i)
            scores[i] = scores[par[i]] + float(logps[-1][tok[i]])
        # siblings are distinct tokens; a parent never scores below its child
        for i in range(1, len(par)):
            sib = [tok[j] for j in range(1, len(par)) if par[j] == par[i] and j != i]
            assert tok[i] not in sib
            assert scores[par[i]] >= scores[i] - 1e-6
        # the root's best child (by draft prob) is always kept, and its score is the best of all nodes
        best_child = int(np.argmax(_path_logps(models, dcache, root_tok, root_hidden, [], row)[0]))
        kids = [i for i in range(1, len(par)) if par[i] == 0]
        assert best_child in [int(tok[i]) for i in kids]


# ---- caches after speculative rounds ----------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 1))
def _reference_caches(tgraph, dgraph, tparams, dparams, tokens_bt):
    """Fresh target and drafter passes over whole sequences (every position valid)."""
    target, drafter = nnx.merge(tgraph, tparams), nnx.merge(dgraph, dparams)
    b, t = tokens_bt.shape
    out = target(tokens_bt, jnp.broadcast_to(jnp.arange(t), (b, t)), KVCache.init(CFG, b, t))
    dcache = spec.drafter_prefill(
        drafter, target, drafter.init_cache(b, t), tokens_bt, out.hidden, jnp.full((b,), t), "reference"
    )
    return out.cache, dcache, out.hidden


def _check_caches(models, state, prompts: list[list[int]], n: int) -> None:
    """Every row's caches and carried hidden state vs one fresh pass over its committed tokens."""
    target, drafter = models
    tg, tp = nnx.split(target)
    dg, dp = nnx.split(drafter)
    num = np.asarray(state.num_generated)
    out = np.asarray(state.out_tokens)
    rows = len(prompts) * n
    assert not np.asarray(state.done)[:rows].any()
    seqs = [list(prompts[r // n]) + out[r, : num[r] - 1].tolist() for r in range(rows)]  # newest not cached
    width = state.cache.capacity
    padded = np.zeros((rows, width), np.int32)
    for r, seq in enumerate(seqs):
        padded[r, : len(seq)] = seq
    # causal passes: positions past a row's length do not touch the ones before it
    tcache, dcache, hidden = _reference_caches(tg, dg, tp, dp, jnp.asarray(padded))
    np.testing.assert_array_equal(np.asarray(state.cache.lengths)[:rows], [len(s) for s in seqs])
    np.testing.assert_array_equal(
        np.asarray(state.aux.drafter_cache.lengths)[:rows], [len(s) - 1 for s in seqs]
    )
    dc = state.aux.drafter_cache
    for r, seq in enumerate(seqs):
        ln = len(seq)
        for layer in range(CFG.num_layers):
            for got, want in ((state.cache.k, tcache.k), (state.cache.v, tcache.v)):  # [B, Hkv, S, D]
                np.testing.assert_allclose(got[layer][r, :, :ln], want[layer][r, :, :ln], atol=1e-5)
        for got, want in ((dc.k[0], dcache.k[0]), (dc.v[0], dcache.v[0])):
            np.testing.assert_allclose(got[r, :, : ln - 1], want[r, :, : ln - 1], atol=1e-5)
        np.testing.assert_allclose(state.aux.hidden[r], hidden[r, ln - 1], atol=1e-5)


def test_caches_after_speculative_rounds_equal_a_fresh_pass(models):
    """Plain steps (drafter kept in step), EAGLE tree rounds and n-gram rounds at temperature 0.3: afterwards
    the target cache equals a fresh target pass over the committed tokens, the drafter cache a fresh drafter
    pass over the same pairs, and the carried hidden state the target's last committed hidden state."""
    target, _ = models
    # a drafter that mostly copies the next token's embedding: the tiny target is nearly a bigram model, so
    # its drafts are often accepted and the commits move real tree paths
    h = CFG.hidden_size
    drafter = Drafter(CFG, nnx.Rngs(2))
    drafter.fc[...] = drafter.fc[...] + jnp.concatenate([4.0 * jnp.eye(h), jnp.zeros((h, h))], axis=1)
    cfg = EngineConfig(
        max_new_tokens=64, max_cache_len=128, chunk_steps=3, min_cache_bucket=128, compact=False
    )
    engine = RolloutEngine(target, cfg, eos_ids=[], drafter=drafter)
    tree_mode = engine.add_mode("eagle", "3_2_5")
    ngram_mode = engine.add_mode("ngram", "3_1_4")
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9]]
    sp = SamplingParams(temperature=0.3, top_k=20, top_p=0.95)
    state = engine.prefill(prompts, n=2, key=jax.random.key(3), sampling=sp, max_new_tokens=64)
    _check_caches((target, drafter), state, prompts, n=2)  # after prefill
    bank = engine.new_bank(4, 2, 64)
    accepted_drafts = {}
    for mode in ("plain", tree_mode, ngram_mode, tree_mode):
        state, _, extra, bank = engine.decode_chunk(state, mode, sp, 64, bank)
        if mode != "plain":
            accepted_drafts[mode] = (
                accepted_drafts.get(mode, 0) + extra["accepted_tokens"] - extra["verify_rounds"]
            )
        _check_caches((target, drafter), state, prompts, n=2)
    # the commits moved accepted tree nodes (not just the root) into place
    assert all(v > 0 for v in accepted_drafts.values()), accepted_drafts
