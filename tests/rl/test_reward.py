"""DAPO's overlong reward shaping (tlt_jax/rl/reward.py): the term at and around its boundaries, added to the
verifier's rewards by the reward phase and logged, reaching the step plan from the config, and its errors."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from tlt_jax import config_lib
from tlt_jax.rl import config as rl_config
from tlt_jax.rl.plan import StepPlan
from tlt_jax.rl.reward import OverlongShaping, score_rollout
from tlt_jax.rollout.types import Rollout, RolloutStats
from tlt_jax.tasks import Problem, RewardResult

SMOKE = pathlib.Path(__file__).resolve().parents[2] / "configs" / "smoke.py"


def test_shaping_at_the_boundaries() -> None:
    # cap 20, buffer 4: 0 up to 16 tokens, then -(L - 16) / 4, -1 at the cap and beyond; scaled by penalty
    shaping = OverlongShaping(buffer=4, penalty=1.0, max_len=20)
    lengths = np.array([0, 15, 16, 17, 18, 19, 20, 21, 40])
    want = [0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    np.testing.assert_allclose(shaping.rewards(lengths), want)
    half = OverlongShaping(buffer=4, penalty=0.5, max_len=20).rewards(lengths)
    np.testing.assert_allclose(half, np.asarray(want) * 0.5)
    assert half.dtype == np.float32
    off = OverlongShaping(buffer=0, max_len=20)
    assert not off.enabled and not off.rewards(lengths).any()


def test_the_reward_phase_adds_and_logs_it() -> None:
    class Codec:
        def decode(self, ids):
            return "x" * len(ids)

    class Task:
        def score(self, problem, text):
            return RewardResult(reward=1.0, correct=True, format_ok=True, extracted=text)

    lengths = np.array([2, 6, 7, 8])
    ro = Rollout(
        prompt_tokens=[[1]] * 4,
        prompt_index=np.zeros(4, np.int32),
        tokens=np.ones((4, 8), np.int32),
        logprobs=np.zeros((4, 8), np.float32),
        lengths=lengths,
        finish_reason=["eos"] * 3 + ["length"],
        stats=RolloutStats(num_tokens=int(lengths.sum()), wall_seconds=1.0),
    )
    problems = [Problem("a", "q", "x", {})]
    plain = score_rollout(Task(), Codec(), problems, ro, 4)
    assert plain.overlong is None and plain.overlong_metrics() == {}
    shaped = score_rollout(Task(), Codec(), problems, ro, 4, OverlongShaping(buffer=4, max_len=8))
    np.testing.assert_allclose(shaped.rewards, [1.0, 0.5, 0.25, 0.0])  # cap 8, buffer 4: from 4 tokens on
    assert shaped.accuracy == 1.0  # the verifier's verdicts are unchanged
    assert shaped.overlong_metrics() == pytest.approx(
        {"reward/overlong_mean": -2.25 / 4, "reward/overlong_frac": 0.75}
    )


def test_config_to_plan_and_errors() -> None:
    c = config_lib.load_config_file(SMOKE)  # max_new_tokens 16
    assert not StepPlan.from_config(rl_config.validate_grpo(c)).overlong.enabled
    c.rl.overlong_buffer, c.rl.overlong_penalty = 4, 0.5
    plan = StepPlan.from_config(rl_config.validate_grpo(c))
    assert plan.overlong == OverlongShaping(buffer=4, penalty=0.5, max_len=16)
    c.rl.overlong_buffer = 16
    with pytest.raises(ValueError, match=r"overlong_buffer=16 must be < config.rollout.max_new_tokens=16"):
        rl_config.validate_grpo(c)
    c.rl.overlong_buffer, c.rl.overlong_penalty = -1, -0.5
    with pytest.raises(ValueError) as e:
        rl_config.validate_grpo(c)
    assert "config.rl.overlong_buffer=-1: must be >= 0" in str(e.value)
    assert "config.rl.overlong_penalty=-0.5: must be >= 0" in str(e.value)
