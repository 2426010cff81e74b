"""The history drafter (tlt_jax/rollout/history.py, history_rounds.py): its suffix automaton against brute
force, its draft trees on a spelled-out history, the memory caps, the checkpoint arrays, and rollouts through
the engine (float32: every token equal to plain decoding's, greedy and sampled; the second epoch drafts from
the first's responses) and as an arm of BEG-MAB.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest

from tlt_jax.models.config import tiny_config
from tlt_jax.rollout.adaptive import build_policy
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.history import HistoryParams, HistoryStore, SuffixAutomaton, TreeShape, draft_tree
from tlt_jax.rollout.hooks import FixedMode
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.selector_config import BanditSection

CFG = tiny_config(num_layers=2, tie_embeddings=False)
EOS = 18
PROMPTS = [[9, 9, 2], [81, 65, 35, 40, 6, 10, 3, 23, 104, 83]]
GREEDY = SamplingParams(temperature=0.0)
SAMPLING = SamplingParams(temperature=0.9, top_k=20, top_p=0.95)
WIDE = TreeShape(depth=3, topk=2, nodes=8, internal=8)


# ---- the suffix automaton and the draft tree (host-side, no device) -------------------------------------


def test_suffix_automaton_counts_and_longest_match_against_brute_force() -> None:
    rng = np.random.default_rng(0)
    for _ in range(150):
        strings = [rng.integers(0, 3, rng.integers(1, 12)).tolist() for _ in range(rng.integers(1, 4))]
        sam = SuffixAutomaton()
        for s in strings:
            sam.add(s)
        occurrences = collections.Counter(
            tuple(s[i:j]) for s in strings for i in range(len(s)) for j in range(i + 1, len(s) + 1)
        )
        cnt = sam.counts()
        for sub, c in occurrences.items():  # every substring is a path, its state counts its occurrences
            state = 0
            for t in sub:
                state = sam.next[state][t]
            assert cnt[state] == c, (strings, sub)
        assert len(sam) <= 2 * sum(map(len, strings)) + 1
        ctx = rng.integers(0, 3, 8).tolist()
        _, n = sam.match(ctx)
        assert n == max(k for k in range(9) if k == 0 or tuple(ctx[-k:]) in occurrences), (strings, ctx)


def _store(**kw) -> tuple[HistoryStore, list[int]]:
    """Prompt 1 2 3, responses 4 5 6 7 | 4 5 6 8 | 4 5 9; SuffixDecoding's serving defaults unless `kw`."""
    store = HistoryStore(HistoryParams(max_match=8, **{"spec_factor": 1.0, "min_prob": 0.1, **kw}))
    prompt = [1, 2, 3]
    for r in ([4, 5, 6, 7], [4, 5, 6, 8], [4, 5, 9]):
        store.add(prompt, r)
    return store, prompt


def _tree(store: HistoryStore, prompt: list[int], ctx: list[int], shape: TreeShape = WIDE):
    ph = store.prompt(prompt)
    state, n = ph.automaton().match(ctx)
    return draft_tree(ph.automaton(), state, n, shape, store.params), n


def test_draft_tree_most_frequent_continuations_sized_by_the_match() -> None:
    store, prompt = _store()
    # "... 4 5": a match of 2 earns 2 nodes (spec_factor 1): 6 (2 of 3 occurrences), then 9 (1/3; pushed
    # before 6's children 7 and 8, also 1/3)
    assert _tree(store, prompt, [0, 4, 5]) == (([6, 9], [0, 0], [1, 1]), 2)
    # spec_factor 2 -> 4 nodes: 6's children follow, parents index the tree (node 1 = 6)
    store2, _ = _store(spec_factor=2.0)
    assert _tree(store2, prompt, [0, 4, 5]) == (([6, 9, 7, 8], [0, 0, 1, 1], [1, 1, 2, 2]), 2)
    # min_prob 0.4: only 6 (2/3); its children (1/3 each) and 9 (1/3) fall below
    store3, _ = _store(spec_factor=2.0, min_prob=0.4)
    assert _tree(store3, prompt, [0, 4, 5])[0] == ([6], [0], [1])
    # the prompt's tail matches 3 tokens and every response starts 4 5: a chain of depth 3 (topk 1)
    chain = TreeShape(depth=3, topk=1, nodes=3, internal=3)
    assert _tree(store, prompt, [1, 2, 3], chain) == (([4, 5, 6], [0, 1, 2], [1, 2, 3]), 3)
    # nothing matches: no draft
    assert _tree(store, prompt, [77])[0] == ([], [], [])
    # the strategy's internal-node bound (draft_slots): one node with children -> the root's children only
    flat = TreeShape(depth=3, topk=2, nodes=8, internal=1)
    assert _tree(store2, prompt, [0, 4, 5], flat)[0] == ([6, 9], [0, 0], [1, 1])


