"""Statistical and exact tests of the lossless acceptance rules (tlt_jax/rollout/acceptance.py).

The claim under test: with speculative verification, every emitted token is distributed exactly as the
target's sampling distribution p (from `sampling.target_probs`) given the prefix emitted before it, whatever
the drafter proposes; and greedy verification reproduces greedy decoding.

Statistical protocol (used by every distribution test below): 50,000 independent rows in ONE batched call,
counts of the emitted token compared with the exact p by Pearson's chi-square (scipy.stats.chisquare).
Categories with expected count < 5 are pooled; categories with p = 0 are excluded from the test and asserted
to have count 0. Exactness passes at p-value > 1e-3; lossy variants of the rules run through the same test
must give p-value < 1e-6, so the test demonstrably has power. All keys/seeds are fixed, so results are
deterministic.

Speed: every rule is compiled once for one shape (B=50,000, N=19, V=8, depth 3; the chain tree is padded to
N=19), through module-level jitted wrappers that also count traces for the no-retrace test.
"""

from __future__ import annotations

import collections
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from tlt_jax.rollout.acceptance import (
    ChainAcceptance,
    TreeAcceptance,
    chain_accept_rejection,
    tree_accept,
    tree_accept_greedy,
)
from tlt_jax.rollout.sampling import SamplingParams, target_probs

NUM_SAMPLES = 50_000
PASS_P = 1e-3  # exact rules must give p-value above this
POWER_P = 1e-6  # lossy variants must give p-value below this
MIN_CONDITIONAL = 2_000  # rows needed before a conditional distribution is tested
V = 8
DEPTH = 3
PARAMS = SamplingParams(temperature=0.9, top_k=6, top_p=0.9)  # leaves zero-mass tokens

TRACES: collections.Counter[str] = collections.Counter()


def _counted_jit(name: str, fn, **static):
    """jax.jit of `fn` with `static` bound; counts how often JAX traces it (a retrace = a recompile)."""

    def wrapped(*args):
        TRACES[name] += 1
        return fn(*args, **static)

    return jax.jit(wrapped)


_tree_accept = _counted_jit("tree", tree_accept, max_depth=DEPTH)
_tree_accept_greedy = _counted_jit("greedy", tree_accept_greedy, max_depth=DEPTH)
_chain_accept = _counted_jit("chain", chain_accept_rejection)
_target_probs = jax.jit(target_probs, static_argnums=1)

# Tree shapes: parent of each node (-1 root, -2 padding), depth 3, N = 19 (the chain is padded to it).
CHAIN = [-1, 0, 1, 2] + [-2] * 15
# Root has 3 children, depth-1 nodes have 3/2/1 children, some depth-2 nodes have children; padding in the
# middle and at the end (strategies may pad).
WIDE = [-1, 0, 0, 0, 1, 1, 1, 2, 2, 3, -2, 4, 4, 5, 7, 7, 9, -2, -2]
N = len(WIDE)


