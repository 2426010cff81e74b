"""Stopping a run on request (SIGTERM/SIGINT: a scheduler's preemption, a time limit, Ctrl-C), the same way in
every process and within a bounded time.

- `PreemptionGuard`: the signals become a flag instead of killing the process, noted the moment they arrive
  (`signal.set_wakeup_fd` wakes a thread even while the main thread sits in a long compile or a device wait,
  where Python's own handler cannot run), and arm a deadline: `within_s` seconds later a process still
  running exits by itself with status `EXIT_STOP_LATE`, naming where it was (`describe`).
- `process_max`: the maximum of one integer over every process, a tiny jitted all-reduce over all global
  devices (gloo on CPU, NCCL on GPU), so a decision taken from it is the same in every process. On one
  process it is the value itself: no collective, no cost.
- `StopAgreement`: the stop decision taken together at agreement points that every process reaches in the
  same order (rollout chunk, update part and phase boundaries, between steps). Each process votes
  (`Vote`); the maximum wins, so a signal that reached one process stops all of them at the same point.

The rule (README "Several processes / hosts"): between steps, a stop saves the completed step (unless
saved) and exits. Mid-step, the step is abandoned at the next boundary (no save; the last committed
checkpoint is the resume point, and the redone step is bit-identical: its key is fold_in(seed, step) and the
data position is in the checkpoint) when that loses nothing but the partial step (the state at the step's
start is saved) or when finishing it would not fit the bound (the learner then saves the state at the step's
start where the step has not changed it in place: tlt_jax.rl.stopping); otherwise (completed steps not yet
saved) the step is finished and saved: it is expected to end, with its save, within `within_s` of the request
(from the last step's and the last save's measured durations in this launch; a save's duration is its
blocking part plus its asynchronous write, which the stopping process waits for before it exits).

JAX's own preemption sync (`multihost_utils.reached_preemption_sync_point`) is not used: its notifier is a
C++ SIGTERM handler that the guard's Python handler replaces, it is called once per step, and it agrees
on a step only, not on abandoning one mid-way.
"""

from __future__ import annotations

import enum
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from absl import logging

from tlt_jax.utils.watchdog import EXIT_STOPPED, dump_stacks

# the deadline's exit: a stop that did not complete in time is still a stop (the last complete checkpoint is
# the resume point), so the scheduler requeues it as any other (tlt_jax.utils.watchdog.EXIT_STOPPED)
EXIT_STOP_LATE = EXIT_STOPPED


