"""One picture of a run: `plot_run(workdir)` draws `<workdir>/plots/run.png` from the files the run writes.

A GRPO run (from `metrics.jsonl` and `rollout_timeline.jsonl`), six panels:
  reward            the training reward per step and the held-out reward (eval/*, step 0 = before training)
  step time         time/<part> stacked per step; the parts add up to time/step (tlt_jax.rl.metrics.StepClock)
  running rows      the latest rollout's running rows over its wall time, SD chunks shaded; earlier steps grey
  accept length     spec/accept_len per step, and per speculative mode
  spot trainer      the drafter's staleness (top-1 on fresh rollouts before training on them) and its loss
  bandit            the selector's arm shares per running-row bucket, over every step's chunks
A drafter warm-up (`config.json` job "drafter_warmup"): its training loss and top-1 accuracy, and the
held-out accept length before and after.
A GRPO run with evaluations (`eval/...`, tlt_jax.rl.evaluation) also gets `<workdir>/plots/eval.png`, a row
per evaluation (the held-out split, then each benchmark set): its estimators at the largest k (mean@k,
pass@k, maj@k, best@k; the held-out split: accuracy and reward) and its time per evaluation with the share
of decode time in SD chunks and, with the paired plain pass, the measured speed-up.

Series come from small functions (`metric_series`, `time_parts`, `arm_shares`, `read_timeline`) that the
tests check against the metrics. matplotlib runs on its Agg backend (files only). The learner refreshes the
plot after a step when `PlotRefresher.every_s` passed since the last one, and at the end of the run; only
process 0 writes it (the one that writes metrics.jsonl).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

from absl import logging

from tlt_jax.utils.tracking import CONFIG_FILE, METRICS_FILE, TIME_PARTS, read_metrics

PLOT_DIR = "plots"
PLOT_FILE = "run.png"
EVAL_PLOT_FILE = "eval.png"
ESTIMATORS = ("mean@", "pass@", "maj@", "best@")  # a benchmark set's accuracy estimators (eval/<name>/<e>k)
TIMELINE_FILE = "rollout_timeline.jsonl"  # one line per RL step: its rollout's chunks (RolloutWatch.timeline)
Rows = Sequence[Mapping[str, Any]]
_MAX_RUNNING = 2**31 - 1  # the selector's open-ended last bound (rollout.selector_config.MAX_RUNNING)
_COLORS = ("tab:blue", "tab:red", "tab:purple", "tab:olive", "tab:cyan", "tab:orange", "tab:gray")
_PART_COLORS = dict(zip(TIME_PARTS, _COLORS, strict=True))


def append_timeline(workdir: str | os.PathLike, step: int, timeline: Mapping[str, list]) -> None:
    """Append step `step`'s rollout timeline to `<workdir>/rollout_timeline.jsonl` (a re-run step after a
    resume appends again: readers keep the last line of a step). A torn last line (a kill mid-write) is cut
    first, so it cannot end up in the middle of the file."""
    path = os.path.join(os.fspath(workdir), TIMELINE_FILE)
    if os.path.exists(path):
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": int(step), **timeline}) + "\n")


def read_timeline(workdir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """{step: its rollout timeline}, the last line of each step; empty when the file does not exist."""
    path = os.path.join(os.fspath(workdir), TIMELINE_FILE)
    return {int(r["step"]): r for r in read_metrics(path)} if os.path.exists(path) else {}


def metric_series(rows: Rows, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that have a finite `key`."""
    pts = [(int(r["step"]), float(r[key])) for r in rows if key in r]
    pts = [(s, v) for s, v in pts if math.isfinite(v)]
    return [s for s, _ in pts], [v for _, v in pts]