def chisq_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of counts vs probs; pools expected < 5, skips p = 0 (asserted count 0)."""
    counts = np.asarray(counts, np.float64)
    probs = np.asarray(probs, np.float64)
    zero = probs <= 0.0
    assert counts[zero].sum() == 0, f"tokens with zero target probability were emitted: {counts[zero]}"
    counts, probs = counts[~zero], probs[~zero] / probs[~zero].sum()
    n = counts.sum()
    expected = n * probs
    small = expected < 5.0
    obs_bins, exp_bins = list(counts[~small]), list(expected[~small])
    if small.any():
        pooled_o, pooled_e = counts[small].sum(), expected[small].sum()
        if pooled_e < 5.0 and exp_bins:  # too small alone: merge into the smallest regular bin
            i = int(np.argmin(exp_bins))
            obs_bins[i] += pooled_o
            exp_bins[i] += pooled_e
        else:
            obs_bins.append(pooled_o)
            exp_bins.append(pooled_e)
    if len(obs_bins) < 2:  # a single possible outcome: nothing to test beyond the zero-mass assertion
        return 1.0
    return float(scipy.stats.chisquare(obs_bins, exp_bins).pvalue)


def np_categorical(rng: np.random.Generator, probs_rv: np.ndarray) -> np.ndarray:
    """One draw per row from (unnormalised) probs by inverse CDF; zero-mass entries are never drawn."""
    cdf = np.cumsum(probs_rv, axis=-1)
    u = rng.random(len(probs_rv)) * cdf[:, -1]
    return np.minimum((u[:, None] >= cdf).sum(-1), probs_rv.shape[-1] - 1)


@functools.cache
def dists(seed: int) -> np.ndarray:
    """[32, V] target distributions from sampling.target_probs (temperature 0.9, top-k 6, top-p 0.9)."""
    logits = 1.5 * jax.random.normal(jax.random.PRNGKey(seed), (32, V))
    p = np.asarray(_target_probs(logits, PARAMS), np.float64)
    assert (p == 0).any(axis=-1).all(), "every distribution should have zero-mass tokens"
    return p


def draft_children(parents: list[int], probs: np.ndarray, drafter: str) -> np.ndarray:
    """Node tokens for a tree: each node's children drafted from its parent's target distribution.

    good: the parent's most probable tokens, in order. bad: a zero-mass token, then the least probable token
    and duplicates of it (a single child gets the least probable token). mixed: the 2nd most probable token,
    a zero-mass token, the most probable token.
    """
    n = len(parents)
    tokens = np.full(n, -7, np.int64)  # padding/root tokens: garbage on purpose (never read)
    for c in range(n):
        kids = [i for i in range(n) if parents[i] == c]
        if not kids:
            continue
        order = np.argsort(-probs[c], kind="stable")  # descending probability
        zero = [t for t in order if probs[c, t] == 0]
        if drafter == "good":
            picks = list(order[: len(kids)])
        elif drafter == "bad":
            low = next(t for t in order[::-1] if probs[c, t] > 0)  # least probable positive-mass token
            # One child: low but positive, so the walk can go on. More: a zero-mass token, the least probable
            # one, then duplicates of it (a duplicate sibling carries no mass once its twin is rejected).
            picks = [low] if len(kids) == 1 else ([zero[0]] + [low] * (len(kids) - 1))
        else:
            picks = ([order[1], zero[0], order[0]] + list(order[2:]))[: len(kids)]
        tokens[kids] = picks
    return tokens


def make_tree(parents: list[int], drafter: str, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    probs = dists(seed)[: len(parents)]
    return np.asarray(parents, np.int64), draft_children(parents, probs, drafter), probs


def tile(tokens: np.ndarray, parents: np.ndarray, probs: np.ndarray, b: int = NUM_SAMPLES):
    return (
        jnp.asarray(np.tile(tokens, (b, 1)), jnp.int32),
        jnp.asarray(np.tile(parents, (b, 1)), jnp.int32),
        jnp.asarray(np.tile(probs, (b, 1, 1)), jnp.float32),
    )


def depths_of(parents: np.ndarray) -> np.ndarray:
    d = np.full(len(parents), -1)
    d[0] = 0
    for i in range(1, len(parents)):
        if parents[i] >= 0:
            d[i] = d[parents[i]] + 1
    return d


def check_structure(res: TreeAcceptance, tokens: np.ndarray, parents: np.ndarray, probs: np.ndarray) -> None:
    """Exact invariants of every row: shapes/dtypes, a valid root-to-node path, matching tokens, -1 padding,
    and every emitted token has positive mass under its node's distribution."""
    chex.assert_shape([res.path, res.tokens], (NUM_SAMPLES, DEPTH + 1))
    chex.assert_shape([res.num_accepted, res.bonus, res.last_node], (NUM_SAMPLES,))
    chex.assert_type([res.num_accepted, res.path, res.tokens, res.bonus, res.last_node], jnp.int32)
    n_acc, path, toks = (np.asarray(x) for x in (res.num_accepted, res.path, res.tokens))
    b, d1 = path.shape
    assert (path[:, 0] == 0).all()
    np.testing.assert_array_equal(np.asarray(res.last_node), path[np.arange(b), n_acc])
    np.testing.assert_array_equal(np.asarray(res.bonus), toks[np.arange(b), n_acc])
    for i in range(d1):
        live = n_acc >= i
        assert (path[~live, i] == -1).all() and (toks[~live, i] == -1).all()
        node = path[live, i]
        assert (probs[node, toks[live, i]] > 0).all(), "zero-mass token emitted"
        if i >= 1:  # node path[i] is a child of path[i-1] and its drafted token was emitted at i-1
            assert (parents[node] == path[live, i - 1]).all()
            assert (toks[live, i - 1] == tokens[node]).all()


def tree_pvalues(path: np.ndarray, toks: np.ndarray, parents: np.ndarray, probs: np.ndarray) -> dict:
    """Chi-square p-value per tested node c: the token emitted right after reaching c vs p_c.

    Node 0 (the root) is test (a): the first emitted token vs p_root, over all rows. A drafted node c at
    depth d is test (b): rows whose walk accepted c, their token at position d vs p_c (only if at least
    MIN_CONDITIONAL rows reached c).
    """
    depth = depths_of(parents)
    out = {}
    for c in range(len(parents)):
        if depth[c] < 0:
            continue
        rows = path[:, depth[c]] == c
        if rows.sum() < MIN_CONDITIONAL:
            continue
        out[c] = chisq_pvalue(np.bincount(toks[rows, depth[c]], minlength=V), probs[c])
    return out


