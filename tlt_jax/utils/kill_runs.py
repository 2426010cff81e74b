"""The kill loop's machinery (experiments/checks/kill_loop.py, tests/test_kill_loop.py): the job, a launch
that SIGKILLs it at a phase, the loop of launches, and the comparison with an uninterrupted run.

The job is `python -m tlt_jax.main` on the smoke config with speculative rollouts, the spot trainer (an EAGLE
drafter trained from scratch between chunks, its data buffer saved beside each checkpoint) and a fixed-table
selector (EAGLE above 8 running rows, plain at 5-8, n-gram at <= 4: its choices do not depend on timing).
`launch` watches the learner's phase file (`<workdir>/.phase`, tlt_jax/utils/phase.py) and `checkpoints/`
for orbax's `<step>.orbax-checkpoint-tmp` folders every ~0.5 ms and, given a target, SIGKILLs the job there
(`_due`); the phase file read after the process is dead says where it was. `compare_runs` checks a killed
and relaunched run against the uninterrupted one (see experiments/checks/kill_loop.py's docstring).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository: the job runs configs/smoke.py from it
CHECKPOINT_EVERY = 2  # configs/smoke.py
DEVICES = 2  # fake CPU devices of the job (as tests/test_main.py's runs)
# XLA:CPU at its cheapest compile (the tests' setting, tests/conftest.py): LLVM at -O0 and the older loop
# emitters instead of the MLIR fusion emitters; the same HLO, the same numbers, compiled in about a third
# of the default's time
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# the spot trainer's windows at smoke size: a few ms per drafter step (also tests/test_multiprocess.py's)
TINY_SPOT = (
    "--config.spot.window=16",
    "--config.spot.context=8",
    "--config.spot.ce_tokens=16",
    "--config.spot.ttt_steps=1",
    "--config.spot.ttt_positions=8",
    "--config.spot.eval_samples=4",
)
# SD (EAGLE and n-gram arms), the spot trainer between chunks and a fixed table
OVERRIDES = (
    "--config.spot.mode=between_chunks",
    "--config.spot.threshold=1024",
    *TINY_SPOT,
    "--config.bandit.algorithm=fixed",
    "--config.bandit.arms=('plain','3_1_4','ngram_3_1_4')",
    "--config.bandit.bucket_bounds=(4,8)",
    "--config.bandit.fixed_table=('ngram_3_1_4','plain','3_1_4')",
)
# the learner's phases in the order a step writes them (tlt_jax/rl/learner.py), then the shutdown
PHASES = tuple(
    "init eval rollout spot_after_rollout reward logprob update metrics buffer_save checkpoint plots close "
    "closed".split()
)
SAVE_TARGETS = ("buffer_save", "checkpoint", "async_write")
KILL_TARGETS = ("init", "rollout", "reward", "update", *SAVE_TARGETS)
# the short plan (experiments/checks/kill_loop.py --quick, tests/test_kill_loop.py): (target, aimed step)
QUICK_PLAN = (("rollout", 2), ("async_write", 2), ("checkpoint", 3))
# the longest random delay after the target phase is seen, per target (seconds; 0 where absent)
MAX_DELAY = {"init": 0.3, "rollout": 0.1, "update": 0.02, "checkpoint": 0.01, "async_write": 0.05}
TMP_DIR = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")
# metrics that are timings, or count or leave out chunks that compiled (a relaunch compiles, or loads from
# the cache, again): every other metric must equal the reference's
TIMING = re.compile(
    r"^(compile|throughput|programs|bucket)/|time|seconds|_s$|tok_per_s|wall|share|compiled|/reward"
)


# ---- the job -----------------------------------------------------------------------------------------------


def job_env(
    cache_dir: str | os.PathLike | None = None, devices: int = DEVICES, fast_compile: bool = False
) -> dict[str, str]:
    """The job's environment: `devices` fake CPU devices (the smoke config shards over them), no wandb, and
    the persistent compilation cache `cache_dir` (None: the job's default), so relaunches compile nothing.
    fast_compile: FAST_COMPILE_FLAGS (the tests' setting: the same programs, compiled faster)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if fast_compile:
        env["XLA_FLAGS"] += f" {FAST_COMPILE_FLAGS}"
    env["WANDB_MODE"] = "disabled"
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def job_command(workdir: str | os.PathLike, steps: int, overrides: Sequence[str] = OVERRIDES) -> list[str]:
    """`python -m tlt_jax.main` on the smoke config with SD and `overrides` (default: the spot trainer and a
    fixed selector)."""
    config = f"{ROOT / 'configs' / 'smoke.py'}:steps={steps},spec=true"
    return [sys.executable, "-m", "tlt_jax.main", "--config", config, "--workdir", str(workdir), *overrides]


@dataclasses.dataclass
class Kill:
    """One SIGKILL: what it aimed at, and where the process was when it died."""

    target: str
    aim_step: int
    delay: float
    seconds: float  # since the launch
    step: int | None  # the phase file's step at death (None: before the learner started)
    phase: str  # the phase file's phase at death ("startup": before the learner started)
    writing: list[int]  # the checkpoint steps half-written at death

    @property
    def landed(self) -> str:
        """The phase, or "async_write" for a background checkpoint write outside the checkpoint phase."""
        return "async_write" if self.writing and self.phase != "checkpoint" else self.phase

    @property
    def where(self) -> str:
        """'<landed>@<step>': the phase's step, or the step of the checkpoint being written (+ the phase)."""
        if self.landed != "async_write":
            return f"{self.landed}@{self.step}"
        return f"async_write@{self.writing[-1]} ({self.phase}@{self.step})"


@dataclasses.dataclass
class Launch:
    """One launch of the job: the checkpoint it resumed from, its phases over time, how it ended."""

    index: int
    resumed_from: int | None
    trace: list[tuple[float, str]]  # (seconds since the launch, "<step> <phase>[ +write]") at each change
    seconds: float
    returncode: int | None
    kill: Kill | None = None


def committed_steps(workdir: pathlib.Path) -> list[int]:
    """The finalised checkpoint steps in `<workdir>/checkpoints` (orbax renames a step's folder once done)."""
    d = workdir / "checkpoints"
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if d.is_dir() else []


def _writing(workdir: pathlib.Path) -> list[int]:
    """Steps whose checkpoint folder is being written (`<step>.orbax-checkpoint-tmp*`)."""
    d = workdir / "checkpoints"
    names = os.listdir(d) if d.is_dir() else []
    return sorted(int(m.group(1)) for m in map(TMP_DIR.match, names) if m)


def _where(workdir: pathlib.Path) -> tuple[tuple[int, str] | None, list[int]]:
    """(the phase file's (step, phase) or None, the checkpoints being written). Before the learner is past
    "init" a tmp folder is an earlier launch's (its Checkpointer removes them): none is being written."""
    from tlt_jax.utils.phase import read_phase

    now = read_phase(workdir)
    return now, [] if now is None or now[1] == "init" else _writing(workdir)


def _due(now: tuple[int, str] | None, writing: list[int], target: str, aim: int, steps: int) -> bool:
    """Whether the watcher has reached the target: its phase at or after the aimed step (a phase that went
    by unseen counts as reached at the next one), or for async_write a checkpoint >= aim being written
    while the learner has left the checkpoint's blocking part (the final one: at all, as the run ends
    inside that part)."""
    if now is None:
        return False
    if target == "async_write":
        return any(s >= aim and (now[1] != "checkpoint" or s == steps) for s in writing)
    step, phase = now
    if target == "init" or phase in ("close", "closed"):
        return True
    order = PHASES.index(phase) if phase in PHASES else 0
    return step > aim or (step == aim and order >= PHASES.index(target))


def launch(
    workdir: pathlib.Path,
    steps: int,
    env: dict[str, str],
    log: pathlib.Path,
    index: int,
    kill: tuple[str, int, float] | None = None,
    timeout: float = 900,
    overrides: Sequence[str] = OVERRIDES,
) -> Launch:
    """Run the job (`job_command` with `overrides`) once; with `kill` = (target, aimed step, delay) SIGKILL
    it there (`_due`), else let it finish. The phase file of an earlier launch is removed first, so a kill
    before the learner starts reads as "startup"."""
    (workdir / ".phase").unlink(missing_ok=True)
    resumed = (committed_steps(workdir) or [None])[-1]
    t0 = time.monotonic()
    with open(log, "w") as err:
        proc = subprocess.Popen(
            job_command(workdir, steps, overrides), env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err
        )
    out = Launch(index, resumed, [], 0.0, None)
    try:
        last = None
        while proc.poll() is None:
            now, writing = _where(workdir)
            mark = f"{now[0]} {now[1]}" if now else "- startup"
            mark += " +write" if writing else ""
            if mark != last:
                out.trace.append((time.monotonic() - t0, mark))
                last = mark
            if kill is not None and _due(now, writing, kill[0], kill[1], steps):
                out.kill = _kill(proc, workdir, kill, t0)
                break
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"launch {index} ran past {timeout:.0f}s; see {log}")
            time.sleep(0.0005)
        out.returncode = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out.seconds = time.monotonic() - t0
    return out


def _kill(
    proc: subprocess.Popen, workdir: pathlib.Path, kill: tuple[str, int, float], t0: float
) -> Kill | None:
    """Sleep the delay (only when the target phase itself was reached), SIGKILL, and read where it died;
    None when the process exited first."""
    target, aim, delay = kill
    now, _ = _where(workdir)
    if delay and (target == "async_write" or (now is not None and now[1] == target)):
        time.sleep(delay)
    if proc.poll() is not None:
        return None
    os.kill(proc.pid, signal.SIGKILL)
    seconds = time.monotonic() - t0
    proc.wait()
    at, writing = _where(workdir)
    return Kill(
        target,
        aim,
        delay,
        seconds,
        None if at is None else at[0],
        "startup" if at is None else at[1],
        writing,
    )


def aim_step(rng: random.Random, target: str, resumed: int | None, steps: int, earliest: int = 1) -> int:
    """The step to aim at after a resume from `resumed`, from `earliest` on: the first or second such step,
    or for the save targets the first that saves (async_write: not the final one while another is left)."""
    first = max((resumed or 0) + 1, earliest)
    if target in SAVE_TARGETS:
        saves = [s for s in range(first, steps + 1) if s % CHECKPOINT_EVERY == 0 or s == steps]
        if target == "async_write" and len(saves) > 1:
            saves = saves[:-1]
        return saves[0] if saves else steps
    return min(rng.randint(first, first + 1), steps) if target != "init" else 0


def _check_exit(run: Launch, logs: pathlib.Path) -> None:
    """A RuntimeError with the log's tail when a launch that was not killed failed."""
    if run.returncode != 0:
        tail = (logs / f"launch_{run.index}.log").read_text()[-3000:]
        raise RuntimeError(f"launch {run.index} exited {run.returncode}:\n{tail}")


def kill_loop(
    workdir: pathlib.Path,
    steps: int,
    plan: Sequence[tuple[str, int | None]],
    env: dict[str, str],
    logs: pathlib.Path,
    seed: int = 0,
    delays: Mapping[str, float] = MAX_DELAY,
    say: Callable[[str], None] = print,
) -> list[Launch]:
    """Launch, kill per `plan` (target, aimed step; None: `aim_step`, the kills spread evenly over the run)
    after a random delay of at most `delays[target]` (0 where absent), relaunch; the last launch runs to the
    end (a RuntimeError with its log when it fails). Returns every launch."""
    rng = random.Random(seed)
    launches = []
    for n, (target, aim) in enumerate(plan):
        if target not in KILL_TARGETS:
            raise ValueError(f"kill target {target!r}: use one of {KILL_TARGETS}")
        resumed = (committed_steps(workdir) or [None])[-1]
        earliest = 1 + n * steps // len(plan)
        step = aim if aim is not None else aim_step(rng, target, resumed, steps, earliest)
        delay = rng.uniform(0.0, delays.get(target, 0.0))
        i = len(launches) + 1
        run = launch(workdir, steps, env, logs / f"launch_{i}.log", i, (target, step, delay))
        launches.append(run)
        k = run.kill
        say(
            f"launch {i} (from checkpoint {resumed}): "
            + (
                f"killed at {k.seconds:.2f}s aiming {target}@{step}, landed {k.where}"
                if k
                else f"exited {run.returncode} before {target}@{step}"
            )
        )
        if k is None:
            _check_exit(run, logs)
            break  # finished before the kill: nothing left to kill
    i = len(launches) + 1
    final = launch(workdir, steps, env, logs / f"launch_{i}.log", i)
    launches.append(final)
    _check_exit(final, logs)
    say(f"launch {i} (from checkpoint {final.resumed_from}): finished in {final.seconds:.1f}s")
    return launches


# ---- the comparison ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Comparison:
    """A killed-and-relaunched run against the uninterrupted one (`compare_runs`)."""

    identical: bool  # final state, spot buffer, deterministic metrics and samples equal the reference's
    steps_once: bool  # metrics.jsonl has steps 1..N, each once
    leftovers: list[str]  # half-written files and folders (`leftovers`)
    differences: list[str]  # what differs, for the report

    @property
    def ok(self) -> bool:
        return self.identical and self.steps_once and not self.leftovers


def leftovers(workdir: str | os.PathLike) -> list[str]:
    """What a crash can leave half-written, relative to `workdir`: orbax's `*.orbax-checkpoint-tmp*`
    folders, `*.tmp` files (metrics, samples, config, the spot buffer's `.tmp.npz`), retired steps not yet
    removed (`checkpoints/.deleted`), a checkpoint folder without orbax's commit files, a spot buffer folder
    without its checkpoint, a checkpoint without its spot buffer."""
    from tlt_jax.utils.checkpoint import TRASH

    root = pathlib.Path(workdir)
    out = []
    for path in sorted(root.rglob("*")):
        half = ".orbax-checkpoint-tmp" in path.name or path.name.endswith(".tmp") or ".tmp." in path.name
        if half or path.name == TRASH:
            out.append(str(path.relative_to(root)))
    steps = set(committed_steps(root))
    for s in sorted(steps):
        if not all(
            (root / "checkpoints" / str(s) / f).exists()
            for f in ("_CHECKPOINT_METADATA", "commit_success.txt")
        ):
            out.append(f"checkpoints/{s} (not committed)")
    buffers = root / "spot_buffer"
    if buffers.is_dir():
        have = {int(n) for n in os.listdir(buffers) if n.isdigit()}
        out += [f"spot_buffer/{s} (no checkpoint)" for s in sorted(have - steps)]
        out += [f"checkpoints/{s} (no spot buffer)" for s in sorted(steps - have)]
    return out


def checkpoint_leaves(workdir: str | os.PathLike, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Checkpoint `step` of `<workdir>/checkpoints` as {leaf path: NumPy array} (typed keys as their key
    data) and its meta. Opening a Checkpointer removes half-written folders: call `leftovers` first."""
    import jax
    import numpy as np

    from tlt_jax.utils.checkpoint import Checkpointer, path_str

    with Checkpointer(pathlib.Path(workdir) / "checkpoints", async_save=False) as ckpt:
        state, meta = ckpt.restore(step)
    leaves = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        is_key = jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)
        leaves[path_str(path)] = np.asarray(jax.random.key_data(x) if is_key else x)
    return leaves, meta


def _same(a: Any, b: Any) -> bool:
    """Bit for bit: same dtype, shape and bytes (NaNs included)."""
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _state_differences(ref: pathlib.Path, got: pathlib.Path, steps: int) -> list[str]:
    """The final checkpoints and spot buffers, leaf by leaf. The selector's reward windows hold tokens/s
    (timings): only which slots are filled is compared there."""
    import numpy as np

    (a, meta_a), (b, meta_b) = checkpoint_leaves(ref, steps), checkpoint_leaves(got, steps)
    out = [f"checkpoint leaf {p}: only in one run" for p in sorted(set(a) ^ set(b))]
    for p in sorted(set(a) & set(b)):
        x, y = (np.isnan(a[p]), np.isnan(b[p])) if p.endswith("state/rewards") else (a[p], b[p])
        if not _same(x, y):
            out.append(f"checkpoint leaf {p}")
    if meta_a != meta_b:
        out.append(f"checkpoint meta {meta_a} vs {meta_b}")
    buf = f"spot_buffer/{steps}/drafter_buffer.npz"
    if (ref / buf).exists() or (got / buf).exists():
        with np.load(ref / buf) as za, np.load(got / buf) as zb:
            if sorted(za.files) != sorted(zb.files):
                out.append(f"{buf}: arrays {za.files} vs {zb.files}")
            out += [f"{buf}: {k}" for k in sorted(set(za.files) & set(zb.files)) if not _same(za[k], zb[k])]
    return out


def _lines(path: pathlib.Path) -> list[dict[str, Any]]:
    from tlt_jax.utils.tracking import read_metrics

    return read_metrics(path) if path.exists() else []


def compare_runs(ref: str | os.PathLike, got: str | os.PathLike, steps: int) -> Comparison:
    """The run in `got` (killed and relaunched) against the uninterrupted `ref`, both of `steps` steps: see
    the module docstring. Reads `leftovers` before opening any checkpoint."""
    ref, got = pathlib.Path(ref), pathlib.Path(got)
    left = leftovers(got)
    rows_a, rows_b = _lines(ref / "metrics.jsonl"), _lines(got / "metrics.jsonl")
    want = list(range(1, steps + 1))
    steps_once = [r["step"] for r in rows_b] == want
    diffs = [] if steps_once else [f"metrics.jsonl steps {[r['step'] for r in rows_b]}, want {want}"]
    if [r["step"] for r in rows_a] != want:
        diffs.append(f"the reference's metrics.jsonl has steps {[r['step'] for r in rows_a]}")
    by_step = {r["step"]: r for r in rows_b}
    for ra in rows_a:
        rb = by_step.get(ra["step"], {})
        for k in sorted(ra):
            if not TIMING.search(k) and not _same(ra[k], rb.get(k, float("inf"))):
                diffs.append(f"metric {k} at step {ra['step']}: {ra[k]} vs {rb.get(k)}")
    if _lines(ref / "samples.jsonl") != _lines(got / "samples.jsonl"):
        diffs.append("samples.jsonl")
    if steps in committed_steps(got):
        diffs += _state_differences(ref, got, steps)
    else:
        diffs.append(f"no final checkpoint {steps} (have {committed_steps(got)})")
    identical = not [d for d in diffs if not d.startswith("metrics.jsonl steps")]
    return Comparison(identical, steps_once, left, diffs)
