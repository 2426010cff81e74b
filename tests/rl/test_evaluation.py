"""Held-out evaluation: the same problems and keys every time (paired), logged at step 0 and every k steps,
refused when training would read the held-out problems, and a clear error for a bad eval section."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from tlt_jax import config_lib
from tlt_jax.rl import config as rl_config
from tlt_jax.rl.learner import Learner
from tlt_jax.tasks import make_task

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def eval_config(steps: int = 2, every: int = 2, size: int = 32):
    c = config_lib.load_config_file(CONFIGS / "smoke.py", f"steps={steps}")
    c.task.size = size
    c.eval.every, c.eval.prompts, c.eval.samples = every, 2, 8  # 16 rows: the training step's programs
    return c


def test_eval_is_paired_logged_at_step_zero_and_every_k(tmp_path) -> None:
    learner = Learner(eval_config(steps=3, every=2), str(tmp_path))
    try:
        first, again = learner.evaluator.run(), learner.evaluator.run()
        assert learner.train() == "done"
    finally:
        learner.close()
    # unchanged policy, same keys: the same samples, so the same scores (no noise between evaluations)
    for k in first:
        if k != "eval/seconds":
            assert first[k] == again[k], k
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    with_eval = [r["step"] for r in rows if "eval/reward" in r]
    assert with_eval == [0, 2, 3]  # before training, every 2 steps, and after the last
    assert rows[0]["eval/reward"] == first["eval/reward"]
    assert 0.0 <= rows[-1]["eval/accuracy"] <= 1.0 and rows[-1]["eval/length_mean"] > 0


def test_eval_problems_are_held_out_of_training() -> None:
    c = eval_config(steps=4, size=8)  # training reads problems 0..7, the eval wants 6..7
    with pytest.raises(ValueError, match=r"config.eval.prompts=2.*last 2 of the task's 8.*first 8"):
        Learner(c, "/nonexistent/never-created")
    c = eval_config(steps=4, size=32)  # the held-out problems: the stream's last, none trained on
    task = make_task(c.task)
    train, _ = task.batch(0, 4 * 2)
    heldout, _ = task.batch(len(task) - 2, 2)
    assert not {p.uid for p in train} & {p.uid for p in heldout}


@pytest.mark.parametrize("bad", [dict(every=-1), dict(prompts=0), dict(samples=0), dict(evry=1)])
def test_bad_eval_section_names_the_field(bad) -> None:
    c = eval_config()
    for k, v in bad.items():
        c.eval[k] = v
    with pytest.raises(ValueError, match="config.eval"):
        rl_config.validate_grpo(c)


def test_eval_seconds_are_not_in_the_step_time(tmp_path) -> None:
    learner = Learner(eval_config(steps=1, every=1), str(tmp_path))
    try:
        learner.train()
    finally:
        learner.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]
    assert set(rows[0]) == {"step"} | {k for k in rows[1] if k.startswith("eval/")}
    assert np.isfinite(rows[1]["time/step"]) and rows[1]["eval/seconds"] > 0
