"""Speculative rollouts through the engine: greedy identity, switching + compaction, no recompiles, and the
lossless claim end to end (the emitted tokens are distributed exactly as the target samples them).

Models are tiny and built so that speculation does real work:
- the target's attention is scaled up, so its next token depends on the context (a verify pass that mixed
  up positions, masks or caches would change the output);
- a "mirror" drafter copies the target's single layer and reads only the token embedding (embeddings have
  unit RMS, so the target's input norm is the identity): it predicts the target almost exactly, and noise on
  its fusion weights sets the acceptance rate; random drafters (low acceptance) are the other extreme.

Statistical protocol (as tests/rollout/test_acceptance.py): 32,768 samples of one prompt in one engine call
per variant; Pearson chi-square of the joint of the first three response tokens against the exact joint the
target computes by teacher forcing (`target_probs`, temperature 0.9, top-k 20 < V = 32, top-p 0.95);
cells with expected count < 5 pooled; zero-probability cells must stay empty. Exact variants pass at
p > 1e-3; a biased acceptance rule run through the same pipeline must give p < 1e-6 (the test has power).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx

from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.acceptance import tree_accept
from tlt_jax.rollout.eagle_draft import drafter_prefill
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import ChunkView, FixedMode, RolloutHooks
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.ngram import NgramBank
from tlt_jax.rollout.sampling import SamplingParams, target_probs
from tlt_jax.rollout.strategy import SpecConfig
from tlt_jax.rollout.types import ChunkRecord

GREEDY = SamplingParams(temperature=0.0)
CFG = tiny_config(num_layers=2, tie_embeddings=False)
EOS = 18  # ends prompt 0's greedy continuation at 9 tokens, never appears in prompt 1's (checked below)


class CompileCounter:
    """Counts XLA backend compilations through jax.monitoring (the ground truth, not the engine's cache)."""

    def __init__(self) -> None:
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            self.count += 1


_COMPILES = CompileCounter()


def check_stats(out, max_depth: int) -> None:
    """Bookkeeping: every chunk's counts add up; all tokens after the first (prefill) come from chunks."""
    for c in out.stats.chunks:
        if c.mode == "plain":
            assert c.accepted_tokens == 0 and c.verify_rounds == 0
            continue
        hist = np.asarray(c.accept_hist)
        assert len(hist) == max_depth + 2 and hist[0] == 0
        assert hist.sum() == c.verify_rounds and (hist * np.arange(len(hist))).sum() == c.accepted_tokens
        assert c.accepted_tokens == c.new_tokens
    assert sum(c.new_tokens for c in out.stats.chunks) == out.lengths.sum() - len(out.lengths)


# ---- greedy: speculative == plain, token for token ------------------------------------------------------

PROMPTS = [[9, 9, 2], [81, 65, 35, 40, 6, 10, 3, 23, 104, 83]]  # different lengths in one batch
# learned chain and trees (a depth-1 tree: the root's children only; 2_4_12: a wide tree whose logits are
# computed at its nodes with children only, `decode.logit_nodes`), n-gram tree and chain
MODES = [
    ("eagle", "3_1_4"),
    ("eagle", "3_2_6"),
    ("eagle", "1_3_4"),
    ("eagle", "2_4_12"),
    ("ngram", "2_2_5"),
    ("ngram", "3_1_4"),
]


@pytest.fixture(scope="module")
def target(mirror):
    return mirror.target(CFG)


@pytest.fixture(scope="module")
def greedy_engine(target, mirror):
    engine = RolloutEngine(
        target,
        EngineConfig(max_new_tokens=40, max_cache_len=96, chunk_steps=8, compact=False),
        eos_ids=[EOS],
        drafter=mirror.drafter(target, noise=0.03),
    )
    names = [engine.add_mode(kind, strat) for kind, strat in MODES]
    plain = engine.generate(PROMPTS, n=2, key=jax.random.key(0), sampling=GREEDY, hooks=FixedMode("plain"))
    assert plain.finish_reason == ["eos", "eos", "length", "length"], "EOS no longer splits the batch"
    return engine, names, plain


@pytest.mark.parametrize("which", range(len(MODES)), ids=[f"{k}_{s}" for k, s in MODES])
def test_greedy_speculative_equals_plain(greedy_engine, which):
    """Whole rollout speculative (prompts of different lengths, 2 samples each, EOS inside accepted paths,
    the 40-token budget cutting the last round): identical tokens, lengths, finish reasons; same log-probs."""
    engine, names, plain = greedy_engine
    mode = names[which]
    out = engine.generate(PROMPTS, n=2, key=jax.random.key(0), sampling=GREEDY, hooks=FixedMode(mode))
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    assert out.finish_reason == plain.finish_reason
    np.testing.assert_allclose(out.logprobs, plain.logprobs, atol=1e-5)
    assert all(c.mode == mode for c in out.stats.chunks)
    # drafts were accepted (identity with plain would hold trivially if every round emitted the bonus only)
    assert out.stats.mean_accept_length > 1.2, (mode, out.stats.mean_accept_length)


def assert_chain_and_tree_equal_plain(engine: RolloutEngine, plain) -> tuple:
    """Greedy chain and tree EAGLE rollouts equal `plain`; returns the last (output, mode)."""
    for kind, strat in MODES[:2]:
        mode = engine.add_mode(kind, strat)
        out = engine.generate(PROMPTS, n=2, key=jax.random.key(0), sampling=GREEDY, hooks=FixedMode(mode))
        np.testing.assert_array_equal(out.tokens, plain.tokens)
        np.testing.assert_array_equal(out.lengths, plain.lengths)
    return out, mode


def test_greedy_speculative_with_reduced_draft_vocabulary_equals_plain(target, greedy_engine, mirror):
    """A drafter head over half of the vocabulary (drafts only from it): chain and tree SD equal plain."""
    _, _, plain = greedy_engine
    engine = RolloutEngine(
        target,
        EngineConfig(max_new_tokens=40, max_cache_len=96, chunk_steps=8, compact=False),
        eos_ids=[EOS],
        drafter=mirror.drafter(target, noise=0.03),
        draft_vocab=np.arange(0, CFG.vocab_size, 2),
    )
    assert_chain_and_tree_equal_plain(engine, plain)
    with pytest.raises(ValueError, match="draft_vocab: need token ids in"):
        RolloutEngine(target, EngineConfig(), eos_ids=[EOS], draft_vocab=[0, CFG.vocab_size])


def test_greedy_speculative_with_cpu_kernel_equals_plain(greedy_engine, mirror):
    """The CPU FFI kernels: every projection through the small-M matmul (verify passes run it at M = B x
    tokens to verify) and attention through the tree-attention kernel. Plain decoding gives XLA's tokens,
    chain and tree SD give plain's."""
    _, _, plain_xla = greedy_engine
    target = mirror.target(CFG.replace(linear_impl="cpu_ffi"))
    engine = RolloutEngine(
        target,
        EngineConfig(max_new_tokens=40, max_cache_len=96, chunk_steps=8, compact=False, attn_impl="cpu_ffi"),
        eos_ids=[EOS],
        drafter=mirror.drafter(target, noise=0.03),
    )
    plain = engine.generate(PROMPTS, n=2, key=jax.random.key(0), sampling=GREEDY, hooks=FixedMode("plain"))
    np.testing.assert_array_equal(plain.tokens, plain_xla.tokens)
    np.testing.assert_allclose(plain.logprobs, plain_xla.logprobs, atol=1e-5)
    # with the kernel, the drafter's weight matrices are kept in bfloat16 ("auto"), its norms in fp32
    dtypes = {(a.ndim, a.dtype) for a in jax.tree.leaves(engine.drafter_params)}
    assert dtypes == {(2, jnp.dtype(jnp.bfloat16)), (1, jnp.dtype(jnp.float32))}
    out, mode = assert_chain_and_tree_equal_plain(engine, plain)
    check_stats(out, engine.modes[mode].strategy.max_depth)
    assert out.stats.mean_accept_length > 1.2, (
        "drafts were rarely accepted: the test would not exercise commits"
    )
    with pytest.raises(ValueError, match="drafter_weight_dtype must be one of"):
        SpecConfig(drafter_weight_dtype="float16")


def test_greedy_speculative_with_pallas_kernel_equals_plain(target, greedy_engine, mirror):
    """Every attention of the engine (the target's prefill and verify passes, the drafter's draft and cache
    passes) through the Pallas tree-attention kernel, interpreted on CPU (compiled on GPUs): a tree rollout
    gives plain's tokens."""
    _, _, plain = greedy_engine
    engine = RolloutEngine(
        target,
        EngineConfig(max_new_tokens=40, max_cache_len=96, chunk_steps=8, compact=False, attn_impl="pallas"),
        eos_ids=[EOS],
        drafter=mirror.drafter(target, noise=0.03),
    )
    mode = engine.add_mode("eagle", "3_2_6")
    out = engine.generate(PROMPTS, n=2, key=jax.random.key(0), sampling=GREEDY, hooks=FixedMode(mode))
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    np.testing.assert_allclose(out.logprobs, plain.logprobs, atol=1e-5)
    assert out.stats.mean_accept_length > 1.2


# ---- caches after speculative rounds ----------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 1))
def _reference_caches(tgraph, dgraph, tparams, dparams, tokens_bt):
    """Fresh causal target and drafter passes over whole (padded) sequences."""
    target, drafter = nnx.merge(tgraph, tparams), nnx.merge(dgraph, dparams)
    b, t = tokens_bt.shape
    out = target(tokens_bt, jnp.broadcast_to(jnp.arange(t), (b, t)), KVCache.init(CFG, b, t))
    dcache = drafter_prefill(
        drafter, target, drafter.init_cache(b, t), tokens_bt, out.hidden, jnp.full((b,), t), "reference"
    )
    return out.cache, dcache, out.hidden


def _check_caches(engine: RolloutEngine, state, prompts: list[list[int]], n: int) -> int:
    """Each live row's target cache, drafter cache and carried hidden state vs one fresh pass over its
    committed tokens (prompt + response minus the newest token, which is not cached yet). Returns the
    number of rows checked."""
    tg, dg = engine.graphdef, engine.drafter_graphdef
    num, out, done = (np.asarray(x) for x in (state.num_generated, state.out_tokens, state.done))
    rows = [r for r in range(len(prompts) * n) if not done[r]]
    seqs = {r: list(prompts[r // n]) + out[r, : num[r] - 1].tolist() for r in rows}
    padded = np.zeros((len(done), state.cache.capacity), np.int32)
    for r, seq in seqs.items():
        padded[r, : len(seq)] = seq
    # causal passes: the padding after a row's tokens does not touch the positions before it
    tcache, dcache, hidden = _reference_caches(
        tg, dg, engine.params, engine.drafter_params, jnp.asarray(padded)
    )
    t_len, d_len = np.asarray(state.cache.lengths), np.asarray(state.aux.drafter_cache.lengths)
    dc = state.aux.drafter_cache
    for r, seq in seqs.items():
        ln = len(seq)
        assert t_len[r] == ln and d_len[r] == ln - 1, (r, t_len[r], d_len[r], ln)
        for layer in range(CFG.num_layers):
            for got, want in ((state.cache.k, tcache.k), (state.cache.v, tcache.v)):  # [B, Hkv, S, D]
                np.testing.assert_allclose(got[layer][r, :, :ln], want[layer][r, :, :ln], atol=1e-5)
        for got, want in ((dc.k[0], dcache.k[0]), (dc.v[0], dcache.v[0])):
            np.testing.assert_allclose(got[r, :, : ln - 1], want[r, :, : ln - 1], atol=1e-5)
        np.testing.assert_allclose(state.aux.hidden[r], hidden[r, ln - 1], atol=1e-5)
    return len(rows)


def test_caches_after_speculative_rounds_equal_a_fresh_pass(greedy_engine):
    """Prefill, plain steps (the drafter kept in step), EAGLE chain, EAGLE tree and n-gram rounds on rows at
    different lengths: after each chunk the target cache equals a fresh target pass over the committed
    tokens, the drafter cache a fresh drafter pass over the same (token, target feature) pairs, and the
    carried hidden state is the target's last committed one."""
    engine, names, _ = greedy_engine
    prompts = [[62, 54, 52, 4], PROMPTS[1]]  # no EOS within 64 tokens: rows stay live until the budget
    state, _ = engine.prefill(prompts, n=2, key=jax.random.key(0), sampling=GREEDY, max_new_tokens=64)
    assert _check_caches(engine, state, prompts, 2) == 4
    bank = NgramBank.empty(4, 2, 64)
    accepted = 0
    for mode in ("plain", names[0], names[1], names[2]):  # plain, EAGLE chain, EAGLE tree, n-gram tree
        state, rec, bank, _ = engine.decode_chunk(state, mode, GREEDY, bank)
        if mode != "plain":
            accepted += rec.accepted_tokens - rec.verify_rounds  # drafts accepted
        assert _check_caches(engine, state, prompts, 2) >= (4 if mode != names[2] else 1)
    assert accepted > 0, "no draft was accepted: commits of tree paths went untested"
    assert len(set(np.asarray(state.cache.lengths)[:4].tolist())) > 1, "rows should be at different lengths"


def test_caches_after_sampled_chain_rounds_equal_a_fresh_pass(greedy_engine):
    """Temperature 0.9: learned chains sample their drafts and verify them by rejection sampling; the
    committed tokens (whatever was accepted) leave both caches and the carried hidden state as a fresh pass
    over them would."""
    engine, _, _ = greedy_engine
    sp = SamplingParams(temperature=0.9)
    mode = engine.add_mode("eagle", "3_1_4", acceptance="rejection", label="rej")
    assert engine.modes[mode].rejection
    prompts = [[62, 54, 52, 4], PROMPTS[1]]
    state, _ = engine.prefill(prompts, n=2, key=jax.random.key(3), sampling=sp, max_new_tokens=40)
    state, rec, _, _ = engine.decode_chunk(state, mode, sp)
    assert rec.accepted_tokens > rec.verify_rounds, "no sampled draft was accepted"
    assert _check_caches(engine, state, prompts, 2) >= 1


# ---- switching at a threshold, compaction, mode alternation, no recompiles -------------------------------

SWITCH_PROMPTS = [*PROMPTS, [10, 53, 36, 94, 96, 91, 118, 119, 24]]  # 9, 40 and 14 tokens


@pytest.fixture(scope="module")
def compact_engine(target, mirror):
    spec = SpecConfig(enabled=True, drafter="eagle", strategy="3_2_6", threshold=2, min_steps_below=4)
    engine = RolloutEngine(
        target,
        EngineConfig(max_new_tokens=40, max_cache_len=96, chunk_steps=4, compact=True, spec=spec),
        eos_ids=[EOS],
        drafter=mirror.drafter(target, noise=0.03),
    )
    engine.add_mode("ngram", "3_1_4")
    return engine


@pytest.fixture(scope="module")
def switch_reference(greedy_engine):
    engine, _, _ = greedy_engine
    out = engine.generate(
        SWITCH_PROMPTS, n=1, key=jax.random.key(0), sampling=GREEDY, hooks=FixedMode("plain")
    )
    assert len(set(out.lengths.tolist())) == 3, "rows should finish at different steps (compaction)"
    return out


def test_threshold_switch_with_compaction_greedy(compact_engine, switch_reference):
    """SpecConfig's switch: plain until <= 2 rows have run for 4 steps, then EAGLE; rows finish at different
    times, so the batch is compacted 4 -> 2 -> 1 while speculating. Output identical to plain decoding."""
    out = compact_engine.generate(SWITCH_PROMPTS, n=1, key=jax.random.key(0), sampling=GREEDY)
    np.testing.assert_array_equal(out.tokens, switch_reference.tokens)
    np.testing.assert_array_equal(out.lengths, switch_reference.lengths)
    np.testing.assert_allclose(out.logprobs, switch_reference.logprobs, atol=1e-5)
    modes = [c.mode for c in out.stats.chunks]
    first_sd = modes.index("3_2_6")
    assert "plain" in modes[:first_sd] and set(modes[first_sd:]) == {"3_2_6"}
    running = out.stats.running_per_step
    sd = out.stats.sd_per_step
    switch = sd.index(True)
    assert switch >= 4 and all(r <= 2 for r in running[switch - 4 : switch]) and max(running[:switch]) > 2
    buckets = [c.batch_bucket for c in out.stats.chunks]
    assert buckets[0] == 4 and buckets[-1] == 1 and buckets == sorted(buckets, reverse=True)
    check_stats(out, 3)


class AlternatingSelector(RolloutHooks):
    """Plain above 2 running rows; then EAGLE at batch bucket 2 and, at bucket 1, n-gram and EAGLE chunks in
    turn (a bandit-like choice per bucket). Records what it observed."""

    def __init__(self, tree: str = "3_2_6", chain: str = "ngram_3_1_4") -> None:
        self.i = 0
        self.tree, self.chain = tree, chain
        self.records: list[ChunkRecord] = []

    def choose_mode(self, running: int, batch_bucket: int) -> str:
        if running > 2:
            return "plain"
        if batch_bucket > 1:
            return self.tree
        self.i += 1
        return self.chain if self.i % 2 else self.tree

    def on_chunk(self, view: ChunkView) -> None:
        assert view.record.steps == len(view.record.running)
        self.records.append(view.record)


def test_recorded_hidden_states_through_speculative_rounds(target, switch_reference, mirror):
    """EngineConfig.record_hidden with speculative rounds: the target states of each round's committed path
    (root + accepted drafts) land at their response positions. Plain chunks, then EAGLE tree / n-gram chain
    rounds with compaction: every position's state equals a full causal forward over the final sequence."""
    engine = RolloutEngine(
        target,
        EngineConfig(max_new_tokens=40, max_cache_len=96, chunk_steps=4, compact=True, record_hidden=True),
        eos_ids=[EOS],
        drafter=mirror.drafter(target, noise=0.03),
    )
    tree, chain = engine.add_mode("eagle", "3_2_6"), engine.add_mode("ngram", "3_1_4")
    sel = AlternatingSelector(tree, chain)
    out = engine.generate(SWITCH_PROMPTS, n=1, key=jax.random.key(0), sampling=GREEDY, hooks=sel)
    np.testing.assert_array_equal(out.tokens, switch_reference.tokens)
    assert {c.mode for c in out.stats.chunks} == {"plain", tree, chain}
    assert max(c.accept_length for c in out.stats.chunks) > 2, "rounds should commit several tokens"
    width = 64
    fwd = jax.jit(lambda toks: target(toks, jnp.arange(width)[None]).hidden[0])
    for i in range(len(out.lengths)):
        seq = out.prompt_tokens[i] + out.response(i)
        want = np.asarray(fwd(jnp.asarray([seq[:-1] + [0] * (width - len(seq) + 1)])))[: len(seq) - 1]
        np.testing.assert_allclose(out.features(i), want, atol=1e-4, rtol=1e-4)


def test_mode_selector_alternates_drafters_and_nothing_recompiles(compact_engine, switch_reference, mirror):
    """A ModeSelector switching between the EAGLE and the n-gram drafter chunk by chunk (the drafter cache is
    kept through n-gram rounds), with compaction: output identical to plain. Then a second rollout after
    swapping in other drafter weights: zero new XLA compilations, and still the same greedy output."""
    sel = AlternatingSelector()
    out = compact_engine.generate(SWITCH_PROMPTS, n=1, key=jax.random.key(0), sampling=GREEDY, hooks=sel)
    np.testing.assert_array_equal(out.tokens, switch_reference.tokens)
    np.testing.assert_allclose(out.logprobs, switch_reference.logprobs, atol=1e-5)
    combos = {(r.mode, r.batch_bucket) for r in sel.records}
    assert {("3_2_6", 2), ("3_2_6", 1), ("ngram_3_1_4", 1)} <= combos
    assert sel.records == out.stats.chunks
    assert all(r.tokens_per_second > 0 for r in sel.records)

    programs, compiles = compact_engine.compile_count, _COMPILES.count
    other = mirror.drafter(compact_engine.model(), noise=0.3, seed=7)  # much worse drafts, same shapes
    compact_engine.set_drafter_params(nnx.state(other, nnx.Param))
    again = compact_engine.generate(
        SWITCH_PROMPTS, n=1, key=jax.random.key(0), sampling=GREEDY, hooks=AlternatingSelector()
    )
    assert {(r.mode, r.batch_bucket) for r in again.stats.chunks} <= combos
    assert compact_engine.compile_count == programs
    assert _COMPILES.count == compiles, "XLA compiled a new program after warm-up"
    np.testing.assert_array_equal(again.tokens, switch_reference.tokens)
    eagle = [c for c in out.stats.chunks if c.mode == "3_2_6"]
    eagle_again = [c for c in again.stats.chunks if c.mode == "3_2_6"]
    acc = sum(c.accepted_tokens for c in eagle) / sum(c.verify_rounds for c in eagle)
    acc_again = sum(c.accepted_tokens for c in eagle_again) / sum(c.verify_rounds for c in eagle_again)
    assert acc_again < acc, "the swapped-in drafter weights were not used"


# ---- lossless sampling, end to end ------------------------------------------------------------------------

V = 32
SAMPLE_CFG = tiny_config(
    vocab_size=V,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    tie_embeddings=False,
)
SAMPLING = SamplingParams(temperature=0.9, top_k=20, top_p=0.95)
NUM_SAMPLES = 32_768  # the biased rule's p still underflows to 0, as it did at 65,536
PASS_P, POWER_P = 1e-3, 1e-6


def biased_accept(key, tokens_bn, parents_bn, probs_bnv, max_depth):
    """A LOSSY rule for the power check: tree_accept, but the bonus is drawn from p itself instead of p with
    the rejected drafts removed, so rejected drafts come back too often."""
    acc = tree_accept(key, tokens_bn, parents_bn, probs_bnv, max_depth)
    rows = jnp.arange(tokens_bn.shape[0])
    p_last = probs_bnv[rows, acc.last_node]
    bonus = jax.random.categorical(jax.random.fold_in(key, 7), jnp.log(p_last), axis=-1).astype(jnp.int32)
    at_bonus = jnp.arange(max_depth + 1)[None, :] == acc.num_accepted[:, None]
    return acc.replace(tokens=jnp.where(at_bonus, bonus[:, None], acc.tokens), bonus=bonus)


@pytest.fixture(scope="module")
def sampling_setup(mirror):
    target = Transformer(SAMPLE_CFG, nnx.Rngs(0))
    emb = target.embed[...]
    target.embed[...] = emb / jnp.sqrt(jnp.mean(emb * emb, axis=-1, keepdims=True))
    target.lm_head[...] = target.lm_head[...] * 12.0  # logits of order 1: a non-trivial distribution
    target.layers[0].attn.o_proj[...] = target.layers[0].attn.o_proj[...] * 10.0
    good = mirror.drafter(target, noise=0.05)
    # the prompt: the target's own greedy continuation of [3, 5]
    graph, params = nnx.split(target)
    forward = jax.jit(
        lambda p, toks: nnx.merge(graph, p)(toks, jnp.broadcast_to(jnp.arange(16), toks.shape)).logits
    )
    prompt = [3, 5]
    for _ in range(8):  # causal: the padding after the prompt does not change its logits
        toks = np.zeros((V * V, 16), np.int32)
        toks[:, : len(prompt)] = prompt
        prompt.append(int(jnp.argmax(forward(params, jnp.asarray(toks))[0, len(prompt) - 1])))
    engine = RolloutEngine(
        target,
        EngineConfig(max_new_tokens=3, max_cache_len=32, chunk_steps=4, min_cache_bucket=16, compact=False),
        eos_ids=[],
        drafter=good,
    )
    modes = {
        "chain": engine.add_mode("eagle", "2_1_3", acceptance="rejection"),  # sampled drafts + rejection
        "chain_argmax": engine.add_mode("eagle", "2_1_3", acceptance="target_only", label="argmax"),
        "tree": engine.add_mode("eagle", "2_3_6", acceptance="target_only"),
        "chain_coupled": engine.add_mode("eagle", "2_1_3", acceptance="coupled", label="coupled"),
        "tree_coupled": engine.add_mode("eagle", "2_3_6", acceptance="coupled", label="coupled"),
        "biased": engine.add_mode("eagle", "2_1_3", accept_rule=biased_accept, label="biased"),
    }
    # exact joint of the first three response tokens, by teacher forcing all V^2 two-token prefixes
    p = len(prompt)
    seqs = np.zeros((V * V, 16), np.int32)
    seqs[:, : p + 2] = [[*prompt, a, b] for a in range(V) for b in range(V)]
    logits = forward(params, jnp.asarray(seqs))
    probs = np.asarray(target_probs(logits, SAMPLING), np.float64)
    p0, p1 = probs[0, p - 1], probs[::V, p]  # [V], [V, V]
    p2 = probs[:, p + 1].reshape(V, V, V)
    joint = p0[:, None, None] * p1[:, :, None] * p2
    return engine, modes, good, prompt, joint / joint.sum()


def chi_square_pvalue(tokens: np.ndarray, joint: np.ndarray) -> float:
    idx = tokens[:, 0] * V * V + tokens[:, 1] * V + tokens[:, 2]
    counts = np.bincount(idx, minlength=V**3).astype(np.float64)
    expected = joint.reshape(-1) * len(idx)
    zero = expected == 0
    assert counts[zero].sum() == 0, "a token the target never samples was emitted"
    c, e = counts[~zero], expected[~zero]
    small = e < 5
    if small.any():
        c = np.append(c[~small], c[small].sum())
        e = np.append(e[~small], e[small].sum())
    return float(scipy.stats.chisquare(c, e).pvalue)


def _sample(engine, prompt: list[int], mode: str, seed: int):
    out = engine.generate(
        [prompt],
        n=NUM_SAMPLES,
        key=jax.random.key(seed),
        sampling=SAMPLING,
        hooks=FixedMode(mode),
    )
    assert (out.lengths == 3).all() and all(c.mode == mode for c in out.stats.chunks)
    return out


@pytest.mark.slow
def test_speculative_sampling_is_lossless(sampling_setup, xla_optimized):
    """32,768 samples of the first three response tokens per variant, chi-square against the target's exact
    joint (p > 1e-3), for every acceptance rule: coupled verification (chain and tree: every token is plain
    decoding's own draw), the target-only walk (argmax chain and tree), rejection sampling of a chain with
    sampled drafts; the rejection chain and the trees again with a confident random drafter, and the
    rejection chain with a drafter head over 12 of the 32 tokens. The biased rule is rejected at p < 1e-6,
    so the test can tell. (Coupled and target-only acceptance never look at draft probabilities, so n-gram
    drafts take the very same path.)"""
    engine, modes, good, prompt, joint = sampling_setup
    results = {}
    for name, seed in (
        ("chain", 1),
        ("chain_argmax", 3),
        ("tree", 2),
        ("chain_coupled", 8),
        ("tree_coupled", 9),
    ):
        out = _sample(engine, prompt, modes[name], seed)
        results[name] = (chi_square_pvalue(out.tokens, joint), out.stats.mean_accept_length)
    # a confident, wrong drafter: random weights, fusion scaled up (same shapes: no recompile)
    bad = Drafter(SAMPLE_CFG, nnx.Rngs(11))
    bad.fc[...] = bad.fc[...] * 30.0
    engine.set_drafter_params(nnx.state(bad, nnx.Param))
    for name, seed in (("chain", 6), ("tree", 4), ("tree_coupled", 10)):
        out = _sample(engine, prompt, modes[name], seed)
        results[f"{name}_bad_drafter"] = (chi_square_pvalue(out.tokens, joint), out.stats.mean_accept_length)
    engine.set_drafter_params(nnx.state(good, nnx.Param))
    out = _sample(engine, prompt, modes["biased"], 5)
    biased_p = chi_square_pvalue(out.tokens, joint)

    # a reduced draft vocabulary (the drafter's head over 12 of the 32 tokens): the rejection chain's q is
    # zero elsewhere, so rejected mass must come back through the residual max(p - q, 0) exactly
    sub = RolloutEngine(
        engine.model(),
        EngineConfig(max_new_tokens=3, max_cache_len=32, chunk_steps=4, min_cache_bucket=16, compact=False),
        eos_ids=[],
        drafter=good,
        draft_vocab=np.arange(0, V, 8).tolist() + list(range(1, 9)),
    )
    out = _sample(sub, prompt, sub.add_mode("eagle", "2_1_3", acceptance="rejection"), 7)
    results["chain_draft_vocab"] = (chi_square_pvalue(out.tokens, joint), out.stats.mean_accept_length)

    for name, (pval, _) in results.items():
        assert pval > PASS_P, f"{name}: chi-square p={pval:.2e} ({results})"
    assert biased_p < POWER_P, f"the biased rule passed (p={biased_p:.2e}): the test has no power"
    # the drafts were really used: the good drafter's drafts are accepted, the bad one's less often.
    # (At V = 32 and temperature 0.9 the target keeps 15-18 tokens under top-p 0.95, so even its argmax
    # is sampled only ~30% of the time: acceptance lengths are modest by construction.)
    assert results["chain_argmax"][1] > 1.05 and results["tree"][1] > 1.15, results
    assert results["tree_bad_drafter"][1] < results["tree"][1], results
    assert results["chain_bad_drafter"][1] < results["chain"][1], results
    # coupled and target-only verification accept a drafted child with the same probability (its target
    # mass): ~100k row-rounds each, so the accept lengths agree to well within 0.02
    assert abs(results["tree_coupled"][1] - results["tree"][1]) < 0.02, results
    assert abs(results["chain_coupled"][1] - results["chain_argmax"][1]) < 0.02, results
    # rejection sampling accepts a draft with probability sum_x min(p, q) = 1 - TV(p, q), close to 1 for this
    # near-copy drafter, against p(argmax q) (~0.3 here) for target-only verification of argmax drafts
    assert results["chain"][1] > results["chain_argmax"][1] + 0.5, results


def test_coupled_sampling_equals_plain_token_for_token(sampling_setup):
    """Temperature 0.9, top-k 20, top-p 0.95, 4,096 samples: coupled EAGLE chain and tree rollouts emit the
    very tokens plain decoding emits with the same keys (identity, not only the same distribution), while
    accepting drafts; the target-only walk, exact only in distribution, does not."""
    engine, modes, _, prompt, _ = sampling_setup
    key = jax.random.key(21)
    plain = engine.generate([prompt], n=4096, key=key, sampling=SAMPLING, hooks=FixedMode("plain"))
    for name, min_accept in (("chain_coupled", 1.05), ("tree_coupled", 1.15)):  # as the target-only walk
        out = engine.generate([prompt], n=4096, key=key, sampling=SAMPLING, hooks=FixedMode(modes[name]))
        same = (out.tokens == plain.tokens).all(axis=1).mean()
        assert same >= 0.999, (name, same)
        assert out.stats.mean_accept_length > min_accept, (name, out.stats.mean_accept_length)
    other = engine.generate([prompt], n=4096, key=key, sampling=SAMPLING, hooks=FixedMode(modes["tree"]))
    assert (other.tokens == plain.tokens).all(axis=1).mean() < 0.9