class PreemptionGuard:
    """Context manager turning SIGTERM/SIGINT into a flag, so the loop can stop at a safe point.

    Inside the context the signals set `should_stop` (and `received`, `requested_at`) instead of killing the
    process; a second SIGINT raises KeyboardInterrupt (an escape hatch at the terminal). The previous
    handlers come back on exit. Must be entered from the main thread (a Python rule for signal handlers).
    With `within_s`, the first request (a signal, or `request` from an agreement) arms a deadline: unless
    `disarm` is called first, `within_s` seconds later the process writes what `describe()` says and every
    thread's stack to stderr and calls `exit_fn(EXIT_STOP_LATE)` (default `os._exit`)."""

    def __init__(
        self,
        signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
        within_s: float | None = None,
        describe: Callable[[], str] = lambda: "",
        exit_fn: Callable[[int], Any] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._signals = tuple(signals)
        self.clock = clock
        self._previous: dict[int, Any] = {}
        self.within_s, self.describe, self._exit = within_s, describe, exit_fn
        self.received: signal.Signals | None = None
        self.requested_at: float | None = None  # clock() at the first request
        self._lock = threading.Lock()
        self._sigints = 0
        self._deadline: threading.Timer | None = None
        self._wakeup: tuple[int, int, int] | None = None  # (read fd, write fd, the previous wakeup fd)

    @property
    def should_stop(self) -> bool:
        """True once a stop was requested (a guarded signal, or `request`)."""
        return self.requested_at is not None

    def request(self, why: str, signum: int | None = None) -> None:
        """Note a stop request (first one only: its time, and the deadline armed). Thread-safe."""
        with self._lock:
            if signum is not None and self.received is None:
                self.received = signal.Signals(signum)
            if self.requested_at is not None:
                return
            self.requested_at = self.clock()
            if self.within_s is not None:
                self._deadline = threading.Timer(self.within_s, self._too_late)
                self._deadline.daemon = True
                self._deadline.start()
        bound = f" (within {self.within_s:g} s)" if self.within_s is not None else ""
        logging.warning("%s: stopping at the next agreed point%s", why, bound)

    def disarm(self) -> None:
        """Cancel the deadline (the stop is complete: nothing left that it bounds)."""
        with self._lock:
            if self._deadline is not None:
                self._deadline.cancel()

    def _too_late(self) -> None:
        where = self.describe()
        print(
            f"error: the stop requested {self.within_s:g} s ago did not complete"
            f"{f' ({where})' if where else ''}: exiting with status {EXIT_STOP_LATE}. The last complete "
            "checkpoint is the resume point: rerun the same command. Raise config.stop_within if a chunk, "
            "an update part or a checkpoint write takes longer. Stacks of every thread follow.",
            file=sys.stderr,
            flush=True,
        )
        dump_stacks()
        self._exit(EXIT_STOP_LATE)

    def _handle(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT:
            self._sigints += 1
            if self._sigints > 1:
                raise KeyboardInterrupt
        self.request(f"received {signal.Signals(signum).name}", signum)

    def _watch_wakeup(self, read_fd: int) -> None:
        """The signal numbers Python's C-level handler writes to the wakeup fd, as they arrive."""
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                break
            if not data:
                break
            for signum in data:
                if signum in self._signals:
                    self.request(f"received {signal.Signals(signum).name}", signum)
        os.close(read_fd)

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "PreemptionGuard must be entered from the main thread (signal handlers live there)."
            )
        for s in self._signals:
            self._previous[s] = signal.signal(s, self._handle)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._wakeup = (read_fd, write_fd, previous)
        threading.Thread(target=self._watch_wakeup, args=(read_fd,), name="stop-signals", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        if self._wakeup is not None:
            _, write_fd, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write_fd)  # the watcher reads EOF and ends
            self._wakeup = None


# ---- agreement across processes ---------------------------------------------------------------------------
@functools.cache
def _max_program() -> tuple[Any, Callable[[Any], Any]]:
    """(the [devices] int32 sharding over every global device, the jitted max to a replicated scalar)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()), ("all",))
    fn = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))
    return NamedSharding(mesh, P("all")), fn


def process_max(value: int) -> int:
    """max(value) over every process: every process must call it at the same point (a collective). One
    process: `value`, nothing run."""
    import jax

    if jax.process_count() == 1:
        return int(value)
    sharding, fn = _max_program()
    x = jax.make_array_from_callback(
        (jax.device_count(),), sharding, lambda idx: np.full((1,), value, np.int32)
    )
    return int(np.asarray(fn(x).addressable_data(0)))


class Vote(enum.IntEnum):
    """A process's say at an agreement point; the largest over the processes is what all of them do."""

    GO_ON = 0
    FINISH_STEP = 1  # finish the step, save it, stop
    ABANDON = 2  # leave the step now, unsaved


class StopRequested(Exception):
    """Raised at a mid-step agreement point when the processes agreed to abandon step `step` there."""

    def __init__(self, step: int, where: str):
        super().__init__(f"stop agreed: step {step} abandoned at {where}")
        self.step, self.where = step, where


class StopAgreement:
    """The stop decisions of a run, taken together: `between_steps()` and `mid_step(step, where)` at points
    every process reaches in the same order. `begin_step(saved)` / `end_step()` / `saved(seconds)` give the
    durations the mid-step vote weighs (the rule in the module docstring). `checks` / `check_seconds`
    count the agreement points and the time spent in them."""

    def __init__(self, guard: PreemptionGuard, agree: Callable[[int], int] = process_max):
        self.guard, self.agree, self.clock = guard, agree, guard.clock
        self.checks, self.check_seconds = 0, 0.0
        self.step_t0: float | None = None
        self.start_saved = True  # the state at the current step's start is in a checkpoint
        self.last_step_s: float | None = None  # the last complete step in this launch
        self.last_save_s = 0.0
        self.background_s: Callable[[], float] | None = None  # the last save's write after it returned
        self.finishing = False
        self.decided: tuple[int, str] | None = None  # (step, where) of the agreed stop

    def begin_step(self, saved: bool) -> None:
        self.step_t0, self.start_saved = self.clock(), saved

    def end_step(self) -> None:
        if self.step_t0 is not None:
            self.last_step_s = self.clock() - self.step_t0

    def saved(self, seconds: float, background_s: Callable[[], float] | None = None) -> None:
        """A checkpoint save blocked for `seconds`; `background_s()` is its asynchronous write's time after
        that (measured once written, the time so far while in flight), which a stop waits for too."""
        self.last_save_s, self.background_s = seconds, background_s

    def save_estimate(self) -> float:
        """The full time of a save, as the last one took: its blocking part plus its background write."""
        return self.last_save_s + (self.background_s() if self.background_s is not None else 0.0)

    def _agreed(self, vote: Vote) -> Vote:
        t0 = time.perf_counter()
        agreed = Vote(self.agree(int(vote)))
        self.checks += 1
        self.check_seconds += time.perf_counter() - t0
        if agreed != Vote.GO_ON and not self.guard.should_stop:
            self.guard.request("another process received a stop request")
        return agreed

    def mid_step_vote(self) -> Vote:
        """This process's vote inside a step."""
        g = self.guard
        if g.requested_at is None:
            return Vote.GO_ON
        if self.start_saved or self.last_step_s is None or self.step_t0 is None or g.within_s is None:
            return Vote.ABANDON
        now = self.clock()
        end = now + max(self.last_step_s - (now - self.step_t0), 0.0) + self.save_estimate()
        return Vote.FINISH_STEP if end - g.requested_at <= g.within_s else Vote.ABANDON

    def between_steps(self, step: int) -> bool:
        """Whether every process stops after step `step` (it is to be saved, unless it is already)."""
        stop = self._agreed(Vote.FINISH_STEP if self.guard.should_stop else Vote.GO_ON) != Vote.GO_ON
        if stop and self.decided is None:
            self.decided = (step, "between_steps")
        return stop

    def mid_step(self, step: int, where: str) -> None:
        """An agreement point inside step `step` at `where`: raises StopRequested when all agreed to
        abandon the step; notes (once) an agreement to finish it."""
        agreed = self._agreed(self.mid_step_vote())
        if agreed == Vote.ABANDON:
            self.decided = (step, where)
            raise StopRequested(step, where)
        if agreed == Vote.FINISH_STEP and not self.finishing:
            self.finishing = True
            logging.warning("stop agreed at %s of step %d: finishing the step to save it", where, step)