@pytest.mark.parametrize(
    "shape,drafter,seed",
    [
        (CHAIN, "good", 1),
        (CHAIN, "bad", 2),
        (CHAIN, "mixed", 3),
        (WIDE, "good", 4),
        (WIDE, "bad", 5),
        (WIDE, "mixed", 6),
    ],
)
def test_tree_accept_emits_target_distribution(shape, drafter, seed):
    """(a) first emitted token ~ p_root, (b) token after each accepted node c ~ p_c; 50,000 rows, p > 1e-3.

    Power on the same data: L1, the lossy rule that samples the bonus from p WITHOUT removing the rejected
    siblings' tokens (emulated by re-drawing the bonus of every row from the unmodified p at its last node),
    must give p < 1e-6 on at least one node whenever the drafter puts real mass on rejected siblings.
    """
    parents, tokens, probs = make_tree(shape, drafter, seed)
    res = _tree_accept(jax.random.PRNGKey(100 + seed), *tile(tokens, parents, probs))
    check_structure(res, tokens, parents, probs)
    path, toks, n_acc = np.asarray(res.path), np.asarray(res.tokens), np.asarray(res.num_accepted)
    pvals = tree_pvalues(path, toks, parents, probs)
    assert 0 in pvals
    if drafter == "good":  # well-drafted: every depth-1 node is reached often enough to be tested
        assert all(c in pvals for c in range(len(parents)) if parents[c] == 0)
        assert n_acc.mean() > 0.5
    if drafter == "bad" and shape is WIDE:
        assert n_acc.mean() < 0.5
    bad = {c: p for c, p in pvals.items() if p <= PASS_P}
    assert not bad, f"emitted tokens deviate from the target distribution at nodes {bad} (all: {pvals})"

    if drafter != "bad":  # bad drafts carry little mass, so L1 is (almost) lossless there: no power expected
        lossy = toks.copy()
        lossy[np.arange(NUM_SAMPLES), n_acc] = np_categorical(
            np.random.default_rng(seed), probs[np.asarray(res.last_node)]
        )
        lossy_p = tree_pvalues(path, lossy, parents, probs)
        assert min(lossy_p.values()) < POWER_P, lossy_p


def test_tree_lossy_variants_fail():
    """Power of test (a) against two lossy rules; 50,000 rows, well-drafted WIDE tree, first token vs p_root.

    L1: bonus sampled from p without removing the rejected siblings' tokens (re-emits drafted tokens).
    L2: accept the first root child with u < p(child) from one uniform (no cumulative walk); bonus as the real
        rule. Both must give p-value < 1e-6, whereas the real rule passes (test above, same tree).
    """
    parents, tokens, probs = make_tree(WIDE, "good", 4)
    rng = np.random.default_rng(0)
    res = _tree_accept(jax.random.PRNGKey(7), *tile(tokens, parents, probs))
    n_acc, first = np.asarray(res.num_accepted), np.asarray(res.tokens[:, 0])
    assert chisq_pvalue(np.bincount(first, minlength=V), probs[0]) > PASS_P

    first_l1 = np.where(n_acc > 0, first, np_categorical(rng, probs[np.asarray(res.last_node)]))
    assert chisq_pvalue(np.bincount(first_l1, minlength=V), probs[0]) < POWER_P

    kid_tokens = tokens[parents == 0]
    u = rng.random(NUM_SAMPLES)[:, None]
    hit = u < probs[0, kid_tokens][None, :]
    residual = probs[0].copy()
    residual[kid_tokens] = 0.0
    bonus = np_categorical(rng, np.tile(residual, (NUM_SAMPLES, 1)))
    first_l2 = np.where(hit.any(-1), kid_tokens[np.argmax(hit, -1)], bonus)
    assert chisq_pvalue(np.bincount(first_l2, minlength=V), probs[0]) < POWER_P


def brute_force_greedy(tokens: np.ndarray, parents: np.ndarray, argmax: np.ndarray):
    """Python reference walk for one row: (num_accepted, path, emitted tokens)."""
    cur, path, out = 0, [0], []
    for _ in range(DEPTH):
        nxt = next((j for j in range(len(parents)) if parents[j] == cur and tokens[j] == argmax[cur]), None)
        if nxt is None:
            break
        path.append(nxt)
        out.append(int(tokens[nxt]))
        cur = nxt
    out.append(int(argmax[cur]))
    return len(path) - 1, path, out


