"""Tests of the paper's threshold switch, `hooks.ThresholdPolicy`: plain decoding until at most `threshold`
rows have been running for `min_steps_below` consecutive decode steps, then the speculative mode for the rest
of the rollout. It is the one implementation of the switch (`SpecConfig.threshold` / `min_steps_below`; the
scheduler appends it after the caller's hooks, so it decides every chunk no strategy selector chose).

The selector's former "threshold" algorithm was removed (issue #25); its tests moved here and keep their
assertions, now on the switch driven with real `ChunkView`s: the exact, sticky rule against a plain-Python
reference (one decode step per chunk, as the selector counted chunks), the per-rollout reset, and a clear
error for `SelectorConfig(algorithm="threshold")`. The switch is host-side Python (no device program, so
nothing to compile) and keeps no state across rollouts (nothing to checkpoint): a used switch after
`on_start` chooses exactly as a fresh one, which is what the selector's checkpoint round trip checked.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from tlt_jax.rollout import scheduler
from tlt_jax.rollout import selector_config as sc
from tlt_jax.rollout.hooks import ChunkView, RolloutHooks, RolloutInfo, ThresholdPolicy
from tlt_jax.rollout.types import ChunkRecord

ARMS = ("plain", "7_1_8", "4_4_16", "15_1_16", "6_4_32", "8_4_48")
TTV = (1, 8, 16, 16, 32, 48)
INFO = RolloutInfo(num_prompts=4, group_size=16, max_new_tokens=64, data_shards=1, modes=ARMS[1:])


def _view(mode: str, running: list[int] | tuple[int, ...]) -> ChunkView:
    """The scheduler's view after a chunk of `mode` whose decode steps started at `running` rows each."""
    rec = ChunkRecord(mode, 64, 128, len(running), running[0], 0.1, running=tuple(running))
    return ChunkView(rec, (running[-1],), 0)


def _run(switch: ThresholdPolicy, chunks: list[list[int]]) -> list[str]:
    """Each chunk's mode: chosen at the chunk's first running count, then the chunk is reported."""
    modes = []
    for steps in chunks:
        modes.append(switch.choose_mode(steps[0], 64))
        switch.on_chunk(_view(modes[-1], steps))
    return modes


def _threshold_reference(running_seq, threshold, min_below):
    on, below, out = False, 0, []
    for r in running_seq:
        out.append("6_4_32" if on or (r <= threshold and below >= min_below) else "plain")
        below = below + 1 if r <= threshold else 0
        on = on or (r <= threshold and below >= min_below)
    return out


@pytest.mark.parametrize("min_below", [0, 1, 3])
def test_threshold_switch_is_exact_sticky_and_reset_per_rollout(min_below):
    """(was test_beg_mab.py::test_threshold_rule_is_exact_sticky_and_reset_per_rollout) One decode step per
    chunk: on after `min_below` consecutive steps at <= 32 rows (a step at 33 restarts the count), then on
    for the rest of the rollout even when the running count rises (50, 60); `on_start` resets it."""
    switch = ThresholdPolicy("6_4_32", threshold=32, min_steps_below=min_below)
    seq = [64, 40, 32, 30, 33, 31, 30, 29, 50, 28, 60, 12, 3, 1]  # a dip below that breaks, then holds
    got = _run(switch, [[r] for r in seq])
    want = _threshold_reference(seq, 32, min_below)
    assert got == want and want.index("6_4_32") == {0: 2, 1: 3, 3: 8}[min_below] and want[-1] == "6_4_32"
    assert switch.on
    switch.on_start(INFO)
    assert switch.choose_mode(64, 64) == "plain"
    assert not switch.on and switch.steps_below == 0


def test_a_step_above_the_threshold_restarts_the_count():
    switch = ThresholdPolicy("6_4_32", threshold=32, min_steps_below=3)
    switch.on_chunk(_view("plain", [31, 30]))
    assert switch.steps_below == 2 and not switch.on
    switch.on_chunk(_view("plain", [33]))
    assert switch.steps_below == 0 and switch.choose_mode(30, 32) == "plain"
    switch.on_chunk(_view("plain", [30, 29, 28]))
    assert switch.steps_below == 3 and switch.on and switch.choose_mode(28, 32) == "6_4_32"


