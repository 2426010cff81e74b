"""BEG-MAB's EAGLE strategies with an EAGLE-3 drafter (drafter.arch=eagle3): the adaptive engine's selector
(rollout/adaptive.py over rollout/beg_mab.py) choosing each chunk among plain, the n-gram drafter and EAGLE-3
chains and trees, through the engine.

The drafter is test_engine_eagle3.py's EAGLE-3 mirror of a tiny float32 target (its own head over a 96-token
draft vocabulary, three capture points). Greedy decoding: whatever the selector plays, and in whatever order
the arms follow each other (an EAGLE-3 chunk after plain and n-gram chunks drafts from the drafter cache and
the three layers' states those chunks kept up to date), every rollout equals plain decoding token for token,
the EAGLE-3 arms accept drafts, and the selector's state holds one reward and one accept length per chunk
of each arm.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.rollout.test_engine_eagle3 import CFG, GREEDY, mirror3
from tests.rollout.test_engine_sd import EOS, PROMPTS
from tlt_jax.rollout.adaptive import build_policy
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FixedMode
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.selector_config import BanditSection

# plain first (BEG-MAB's reference arm, `min_plays` = 1 here), then each arm once in index order: the EAGLE-3
# chain follows an n-gram chunk, the tree the chain; epsilon 0.5 then mixes them for the rest of the rollout
ARMS = ("plain", "ngram_3_1_4", "3_1_4", "3_2_6")
EAGLE3_ARMS = ("3_1_4", "3_2_6")
SECTION = dict(
    algorithm="beg_mab",
    arms=ARMS,
    bucket_bounds=(4,),  # 4 rows: every chunk in bucket 0
    all_arms=True,
    bucket_targets=(),
    epsilon=0.5,
    window=32,
    min_plays=1,
    fixed_table=(),
    sglang_ladder=(),
)


@pytest.fixture(scope="module")
def setup(mirror):
    target = mirror.target(CFG)
    vocab = np.sort(np.random.default_rng(0).permutation(CFG.vocab_size)[:96])
    engine = RolloutEngine(
        target,
        EngineConfig(max_new_tokens=40, max_cache_len=96, chunk_steps=4, compact=False),
        eos_ids=[EOS],
        drafter=mirror3(target, vocab, 0.02, (2, 1, 0)),
        draft_vocab=vocab,
    )
    plain = engine.generate(PROMPTS, n=2, key=jax.random.key(0), sampling=GREEDY, hooks=FixedMode("plain"))
    return engine, plain


@pytest.mark.parametrize("seed", [0, 1])
def test_beg_mab_over_eagle3_arms_decodes_plain_tokens_and_learns_each_arm(setup, seed):
    engine, plain = setup
    policy = build_policy(BanditSection(**SECTION), engine, seed=seed)
    assert policy.policy.cfg.arms == ARMS
    assert [engine.modes[a].drafter for a in ARMS[1:]] == ["ngram", "eagle", "eagle"]
    assert engine.aux_layers == (2, 1, 0)  # the rollout's target returns the three layers' states
    out = engine.generate(PROMPTS, n=2, key=jax.random.key(0), sampling=GREEDY, hooks=policy)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    assert out.finish_reason == plain.finish_reason
    np.testing.assert_allclose(out.logprobs, plain.logprobs, atol=1e-5)

    modes = [c.mode for c in out.stats.chunks]
    assert modes[:4] == list(ARMS), modes  # plain, then every arm once: EAGLE-3 after n-gram
    assert set(modes) == set(ARMS)
    # the EAGLE-3 chunks, which follow plain and n-gram chunks, accept drafts (the identity above would be
    # trivial if they did not): 1.7-1.8 tokens per round here, 1.42-1.52 in whole fixed-mode rollouts
    eagle3 = [c for c in out.stats.chunks if c.mode in EAGLE3_ARMS]
    accept = sum(c.accepted_tokens for c in eagle3) / sum(c.verify_rounds for c in eagle3)
    assert accept > 1.3, [(c.mode, c.accept_length) for c in eagle3]
    # the selector's state: per arm, one reward (the chunk's rate at its starting rows) and one accept
    # length per chunk it played, in the one bucket the rollout visited
    summary = policy.policy.summary()
    state = jax.device_get(policy.policy.state)
    for a, arm in enumerate(ARMS):
        chunks = [c for c in out.stats.chunks if c.mode == arm]
        assert policy.chosen[(0, arm)] == len(chunks) == summary[f"bandit/b0/{arm}/count"], arm
        rewards = np.asarray(state.rewards[0, a])
        np.testing.assert_allclose(
            np.sort(rewards[~np.isnan(rewards)]),
            np.sort(np.float32([c.rate_at_start_rows for c in chunks])),
            rtol=1e-6,
        )
        if arm != "plain":
            want = np.mean([c.accept_length for c in chunks])
            assert summary[f"bandit/b0/{arm}/accept"] == pytest.approx(want, rel=1e-5), arm
