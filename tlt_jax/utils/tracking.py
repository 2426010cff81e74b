"""Experiment tracking: a `Tracker` protocol with jsonl (always on), wandb and console backends, a tqdm
progress bar for the rollout, and the console's heartbeat (what a long job is doing while it prints nothing).

The workdir holds `metrics.jsonl` (one JSON object per step) and `config.json`, so a run can be inspected
without wandb; wandb runs offline under `workdir/wandb` unless the config or WANDB_MODE says otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
import string
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any, Protocol, runtime_checkable

import ml_collections as mlc
from absl import logging

from tlt_jax.utils.plain import plain_dict

Metrics = Mapping[str, float | int]
WANDB_MODES = ("online", "offline", "disabled", "shared")
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
WANDB_ID_FILE = "wandb_run_id"


@runtime_checkable
class Tracker(Protocol):
    """What the learner logs to: `step` is the RL step; metrics are flat `name -> number` ('a/b' names)."""

    def log(self, step: int, metrics: Metrics) -> None: ...

    def log_config(self, config: mlc.ConfigDict | Mapping[str, object]) -> None: ...

    def close(self) -> None: ...


def _scalar(name: str, value: Any) -> float | int | bool | str:
    """numpy / jax scalars -> Python numbers; a non-scalar is an error naming the key."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
        return value.item()
    raise TypeError(
        f"metric {name!r} must be a scalar (number), got {type(value).__name__}; reduce it first."
    )


