"""Tests of the speculative-strategy selector (tlt_jax/rollout/beg_mab.py and selector_policies.py).

Learning algorithms run on synthetic reward streams: every chunk's reward is Gaussian around a known mean per
(bucket, arm) (`MEANS`, tokens/s; the best arm of each bucket is >= 15% above the runner-up) with a standard
deviation of 10% of the bucket's best mean; running-row counts are drawn uniformly from one value per bucket.
Criterion: among the last 200 selections in each bucket, >= 80% pick the best (eligible) arm; the measured
rates over seeds 0-2 are 0.90-1.0 for beg_mab (exploring plausible arms and plain only), 0.87-0.95 for egreedy
and 0.93-1.0 for ucb1, the binomial standard error at 200 draws is ~2.5%. After the best arm changes, the same
selector with a window longer than the stream (no forgetting) scores ~0.01-0.05, so the re-convergence
criterion does test the sliding window. The rules of fixed and sglang are checked step by step against
plain-Python references. (The paper's threshold switch is no selector algorithm: it is
`hooks.ThresholdPolicy`, tested in test_threshold_switch.py, where the tests of the former "threshold"
algorithm moved.)
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rollout import beg_mab as bm
from tlt_jax.rollout import selector_config as sc
from tlt_jax.utils.checkpoint import Checkpointer

ARMS = ("plain", "7_1_8", "4_4_16", "15_1_16", "6_4_32", "8_4_48")
TTV = (1, 8, 16, 16, 32, 48)
RUNS = (1, 3, 12, 40)  # one running count in each of the paper's buckets (1 | 2-4 | 5-20 | >= 21)
MEANS = np.array(  # tokens/s per (bucket, arm): SD pays at small batch, plain wins at >= 21 rows
    [
        [100, 150, 170, 180, 205, 260],
        [300, 380, 400, 390, 500, 420],
        [900, 950, 1150, 980, 900, 800],
        [2000, 1700, 1500, 1500, 1200, 1000],
    ],
    np.float32,
)
NOISE = 0.1  # reward sd as a fraction of the bucket's best mean


class CompileCounter:
    """Counts programs lowered for XLA (fires even when the persistent compilation cache supplies them)."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            self.count += 1


_COUNTER = CompileCounter()
_select = jax.jit(bm.select, static_argnums=0)
_update = jax.jit(bm.update, static_argnums=0)


def _cfg(**kw) -> sc.SelectorConfig:
    return sc.SelectorConfig(ARMS, TTV, **kw)


def _swap_best(means: np.ndarray, eligible) -> np.ndarray:
    """Swap each bucket's best and runner-up eligible arm: the old best gets worse AND a stale arm better."""
    out = means.copy()
    for b in range(means.shape[0]):
        order = sorted((a for a in range(means.shape[1]) if eligible[b][a]), key=lambda a: -means[b, a])
        out[b, order[0]], out[b, order[1]] = means[b, order[1]], means[b, order[0]]
    return out


@functools.partial(jax.jit, static_argnums=0)
def _simulate(cfg, means_pba, running, phase, key):
    """Play a stream in one scan: select, draw the reward of (phase, bucket, arm), update."""

    def body(carry, x):
        state, key = carry
        r, p = x
        key, k_sel, k_rew = jax.random.split(key, 3)
        arm = bm.select(cfg, state, r, k_sel)
        b = bm.bucket_index(cfg, r)
        reward = means_pba[p, b, arm] + NOISE * means_pba[p, b].max() * jax.random.normal(k_rew)
        return (bm.update(cfg, state, r, arm, reward, 1.0), key), (b, arm)

    (state, _), (bs, arms) = jax.lax.scan(body, (bm.init(cfg), key), (running, phase))
    return state, bs, arms


