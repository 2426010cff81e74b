"""Tests of strategies (rollout/strategy.py), tree masks and verification (rollout/tree_verify.py), EAGLE-2
drafting (rollout/eagle_draft.py) and the paper's threshold switch (rollout/hooks.py).

The drafting tests compare `eagle_draft` (all draft slots in one buffer, tree-masked) with the plainest
possible reference: the real `Drafter` module run one position at a time along each node's ancestor path.
(Verification and cache commits are tested through the engine in test_engine_sd.py.)
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
from tlt_jax.rollout import eagle_draft as spec
from tlt_jax.rollout.hooks import ChunkView, ThresholdPolicy
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.strategy import Strategy
from tlt_jax.rollout.tree_verify import accept_and_sample, decision_nodes, tree_visibility, verify_round
from tlt_jax.rollout.types import ChunkRecord, DecodeState, DraftTree

CFG = tiny_config(num_layers=2, tie_embeddings=False)


# ---- strategies and selectors ----------------------------------------------------------------------------


def test_strategy_parse_format_and_derived_sizes():
    s = Strategy.parse("8_4_48")
    assert (s.draft_depth, s.topk, s.tokens_to_verify) == (8, 4, 48)
    assert s.name == str(s) == "8_4_48" and not s.is_chain
    assert s.max_depth == 8 and s.tokens_per_round == 9
    assert s.num_candidates == 4 + 7 * 16 and s.draft_slots == 1 + 7 * 4
    assert s.lookahead == 48
    chain = Strategy.parse("4_1_4")  # 3 drafts fit in 4 verify tokens (the root counts)
    assert chain.is_chain and chain.max_depth == 3 and chain.tokens_per_round == 4
    assert Strategy.parse(chain) is chain
    for bad in ("8_4", "a_b_c", "0_1_4", "3_1_1", "2_1_8"):  # 2_1_8: a depth-2 chain has 2 nodes, not 7
        with pytest.raises(ValueError):
            Strategy.parse(bad)


def test_threshold_policy_counts_consecutive_steps_below():
    def view(running: list[int]) -> ChunkView:
        rec = ChunkRecord("plain", 8, 64, len(running), running[0], 0.1, running=tuple(running))
        return ChunkView(rec, (sum(running),), 0)

    sel = ThresholdPolicy("3_1_4", threshold=4, min_steps_below=3)
    assert sel.choose_mode(8, 8) == "plain"
    sel.on_chunk(view([8, 6, 4, 3]))  # two steps at or below 4
    assert sel.choose_mode(3, 4) == "plain"
    sel.on_chunk(view([3, 5, 4]))  # the 5 resets the count: one step below
    assert sel.choose_mode(4, 4) == "plain"
    sel.on_chunk(view([4, 4]))
    assert sel.choose_mode(4, 4) == "3_1_4"
    assert sel.choose_mode(9, 16) == "3_1_4"  # stays on for the rest of the rollout


def test_tree_visibility_is_ancestors_or_self():
    #   0 -> 1 -> 3 ; 0 -> 2 ; 4 is padding
    parents = jnp.asarray([[-1, 0, 0, 1, -2]], jnp.int32)
    vis = np.asarray(tree_visibility(parents, max_depth=2))[0]
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
    tree, after = _draft(tg, dg, Strategy.parse(strategy), tp, dp, dcache, root_tok, root_hidden)
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


# ---- verification: EOS and budget truncation inside an accepted path ---------------------------------------


@functools.partial(jax.jit, static_argnums=(0,))
def _verify(tgraph, tparams, state, tree, eos_ids):
    target = nnx.merge(tgraph, tparams)
    return verify_round(
        target, None, state, tree, SamplingParams(0.0), eos_ids, max_depth=3, attn_impl="reference"
    )


def test_verify_truncates_accepted_path_at_eos_and_budget(models):
    """A chain of drafts that greedy verification accepts in full (it is the target's own greedy text):
    the emitted tokens stop at an EOS inside the path, and at the row's token budget."""
    target, _ = models
    tg, tp = nnx.split(target)
    prompt = [5, 17, 42, 9]
    seq = list(prompt)
    for _ in range(5):  # greedy continuation g0..g4
        logits = _full_logits(tg, tp, jnp.asarray([seq + [0] * (16 - len(seq))]))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    g = seq[len(prompt) :]
    cache = KVCache.init(CFG, 1, 32)
    pos = jnp.arange(len(prompt))[None]
    cache = target(jnp.asarray([prompt]), pos, cache).cache.advance(len(prompt))

    def state(max_new: int) -> DecodeState:
        out = jnp.zeros((1, 8), jnp.int32).at[0, 0].set(g[0])
        return DecodeState(
            cache=cache,
            last_token=jnp.asarray([g[0]], jnp.int32),
            out_tokens=out,
            out_logp=jnp.zeros((1, 8), jnp.float32),
            num_generated=jnp.asarray([1], jnp.int32),
            done=jnp.asarray([False]),
            seq_keys=jnp.zeros((1, 2), jnp.uint32),
            max_new=jnp.asarray([max_new], jnp.int32),
        )

    tree = DraftTree(
        tokens=jnp.asarray([g[:4]], jnp.int32),
        parents=jnp.asarray([[-1, 0, 1, 2]], jnp.int32),
        depth=jnp.asarray([[0, 1, 2, 3]], jnp.int32),
    )
    no_eos = jnp.asarray([-1], jnp.int32)
    cases = [  # (max_new, eos, emitted tokens, done)
        (8, no_eos, g[1:5], False),  # all 3 drafts + the bonus
        (8, jnp.asarray([g[2]], jnp.int32), g[1:3], True),  # EOS is the 2nd emitted token
        (3, no_eos, g[1:3], True),  # 2 tokens left in the budget
    ]
    for max_new, eos, want, done in cases:
        st, stats = _verify(tg, tp, state(max_new), tree, eos)
        n = int(st.num_generated[0])
        assert np.asarray(st.out_tokens)[0, 1:n].tolist() == want
        assert bool(st.done[0]) == done and int(st.last_token[0]) == want[-1]
        assert int(st.cache.lengths[0]) == len(prompt) + len(want)
        assert int(stats.emitted) == len(want) and int(stats.rows) == 1


@functools.partial(jax.jit, static_argnums=(0,))
def _full_logits(tgraph, tparams, tokens_bt):
    target = nnx.merge(tgraph, tparams)
    return target(tokens_bt, jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)).logits


