"""The watchdog: a process that makes no progress for too long exits non-zero, naming its phase, instead of
sitting idle until the cluster's time limit (a collective whose peer never arrives, a deadlocked program,
a filesystem that stopped answering).

Progress is what the job reports: `phase(step, name)` at each phase change and `beat()` within a phase (the
learner beats after every rollout chunk, update part and stop-agreement point). While JAX compiles (trace,
lowering or XLA's backend compile, seen through `jax.monitoring`'s start and end events) the limit is the
"compile" kind's, and the end of a compilation counts as progress. Otherwise the limit is that of the
phase's kind (`kinds`: phase name -> kind, the rest "other"); 0 turns a kind off. When the limit passes, the
watchdog writes one error line (phase, step, how long, which limit and how to raise it), every thread's
stack, and calls `exit_fn(EXIT_STALLED)` (default `os._exit`: a thread stuck in a collective cannot be
interrupted; the checkpoints on disk stay the resume point). The other processes of a run then fail in
their next collective or are ended by JAX's heartbeat (`utils/distributed.py`).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from tlt_jax.utils.background import BackgroundLoop

# The exit statuses of `python -m tlt_jax.main` a scheduler acts on (configs/cluster/slurm_grpo.sh requeues on
# EXIT_STOPPED only): 0 the run finished; EXIT_STOPPED it stopped on a request (SIGTERM/SIGINT: a preemption,
# a time limit) with its checkpoints consistent, every process with this status: rerun the same command (or
# requeue) to resume; EXIT_STALLED the watchdog ended a process that made no progress; 2 a config error;
# anything else failed.
EXIT_STOPPED = 75  # sysexits' EX_TEMPFAIL
EXIT_STALLED = 70  # sysexits' EX_SOFTWARE
KINDS = ("compile", "rollout", "update", "checkpoint", "eval", "other")
# seconds without progress per kind: generous against a 32K-token rollout chunk (seconds on a GPU node), an
# update part at 32K (minutes), a 7B checkpoint write (about a minute), a whole held-out evaluation (no beats
# inside it) and the compilation of the 32B programs (tens of minutes)
DEFAULT_LIMITS: Mapping[str, float] = {
    "compile": 3600.0,
    "rollout": 1800.0,
    "update": 3600.0,
    "checkpoint": 1800.0,
    "eval": 7200.0,
    "other": 1800.0,
}
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


def limit_problems(limits: Mapping[str, object], name: str = "watchdog") -> list[str]:
    """Config problems of a limits mapping (`config.<name>.<kind>` seconds >= 0, known kinds only)."""
    out = [f"config.{name}.{k}: unknown kind; use {' / '.join(KINDS)}." for k in limits if k not in KINDS]
    for k, v in limits.items():
        if k in KINDS and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
            out.append(f"config.{name}.{k}={v!r}: must be seconds >= 0 (0: no limit for {k} phases).")
    return out


def dump_stacks() -> None:
    """Every thread's Python stack to stderr (where it has a file descriptor)."""
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # a captured stderr without a descriptor (tests)
        pass


class CompileTracker:
    """How many compilations are running now (any thread) and when the last one ended, from JAX's
    compile events: a start (`record_scalar`, its value the start time) and an end (its duration)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self.running, self.last_end = 0, clock()
        jax.monitoring.register_scalar_listener(self._on_start)
        jax.monitoring.register_event_duration_secs_listener(self._on_end)

    def _on_start(self, event: str, value: float, **_: object) -> None:
        if event in _COMPILE_EVENTS:
            with self._lock:
                self.running += 1

    def _on_end(self, event: str, duration: float, **_: object) -> None:
        if event in _COMPILE_EVENTS:
            with self._lock:
                self.running = max(self.running - 1, 0)
                self.last_end = self.clock()


_TRACKER: CompileTracker | None = None


def compile_tracker() -> CompileTracker:
    """The process's `CompileTracker` (its listeners are registered once)."""
    global _TRACKER
    if _TRACKER is None:
        _TRACKER = CompileTracker()
    return _TRACKER


class Watchdog(BackgroundLoop):
    """A daemon thread that ends the process when its phase makes no progress within the phase kind's
    limit (module docstring). A context manager: the thread runs inside the `with` block."""

    def __init__(
        self,
        limits: Mapping[str, float],
        kinds: Mapping[str, str],
        *,
        exit_fn: Callable[[int], Any] = os._exit,
        poll: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        compiles: CompileTracker | None = None,
        enabled: bool = True,
    ):
        self.limits, self.kinds = {**DEFAULT_LIMITS, **limits}, dict(kinds)
        self.poll, self.clock = float(poll), clock
        self._exit = exit_fn
        self.compiles = compiles if compiles is not None else compile_tracker()
        self.step, self.name, self.last = 0, "init", clock()
        self.fired: str | None = None  # the error line, once it fired
        super().__init__("watchdog", enabled)

    def phase(self, step: int, name: str) -> None:
        """The job entered phase `name` of step `step` (progress)."""
        self.step, self.name, self.last = int(step), name, self.clock()

    def beat(self) -> None:
        """Progress within the current phase."""
        self.last = self.clock()

    def kind(self) -> str:
        return "compile" if self.compiles.running else self.kinds.get(self.name, "other")

    def check(self) -> str | None:
        """The error line when the current phase is past its limit now, else None."""
        kind = self.kind()
        limit = float(self.limits.get(kind, 0.0))
        idle = self.clock() - max(self.last, self.compiles.last_end)
        if limit <= 0 or idle <= limit:
            return None
        what = "compiling" if kind == "compile" else f"phase kind {kind}"
        return (
            f"error: watchdog: no progress for {idle:.0f} s in phase {self.name!r} of step {self.step} "
            f"({what}; limit config.watchdog.{kind}={limit:g} s): most likely a collective that never "
            f"returns (a peer process stuck or gone, a deadlocked program). Exiting with status "
            f"{EXIT_STALLED} instead of idling until the job's time limit; relaunch to resume from the last "
            f"complete checkpoint, or raise config.watchdog.{kind} if this phase is legitimately that slow."
        )

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            line = self.check()
            if line is None:
                continue
            self.fired = line
            print(line, file=sys.stderr, flush=True)
            dump_stacks()
            self._exit(EXIT_STALLED)
            return

    def __enter__(self) -> Watchdog:
        self.last = self.clock()
        return super().__enter__()
