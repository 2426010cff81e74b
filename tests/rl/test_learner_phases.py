"""The RL step's phases on their own, without a learner: the step plan, rewards, advantages and the batch,
the update's skip and log-prob branches, and the metrics' assembly (values, order, timings)."""

from __future__ import annotations

import pathlib
import types

import jax
import numpy as np
import pytest

from tlt_jax import config_lib
from tlt_jax.rl import config as rl_config
from tlt_jax.rl.advantages import Advantages, step_advantages, train_batch
from tlt_jax.rl.metrics import (
    StepClock,
    engine_gap_metrics,
    finish_metrics,
    learning_metrics,
    scheduled_lr,
)
from tlt_jax.rl.optimizer import OptimConfig
from tlt_jax.rl.plan import StepPlan
from tlt_jax.rl.reward import Scores, score_rollout
from tlt_jax.rl.update import UpdateResult, old_logprobs, update_policy
from tlt_jax.rollout.types import Rollout, RolloutStats
from tlt_jax.tasks import Problem, RewardResult

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
PLAN = StepPlan(prompts=2, group=4, seq_bucket=4, max_response=6, optim=OptimConfig(lr=0.1, warmup_steps=3))


def rollout(lengths=(3, 1, 6, 2, 4, 4, 1, 5), finish=None) -> Rollout:
    """Two prompts x four samples; response tokens 1..6 of each row up to its length, log-probs -0.5."""
    lengths = np.asarray(lengths)
    tokens = np.where(np.arange(6)[None] < lengths[:, None], np.arange(1, 7)[None], 0)
    return Rollout(
        prompt_tokens=[[7, 8]] * 4 + [[9]] * 4,
        prompt_index=np.repeat([0, 1], 4),
        tokens=tokens,
        logprobs=np.full((8, 6), -0.5, np.float32),
        lengths=lengths,
        finish_reason=finish or ["eos"] * 7 + ["length"],
        stats=RolloutStats(num_tokens=int(lengths.sum()), wall_seconds=2.0),
    )


def test_step_plan_from_the_smoke_config() -> None:
    c = config_lib.load_config_file(CONFIGS / "smoke.py", "kl=0.001")
    plan = StepPlan.from_config(rl_config.validate_grpo(c))
    assert (plan.prompts, plan.group, plan.rows, plan.mini_rows) == (2, 8, 16, 16)
    assert plan.kl_coef == 0.001 and plan.seq_bucket == 16 and plan.max_response == 16
    assert plan.advantage == c.rl.advantage and plan.loss_agg == c.rl.loss_agg


def test_score_rollout_decodes_and_scores_every_row() -> None:
    class Codec:
        def decode(self, ids):
            return "".join(map(str, ids))

    class Task:
        def score(self, problem, text):
            ok = text == problem.answer
            return RewardResult(reward=float(ok), correct=ok, format_ok=bool(text), extracted=text)

    problems = [Problem("a", "q0", "123", {}), Problem("b", "q1", "1", {})]
    scores = score_rollout(Task(), Codec(), problems, rollout(), rows=8)
    assert scores.texts[:3] == ["123", "1", "123456"]
    np.testing.assert_array_equal(scores.rewards, [1, 0, 0, 0, 0, 0, 1, 0])
    assert scores.rewards.dtype == np.float32 and scores.accuracy == 0.25 and scores.format_rate == 1.0
    with pytest.raises(ValueError):  # the rollout must have the plan's rows
        score_rollout(Task(), Codec(), problems, rollout(), rows=4)


def test_group_advantages_and_dynamic_sampling() -> None:
    rewards = np.asarray([1, 0, 1, 0, 1, 1, 1, 1], np.float32)  # group 1 all right: no signal
    adv = step_advantages(rewards, PLAN)
    np.testing.assert_allclose(adv.values, [1, -1, 1, -1, 0, 0, 0, 0], atol=1e-5)
    assert adv.keep.all() and adv.keep.shape == (8,)
    keep = np.asarray([True] * 4 + [False] * 4)  # dynamic sampling's filler group (rl/dynamic_sampling.py)
    dapo = step_advantages(rewards, StepPlan(prompts=2, group=4, advantage="drgrpo"), keep=keep)
    np.testing.assert_allclose(dapo.values, [0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0])
    np.testing.assert_array_equal(dapo.keep, keep)
    with pytest.raises(ValueError, match="keep has shape"):
        step_advantages(rewards, PLAN, keep=keep[:4])


def test_train_batch_carries_advantages_and_masks_dropped_groups() -> None:
    adv = Advantages(np.arange(8, dtype=np.float32), np.asarray([True] * 4 + [False] * 4))
    batch = train_batch(rollout(), adv, PLAN)
    assert batch.prompt.shape == (2, 4) and batch.response.shape == (2, 4, 6)  # Nb capped at max_response
    np.testing.assert_array_equal(batch.advantages, np.arange(8).reshape(2, 4))
    np.testing.assert_array_equal(batch.response_mask.sum(-1), [[3, 1, 6, 2], [0, 0, 0, 0]])


