"""The adaptive engine's policy hook (tlt_jax/rollout/adaptive.py): BEG-MAB choosing each chunk's mode.

A tiny target and a drafter that nearly copies it (the `mirror` fixture), sampled at T = 0.9 with coupled
verification: whatever the bandit chooses, every rollout equals the plain one token for token; the arms
really switch; compiled chunks never become rewards; and once every arm's programs exist (one rollout per
arm), rollouts under the bandit compile nothing new while it switches arms.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tlt_jax.models.config import tiny_config
from tlt_jax.rollout.adaptive import AdaptivePolicy, build_policy
from tlt_jax.rollout.beg_mab import BanditPolicy
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import ChunkView, FixedMode, RolloutInfo
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.selector_config import BanditSection, SelectorConfig
from tlt_jax.rollout.types import ChunkRecord

PROMPTS = [[9, 9, 2], [81, 65, 35, 40, 6, 10, 3, 23], [10, 53, 36, 94]]
SP = SamplingParams(temperature=0.9, top_p=0.95)
EOS = [18, 40, 77, 91, 130]  # rows end at different steps: the bandit sees several buckets
SECTION = dict(
    algorithm="beg_mab",
    arms=("plain", "3_1_4", "2_1_3", "ngram_3_1_4"),
    bucket_bounds=(1, 2, 4, 8),
    all_arms=True,
    bucket_targets=(),
    epsilon=0.3,
    window=16,
    min_plays=3,
    fixed_table=(),
    sglang_ladder=(),
)


@pytest.fixture(scope="module")
def setup(mirror):
    cfg = tiny_config(num_layers=2, tie_embeddings=False)
    target = mirror.target(cfg)
    target.lm_head[...] = target.lm_head[...] * 30.0  # a confident target: drafts get accepted
    engine = RolloutEngine(
        target,
        EngineConfig(max_new_tokens=32, max_cache_len=96, chunk_steps=4, min_cache_bucket=16),
        eos_ids=EOS,
        drafter=mirror.drafter(target, noise=0.03),
    )
    policy = build_policy(BanditSection(**SECTION), engine, seed=0)
    plain = engine.generate(PROMPTS, n=4, key=jax.random.key(1), sampling=SP, hooks=FixedMode("plain"))
    assert len(set(plain.lengths.tolist())) > 3, "rows should finish at different steps"
    return engine, policy, plain


def test_compilation_never_lands_in_a_reward(setup):
    """A fresh engine's chunks compile their programs before the chunk's clock starts: every chunk is a
    reward, the chunks that compiled took less time than compiling their programs did, and the compilation
    is accounted as its own phase of the rollout."""
    engine, policy, plain = setup
    before = {i.key for i in engine.programs.infos()}
    out = engine.generate(PROMPTS, n=4, key=jax.random.key(1), sampling=SP, hooks=policy)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    compiled = [c for c in out.stats.chunks if c.compiled]
    assert compiled and policy.compiled_chunks == len(compiled)
    fresh = [i for i in engine.programs.infos("chunk") if i.key not in before]
    assert len(fresh) == len(compiled)
    assert sum(c.seconds for c in compiled) < sum(i.compile_seconds for i in fresh)
    assert out.stats.phase_seconds["compile"] == pytest.approx(sum(c.compile_seconds for c in compiled))
    # a compiled chunk's compile_seconds spans its program's compilation (they pair in order)
    assert all(c.compile_seconds >= i.compile_seconds for c, i in zip(compiled, fresh, strict=True))
    observed = policy.policy.summary()
    counted = sum(v for k, v in observed.items() if k.endswith("/count"))
    assert counted == len(out.stats.chunks)


def test_reward_is_the_chunk_rate_scaled_to_its_starting_rows(setup):
    """2 rows for 4 steps, then 1 (a row finished inside the chunk): 12 tokens in 1.2 s is 10 tok/s, 13.3 at
    the 2 starting rows; and a rollout's rewards are exactly its chunks' scaled rates."""
    rec = ChunkRecord("plain", 2, 128, 8, 2, 1.2, new_tokens=12, running=(2, 2, 2, 2, 1, 1, 1, 1))
    assert rec.tokens_per_second == pytest.approx(10.0)
    assert rec.rate_at_start_rows == pytest.approx(10.0 * 2 / 1.5)
    engine, _, _ = setup
    policy = build_policy(BanditSection(**SECTION), engine, seed=5)
    out = engine.generate(PROMPTS, n=4, key=jax.random.key(2), sampling=SP, hooks=policy)
    rewards = np.asarray(policy.policy.state.rewards)
    np.testing.assert_allclose(
        np.sort(rewards[~np.isnan(rewards)]),
        np.sort(np.float32([c.rate_at_start_rows for c in out.stats.chunks])),
        rtol=1e-6,
    )
    assert any(c.running[-1] < c.running_start for c in out.stats.chunks)  # some rows ended inside chunks


def test_switching_arms_compiles_nothing_after_warmup(setup):
    """A selector whose choices do not depend on timing (a fixed table: a different arm in each running-batch
    bucket) runs a rollout (warm-up: it compiles what the trajectory visits), then the identical rollout
    again: the arms switch as the batch shrinks and nothing compiles. (Program keys are shapes, not arms:
    strategies sharing tokens_to_verify even share one program, so within a group switching is free.)"""
    engine, _, plain = setup
    table = ("3_1_4", "ngram_3_1_4", "2_1_3", "3_1_4", "plain")
    section = BanditSection(**dict(SECTION, algorithm="fixed", fixed_table=table))
    policy = build_policy(section, engine, seed=3)
    first = engine.generate(PROMPTS, n=4, key=jax.random.key(1), sampling=SP, hooks=policy)
    programs = engine.compile_count
    again = engine.generate(PROMPTS, n=4, key=jax.random.key(1), sampling=SP, hooks=policy)
    modes = [c.mode for c in again.stats.chunks]
    assert modes == [c.mode for c in first.stats.chunks] and len(set(modes)) >= 3, modes
    assert engine.compile_count == programs and not any(c.compiled for c in again.stats.chunks)
    for out in (first, again):
        np.testing.assert_array_equal(out.tokens, plain.tokens)
        np.testing.assert_array_equal(out.lengths, plain.lengths)
    m = policy.metrics()
    assert any(k.endswith("/chosen") for k in m) and m["bandit/compiled_chunks"] == 0


def test_fixed_table_policy_and_arm_registration(setup):
    engine, _, plain = setup
    # strategies with the same tokens_to_verify share programs: the EAGLE and n-gram 3_1_4 arms share one
    assert engine.mode_group("3_1_4") == engine.mode_group("ngram_3_1_4") == ("3_1_4", "ngram_3_1_4")
    cfg = SelectorConfig(
        arms=("plain", "3_1_4"),
        tokens_to_verify=(1, 4),
        bucket_bounds=(1, 2, 4, 2**31 - 1),
        algorithm="fixed",
        fixed_table=("3_1_4", "3_1_4", "plain", "plain"),
    )
    policy = AdaptivePolicy(BanditPolicy(cfg))
    out = engine.generate(PROMPTS, n=4, key=jax.random.key(1), sampling=SP, hooks=policy)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    for c in out.stats.chunks:
        assert c.mode == ("3_1_4" if c.running_start <= 2 else "plain"), (c.running_start, c.mode)


def test_a_new_rollout_keeps_what_the_selector_learned():
    """(from test_beg_mab.py: "learned statistics survive the reset") `on_start` restarts the rollout's own
    counts (chosen arms, compiled chunks) and leaves the selector's state, which has no per-rollout part, as
    it was: the statistics, and so the choices, carry over to the next rollout."""
    cfg = SelectorConfig(("plain", "3_1_4"), (1, 4), algorithm="egreedy", epsilon=0.0, window=8)
    hook = AdaptivePolicy(BanditPolicy(cfg, seed=0))
    info = RolloutInfo(num_prompts=1, group_size=2, max_new_tokens=8, data_shards=1, modes=("3_1_4",))
    hook.on_start(info)
    seconds = {"plain": 0.5, "3_1_4": 0.1}  # 16 and 80 tokens/s
    for _ in range(3):  # plain, then 3_1_4 (each arm once first), then the greedy 3_1_4
        mode = hook.choose_mode(2, 2)
        rec = ChunkRecord(mode, 2, 16, 4, 2, seconds[mode], compiled=True, new_tokens=8, running=(2,) * 4)
        hook.on_chunk(ChunkView(rec, (2,), 0))
    state = jax.tree_util.tree_map(np.asarray, hook.policy.state)
    before = hook.policy.summary()
    assert before["bandit/b1/plain/count"] == 1 and before["bandit/b1/3_1_4/count"] == 2
    assert hook.metrics()["bandit/compiled_chunks"] == 3 and hook.chosen
    hook.on_start(info)
    jax.tree_util.tree_map(np.testing.assert_array_equal, hook.policy.state, state)
    assert hook.policy.summary() == pytest.approx(before, nan_ok=True)
    assert not hook.chosen and hook.metrics()["bandit/compiled_chunks"] == 0
    assert hook.choose_mode(2, 2) == "3_1_4"  # what it learned leads (a fresh selector would try plain)