def time_parts(rows: Rows) -> tuple[list[int], dict[str, list[float]]]:
    """(steps, {part: seconds per step}) of the rows with time/step: the parts of `TIME_PARTS` first, then
    any other time/<phase> (older runs); a part a step did not record counts 0 there."""
    timed = [r for r in rows if "time/step" in r]
    names = {k[len("time/") :] for r in timed for k in r if k.startswith("time/") and k != "time/step"}
    order = [p for p in TIME_PARTS if p in names] + sorted(names - set(TIME_PARTS))
    return [int(r["step"]) for r in timed], {
        p: [float(r.get(f"time/{p}", 0.0)) for r in timed] for p in order
    }


def arm_shares(rows: Rows) -> dict[int, dict[str, float]]:
    """{bucket: {arm: share of the bucket's chunks}} summed over every step's `bandit/b<bucket>/<arm>/chosen`
    (the chunks the selector gave each arm in that step's rollout)."""
    counts: dict[int, dict[str, float]] = {}
    for r in rows:
        for k, v in r.items():
            parts = k.split("/")
            if len(parts) == 4 and parts[0] == "bandit" and parts[3] == "chosen" and parts[1][1:].isdigit():
                arms = counts.setdefault(int(parts[1][1:]), {})
                arms[parts[2]] = arms.get(parts[2], 0.0) + float(v)
    return {
        b: {a: n / sum(arms.values()) for a, n in sorted(arms.items())}
        for b, arms in sorted(counts.items())
        if sum(arms.values()) > 0
    }


def bucket_labels(bounds: Sequence[int], n: int) -> list[str]:
    """Readable names of `n` selector buckets with inclusive upper bounds `bounds` on the running rows
    ("1 row", "3-4 rows", "> 8 rows"; the bucket past the last bound is the rest); "b<i>" without bounds."""
    out = []
    for b in range(n):
        if b > len(bounds) or not bounds:
            out.append(f"b{b}")
        elif b == len(bounds) or int(bounds[b]) >= _MAX_RUNNING:
            out.append(f"> {int(bounds[b - 1])} rows" if b else "any rows")
        else:
            lo, hi = (int(bounds[b - 1]) + 1 if b else 1), int(bounds[b])
            out.append(f"{hi} row{'s' * (hi > 1)}" if lo == hi else f"{lo}-{hi} rows")
    return out