# ---- acceptance from the logits of the nodes with children only -----------------------------------------


def _random_trees(rng: np.random.Generator, b: int, n: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """[b, n] random topologically ordered trees of depth <= `depth` with ~15% padding: (parents, depth)."""
    parents, d = np.full((b, n), -2), np.full((b, n), 0)
    parents[:, 0] = -1
    rows = np.arange(b)
    for i in range(1, n):
        par = rng.integers(0, i, b)
        par = np.where((parents[rows, par] == -2) | (d[rows, par] >= depth), 0, par)
        real = rng.random(b) >= 0.15
        parents[:, i] = np.where(real, par, -2)
        d[:, i] = np.where(real, d[rows, par] + 1, 0)
    return parents, d


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _accept_nodes(tgraph, sp, m, tparams, state, tree, hidden):
    target = nnx.merge(tgraph, tparams)
    nodes = None if m is None else decision_nodes(tree.parents, m)
    h = hidden if m is None else jnp.take_along_axis(hidden, nodes[..., None], axis=1)
    kw = {"max_depth": 3, "nodes_bm": nodes}
    return accept_and_sample(target, state, tree, target.logits(h), hidden, sp, jnp.asarray([-1]), **kw)


def test_acceptance_from_the_nodes_with_children_equals_every_node(models):
    """Coupled acceptance from the logits of the nodes with children, plus a draw at the stop node, emits
    what acceptance from every node's logits emits (512 random trees, most drafts the target's likeliest
    token, walks ending at leaves and at inner nodes; greedy: test_engine_sd's 2_4_12). With fewer nodes
    than have children it stays exact (it emits a prefix of the same tokens), and only accepts less."""
    target, _ = models
    tg, tp = nnx.split(target)
    b, n, rng = 512, 12, np.random.default_rng(7)
    parents, depth = _random_trees(rng, b, n, 3)
    hidden = jnp.asarray(4.0 * rng.normal(size=(b, n, CFG.hidden_size)), jnp.float32)  # peaked p
    best = np.asarray(jnp.argmax(target.logits(hidden), axis=-1))
    rows = np.arange(b)[:, None]
    tokens = np.where(
        rng.random((b, n)) < 0.8, best[rows, np.maximum(parents, 0)], rng.integers(0, 9, (b, n))
    )
    tree = DraftTree(*(jnp.asarray(x, jnp.int32) for x in (tokens, parents, depth)))
    state = DecodeState(
        cache=KVCache(k=(), v=(), lengths=jnp.zeros((b,), jnp.int32)),
        last_token=jnp.zeros((b,), jnp.int32),
        out_tokens=jnp.zeros((b, 8), jnp.int32),
        out_logp=jnp.zeros((b, 8), jnp.float32),
        num_generated=jnp.asarray(rng.integers(1, 4, b), jnp.int32),
        done=jnp.zeros((b,), bool),
        seq_keys=jnp.asarray(rng.integers(0, 2**31, (b, 2)), jnp.uint32),
        max_new=jnp.full((b,), 8, jnp.int32),
    )
    has_child = (parents[:, None, :] == np.arange(n)[None, :, None]).any(-1)
    sp = SamplingParams(0.9)
    full, nodes, few = (
        jax.tree_util.tree_map(np.asarray, _accept_nodes(tg, sp, m, tp, state, tree, hidden))
        for m in (None, int(has_child.sum(1).max()), 2)
    )
    np.testing.assert_array_equal(nodes.n_emit, full.n_emit)
    stop = full.path[np.arange(b), full.n_emit - 1]
    assert full.n_emit.mean() > 2.0 and 0.1 < has_child[np.arange(b), stop].mean() < 0.9  # both stop kinds
    assert (few.n_emit <= full.n_emit).all() and (few.n_emit < full.n_emit).mean() > 0.1
    for out in (nodes, few):
        emitted = np.arange(4)[None, :] < out.n_emit[:, None]
        np.testing.assert_array_equal(np.where(emitted, out.tokens, -1), np.where(emitted, full.tokens, -1))
        np.testing.assert_array_equal(np.where(emitted, out.path, -1), np.where(emitted, full.path, -1))
        np.testing.assert_allclose(np.where(emitted, out.logp, 0), np.where(emitted, full.logp, 0), atol=1e-5)
