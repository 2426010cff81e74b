"""tlt_jax.utils.run_plots: the series each panel draws come from the metrics (a metrics.jsonl written here),
the PNG is drawn at its size and is not blank, a warm-up gets its own figure; and a tiny TLT run (n-gram
drafts, the spot trainer between chunks, BEG-MAB) writes its plot, its rollout timeline and a step time whose
parts (tlt_jax.rl.metrics.StepClock) add up to the step."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from tlt_jax import config_lib
from tlt_jax.rl.learner import Learner
from tlt_jax.utils.run_plots import (
    append_timeline,
    arm_shares,
    bucket_labels,
    metric_series,
    plot_run,
    read_timeline,
    refresh_plot,
    time_parts,
)
from tlt_jax.utils.tracking import TIME_PARTS, read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
GRPO_SIZE = (640, 1200)  # 15 x 8 inches at 80 dpi
WARMUP_SIZE = (320, 880)


def write_run(workdir: pathlib.Path, rows: list[dict], config: dict) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (workdir / "config.json").write_text(json.dumps(config))


def read_png(path: pathlib.Path) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(path)


def assert_drawn(image: np.ndarray, size: tuple[int, int]) -> None:
    assert image.shape[:2] == size, image.shape
    rgb = image[..., :3].reshape(-1, 3)
    assert rgb.std() > 0.05 and len(np.unique(rgb, axis=0)) > 50, "the plot is blank"


GRPO_ROWS = [
    {"step": 0, "eval/reward": 0.1, "eval/accuracy": 0.0},
    {
        "step": 1,
        "reward/mean": 0.2,
        "time/rollout": 3.0,
        "time/compile": 5.0,
        "time/spot": 1.0,
        "time/update": 2.0,
        "time/other": 0.5,
        "time/step": 11.5,
        "bandit/b0/plain/chosen": 1.0,
        "bandit/b0/3_1_4/chosen": 3.0,
        "bandit/b2/plain/chosen": 4.0,
        "spot/stale_top1": 0.4,
        "spot/loss": 2.0,
    },
    {
        "step": 2,
        "reward/mean": 0.3,
        "time/rollout": 2.5,
        "time/update": 1.5,
        "time/other": 0.25,
        "time/step": 4.25,
        "bandit/b0/3_1_4/chosen": 4.0,
        "spec/accept_len": 2.5,
        "spec/mode/3_1_4/accept_len": 2.5,
        "spot/stale_top1": float("nan"),  # not finite: left out
        "eval/reward": 0.25,
    },
]


def test_series_come_from_the_metrics(tmp_path) -> None:
    assert metric_series(GRPO_ROWS, "reward/mean") == ([1, 2], [0.2, 0.3])
    assert metric_series(GRPO_ROWS, "eval/reward") == ([0, 2], [0.1, 0.25])
    assert metric_series(GRPO_ROWS, "spot/stale_top1") == ([1], [0.4])
    steps, parts = time_parts(GRPO_ROWS)
    assert steps == [1, 2] and list(parts) == ["rollout", "compile", "spot", "update", "other"]
    assert parts["compile"] == [5.0, 0.0] and parts["rollout"] == [3.0, 2.5]
    for i, row in enumerate(GRPO_ROWS[1:]):  # the stacked bars reach the step's time
        assert sum(p[i] for p in parts.values()) == pytest.approx(row["time/step"])
    # chunks per bucket over all steps: bucket 0 had 1 plain and 3 + 4 EAGLE chunks
    assert arm_shares(GRPO_ROWS) == {0: {"3_1_4": 7 / 8, "plain": 1 / 8}, 2: {"plain": 1.0}}
    assert bucket_labels((1, 2, 4, 8), 5) == ["1 row", "2 rows", "3-4 rows", "5-8 rows", "> 8 rows"]
    assert bucket_labels((4, 2**31 - 1), 2) == ["1-4 rows", "> 4 rows"] and bucket_labels((), 2) == [
        "b0",
        "b1",
    ]
    # the timeline: one line per step, a re-run step (after a resume) replaces the earlier line
    append_timeline(
        tmp_path, 1, {"t0": [0.0], "t1": [1.0], "mode": ["plain"], "running": [[4, 3]], "left": [2]}
    )
    append_timeline(tmp_path, 1, {"t0": [0.0], "t1": [2.0], "mode": ["3_1_4"], "running": [[4]], "left": [0]})
    assert read_timeline(tmp_path)[1]["mode"] == ["3_1_4"] and read_timeline(tmp_path / "none") == {}
    # a kill mid-write leaves a torn last line: the next append cuts it rather than burying it mid-file
    with open(tmp_path / "rollout_timeline.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 2, "t0": [0.')
    append_timeline(tmp_path, 2, {"t0": [0.0], "t1": [1.0], "mode": ["plain"], "running": [[2]], "left": [0]})
    assert sorted(read_timeline(tmp_path)) == [1, 2] and read_timeline(tmp_path)[2]["mode"] == ["plain"]


def test_plot_run_draws_a_grpo_run_and_a_warmup(tmp_path) -> None:
    grpo = tmp_path / "grpo"
    write_run(grpo, GRPO_ROWS, {"job": "grpo", "num_steps": 2, "bandit": {"bucket_bounds": [1, 2, 4, 8]}})
    append_timeline(grpo, 2, {"t0": [0.5, 2.0], "t1": [2.0, 3.0], "mode": ["plain", "3_1_4"],
                              "running": [[8, 8, 6], [2, 1]], "left": [2, 0]})  # fmt: skip
    path = plot_run(grpo)
    assert path == grpo / "plots" / "run.png" and not list(path.parent.glob("*.tmp"))
    assert_drawn(read_png(path), GRPO_SIZE)
    warm = tmp_path / "warmup"
    rows = [{"step": 0, "eval/accept_length": 1.2}]
    rows += [
        {"step": s, "train/loss": 5.0 / s, "train/ce": 4.0 / s, "train/top1_acc": 0.1 * s} for s in (1, 2, 3)
    ]
    write_run(
        warm, rows + [{"step": 3, "eval/accept_length": 2.1}], {"job": "drafter_warmup", "num_steps": 3}
    )
    assert_drawn(read_png(plot_run(warm)), WARMUP_SIZE)
    with pytest.raises(
        FileNotFoundError, match="metrics.jsonl does not exist: plot_run needs a run's workdir"
    ):
        plot_run(tmp_path / "empty")
    assert refresh_plot(tmp_path / "empty") is None  # the run's side: a warning, never an error


def tiny_tlt_config():
    """The smoke run with TLT's parts: n-gram drafts, a fresh EAGLE drafter spot-trained between chunks
    (settings of tests/rl/test_learner_checkpoint.py: its programs come from the test compile cache), BEG-MAB
    over plain and the n-gram arm (no held-out eval: 5 s more, and its panel is checked above)."""
    c = config_lib.load_config_file(ROOT / "configs" / "smoke.py", "steps=2,spec=true")
    c.spot.mode, c.spot.threshold = "between_chunks", 1024
    c.spot.window, c.spot.context, c.spot.ce_tokens = 16, 8, 16
    c.spot.ttt_steps, c.spot.ttt_positions, c.spot.eval_samples = 1, 8, 4
    c.bandit.algorithm, c.bandit.arms, c.bandit.bucket_bounds = "beg_mab", ("plain", "ngram_3_1_4"), (4, 8)
    return c


@pytest.mark.extended  # make test: test_plot_run_draws_a_grpo_run_and_a_warmup draws from a run's files
def test_a_tiny_tlt_run_plots_itself_and_its_time_parts_add_up(tmp_path) -> None:
    learner = Learner(tiny_tlt_config(), str(tmp_path))
    assert learner.train() == "done"
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # disjoint parts (compile and the spot trainer out of the phases) that sum to the step
        parts = [r[f"time/{p}"] for p in TIME_PARTS]
        assert min(parts) >= 0 and sum(parts) == pytest.approx(r["time/step"], rel=1e-9), r
        # the training between chunks less the drafter's compilation, plus the (empty) after-rollout phase
        assert r["time/spot"] <= r["spot/added_seconds"] + 0.01
    assert rows[0]["time/compile"] > 0  # the first step compiles (or reads the compile cache)
    assert sum(r["spot/steps"] for r in rows) > 0 and sum(r["time/spot"] for r in rows) > 0
    timeline = read_timeline(tmp_path)
    assert sorted(timeline) == [1, 2]
    for s, t in timeline.items():  # every chunk of the rollout, in order, down to no running row
        assert t["left"][-1] == 0 and t["t0"] == sorted(t["t0"]) and len(t["mode"]) == len(t["running"])
        chosen = sum(v for k, v in rows[s - 1].items() if k.startswith("bandit/") and k.endswith("/chosen"))
        assert chosen == len(t["mode"])  # the selector chose every chunk's mode
    assert_drawn(read_png(tmp_path / "plots" / "run.png"), GRPO_SIZE)  # drawn at the end of train()


def test_eval_sets_are_drawn_by_their_mean_and_largest_pass_at_k() -> None:
    """Benchmark sets (config.eval.sets) log eval/<name>/mean@k and pass@1..k: the reward panel draws each
    set's mean@k and its largest pass@k (pass@16, not pass@2: numbers compared, not strings)."""
    from tlt_jax.utils.run_plots import _eval_set_keys

    rows = [
        {"step": 0, "eval/aime/mean@16": 0.1, "eval/aime/pass@2": 0.2, "eval/aime/pass@16": 0.4},
        {"step": 0, "eval/math500/mean@4": 0.5, "eval/math500/pass@4": 0.7, "eval/reward": 0.3},
    ]
    assert _eval_set_keys(rows) == [("aime", ("mean@16", "pass@16")), ("math500", ("mean@4", "pass@4"))]