def _empty(ax: Any, title: str, why: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="0.4", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _reward_panel(ax: Any, rows: Rows) -> None:
    steps, train = metric_series(rows, "reward/mean")
    e_steps, held = metric_series(rows, "eval/reward")
    if not steps and not e_steps:
        return _empty(ax, "reward", "no step yet")
    ax.plot(steps, train, "o-", ms=3, label="training (this step's prompts)")
    if e_steps:
        ax.plot(e_steps, held, "s--", ms=5, color="tab:green", label="held-out")
    for name, key in _eval_set_keys(rows):  # benchmark sets (config.eval.sets): mean@k and the top pass@k
        for k in key:
            x, y = metric_series(rows, f"eval/{name}/{k}")
            if x:
                ax.plot(x, y, "^:" if k.startswith("pass") else "v-.", ms=5, label=f"{name} {k}")
    ax.set(title="reward", xlabel="step")
    ax.legend(fontsize=8)


def _eval_set_keys(
    rows: Rows, estimators: Sequence[str] = ("mean@", "pass@")
) -> list[tuple[str, tuple[str, ...]]]:
    """(set name, (the key of each estimator at its largest k)) of the benchmark sets logged as
    eval/<name>/<estimator><k> (numbers compared: pass@16 beats pass@2)."""
    found: dict[str, set[str]] = {}
    for r in rows:
        for key in r:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "eval" and parts[2].startswith(tuple(estimators)):
                found.setdefault(parts[1], set()).add(parts[2])
    out = []
    for name, keys in sorted(found.items()):
        top = [
            max((k for k in keys if k.startswith(e)), key=lambda k: int(k[len(e) :]), default="")
            for e in estimators
        ]
        out.append((name, tuple(k for k in top if k)))
    return out


def eval_rows(rows: Rows) -> list[tuple[str, str, tuple[str, ...]]]:
    """The rows of the eval figure: (label, metric prefix, accuracy keys) for the held-out split (when
    eval/reward was logged) and each benchmark set."""
    out = (
        [("held-out split", "eval/", ("accuracy", "reward"))] if metric_series(rows, "eval/reward")[0] else []
    )
    return out + [(name, f"eval/{name}/", keys) for name, keys in _eval_set_keys(rows, ESTIMATORS)]


def _eval_row(ax: Any, time_ax: Any, rows: Rows, label: str, prefix: str, keys: Sequence[str]) -> None:
    """One evaluation's accuracy estimators over the steps, and its seconds per evaluation with SD's share
    of its decode time and the paired plain pass's speed-up (when logged)."""
    for i, key in enumerate(keys):
        ax.plot(*metric_series(rows, prefix + key), "os^v"[i % 4] + "-", ms=4, label=key)
    ax.set(title=f"{label}: accuracy", xlabel="step (0: before training)")
    ax.legend(fontsize=8)
    steps, secs = metric_series(rows, prefix + "seconds")
    time_ax.bar(steps, secs, color="0.75", label="seconds")
    time_ax.set(title=f"{label}: time per evaluation", xlabel="step", ylabel="seconds")
    twin = time_ax.twinx()
    twin.plot(
        *metric_series(rows, prefix + "sd_share"), "o-", ms=4, color="tab:green", label="SD share of decode"
    )
    x, speedup = metric_series(rows, prefix + "sd_speedup")
    if x:
        twin.plot(x, speedup, "s--", ms=5, color="tab:red", label="speed-up vs plain (paired pass)")
    twin.set(ylabel="share / speed-up (x)", ylim=(0, max([1.05, *speedup]) * 1.15))
    twin.legend(fontsize=7, loc="upper left")


def _eval_figure(plt: Any, rows: Rows, title: str) -> Any:
    panels = eval_rows(rows)
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 3.2 * len(panels)), squeeze=False)
    for (label, prefix, keys), (ax, time_ax) in zip(panels, axes, strict=True):
        _eval_row(ax, time_ax, rows, label, prefix, keys)
    fig.suptitle(title + ": evaluations")
    return fig


def _time_panel(ax: Any, rows: Rows) -> None:
    steps, parts = time_parts(rows)
    if not steps:
        return _empty(ax, "step time", "no step yet")
    bottom = [0.0] * len(steps)
    for p, secs in parts.items():
        if any(secs):
            ax.bar(steps, secs, bottom=bottom, label=p, color=_PART_COLORS.get(p))
            bottom = [b + s for b, s in zip(bottom, secs, strict=True)]
    top = max(max(bottom), 1e-3) * 1.3  # headroom for the legend above the bars
    ax.set(title="step time by part (s; they add up to the step)", xlabel="step", ylim=(0, top))
    ax.legend(fontsize=7, ncol=4, loc="upper center")


def _timeline_xy(t: Mapping[str, Any]) -> tuple[list[float], list[float]]:
    """The running rows of one rollout as a step curve: each chunk's decode steps spread over its seconds,
    then the rows left after it."""
    xs, ys = [], []
    for t0, t1, running, left in zip(t["t0"], t["t1"], t["running"], t["left"], strict=True):
        n = max(len(running), 1)
        xs += [t0 + (t1 - t0) * i / n for i in range(len(running))] + [t1]
        ys += [float(r) for r in running] + [float(left)]
    return xs, ys


def _timeline_panel(ax: Any, timeline: Mapping[int, Mapping[str, Any]]) -> None:
    chunks = {s: t for s, t in timeline.items() if t.get("t0")}
    if not chunks:
        return _empty(ax, "running rows", f"no rollout timeline yet ({TIMELINE_FILE})")
    last = max(chunks)
    for s in sorted(chunks)[-6:-1]:
        ax.step(*_timeline_xy(chunks[s]), where="post", color="0.7", lw=0.8)
    t = chunks[last]
    labelled = False
    for t0, t1, mode in zip(t["t0"], t["t1"], t["mode"], strict=True):
        if mode != "plain":
            ax.axvspan(t0, t1, color="tab:green", alpha=0.2, lw=0, label=None if labelled else "SD chunk")
            labelled = True
    ax.step(*_timeline_xy(t), where="post", color="tab:blue", label=f"step {last}")
    ax.set_xlim(0, max(t["t1"]) * 1.02)  # the latest rollout (earlier ones, in grey, may run longer)
    ax.set(title="running rows over the rollout", xlabel="seconds since the rollout began", ylabel="rows")
    ax.legend(fontsize=8)