def stub_trainer(fused: bool) -> types.SimpleNamespace:
    """A trainer the phases may only ask for its settings (a call to anything else fails the test)."""
    return types.SimpleNamespace(micro_batch_size=4, loss=types.SimpleNamespace(fuse_old_logprobs=fused))


def test_update_skips_mini_batches_with_every_group_filtered() -> None:
    plan = StepPlan(prompts=2, group=4, mini_batches=2, seq_bucket=4, max_response=6)
    r = rollout()
    batch = train_batch(r, Advantages(np.zeros(8, np.float32), np.zeros(8, bool)), plan)
    batch2, logp = old_logprobs(stub_trainer(fused=True), batch, plan)  # fused, no KL: nothing to compute
    assert batch2 is batch and logp.shape == (8, 6) and not logp.any()
    out = update_policy(stub_trainer(fused=True), batch, r.lengths, logp, plan)
    assert (out.metrics, out.skipped, out.trained_cols, out.num_response) == ([], 2, 0, 6)
    assert out.train_logp is logp


def test_learning_metrics_values_and_order() -> None:
    r = rollout()
    scores = Scores(
        ["x"] * 8,
        [RewardResult(float(i % 2), bool(i % 2), i < 6, None) for i in range(8)],
        np.asarray([0, 1] * 4, np.float32),
    )
    adv = Advantages(np.asarray([-1, 1] * 4, np.float32), np.asarray([True] * 6 + [False] * 2))
    upd = UpdateResult([{"loss/pg": 1.0}, {"loss/pg": 3.0}], 1, 12, 6, np.zeros((8, 6), np.float32))
    clock = types.SimpleNamespace(walls={"rollout": 2.0})
    m = learning_metrics(2, PLAN, r, scores, adv, upd, 10, clock)
    assert list(m)[:5] == ["loss/pg", "reward/mean", "reward/std", "accuracy", "format"]
    want = {
        "loss/pg": 2.0,
        "reward/mean": 0.5,
        "reward/std": 0.5,
        "accuracy": 0.5,
        "format": 0.75,
        "length/mean": 3.25,
        "length/p50": 3.5,
        "length/max": 6.0,
        "length/clip_frac": 0.125,
        "rl/kept_frac": 0.75,
        "rl/skipped_updates": 1.0,
        "rl/adv_abs_mean": 1.0,
        "update/column_share": 12 / (8 * 6),
        "optim/lr": 0.1 * 2 / 4,  # warm-up: step 2 of 3 + 1
        "data/position": 10.0,
        "throughput/tok_per_s": 13.0,
    }
    for k, v in want.items():
        assert m[k] == pytest.approx(v), k
    assert scheduled_lr(PLAN, 100) == pytest.approx(0.1)
    empty = learning_metrics(1, PLAN, r, scores, adv, UpdateResult([], 2, 0, 6, upd.train_logp), 0, clock)
    assert "loss/pg" not in empty and next(iter(empty)) == "reward/mean"


def test_engine_gap_only_where_the_trainer_computed_log_probs() -> None:
    r = rollout()
    logp = np.full((8, 6), -0.5, np.float32)
    logp[0, 2] = -1.5  # a response token (row 0 has 3)
    logp[1, 4] = -9.0  # padding (row 1 has 1): not counted
    trained = UpdateResult([{"loss/pg": 0.0}], 0, 8, 6, logp)
    gap = engine_gap_metrics(r, trained, fused=True)
    assert gap["logprob/engine_gap_max"] == pytest.approx(1.0)
    assert gap["logprob/engine_gap"] == pytest.approx(1.0 / r.lengths.sum())
    assert engine_gap_metrics(r, UpdateResult([], 2, 0, 6, logp), fused=True) == {}  # nothing fused
    assert "logprob/engine_gap" in engine_gap_metrics(r, UpdateResult([], 2, 0, 6, logp), fused=False)


def test_finish_metrics_adds_rollout_stats_programs_and_times() -> None:
    engine = types.SimpleNamespace(compile_count=3, modes={"ngram_3_1_4": None})
    clock = StepClock(engine)
    with clock.phase("rollout"):
        jax.jit(lambda x: x * 3 + 1)(np.arange(5.0))  # a fresh program: its compilation is "compile"
    clock.carve("rollout", "spot", 1e6)  # at most what the phase has left
    with clock.phase("update"):
        pass
    m = finish_metrics({"rollout/tokens": -1.0}, rollout(), clock)
    assert m["rollout/tokens"] == -1.0  # a phase's own value wins over the rollout's statistics
    assert m["rollout/wall_s"] == 2.0 and m["programs/count"] == 3.0 and m["spec/modes"] == 1.0
    parts = ["rollout", "compile", "spot", "reward", "logprob", "update", "other"]
    assert list(m)[-9:] == [f"time/{p}" for p in parts] + ["time/step", "rollout/share"]
    assert m["time/compile"] > 0 and m["time/rollout"] == 0.0 and m["time/spot"] > 0  # all carved
    assert sum(m[f"time/{p}"] for p in parts) == pytest.approx(m["time/step"], rel=1e-9)
    assert m["rollout/share"] == pytest.approx(clock.walls["rollout"] / m["time/step"])
