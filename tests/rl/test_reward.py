"""DAPO's overlong reward shaping (tlt_jax/rl/reward.py): the term at and around its boundaries, added to the
verifier's rewards by the reward phase and logged (composed with DAPO's -1 / +1 as VeRL's DAPO reward manager
composes them), reaching the step plan from the config, and its errors."""

from __future__ import annotations

import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt_jax import config_lib
from tlt_jax.models.tokenizer import ByteTokenizer
from tlt_jax.rl import config as rl_config
from tlt_jax.rl.plan import StepPlan
from tlt_jax.rl.reward import OverlongShaping, score_rollout
from tlt_jax.rollout.types import Rollout, RolloutStats
from tlt_jax.tasks import Problem, RewardResult, make_task
from tlt_jax.tasks.datasets import task_config

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


def test_dapo_scale_with_overlong_shaping_as_verl_composes_them(tmp_path) -> None:
    # VeRL's DAPORewardManager (verl/workers/reward_manager/dapo.py): reward = score (math_dapo: +1 / -1) +
    # min(-(L - (L_max - buffer)) / buffer * penalty_factor, 0). Cap 40, buffer 8, factor 1: from 32 tokens on
    row = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "q"}],
           "reward_model": {"style": "rule", "ground_truth": "34"}}  # fmt: skip
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "d.parquet")
    tok = ByteTokenizer()  # one token per byte: the response texts set the lengths
    answers = [("Answer: 34", 12), ("Answer: 35", 30), ("Answer: 34", 36), ("Answer: 35", 40)]
    texts = ["x" * (n - len(a) - 1) + "\n" + a for a, n in answers]
    ids = [tok.encode(t) for t in texts]
    ro = Rollout(
        prompt_tokens=[[1]] * 4,
        prompt_index=np.zeros(4, np.int32),
        tokens=np.asarray([i + [0] * (40 - len(i)) for i in ids], np.int32),
        logprobs=np.zeros((4, 40), np.float32),
        lengths=np.asarray([len(i) for i in ids]),
        finish_reason=["eos"] * 3 + ["length"],
        stats=RolloutStats(num_tokens=118, wall_seconds=1.0),
    )
    assert ro.lengths.tolist() == [12, 30, 36, 40]
    shaping = OverlongShaping(buffer=8, penalty=1.0, max_len=40)
    for scale, low in (("verl", -1.0), ("unit", 0.0)):
        task = make_task(
            task_config("parquet", path=str(tmp_path / "d.parquet"), reward="verl", reward_scale=scale)
        )
        scores = score_rollout(task, tok, [task.problem(0)], ro, 4, shaping)
        # by hand: 12 and 30 tokens: no penalty; 36: -(36 - 32) / 8 = -0.5; 40 (the cap): -1
        want = [1.0, low, 1.0 - 0.5, low - 1.0]
        np.testing.assert_allclose(scores.rewards, want)
        assert [r.correct for r in scores.results] == [True, False, True, False]
        assert scores.overlong_metrics() == pytest.approx(
            {"reward/overlong_mean": -1.5 / 4, "reward/overlong_frac": 0.5}
        )