def _accept_panel(ax: Any, rows: Rows) -> None:
    steps, acc = metric_series(rows, "spec/accept_len")
    if not steps:
        return _empty(ax, "accept length", "no speculative chunk ran")
    ax.plot(steps, acc, "o-", ms=3, color="k", label="all SD chunks")
    modes = sorted(
        {k.split("/")[2] for r in rows for k in r if k.startswith("spec/mode/") and k.endswith("/accept_len")}
    )
    for m in modes:
        ax.plot(*metric_series(rows, f"spec/mode/{m}/accept_len"), ".--", label=m)
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.set(title="accept length (tokens per row per verify round)", xlabel="step")
    ax.legend(fontsize=8)


def _spot_panel(ax: Any, rows: Rows) -> None:
    steps, stale = metric_series(rows, "spot/stale_top1")
    l_steps, loss = metric_series(rows, "spot/loss")
    if not steps and not l_steps:
        return _empty(ax, "spot trainer", "no spot training (config.spot.mode off, or no update yet)")
    ax.plot(steps, stale, "o-", ms=3, color="tab:purple", label="stale top-1 (before training)")
    ax.plot(
        *metric_series(rows, "spot/top1_acc"), "s--", ms=3, color="tab:pink", label="top-1 while training"
    )
    ax.set(title="spot trainer: staleness and loss", xlabel="step", ylabel="top-1", ylim=(0, 1))
    ax.legend(fontsize=8, loc="upper left")
    twin = ax.twinx()
    twin.plot(l_steps, loss, "^-", ms=4, color="tab:brown", label="loss")
    twin.plot(*metric_series(rows, "spot/stale_loss"), "v:", ms=4, color="tab:brown", label="stale loss")
    twin.set_ylabel("loss")
    twin.legend(fontsize=8, loc="upper right")


def _bandit_panel(ax: Any, rows: Rows, bounds: Sequence[int]) -> None:
    shares = arm_shares(rows)
    if not shares:
        return _empty(ax, "bandit", "no selector (config.bandit.algorithm off)")
    buckets = sorted(shares)
    labels = bucket_labels(bounds, max(buckets) + 1)
    arms = sorted({a for s in shares.values() for a in s})
    left = [0.0] * len(buckets)
    for i, arm in enumerate(arms):
        w = [shares[b].get(arm, 0.0) for b in buckets]
        ax.barh([labels[b] for b in buckets], w, left=left, label=arm, color=f"C{i}")
        left = [a + b for a, b in zip(left, w, strict=True)]
    ax.set(
        title="bandit: arm share per running-row bucket", xlabel="share of the bucket's chunks", xlim=(0, 1)
    )
    ax.legend(
        fontsize=7, ncol=min(len(arms), 4), loc="upper center", bbox_to_anchor=(0.5, -0.15), frameon=False
    )


def _warmup_figure(plt: Any, rows: Rows, title: str) -> Any:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps, loss = metric_series(rows, "train/loss")
    if steps:
        a.plot(steps, loss, label="loss")
        a.plot(*metric_series(rows, "train/ce"), "--", label="ce")
        a2 = a.twinx()
        a2.plot(*metric_series(rows, "train/top1_acc"), color="tab:green", label="top-1")
        a2.set(ylabel="top-1", ylim=(0, 1))
        a2.legend(fontsize=8, loc="upper right")
        a.set(title="drafter warm-up: training", xlabel="step", ylabel="loss")
        a.legend(fontsize=8, loc="upper left")
    else:
        _empty(a, "drafter warm-up: training", "no training step logged yet")
    e_steps, acc = metric_series(rows, "eval/accept_length")
    if e_steps:
        b.plot(e_steps, acc, "s-", color="k")
        b.set(title="held-out accept length", xlabel="step", ylabel="tokens per round")
    else:
        _empty(b, "held-out accept length", "no evaluation yet")
    fig.suptitle(title)
    return fig