def random_trees(rng: np.random.Generator, b: int) -> tuple[np.ndarray, np.ndarray]:
    """[b, N] random topologically ordered trees, depth <= DEPTH, ~15% padding nodes, tokens in {0, 1, 2}."""
    parents = np.full((b, N), -2, np.int64)
    depth = np.full((b, N), 99, np.int64)
    parents[:, 0], depth[:, 0] = -1, 0
    rows = np.arange(b)
    for i in range(1, N):
        par = rng.integers(0, i, b)
        par = np.where((parents[rows, par] == -2) | (depth[rows, par] >= DEPTH), 0, par)
        real = rng.random(b) >= 0.15
        parents[:, i] = np.where(real, par, -2)
        depth[:, i] = np.where(real, depth[rows, par] + 1, 99)
    return rng.integers(0, 3, (b, N)), parents


def test_greedy_matches_brute_force_and_one_hot_tree_accept():
    """Exact: tree_accept_greedy == a Python walk (first 500 of 50,000 random trees); tree_accept on the
    one-hot p that sampling.target_probs gives at temperature 0 == tree_accept_greedy on all 50,000 rows."""
    rng = np.random.default_rng(3)
    tokens, parents = random_trees(rng, NUM_SAMPLES)
    logits = rng.normal(size=(NUM_SAMPLES, N, V))
    logits[..., :3] += 2.0  # argmax mostly in {0, 1, 2}, so drafted tokens often match
    probs = _target_probs(jnp.asarray(logits, jnp.float32), SamplingParams(temperature=0.0))
    argmax = np.argmax(logits, -1)
    tok_j, par_j = jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32)
    greedy = _tree_accept_greedy(tok_j, par_j, jnp.asarray(argmax, jnp.int32))
    g_n, g_path, g_tok = (np.asarray(x) for x in (greedy.num_accepted, greedy.path, greedy.tokens))
    g_bonus, g_last = np.asarray(greedy.bonus), np.asarray(greedy.last_node)
    for r in range(500):
        n_acc, path, out = brute_force_greedy(tokens[r], parents[r], argmax[r])
        assert g_n[r] == n_acc
        np.testing.assert_array_equal(g_path[r], path + [-1] * (DEPTH - n_acc))
        np.testing.assert_array_equal(g_tok[r], out + [-1] * (DEPTH - n_acc))
        assert g_bonus[r] == out[-1] and g_last[r] == path[-1]
    assert set(np.unique(g_n[:500])) == set(range(DEPTH + 1))  # the trees exercise every outcome
    for seed in range(2):
        sampled = _tree_accept(jax.random.PRNGKey(seed), tok_j, par_j, probs)
        chex.assert_trees_all_equal(sampled, greedy)