class JsonlTracker:
    """Appends `{"step": step, **metrics}` per `log` call to `workdir/metrics.jsonl`, flushing each line.

    On resume, call `truncate_from(resumed_step)` so lines of steps that will be re-run are dropped and the
    file stays one line per step.
    """

    def __init__(self, workdir: str | os.PathLike):
        self.workdir = os.fspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.path = os.path.join(self.workdir, METRICS_FILE)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: Metrics) -> None:
        """Append one line for `step`."""
        if self._file is None:
            raise RuntimeError(f"JsonlTracker for {self.path} is closed.")
        if "step" in metrics:
            raise ValueError("metrics must not contain a 'step' key: it is written from the `step` argument.")
        row = {"step": int(step), **{k: _scalar(k, v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def log_config(self, config: mlc.ConfigDict | Mapping[str, object]) -> None:
        """Write the config to `workdir/config.json` (overwritten: the config of the latest (re)start)."""
        tmp = os.path.join(self.workdir, CONFIG_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(plain_dict(config), f, indent=2, sort_keys=True, default=str)
        os.replace(tmp, os.path.join(self.workdir, CONFIG_FILE))

    def truncate_from(self, step: int) -> int:
        """Drop lines with step >= `step` (and a torn last line from a crash); returns how many went."""
        if self._file is not None:
            self._file.close()
        if not os.path.exists(self.path):  # deleted under us: nothing to keep
            open(self.path, "w").close()
        dropped = truncate_jsonl(self.path, step)
        self._file = open(self.path, "a", encoding="utf-8")
        return dropped

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def truncate_jsonl(path: str | os.PathLike, step: int) -> int:
    """Drop the lines of a `{"step": ...}` JSONL file with step >= `step` (re-run after a restore) and a
    torn last line from a crash; returns how many went. Atomic: a crash leaves the old or the new file."""
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        n_lines = sum(1 for line in f if line.strip())
    keep = [r for r in read_metrics(path) if r["step"] < step]
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(tmp, path)
    return n_lines - len(keep)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Parse a metrics.jsonl file. A torn last line (the process died mid-write) is skipped; a corrupt line
    elsewhere is an error naming the line."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    rows = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == last:
                logging.warning("%s: skipping a torn last line (%d chars)", path, len(line))
                continue
            raise ValueError(f"{path}:{i + 1}: not valid JSON ({e}); fix or delete that line.") from e
    return rows


def resolve_wandb_mode(config_mode: str | None, env: Mapping[str, str]) -> str:
    """The wandb mode: the explicit config value if set, else $WANDB_MODE, else 'offline' (never online by
    accident: online needs a key and network)."""
    mode = config_mode or env.get("WANDB_MODE") or "offline"
    if mode not in WANDB_MODES:
        source = "config.wandb.mode" if config_mode else "the WANDB_MODE environment variable"
        raise ValueError(f"{source} is {mode!r}; use one of {', '.join(WANDB_MODES)}.")
    return mode


class WandbTracker:
    """Logs to wandb; offline by default, into `workdir/wandb/offline-run-*` (upload later: `wandb sync`).

    The run id is kept in `workdir/wandb_run_id`, so a restarted run continues the same wandb run. Mode
    'disabled' creates no wandb run at all (and does not import wandb).
    """

    def __init__(
        self,
        project: str,
        name: str | None,
        workdir: str | os.PathLike,
        mode: str | None = None,
        config: mlc.ConfigDict | Mapping[str, object] | None = None,
    ):
        self.mode = resolve_wandb_mode(mode, os.environ)
        self.run: Any = None
        if self.mode == "disabled":
            return
        import wandb

        workdir = os.fspath(workdir)
        os.makedirs(workdir, exist_ok=True)
        id_path = os.path.join(workdir, WANDB_ID_FILE)
        if os.path.exists(id_path):
            with open(id_path, encoding="utf-8") as f:
                run_id = f.read().strip()
        else:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
            with open(id_path, "w", encoding="utf-8") as f:
                f.write(run_id + "\n")
        self.run_id = run_id
        self.run = wandb.init(
            project=project,
            name=name,
            id=run_id,
            resume="allow",
            dir=workdir,  # wandb writes into `<dir>/wandb/`
            mode=self.mode,
            config=plain_dict(config) if config is not None else None,
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True, disable_git=True),
        )

    def log(self, step: int, metrics: Metrics) -> None:
        """Log one step (wandb requires non-decreasing steps within a run)."""
        if self.run is not None:
            self.run.log({k: _scalar(k, v) for k, v in metrics.items()}, step=int(step))

    def log_config(self, config: mlc.ConfigDict | Mapping[str, object]) -> None:
        """Merge `config` into the run's config."""
        if self.run is not None:
            self.run.config.update(plain_dict(config), allow_val_change=True)

    def close(self) -> None:
        """Finish the run (idempotent)."""
        if self.run is not None:
            self.run.finish()
            self.run = None


def _fmt_num(x: Any) -> str:
    """Integers (also integral floats such as a p50 length of 32.0) without decimals, else 3 decimals."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return str(x)
    if x.is_integer() and abs(x) < 1e12:
        return str(int(x))
    if abs(x) >= 100:
        return f"{x:.1f}"
    if x != 0 and abs(x) < 1e-3:
        return f"{x:.2e}"
    return f"{x:.3f}"


def _secs(x: float) -> str:
    """Seconds at a precision that suits them: 132.8, 6.79, 0.03."""
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


# the step's time as disjoint parts that add up to time/step (tlt_jax.rl.metrics.StepClock), in console order
TIME_PARTS = ("rollout", "compile", "spot", "reward", "logprob", "update", "other")


def _time_field(m: dict[str, Any]) -> str | None:
    """`time 132.8 s = rollout 71.2 + compile 42.8 + ...`: the step's total and its parts (those that round to
    zero left out); metrics of other phase names come after the known ones."""
    parts = {k[len("time/") :]: float(v) for k, v in m.items() if k.startswith("time/") and k != "time/step"}
    if not parts and "time/step" not in m:
        return None
    total = float(m["time/step"]) if "time/step" in m else sum(parts.values())
    order = [p for p in TIME_PARTS if p in parts] + sorted(p for p in parts if p not in TIME_PARTS)
    shown = [f"{p} {_secs(parts[p])}" for p in order if float(_secs(parts[p])) != 0]
    return f"time {_secs(total)} s" + (" = " + " + ".join(shown) if shown else "")


def format_step_line(step: int, metrics: Metrics, num_steps: int | None = None) -> str:
    """One console line for a step (`step/num_steps` when given); fields of absent metrics are left out.

    Reads: reward/mean, accuracy, length/{p50,p90,max} (tokens, whole numbers), time/step and its parts
    time/<part> (they add up to time/step), throughput/tok_per_s, spec/accept_len (`accept - (no SD chunk)`
    when speculative modes exist, spec/modes > 0, but no chunk of the step speculated), dynamic_sampling/*
    (DAPO's refill), eval/reward, eval/accuracy and eval/seconds (the held-out evaluation).
    """
    m = dict(metrics)
    parts = [f"step {step}" + (f"/{num_steps}" if num_steps else "")]
    if "reward/mean" in m:
        parts.append(f"reward {_fmt_num(m['reward/mean'])}")
    if "accuracy" in m:
        parts.append(f"acc {100 * float(m['accuracy']):.1f}%")
    lens = [m.get(f"length/{k}") for k in ("p50", "p90", "max")]
    if any(v is not None for v in lens):
        parts.append("len p50/p90/max " + "/".join("-" if v is None else f"{float(v):.0f}" for v in lens))
    if time_field := _time_field(m):
        parts.append(time_field)
    if "throughput/tok_per_s" in m:
        parts.append(f"{float(m['throughput/tok_per_s']):.0f} tok/s")
    if "dynamic_sampling/gen_batches" in m:  # DAPO's refill: generation batches, groups kept / generated
        kept, made = m["dynamic_sampling/kept_groups"], m["dynamic_sampling/generated_groups"]
        short = float(m.get("dynamic_sampling/short_groups", 0))
        parts.append(
            f"{float(m['dynamic_sampling/gen_batches']):.0f} gen batches, kept {float(kept):.0f}/"
            f"{float(made):.0f} groups" + (f" ({short:.0f} short)" if short else "")
        )
    if "spec/accept_len" in m:
        parts.append(f"accept {float(m['spec/accept_len']):.2f}")
    elif float(m.get("spec/modes", 0)) > 0:
        parts.append("accept - (no SD chunk)")
    if "eval/reward" in m:
        acc, secs = 100 * float(m.get("eval/accuracy", 0)), m.get("eval/seconds")
        took = "" if secs is None else f" ({_secs(float(secs))} s)"
        parts.append(f"held-out reward {_fmt_num(m['eval/reward'])} acc {acc:.1f}%{took}")
    return " | ".join(parts)


def shorten(text: str, width: int) -> str:
    """`text` cut in the middle to at most `width` characters ("Find the final an…: 5 + 4 - 5 ="): a prompt's
    start says what kind of problem it is and its end what is asked."""
    if len(text) <= width:
        return text
    head = max(width - 1, 0) // 2
    return text[:head] + "…" + text[len(text) - max(width - 1 - head, 0) :]


def interpreter() -> str:
    """The running Python as a user would type it: relative to the working directory when inside it
    (`.venv/bin/python`), else its absolute path (hints print commands that must run in the same venv)."""
    exe, rel = os.path.abspath(sys.executable), os.path.relpath(sys.executable)
    return rel if not rel.startswith("..") else exe


def console_print(line: str) -> None:
    """absl logging under `app.run` (flags parsed); print elsewhere, where absl would hide INFO lines."""
    from absl import flags

    if flags.FLAGS.is_parsed():
        logging.info(line)
    else:
        print(line, flush=True)


class ConsoleTracker:
    """Prints `format_step_line` every `every` steps (absl logging / print by default, or any `print_fn`)."""

    def __init__(
        self, every: int = 1, print_fn: Callable[[str], None] | None = None, num_steps: int | None = None
    ):
        self.every = max(1, int(every))
        self.num_steps = num_steps
        self._print = print_fn or console_print

    def log(self, step: int, metrics: Metrics) -> None:
        """Print the step's summary line (on every `every`-th step)."""
        if step % self.every == 0:
            self._print(format_step_line(step, metrics, self.num_steps))

    def log_config(self, config: mlc.ConfigDict | Mapping[str, object]) -> None:
        """Nothing: the config lives in config.json and wandb, too long for a console line."""

    def close(self) -> None:
        """Nothing to release."""


class MultiTracker:
    """Fans every call out to several trackers; `close` closes all of them even if one fails."""

    def __init__(self, trackers: Iterable[Tracker]):
        self.trackers = list(trackers)

    def log(self, step: int, metrics: Metrics) -> None:
        """Log to every tracker."""
        for t in self.trackers:
            t.log(step, metrics)

    def log_config(self, config: mlc.ConfigDict | Mapping[str, object]) -> None:
        """Log the config to every tracker."""
        for t in self.trackers:
            t.log_config(config)

    def close(self) -> None:
        """Close every tracker, then re-raise the first error, if any."""
        errors = []
        for t in self.trackers:
            try:
                t.close()
            except Exception as e:  # closing the others matters more than the first failure
                errors.append(e)
        if errors:
            raise errors[0]


def make_trackers(
    config: mlc.ConfigDict | Mapping[str, object], workdir: str | os.PathLike, resume_step: int | None = None
) -> MultiTracker:
    """jsonl (always) + console + wandb (mode from `config.wandb.mode`, else $WANDB_MODE, else offline).

    `resume_step`: the step a restored run continues from; metrics of steps >= it are dropped from the jsonl.
    """
    wb = config.get("wandb", None) if hasattr(config, "get") else getattr(config, "wandb", None)
    wb_get = (lambda k, d=None: wb.get(k, d)) if wb is not None else (lambda k, d=None: d)
    jsonl = JsonlTracker(workdir)
    if resume_step is not None:
        jsonl.truncate_from(resume_step)
    every = int(config.get("log_every", 1) or 1)
    trackers: list[Tracker] = [
        jsonl,
        ConsoleTracker(every, num_steps=int(config.get("num_steps", 0)) or None),
    ]
    trackers.append(
        WandbTracker(
            project=wb_get("project") or "tlt_jax",
            name=wb_get("name") or os.path.basename(os.path.abspath(os.fspath(workdir))),
            workdir=workdir,
            mode=wb_get("mode"),
            config=config,
        )
    )
    return MultiTracker(trackers)


class RolloutProgress:
    """A tqdm bar over finished sequences, with running rows, tokens generated and tok/s as its postfix.

    `update(running, finished, new_tokens)`: `running` and `finished` are current totals, `new_tokens` the
    tokens generated since the last call. `disable=None` shows the bar only on a TTY; True hides it (tests,
    batch jobs) while still counting; False forces it on (e.g. into a StringIO).
    """

    def __init__(
        self,
        total: int | None = None,
        desc: str = "rollout",
        file: IO[str] | None = None,
        disable: bool | None = None,
        mininterval: float = 0.5,
    ):
        from tqdm import tqdm

        stream = file if file is not None else sys.stderr
        if disable is None:
            disable = not (hasattr(stream, "isatty") and stream.isatty())
        self.tokens = 0
        self.running = 0
        self.finished = 0
        self._t0 = time.perf_counter()
        self._bar = tqdm(
            total=total,
            desc=desc,
            unit="seq",
            file=stream,
            disable=disable,
            mininterval=mininterval,
            leave=False,
        )

    @property
    def tok_per_s(self) -> float:
        """Tokens generated per second since the bar was created."""
        return self.tokens / max(time.perf_counter() - self._t0, 1e-9)

    def update(self, running: int, finished: int, new_tokens: int) -> None:
        """Record the current running/finished counts and `new_tokens` more generated tokens."""
        self.running, self.tokens = int(running), self.tokens + int(new_tokens)
        delta, self.finished = int(finished) - self.finished, int(finished)
        self._bar.set_postfix_str(
            f"running {self.running} | finished {self.finished} | {self.tokens} tok "
            f"| {self.tok_per_s:.1f} tok/s",
            refresh=False,
        )
        self._bar.update(delta)

    def close(self) -> None:
        """Close the bar (idempotent)."""
        self._bar.close()

    def __enter__(self) -> RolloutProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
