"""A stop (SIGTERM's agreed stop, requested here in-process at a chosen point) loses as little as it can
(issue #52 item 4): one during an evaluation drops the evaluation and saves the step before it stops; one
that abandons a step whose start is in no checkpoint (checkpoint_every > 1) saves the state the step started
from, so resuming redoes only that step and the run ends as the uninterrupted one, bit for bit; where the step
changed part of that state in place (a donated buffer), `StepStart.changed` names the part. Real learners on
the smoke config (tests/test_main.py and tests/test_multiprocess.py stop real processes with SIGTERM)."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax import config_lib
from tlt_jax.rl.learner import Learner
from tlt_jax.rl.stopping import StepStart
from tlt_jax.rollout.hooks import RolloutHooks
from tlt_jax.utils.checkpoint import Checkpointer
from tlt_jax.utils.tracking import read_metrics

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
STEPS = 2
TRAINING = ("reward/mean", "loss/pg", "optim/grad_norm", "length/mean", "data/position")


def config():
    """The smoke run with a held-out evaluation after every step, saved only at its end (checkpoint_every
    0: every stop mid-run has completed steps that no checkpoint holds)."""
    c = config_lib.load_config_file(CONFIGS / "smoke.py", f"steps={STEPS}")
    c.task.size = 32
    c.eval.every, c.eval.prompts, c.eval.samples = 1, 2, 8  # 16 rows: the training step's programs
    c.eval.before_train = False
    c.checkpoint_every = 0
    return c


def stop_in_eval(learner: Learner, after_step: int) -> list[int]:
    """Request a stop as the evaluation after step `after_step` starts; returns the eval chunks run then."""
    chunks, run = [], learner.evaluator.run

    def run_and_count(watchers=()):
        if learner.step != after_step:
            return run(watchers)
        learner.guards.guard.request("test: a stop during the evaluation")
        counted = [*watchers, _ChunkCount(chunks)]
        return run(counted)

    learner.evaluator.run = run_and_count
    return chunks


class _ChunkCount(RolloutHooks):
    """A rollout watcher counting chunks (after the stop check: only those it let run)."""

    def __init__(self, out: list[int]):
        self.out = out

    def on_chunk(self, view) -> None:
        self.out.append(1)


def abandon_in_rollout(learner: Learner, step: int) -> None:
    """Make the processes abandon step `step` at its first rollout chunk: a stop requested as its rollout
    starts, with the last step measured as taking far longer than `stop_within` (finishing would not fit)."""
    rollout = learner._rollout

    def stopping(problems, key, params):
        if learner.step + 1 == step:
            learner.guards.agreement.last_step_s = 1e9
            learner.guards.guard.request("test: a stop that cannot finish the step")
        return rollout(problems, key, params)

    learner._rollout = stopping


def final_state(workdir: pathlib.Path) -> list[np.ndarray]:
    with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        state, meta = ckpt.restore(STEPS)
    assert meta["step"] == STEPS
    key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
    return [np.asarray(jax.random.key_data(x) if key(x) else x) for x in jax.tree.leaves(state)]


def steps_saved(workdir: pathlib.Path) -> list[int]:
    with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        return ckpt.all_steps()


@pytest.mark.slow
def test_stops_in_an_unsaved_step_and_in_an_eval_save_and_resume_to_the_same_run(tmp_path) -> None:
    ref = tmp_path / "reference"
    assert Learner(config(), str(ref)).train() == "done"
    run = tmp_path / "stopped"
    # 1. step 1 runs (unsaved: checkpoint_every 0), step 2 is abandoned at its first rollout chunk: the state
    # it started from (step 1's) is saved, not lost
    learner = Learner(config(), str(run))
    abandon_in_rollout(learner, step=2)
    assert learner.train() == "preempted"
    assert steps_saved(run) == [1]
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1]
    # 2. resumed from step 1: step 2 redone; a stop during its evaluation ends the evaluation at its first
    # chunk, and step 2 is saved: the run is complete ("done": nothing left to requeue)
    learner = Learner(config(), str(run))
    chunks = stop_in_eval(learner, after_step=2)
    assert learner.train() == "done"
    assert chunks == [] and steps_saved(run) == [1, 2]
    want, got = read_metrics(ref / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2]
    assert "eval/reward" in want[1] and not any(k.startswith("eval/") for k in got[1])
    # the run equals the uninterrupted one: the training metrics of each step, the final state bit for bit
    for a, b in zip(want, got, strict=True):
        assert {k: a.get(k) for k in TRAINING} == {k: b.get(k) for k in TRAINING}, a["step"]
    for a, b in zip(final_state(ref), final_state(run), strict=True):
        np.testing.assert_array_equal(a, b)


def test_step_start_names_the_parts_a_step_donated() -> None:
    """`StepStart.changed`: the top-level parts of the saved tree with a buffer donated since (the update's
    parameters and optimizer state, the spot trainer's state), which a stop then cannot save."""
    params, spot = {"w": jnp.ones(3), "b": jnp.zeros(2)}, {"state": {"step": jnp.zeros((), jnp.int32)}}
    start = StepStart(4, {"params": params, "spot": spot, "rng": jax.random.key(0)}, {"step": 4})
    assert start.changed() == []
    jax.jit(lambda s: s + 1, donate_argnums=0)(spot["state"]["step"])  # a spot training step's donation
    assert start.changed() == ["spot"]
    jax.jit(lambda p: jax.tree.map(jnp.negative, p), donate_argnums=0)(params)  # the update's apply
    assert start.changed() == ["params", "spot"]
