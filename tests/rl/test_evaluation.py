"""Evaluation: the held-out split (the same problems and keys every time, paired; logged at step 0 and every k
steps; never trained on, in any epoch), benchmark sets (mean@k, pass@k with the unbiased estimator against
hand-computed values), and a clear error for a bad eval section."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from tlt_jax import config_lib
from tlt_jax.rl import config as rl_config
from tlt_jax.rl.evaluation import pass_at_k, sample_metrics
from tlt_jax.rl.learner import Learner
from tlt_jax.tasks import make_task
from tlt_jax.tasks.base import TrainSplit

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


def test_held_out_problems_are_never_trained_on_in_any_epoch() -> None:
    c = eval_config(steps=4, size=8)  # 4 steps x 2 prompts read 8 positions of the 6 training problems
    task = make_task(c.task)
    split = TrainSplit(task, 2)
    held_out = {task.problem(int(i)).uid for i in split.held_out_indices}
    assert held_out == {p.uid for p in task.batch(len(task) - 2, 2)[0]}  # the first epoch's last two
    first, _ = split.batch(0, 6)
    assert [p.uid for p in first] == [p.uid for p in task.batch(0, 6)[0]]  # epoch 0: the order as before
    later, _ = split.batch(6, 18)  # epochs 1-3: each a reshuffle of the same six
    assert not held_out & {p.uid for p in first + later}
    assert [sorted(p.uid for p in later[i : i + 6]) for i in (0, 6, 12)] == [sorted(p.uid for p in first)] * 3
    assert [p.uid for p in later[:6]] != [p.uid for p in later[6:12]]
    with pytest.raises(ValueError, match=r"config.eval.prompts=8: .*0 < prompts < the task's 8"):
        TrainSplit(task, 8)


@pytest.mark.parametrize(
    "n,c,k,want",
    [(4, 0, 1, 0.0), (4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 2, 3, 1.0), (5, 2, 2, 0.7), (8, 3, 4, 1 - 5 / 70)],
)
def test_pass_at_k_unbiased_estimator(n: int, c: int, k: int, want: float) -> None:
    # 1 - C(n-c, k) / C(n, k) by hand: (4,1,2): 1 - 3/6; (5,2,2): 1 - 3/10; (8,3,4): 1 - C(5,4)/C(8,4)
    assert pass_at_k(n, c, k) == pytest.approx(want)


def test_sample_metrics() -> None:
    correct = np.asarray([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
    m = sample_metrics(correct, np.asarray([10] * 11 + [22]), np.asarray([False] * 11 + [True]))
    assert m == pytest.approx(
        {
            "mean@4": 5 / 12,
            "pass@1": (0.25 + 1 + 0) / 3,
            "pass@2": (0.5 + 1 + 0) / 3,
            "pass@4": 2 / 3,
            "length_mean": 11.0,
            "clip_frac": 1 / 12,
        }
    )
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(2, 1, 3)


@pytest.mark.parametrize(
    "bad",
    [
        dict(every=-1),
        dict(prompts=-1),
        dict(samples=0),
        dict(evry=1),
        dict(sets={"x": {"samples": 2}}),
        dict(sets={"x": {"path": "/nonexistent/x.parquet"}}),
    ],
)
def test_bad_eval_section_names_the_field(bad) -> None:
    c = eval_config()
    for k, v in bad.items():
        c.eval[k] = v
    with pytest.raises(ValueError, match="config.eval"):
        rl_config.validate_grpo(c)


def test_eval_sets_and_seconds_outside_the_step_time(tmp_path) -> None:
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"question": f"Say {d}.", "answer": d}) + "\n" for d in "12"))
    c = eval_config(steps=1, every=1)
    # 2 x 8 rows as a training step (its programs serve), short prompts for the byte tokenizer
    toy = {"path": str(bench), "samples": 8, "max_new_tokens": 8, "prompt": "none"}
    c.eval.sets = {
        "toy": toy,
        "greedy": {"path": str(bench), "samples": 8, "temperature": 0.0, "prompt": "none"},
    }
    learner = Learner(c, str(tmp_path / "w"))
    try:
        learner.train()
    finally:
        learner.close()
    rows = [json.loads(line) for line in open(tmp_path / "w" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]
    assert set(rows[0]) == {"step"} | {k for k in rows[1] if k.startswith("eval/")}
    assert np.isfinite(rows[1]["time/step"]) and rows[1]["eval/seconds"] > 0
    toy = {k.removeprefix("eval/toy/") for k in rows[1] if k.startswith("eval/toy/")}
    assert toy == {"mean@8", "pass@1", "pass@2", "pass@4", "pass@8", "length_mean", "clip_frac", "seconds"}
    assert rows[1]["eval/toy/length_mean"] <= 8 and 0 <= rows[1]["eval/toy/pass@8"] <= 1
    greedy = {k: rows[1][f"eval/greedy/{k}"] for k in ("mean@8", "pass@1", "pass@8")}
    assert len(set(greedy.values())) == 1  # 8 identical greedy samples: every estimate is the accuracy