def chain_tables(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """p tables (target, via target_probs; zero-mass tokens) and q tables (a different, full-support drafter:
    half p, half a random softmax, so acceptance is frequent but q != p).

    Position 1 uses row [0, 0]; positions 2..4 depend on the previous token: [position, prev token, V].
    """
    p = dists(seed).reshape(4, V, V)
    q_logits = np.random.default_rng(seed).normal(size=(3, V, V))
    q = 0.5 * p[:3] + 0.5 * np.exp(q_logits) / np.exp(q_logits).sum(-1, keepdims=True)
    return p, q


def sample_chain_inputs(p: np.ndarray, q: np.ndarray, seed: int, b: int = NUM_SAMPLES):
    """Drafts d1 ~ q[0, 0], d2 ~ q[1, d1], d3 ~ q[2, d2]; targets p[0, 0], p[1, d1], p[2, d2], p[3, d3]."""
    rng = np.random.default_rng(seed)
    prev = np.zeros(b, np.int64)
    drafts, qs, ps = [], [], []
    for i in range(3):
        qi = q[i, prev]
        d = np_categorical(rng, qi)
        drafts.append(d)
        qs.append(qi)
        ps.append(p[i, prev])
        prev = d
    ps.append(p[3, prev])
    return (
        jnp.asarray(np.stack(drafts, 1), jnp.int32),
        jnp.asarray(np.stack(qs, 1), jnp.float32),
        jnp.asarray(np.stack(ps, 1), jnp.float32),
    )


def test_chain_rejection_emits_target_distribution_and_lossy_fails():
    """Chain rejection sampling, k=3, q != p, 50,000 rows; chi-square p > 1e-3 for:

    first token vs p_1; second token given first draft x accepted vs p_2(.|x); third given the first two
    accepted with second token y vs p_3(.|y) (each conditional tested when >= 2,000 rows). Power: the lossy
    variant that samples the correction from p instead of norm(max(p - q, 0)) must give first-token p-value
    < 1e-6.
    """
    p, q = chain_tables(21)
    drafts, q_bkv, p_bkv = sample_chain_inputs(p, q, 22)
    res = _chain_accept(jax.random.PRNGKey(23), drafts, q_bkv, p_bkv)
    assert isinstance(res, ChainAcceptance)
    chex.assert_shape(res.tokens, (NUM_SAMPLES, 4))
    chex.assert_type([res.num_accepted, res.tokens, res.bonus], jnp.int32)
    n_acc, toks, d = np.asarray(res.num_accepted), np.asarray(res.tokens), np.asarray(drafts)
    ar = np.arange(NUM_SAMPLES)
    np.testing.assert_array_equal(toks[ar, n_acc], np.asarray(res.bonus))
    for i in range(4):
        assert (toks[n_acc < i, i] == -1).all()
        if i < 3:
            np.testing.assert_array_equal(toks[n_acc > i, i], d[n_acc > i, i])
        live = n_acc >= i
        assert (np.asarray(p_bkv)[ar[live], i, toks[live, i]] > 0).all(), "zero-mass token emitted"
    assert 0.3 < n_acc.mean() < 2.7  # q != p: both acceptance and rejection happen

    pvals = {"first": chisq_pvalue(np.bincount(toks[:, 0], minlength=V), p[0, 0])}
    for x in range(V):
        rows = (n_acc >= 1) & (toks[:, 0] == x)
        if rows.sum() >= MIN_CONDITIONAL:
            pvals[f"second|{x}"] = chisq_pvalue(np.bincount(toks[rows, 1], minlength=V), p[1, x])
        rows2 = (n_acc >= 2) & (toks[:, 1] == x)  # p_3 depends only on the second token
        if rows2.sum() >= MIN_CONDITIONAL:
            pvals[f"third|{x}"] = chisq_pvalue(np.bincount(toks[rows2, 2], minlength=V), p[2, x])
    assert any(k.startswith("second") for k in pvals) and any(k.startswith("third") for k in pvals)
    bad = {k: v for k, v in pvals.items() if v <= PASS_P}
    assert not bad, f"chain rejection sampling is not lossless: {bad} (all: {pvals})"

    # Lossy variant: on rejection, the correction is sampled from p (ignoring q).
    first_p = np_categorical(np.random.default_rng(24), np.tile(p[0, 0], (NUM_SAMPLES, 1)))
    first_lossy = np.where(n_acc >= 1, toks[:, 0], first_p)
    assert chisq_pvalue(np.bincount(first_lossy, minlength=V), p[0, 0]) < POWER_P


def test_jit_no_retrace_and_bounded_memory():
    """Each rule traces at most once per shape: calls with new values of the same shapes add no trace.

    Memory: a Qwen-sized tree_accept (B=4, N=64, V=151,936, depth 12) is compiled (not run) and its
    temporaries must be < 25% of the [B, N, V] input, i.e. no [B, N, V]- or [B, N, N, V]-sized intermediate.
    """
    for seed in range(3):
        parents, tokens, probs = make_tree(WIDE, ["good", "bad", "mixed"][seed], seed)
        tok_b, par_b, probs_b = tile(tokens, parents, probs)
        _tree_accept(jax.random.PRNGKey(seed), tok_b, par_b, probs_b)
        _tree_accept_greedy(tok_b, par_b, jnp.argmax(probs_b, -1).astype(jnp.int32))
        p, q = chain_tables(seed)
        _chain_accept(jax.random.PRNGKey(seed), *sample_chain_inputs(p, q, seed))
        if seed == 0:
            after_first = dict(TRACES)
    assert dict(TRACES) == after_first
    assert after_first == {"tree": 1, "greedy": 1, "chain": 1}  # every test in this file uses one shape

    b, n, v = 4, 64, 151_936
    spec = jax.ShapeDtypeStruct
    args = (
        spec((2,), jnp.uint32),
        spec((b, n), jnp.int32),
        spec((b, n), jnp.int32),
        spec((b, n, v), jnp.float32),
    )
    compiled = jax.jit(tree_accept, static_argnames="max_depth").lower(*args, max_depth=12).compile()
    mem = compiled.memory_analysis()
    assert mem.temp_size_in_bytes < 0.25 * b * n * v * 4, mem