def test_switch_turns_on_at_the_first_chunk_boundary_after_the_count():
    """A real rollout's running count only falls: with 4-step chunks the first speculative chunk is the one
    after the chunk in which the count reached `min_steps_below`, and every later chunk speculates."""
    steps = [64] * 6 + [40] * 5 + [20] * 7 + [9] * 9 + [3] * 5
    for min_below in (0, 2, 5, 9):
        chunks = [steps[i : i + 4] for i in range(0, len(steps), 4)]
        modes = _run(ThresholdPolicy("6_4_32", threshold=32, min_steps_below=min_below), chunks)
        reached = steps.index(20) + max(min_below - 1, 0)  # the step that completes the count
        first = reached // 4 + 1  # the chunk after the one holding that step
        assert modes == ["plain"] * first + ["6_4_32"] * (len(chunks) - first), (min_below, modes)


def test_the_switch_api_moved_from_the_policy_test():
    """(the threshold part of test_beg_mab.py::test_policy_api_summary_new_rollout_and_no_recompiles) plain
    at 64 rows; once one step ran at <= 4 rows (min_steps_below 1) the switch is on (the selector reported it
    as `bandit/sd_on`), for the rest of the rollout; the next rollout starts plain."""
    switch = ThresholdPolicy("8_4_48", threshold=4, min_steps_below=1)
    assert switch.choose_mode(64, 64) == "plain"
    for _ in range(3):
        switch.on_chunk(_view("plain", [64]))
    switch.on_chunk(_view("8_4_48", [1]))
    assert switch.on and switch.choose_mode(64, 64) == "8_4_48"  # on for the rest of the rollout
    switch.on_start(INFO)
    assert switch.choose_mode(64, 64) == "plain"


def test_a_new_rollout_starts_like_a_fresh_switch():
    """(the "threshold" case of test_beg_mab.py::test_policy_checkpoint_round_trip_continues_bit_identically)
    The switch keeps nothing across rollouts: after `on_start` a used switch makes exactly the choices of a
    fresh one (the scheduler even builds a fresh one per rollout), so a resumed run continues identically."""
    rng = np.random.default_rng(0)
    streams = [[[int(r)] for r in rng.choice([1, 2, 3, 8, 16, 30, 64], n)] for n in (60, 50)]
    used = ThresholdPolicy("6_4_32", threshold=32, min_steps_below=2)
    assert "6_4_32" in _run(used, streams[0])
    used.on_start(INFO)
    want = _run(ThresholdPolicy("6_4_32", threshold=32, min_steps_below=2), streams[1])
    assert _run(used, streams[1]) == want and "plain" in want and "6_4_32" in want


class _Chooser(RolloutHooks):
    """A selector with an opinion on the chunks starting at 20-30 rows only."""

    def choose_mode(self, running: int, batch_bucket: int) -> str | None:
        del batch_bucket
        return "7_1_8" if 20 <= running <= 30 else None


def test_the_scheduler_adds_the_spec_config_switch_for_chunks_no_hook_chose():
    """`scheduler._rollout_hooks` appends the SpecConfig switch after the caller's hooks: it decides the
    chunks they leave open and counts the steps of every chunk (the 30 and 20 of the selector's chunk
    complete its count of 2)."""
    spec = types.SimpleNamespace(threshold=32, min_steps_below=2)
    engine = types.SimpleNamespace(spec_mode="6_4_32", config=types.SimpleNamespace(spec=spec), history=None)
    hooks = scheduler._rollout_hooks(engine, _Chooser())
    switch = hooks.hooks[-1]
    assert isinstance(switch, ThresholdPolicy) and (switch.mode, switch.threshold) == ("6_4_32", 32)
    modes = []
    for steps in ([64, 64], [40, 31], [30, 20], [16, 8], [4]):
        modes.append(hooks.choose_mode(steps[0], 64))
        hooks.on_chunk(_view(modes[-1], steps))
    assert modes == ["plain", "plain", "7_1_8", "6_4_32", "6_4_32"]
    assert scheduler._rollout_hooks(types.SimpleNamespace(spec_mode=None, history=None), None).hooks == []


def test_selector_config_refuses_a_threshold_algorithm_and_names_the_switch():
    """(replaces the two `SelectorConfig.sd_arm` rows of test_beg_mab.py's error table)"""
    for kw in (dict(), dict(fixed_table=("plain",) * 4)):
        with pytest.raises(
            ValueError, match=r"SelectorConfig\.algorithm: 'threshold' is not a selector"
        ) as e:
            sc.SelectorConfig(ARMS, TTV, algorithm="threshold", **kw)
        assert "SpecConfig.threshold / min_steps_below" in str(e.value)
        assert "config.bandit.algorithm=off" in str(e.value)
    assert "threshold" not in sc.ALGORITHMS