EVAL_ROWS = [  # two evaluations of the held-out split and of a benchmark set with the paired plain pass
    {
        "step": s,
        "eval/reward": 0.2 + s,
        "eval/accuracy": 0.1 * s,
        "eval/seconds": 3.0,
        "eval/sd_share": 0.4,
        "eval/aime/mean@8": 0.1 + s / 10,
        "eval/aime/pass@2": 0.2,
        "eval/aime/pass@8": 0.5,
        "eval/aime/maj@2": 0.1,
        "eval/aime/maj@8": 0.3,
        "eval/aime/best@8": 0.6,
        "eval/aime/seconds": 40.0 - s,
        "eval/aime/sd_share": 0.6,
        "eval/aime/sd_speedup": 1.5 + s / 4,
    }
    for s in (0, 2)
]


def test_evaluations_get_their_own_figure(tmp_path) -> None:
    """plots/eval.png: a row per evaluation (held-out split, then each set) with its estimators at the
    largest k, its seconds, SD share and measured speed-up; none for a run without evaluations."""
    from tlt_jax.utils.run_plots import eval_rows

    assert eval_rows(EVAL_ROWS) == [
        ("held-out split", "eval/", ("accuracy", "reward")),
        ("aime", "eval/aime/", ("mean@8", "pass@8", "maj@8", "best@8")),
    ]
    assert metric_series(EVAL_ROWS, "eval/aime/sd_speedup") == ([0, 2], [1.5, 2.0])
    write_run(tmp_path / "run", [*EVAL_ROWS, GRPO_ROWS[1]], {"job": "grpo", "num_steps": 2})
    plot_run(tmp_path / "run")
    assert_drawn(read_png(tmp_path / "run" / "plots" / "eval.png"), (2 * 256, 960))  # 2 x (12 x 3.2 in)
    write_run(tmp_path / "plain", GRPO_ROWS[1:2], {"job": "grpo", "num_steps": 2})
    plot_run(tmp_path / "plain")
    assert not (tmp_path / "plain" / "plots" / "eval.png").exists()