def _config(workdir: pathlib.Path) -> dict[str, Any]:
    try:
        return json.loads((workdir / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _save(plt: Any, fig: Any, out: pathlib.Path) -> None:
    """Write `fig` to `out` atomically (a reader never sees half a file) and close it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.tight_layout()
        fig.savefig(out.with_suffix(".tmp"), dpi=80, format="png")
    finally:
        plt.close(fig)
    os.replace(out.with_suffix(".tmp"), out)


def plot_run(workdir: str | os.PathLike) -> pathlib.Path:
    """Draw the run in `workdir` (its metrics.jsonl, rollout_timeline.jsonl and config.json) into
    `<workdir>/plots/run.png` (and a GRPO run's evaluations into `plots/eval.png`), each replaced atomically,
    and return run.png's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wd = pathlib.Path(workdir)
    if not (wd / METRICS_FILE).exists():
        raise FileNotFoundError(f"{wd / METRICS_FILE} does not exist: plot_run needs a run's workdir.")
    rows, config = read_metrics(wd / METRICS_FILE), _config(wd)
    steps = max((int(r["step"]) for r in rows), default=0)
    job = config.get("job", "run")
    planned = config.get("train", {}).get("steps") if job == "drafter_warmup" else config.get("num_steps")
    title = f"{wd.resolve().name}: {job}, {steps} of {planned or '?'} steps"
    if config.get("job") == "drafter_warmup":
        fig = _warmup_figure(plt, rows, title)
    else:
        fig, axes = plt.subplots(2, 3, figsize=(15, 8))
        _reward_panel(axes[0, 0], rows)
        _time_panel(axes[0, 1], rows)
        _timeline_panel(axes[0, 2], read_timeline(wd))
        _accept_panel(axes[1, 0], rows)
        _spot_panel(axes[1, 1], rows)
        _bandit_panel(axes[1, 2], rows, config.get("bandit", {}).get("bucket_bounds", ()))
        fig.suptitle(title)
    out = wd / PLOT_DIR / PLOT_FILE
    _save(plt, fig, out)
    if config.get("job") != "drafter_warmup" and eval_rows(rows):
        _save(plt, _eval_figure(plt, rows, title), wd / PLOT_DIR / EVAL_PLOT_FILE)
    return out


def refresh_plot(workdir: str | os.PathLike) -> pathlib.Path | None:
    """`plot_run`, a failure logged as a warning instead of raised: a plot never stops a run."""
    try:
        return plot_run(workdir)
    except Exception as e:
        logging.warning(
            "could not draw %s: %s: %s", pathlib.Path(workdir) / PLOT_DIR / PLOT_FILE, type(e).__name__, e
        )
        return None


class PlotRefresher:
    """Redraws a run's plot after a step once `every_s` seconds passed since the last drawing (or since the
    refresher was made), and at the end (`final`); nothing when not `enabled` (processes other than 0)."""

    def __init__(self, workdir: str | os.PathLike, enabled: bool = True, every_s: float = 30.0):
        self.workdir, self.enabled, self.every_s = workdir, enabled, float(every_s)
        self._last = time.perf_counter()

    def after_step(self) -> None:
        """Redraw when the last drawing is `every_s` old (a long step redraws after every step)."""
        if self.enabled and time.perf_counter() - self._last >= self.every_s:
            self.final()

    def final(self) -> pathlib.Path | None:
        """Redraw now; returns the plot's path (None when disabled or it failed)."""
        if not self.enabled:
            return None
        self._last = time.perf_counter()
        return refresh_plot(self.workdir)