def _best_arm_rates(cfg, n1: int, n2: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n1 chunks per bucket on MEANS, then n2 with each bucket's best and runner-up swapped. Returns the
    best-arm rate over the last 200 selections of each (phase, bucket), and every chunk's bucket and arm."""
    rng = np.random.default_rng(0)
    running = rng.choice(RUNS, 4 * (n1 + n2)).astype(np.int32)
    phase = np.r_[np.zeros(4 * n1, np.int32), np.ones(4 * n2, np.int32)]
    means2 = _swap_best(MEANS, cfg.eligible)
    _, bs, arms = _simulate(cfg, np.stack([MEANS, means2]), running, phase, jax.random.PRNGKey(0))
    bs, arms = np.asarray(bs), np.asarray(arms)
    rates = np.zeros((2, 4))
    for p, (lo, hi, means) in enumerate(((0, 4 * n1, MEANS), (4 * n1, 4 * (n1 + n2), means2))):
        for b in range(4):
            best = max((a for a in range(len(ARMS)) if cfg.eligible[b][a]), key=lambda a: means[b, a])
            last = arms[lo:hi][bs[lo:hi] == b][-200:]
            assert len(last) == 200
            rates[p, b] = np.mean(last == best)
    return rates, bs, arms


@pytest.mark.parametrize("algorithm", ["beg_mab", "egreedy", "ucb1"])
def test_bandits_converge_then_reconverge_after_the_best_arm_changes(algorithm):
    """Default config (window 300, epsilon 0.1, ucb_c 0.15); 1200 chunks per bucket, then 600 with the best
    and runner-up of each bucket swapped: >= 80% best arm in the last 200 of each phase and bucket."""
    cfg = _cfg(algorithm=algorithm)
    rates, bs, arms = _best_arm_rates(cfg, 1200, 600)
    assert (rates >= 0.8).all(), rates
    assert all(cfg.eligible[b][a] for b, a in zip(bs, arms, strict=True))
    if algorithm == "beg_mab":  # the grouping decides where SD can be tried: bs 1 -> the 48-token tree only
        assert set(arms[bs == 0]) == {0, 5} and set(arms[bs == 3]) == {0, 1}
    if algorithm == "egreedy":  # control: without forgetting (a window longer than the stream) it fails
        rates, _, _ = _best_arm_rates(_cfg(algorithm=algorithm, window=4 * 1800), 1200, 600)
        assert (rates[0] >= 0.8).all() and (rates[1] < 0.5).all(), rates


def test_beg_eligibility_is_the_papers_grouping_plus_plain():
    cfg = _cfg()
    want = [
        (True, False, False, False, False, True),  # bs 1 -> 48 tokens
        (True, False, False, False, True, False),  # 2-4 -> 32
        (True, False, True, True, False, False),  # 5-20 -> 16 (both 16-token strategies)
        (True, True, False, False, False, False),  # >= 21 -> 8
    ]
    assert [list(r) for r in cfg.eligible] == [list(r) for r in want]
    assert sc.beg_eligibility((1, 12, 20, 40), (16,)) == ((True, True, True, False),)  # a tie keeps both
    assert _cfg(algorithm="egreedy").eligible == sc.all_arms_eligibility(4, len(ARMS))


@pytest.mark.parametrize("algorithm", ["beg_mab", "egreedy"])
def test_each_eligible_arm_is_tried_first_in_index_order(algorithm):
    """egreedy tries every eligible arm once; beg_mab plays plain (the reference) `min_plays` times first.
    Even always-explore (epsilon 1) must try every arm first."""
    cfg = _cfg(algorithm=algorithm, epsilon=1.0)
    state = bm.init(cfg)
    for b, r in enumerate(RUNS):
        want = [a for a in range(len(ARMS)) if cfg.eligible[b][a]]
        if algorithm == "beg_mab":
            want = [0] * (cfg.min_plays - 1) + want
        tried = []
        for i in range(len(want)):
            arm = int(_select(cfg, state, r, jax.random.PRNGKey(100 * b + i)))
            tried.append(arm)
            state = _update(cfg, state, r, arm, 1.0, 1.0)
        assert tried == want


def _stream(cfg, state, reward_of, n: int, running: int = 1, seed: int = 0):
    """n selections at `running` rows, each rewarded by reward_of(arm, i); returns (state, arms played)."""
    played = []
    for i in range(n):
        arm = int(_select(cfg, state, running, jax.random.PRNGKey(seed + i)))
        played.append(arm)
        state = _update(cfg, state, running, arm, reward_of(arm, i), 1.0)
    return state, played


def test_beg_mab_trusts_plain_only_after_min_plays_so_one_slow_chunk_does_not_decide():
    """plain's first chunk is slowed (50 tok/s, another process) but it really runs at 100; the SD arm runs at
    80. With min_plays 3 plain is played until its median (100) outvotes the slow chunk, and plain leads; the
    paper's rule (min_plays 1) ranks plain by that one chunk and exploits the SD arm from then on."""
    reward = lambda arm, i: (50.0 if i == 0 else 100.0) if arm == 0 else 80.0  # noqa: E731
    for min_plays, want in ((3, 0), (1, 1)):
        cfg = sc.SelectorConfig(("plain", "3_1_4"), (1, 4), epsilon=0.0, min_plays=min_plays, window=50)
        state, played = _stream(cfg, bm.init(cfg), reward, 40)
        assert played[: min_plays + 1] == [0] * min_plays + [1]  # plain to min_plays, then every arm once
        assert set(played[-20:]) == {want}, (min_plays, played)


def test_beg_mab_explores_only_plausible_arms_and_re_measures_stale_ones():
    """Arm 1 (a verify tree at many rows) runs at half plain's speed: once trusted plain leads, arm 1's best
    reward is below plain's median, so even epsilon = 1 never explores it; arm 2 (within noise of plain) is
    explored. After `window` plays of the bucket without it, arm 1 has no fresh reward, and it is re-measured
    once `window x 2` plays (its slowdown) have passed since its last play: every ~41 plays, no more often."""
    elig = sc.all_arms_eligibility(4, 3)
    cfg = sc.SelectorConfig(("plain", "7_1_8", "2_1_3"), (1, 8, 3), eligible=elig, epsilon=1.0, window=20)
    rng = np.random.default_rng(0)
    means = (100.0, 50.0, 98.0)
    state, played = _stream(cfg, bm.init(cfg), lambda arm, i: means[arm] + rng.normal(0, 3), 200)
    assert played[:5] == [0, 0, 0, 1, 2], played  # plain to min_plays, then each arm once
    plays = [i for i, a in enumerate(played) if a == 1]
    gaps = np.diff(plays)
    assert len(plays) >= 200 // 42 and (gaps > 2 * 20 * 0.9).all() and (gaps <= 2 * 20 * 1.2 + 1).all(), plays
    assert played.count(0) > 60 and played.count(2) > 60  # epsilon = 1: uniform over the two plausible arms


def test_window_keeps_the_last_rewards_and_greedy_ranks_by_it():
    cfg = sc.SelectorConfig(("plain", "3_1_4"), (1, 4), algorithm="egreedy", epsilon=0.0, window=5)
    state = bm.init(cfg)
    for x in range(13):
        state = _update(cfg, state, 12, 1, float(x), 2.0)
    np.testing.assert_array_equal(np.sort(state.rewards[2, 1]), [8, 9, 10, 11, 12])
    assert int(state.count[2, 1]) == 13 and int(state.head[2, 1]) == 3 and int(state.bucket_steps[2]) == 13
    rewards = np.asarray(state.rewards)
    assert np.isnan(rewards[[0, 1, 3]]).all() and np.isnan(rewards[2, 0]).all()
    # plain: 5 x 100 then 5 x 1 (lifetime mean 50.5 > 50, window mean 1) vs the SD arm: 5 x 50
    state = bm.init(cfg)
    for x in [100.0] * 5 + [1.0] * 5:
        state = _update(cfg, state, 1, 0, x, 0.0)
    for _ in range(5):
        state = _update(cfg, state, 1, 1, 50.0, 2.0)
    assert int(_select(cfg, state, 1, jax.random.PRNGKey(0))) == 1
    state = _update(cfg, state, 1, 0, 1000.0, 0.0)  # window mean of plain becomes (4 * 1 + 1000) / 5
    assert int(_select(cfg, state, 1, jax.random.PRNGKey(0))) == 0
    # ucb1 counts plays in the bucket's last `window` plays: an arm pushed out of it is re-measured
    cfg = sc.SelectorConfig(("plain", "3_1_4"), (1, 4), algorithm="ucb1", window=5)
    state = bm.init(cfg)
    for arm, x in [(0, 1.0), (1, 100.0)] + [(1, 100.0)] * 3:
        state = _update(cfg, state, 1, arm, x, 2.0)
    assert int(_select(cfg, state, 1, jax.random.PRNGKey(0))) == 1  # plain still in the window: exploit
    state = _update(cfg, state, 1, 1, 100.0, 2.0)  # plain's only play leaves the window
    assert int(_select(cfg, state, 1, jax.random.PRNGKey(0))) == 0


def test_bucket_index_and_fixed_table_follow_the_bounds():
    table = ("8_4_48", "6_4_32", "4_4_16", "plain")
    cfg = _cfg(algorithm="fixed", fixed_table=table)
    state = bm.init(cfg)
    cases = {0: 0, 1: 0, 2: 1, 4: 1, 5: 2, 20: 2, 21: 3, 10**6: 3, 2**31 - 1: 3}
    for running, b in cases.items():
        assert int(bm.bucket_index(cfg, running)) == b
        assert ARMS[int(_select(cfg, state, running, jax.random.PRNGKey(running)))] == table[b]
    narrow = sc.SelectorConfig(ARMS, TTV, bucket_bounds=(8,), algorithm="fixed", fixed_table=("plain",))
    assert int(bm.bucket_index(narrow, 1000)) == 0  # above the last bound -> the last bucket


SG_ARMS = ("plain", "1_1_2", "3_1_4", "7_1_8")


def _sg_cfg(**kw) -> sc.SelectorConfig:
    return sc.SelectorConfig(SG_ARMS, (1, 2, 4, 8), algorithm="sglang", sglang_ladder=SG_ARMS, **kw)


def _chain_accept(arm: int, alpha: float) -> float:
    """Tokens per round of a chain of depth d with per-draft acceptance alpha; plain reports 0 (engine)."""
    depth = (1, 2, 4, 8)[arm] - 1
    return 0.0 if depth == 0 else 1.0 + sum(alpha**i for i in range(1, depth + 1))


def _alpha_table(alphas) -> np.ndarray:
    """[T, arm] accept lengths of chains with per-draft acceptance alphas[t]."""
    return np.asarray([[_chain_accept(a, x) for a in range(4)] for x in alphas], np.float32)


def _sglang_reference(cfg, table):
    """Plain-Python statement of the sglang rule (float32 EMA); table[t, arm] = accept length of chunk t."""
    caps = [m - 1 for m in cfg.ladder_max_accept]
    a, rung, ema, since, rungs = np.float32(cfg.sglang_alpha), cfg.ladder_start[0], None, 0, []
    for t in range(len(table)):
        rungs.append(rung)
        if caps[rung] > 0:
            g = np.float32(table[t, cfg.ladder_index[rung]] - 1.0)
            ema = g if ema is None else np.float32((1 - a) * ema + a * g)
        since += 1
        up, down = rung + 1 < len(caps), rung > 0
        if caps[rung] == 0:
            if up and 0 < cfg.sglang_probe_interval <= since:
                rung, since, ema = rung + 1, 0, None
        elif since >= cfg.sglang_min_obs and ema is not None:
            floor = cfg.sglang_down * caps[rung - 1] if down and caps[rung - 1] else cfg.sglang_plain_floor
            if down and ema < floor:
                rung, since = rung - 1, 0
            elif up and ema > cfg.sglang_up * caps[rung]:
                rung, since = rung + 1, 0
    return rungs


@functools.partial(jax.jit, static_argnums=0)
def _sglang_scan(cfg, table):
    def body(state, acc_a):
        arm = bm.select(cfg, state, 1, jax.random.PRNGKey(0))
        return bm.update(cfg, state, 1, arm, 100.0, acc_a[arm]), arm

    return jax.lax.scan(body, bm.init(cfg), table)[1]


def _run_sglang(cfg, table) -> list[int]:
    """The rung of every chunk (the ladder is SG_ARMS itself, so rung == arm index)."""
    return [int(x) for x in _sglang_scan(cfg, np.asarray(table, np.float32))]


def _moves(rungs):
    return [(t, rungs[t - 1], rungs[t]) for t in range(1, len(rungs)) if rungs[t] != rungs[t - 1]]


def test_sglang_climbs_and_descends_its_ladder():
    """Acceptance 0.95 for 100 chunks, 0.3 for 100, 0.1 for 100; start on plain, which probes a rung up."""
    cfg = _sg_cfg()
    table = _alpha_table([0.95] * 100 + [0.3] * 100 + [0.1] * 100)
    rungs = _run_sglang(cfg, table)
    assert rungs == _sglang_reference(cfg, table)
    visits = [r for i, r in enumerate(rungs) if i == 0 or r != rungs[i - 1]]
    assert visits[:7] == [0, 1, 2, 3, 2, 1, 0]  # probe up, climb to depth 7, back down to plain
    assert rungs[99] == 3 and rungs[199] == 1  # 0.3 still pays at depth 1 (0.3 > plain floor 0.25)
    assert set(rungs[210:]) <= {0, 1} and rungs.count(1) > 0  # then only probes from plain, each dropped
    moves = _moves(rungs)
    assert all(t2 - t1 >= cfg.sglang_min_obs for (t1, *_), (t2, *_) in itertools.pairwise(moves))


def test_sglang_hysteresis_does_not_oscillate_between_thresholds():
    # 0.85 acceptance: depth 1 accepts 0.85 of 1 draft (> up 0.8): one move up; depth 3 accepts 2.18 of 3,
    # below up (2.4) and far above down (0.5 of depth 1's draft): it stays, no bounce back.
    cfg = _sg_cfg(sglang_start=1)
    rungs = _run_sglang(cfg, _alpha_table([0.85] * 400))
    assert _moves(rungs) == [(cfg.sglang_min_obs, 1, 2)]
    # a noisy stream sitting between the thresholds of depth 3 (0.5 < drafts accepted < 2.4) never moves
    gains = np.clip(1.5 + 0.5 * np.random.default_rng(0).standard_normal(600), 0.6, 2.3)
    table = np.repeat(1.0 + gains[:, None], 4, axis=1)
    assert set(_run_sglang(_sg_cfg(sglang_start=2), table)) == {2}
    # the same stream from depth 1 (drafts accepted > 0.8 of its 1 draft, mostly) climbs once and stays
    rungs = _run_sglang(cfg, table)
    assert len(_moves(rungs)) == 1 and rungs[-1] == 2 and rungs == _sglang_reference(cfg, table)


@pytest.mark.parametrize("algorithm", sc.ALGORITHMS)
def test_select_and_update_compile_once_for_traced_values(algorithm):
    cfg = _cfg(
        algorithm=algorithm,
        fixed_table=("8_4_48", "6_4_32", "4_4_16", "plain"),
        sglang_ladder=("plain", "7_1_8", "15_1_16", "8_4_48"),
    )
    # jit caches are shared by every jax.jit of the same function (one entry per static config): count deltas
    sel, upd = jax.jit(bm.select, static_argnums=0), jax.jit(bm.update, static_argnums=0)
    sizes = sel._cache_size(), upd._cache_size()
    state = upd(cfg, bm.init(cfg), 5, sel(cfg, bm.init(cfg), 5, jax.random.PRNGKey(0)), 10.0, 2.0)
    assert (sel._cache_size(), upd._cache_size()) == (sizes[0] + 1, sizes[1] + 1)
    before = _COUNTER.count
    rng = np.random.default_rng(0)
    for i in range(100):
        running = int(rng.integers(0, 200))
        arm = sel(cfg, state, running, jax.random.PRNGKey(i))
        state = upd(cfg, state, running, arm, float(rng.uniform(1, 500)), float(rng.uniform(0, 5)))
    assert _COUNTER.count == before
    assert (sel._cache_size(), upd._cache_size()) == (sizes[0] + 1, sizes[1] + 1)
    assert int(state.bucket_steps.sum()) == 101


def _play(policy: bm.BanditPolicy, steps: int, seed: int) -> list[str]:
    """Drive a policy with a deterministic stream (reward and accept length depend on the arm chosen)."""
    rng = np.random.default_rng(seed)
    running = rng.choice([1, 2, 3, 8, 16, 30, 64], steps)
    noise = rng.standard_normal(steps)
    chosen = []
    for t in range(steps):
        r = int(running[t])
        arm = policy.select(r)
        a = ARMS.index(arm)
        policy.observe(
            arm,
            r,
            float(MEANS[int(bm.bucket_index(policy.cfg, r)), a] * (1 + 0.1 * noise[t])),
            _chain_accept(min(a, 3), 0.7),
        )
        chosen.append(arm)
    return chosen


@pytest.mark.parametrize("algorithm", ["beg_mab", "sglang"])
def test_policy_checkpoint_round_trip_continues_bit_identically(algorithm, tmp_path):
    cfg = _cfg(
        algorithm=algorithm,
        fixed_table=("8_4_48", "6_4_32", "4_4_16", "plain"),
        sglang_ladder=("plain", "7_1_8", "15_1_16", "8_4_48"),
        sglang_probe_interval=3,
    )
    policy = bm.BanditPolicy(cfg, seed=1)
    _play(policy, 60, seed=0)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(7, policy.state_dict())
        restored_tree, _ = ckpt.restore(7, abstract_state=bm.BanditPolicy(cfg, seed=99).state_dict())
    resumed = bm.BanditPolicy(cfg, seed=99)  # a different seed: the key must come from the checkpoint
    resumed.load_state_dict(restored_tree)
    want, got = _play(policy, 50, seed=1), _play(resumed, 50, seed=1)
    assert got == want
    jax.tree_util.tree_map(np.testing.assert_array_equal, resumed.state_dict(), policy.state_dict())
    assert resumed.summary() == pytest.approx(policy.summary(), nan_ok=True)


def test_policy_api_summary_and_no_recompiles():
    """(The threshold switch's part of this test moved to test_threshold_switch.py; that the selector keeps
    what it learned across rollouts: test_adaptive.py::test_a_new_rollout_keeps_what_the_selector_learned.)"""
    cfg = _cfg(algorithm="fixed", fixed_table=("8_4_48", "6_4_32", "4_4_16", "plain"))
    policy = bm.BanditPolicy(cfg)
    assert policy.select(64) == "plain" and policy.select(1) == "8_4_48"
    for tps in (10.0, 30.0, 20.0):
        policy.observe("plain", 64, tps, 0.0)
    policy.observe("8_4_48", 1, 50.0, 3.5)
    s = policy.summary()
    assert s["bandit/b3/plain/count"] == 3 and s["bandit/b3/plain/reward"] == 20.0
    assert s["bandit/b3/plain/reward_mean"] == 20.0 and s["bandit/b0/8_4_48/accept"] == 3.5
    with pytest.raises(ValueError, match="unknown arm"):
        policy.observe("9_9_99", 1, 1.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        policy.observe("plain", 1, float("nan"), 1.0)
    sizes = (bm._select_jit._cache_size(), bm._update_jit._cache_size())
    before = _COUNTER.count
    for i in range(100):
        arm = policy.select(1 + i % 40)
        policy.observe(arm, 1 + i % 40, 1.0 + i, 1.0)
    assert _COUNTER.count == before
    assert (bm._select_jit._cache_size(), bm._update_jit._cache_size()) == sizes


def test_policy_learns_the_mean_speed_of_all_processes(monkeypatch):
    """Several processes (faked: the other one measured 40 tokens/s more and the same acceptance) learn the
    mean of their measured speeds, so they hold one state and choose one arm; a non-finite speed in any
    process fails in all of them (no process waits on a collective the others left)."""
    from jax.experimental import multihost_utils

    cfg = _cfg(algorithm="egreedy", epsilon=0.0)
    gathered = []

    def allgather(x, tiled=False):  # noqa: ANN001, ANN202
        gathered.append(np.asarray(x))
        return np.stack([x, x + np.float32([40.0, 0.0])])

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    policy = bm.BanditPolicy(cfg)
    policy.observe("plain", 64, 100.0, 0.0)
    policy.observe("8_4_48", 64, 30.0, 3.5)
    s = policy.summary()
    assert s["bandit/b3/plain/reward"] == 120.0 and s["bandit/b3/8_4_48/reward"] == 50.0
    assert s["bandit/b3/8_4_48/accept"] == 3.5 and len(gathered) == 2
    with pytest.raises(ValueError, match="finite"):
        policy.observe("plain", 64, float("inf"), 1.0)
    monkeypatch.undo()  # one process: the measured values themselves
    policy.observe("plain", 64, 100.0, 0.0)
    assert policy.summary()["bandit/b3/plain/reward_mean"] == pytest.approx((120.0 + 100.0) / 2)


@pytest.mark.devices(4)
def test_policy_loads_a_state_replicated_over_a_mesh_onto_this_process():
    """A multi-process checkpoint restores the selector's leaves replicated over every device
    (utils/checkpoint.py); loaded, the selector runs on one device again, as a fresh one does."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tlt_jax import sharding as shd

    cfg = _cfg(algorithm="beg_mab")
    policy = bm.BanditPolicy(cfg, seed=1)
    _play(policy, 20, seed=0)
    everywhere = NamedSharding(shd.make_mesh(data=4), P())
    resumed = bm.BanditPolicy(cfg, seed=5)
    resumed.load_state_dict(jax.device_put(policy.state_dict(), everywhere))
    for leaf in jax.tree.leaves(resumed.state_dict()):
        assert len(leaf.sharding.device_set) == 1
    assert _play(resumed, 20, seed=1) == _play(policy, 20, seed=1)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(arms=("plain", "plain"), tokens_to_verify=(1, 1)), r"SelectorConfig\.arms"),
        (dict(tokens_to_verify=(2, 8, 16, 16, 32, 48)), r"SelectorConfig\.tokens_to_verify.*'plain'"),
        (dict(bucket_bounds=(4, 1)), r"SelectorConfig\.bucket_bounds.*increasing"),
        (dict(algorithm="bandit"), r"SelectorConfig\.algorithm.*one of"),
        (dict(eligible=((True,) * 6,) * 3), r"SelectorConfig\.eligible.*num_buckets"),
        (dict(eligible=((True,) * 6,) * 3 + ((False,) * 6,)), r"SelectorConfig\.eligible.*no eligible"),
        (dict(bucket_targets=(48, 16)), r"SelectorConfig\.bucket_targets"),
        (dict(max_accept=(1, 9, 16, 16, 32, 48)), r"SelectorConfig\.max_accept"),
        (dict(epsilon=1.5), r"SelectorConfig\.epsilon"),
        (dict(algorithm="fixed"), r"SelectorConfig\.fixed_table"),
        (dict(algorithm="fixed", fixed_table=("plain", "x", "plain", "plain")), r"SelectorConfig\.fixed"),
        (dict(algorithm="sglang"), r"SelectorConfig\.sglang_ladder"),
        (dict(algorithm="sglang", sglang_ladder=("8_4_48", "7_1_8")), r"sglang_ladder.*shallow to deep"),
        (dict(algorithm="sglang", sglang_ladder=("plain",), sglang_up=0.5), r"up > down"),
        (dict(algorithm="sglang", sglang_ladder=("plain",), sglang_start=3), r"sglang_start"),
    ],
)
def test_config_errors_name_the_field_and_the_fix(kw, match):
    base = dict(arms=ARMS, tokens_to_verify=TTV)
    with pytest.raises(ValueError, match=match):
        sc.SelectorConfig(**{**base, **kw})


def test_config_is_hashable_and_lists_become_tuples():
    a = sc.SelectorConfig(list(ARMS), list(TTV), bucket_bounds=[1, 4, 20, 2**31 - 1])
    b = _cfg()
    assert a == b and hash(a) == hash(b)
    assert jnp.asarray(a.eligible).shape == (4, len(ARMS))