def test_memory_caps_evict_the_oldest_responses() -> None:
    store = HistoryStore(HistoryParams(max_match=4, max_prompt_tokens=10, max_tokens=16))
    a, b = [1, 2], [3, 4]
    store.add(a, [5] * 6)  # a: 6
    store.add(a, [6] * 4)  # a: 10 (at its cap)
    store.add(a, [7] * 3)  # a: 13 > 10: the [5]*6 goes -> 7
    assert [r.tolist()[0] for _, r in store.prompt(a).responses] == [6, 7] and store.total == 7
    store.add(b, [8] * 5)  # total 12
    store.add(b, [9] * 5)  # total 17 > 16: the oldest left anywhere (a's [6]*4) goes -> 13
    assert [r[0] for _, r in store.prompt(a).responses] == [7]
    assert store.total == 13 == sum(p.tokens for p in store.prompts.values())
    assert store.take_stats().evicted == 2 and store.evicted_total == 2
    # the evicted text no longer drafts: after "5 5" nothing follows any more (the automaton was rebuilt)
    assert _tree(store, a, [5, 5])[0] == ([], [], [])
    assert _tree(store, a, [7, 7])[0][0][:1] == [7]
    rng = np.random.default_rng(0)
    for _ in range(50):  # the caps hold whatever comes
        store.add(a if rng.random() < 0.5 else b, [1] * int(rng.integers(1, 9)))
        assert store.total <= 16 and all(p.tokens <= 10 for p in store.prompts.values())
    assert 0 < store.host_bytes() < 1 << 20 and store.metrics()["history/tokens"] == store.total


def test_checkpoint_arrays_restore_a_store_that_drafts_the_same() -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 5, 4).tolist() for _ in range(3)]
    params = HistoryParams(max_match=6, max_prompt_tokens=60, max_tokens=120, spec_factor=2.0, min_prob=0.0)
    store = HistoryStore(params)
    added = []
    for _ in range(40):  # with evictions
        p, r = prompts[rng.integers(3)], rng.integers(0, 5, rng.integers(3, 12)).tolist()
        store.add(p, r)
        added.append((p, r))
    store.end_rollout()
    back = HistoryStore(params)
    back.load(store.state_arrays())
    assert back.total == store.total and back.next_seq == store.next_seq
    # insertion order does not matter: the kept responses added in reverse draft the same trees
    rev = HistoryStore(params)
    kept = [(p, r.tolist()) for p in prompts for _, r in store.prompt(p).responses]
    for p, r in reversed(kept):
        rev.add(p, r)
    shape = TreeShape(depth=4, topk=3, nodes=12, internal=10)
    for _ in range(60):
        hs = [store.prompt(p) for p in prompts]
        ctx = [rng.integers(0, 5, 6) for _ in range(3)]
        want = store.draft(hs, ctx, shape)
        for other in (back, rev):
            got = other.draft([other.prompt(prompts[i]) for i in range(3)], ctx, shape)
            for w, g in zip(want, got, strict=True):
                np.testing.assert_array_equal(w, g)
    assert store.draft(hs, ctx, shape)[1].max() > 0  # the trees were not all empty
    # the eviction queue survives too: the next addition evicts the same response in both
    store.add(prompts[0], [1] * 30)
    back.add(prompts[0], [1] * 30)
    assert back.state_arrays()["responses"].tolist() == store.state_arrays()["responses"].tolist()


# ---- through the engine (float32) -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_and_plain(mirror):
    """One engine; its plain references computed before a history mode exists (so they are not recorded)."""
    engine = RolloutEngine(
        mirror.target(CFG),
        EngineConfig(max_new_tokens=40, max_cache_len=96, chunk_steps=8, compact=False),
        eos_ids=[EOS],
    )
    plain = {
        name: engine.generate(PROMPTS, n=4, key=jax.random.key(5), sampling=sp, hooks=FixedMode("plain"))
        for name, sp in (("greedy", GREEDY), ("sampled", SAMPLING))
    }
    assert engine.history is None
    return engine, plain


def test_history_rollouts_equal_plain_and_draft_from_the_last_epoch(engine_and_plain) -> None:
    engine, plain = engine_and_plain
    mode = engine.add_mode("history", "3_2_6")
    assert mode == "history_3_2_6" and engine.history is not None
    for name, sp in (("greedy", GREEDY), ("sampled", SAMPLING)):
        accept = []
        for _ in range(2):  # two epochs of the same prompts, the same keys: the same responses
            out = engine.generate(PROMPTS, n=4, key=jax.random.key(5), sampling=sp, hooks=FixedMode(mode))
            np.testing.assert_array_equal(out.tokens, plain[name].tokens)
            np.testing.assert_array_equal(out.lengths, plain[name].lengths)
            assert {c.mode for c in out.stats.chunks} == {mode}
            accept.append(out.stats.mean_accept_length)
        # epoch 2 drafts from epoch 1's very responses: nearly every round accepts the whole depth (3 + 1)
        assert accept[1] > 3.5 and accept[1] > accept[0], (name, accept)
    stats = engine.history.take_stats()
    assert stats.rounds > 0 and stats.matched > 0 and stats.draft_seconds > 0
    assert stats.added == 4 * len(PROMPTS) * 4  # every finished response kept (2 samplings x 2 epochs)


def test_history_is_an_arm_of_beg_mab(engine_and_plain) -> None:
    engine, plain = engine_and_plain
    section = BanditSection(algorithm="beg_mab", arms=("plain", "history_2_1_3", "ngram_2_1_3"), min_plays=2)
    policy = build_policy(section, engine, seed=0)
    assert policy.policy.cfg.arms == ("plain", "history_2_1_3", "ngram_2_1_3")
    assert engine.modes["history_2_1_3"].drafter == "history"
    out = engine.generate(PROMPTS, n=4, key=jax.random.key(5), sampling=SAMPLING, hooks=policy)
    np.testing.assert_array_equal(out.tokens, plain["sampled"].tokens)
    played = {arm for (_, arm), n in policy.chosen.items() if n}
    assert "history_2_1_3" in played, policy.chosen
    hist_chunks = [c for c in out.stats.chunks if c.mode == "history_2_1_3"]
    assert hist_chunks and all(c.verify_rounds > 0 for c in hist_chunks)
