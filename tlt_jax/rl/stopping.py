"""What the learner's loop runs inside so that a run stops together and never hangs: the preemption guard and
the stop agreement of every process (tlt_jax.utils.preemption), and the watchdog (tlt_jax.utils.watchdog).

`LoopGuards` wires them to the learner: the phase file's writer is wrapped (`PhaseTee`) so every phase change
reaches the watchdog, and inside a step the phases of `MID_STEP_PHASES` are agreement points; the rollout
gets `StopCheck` (a hook: an agreement point after every chunk) and the trainer `update_part` (after every
update part, once its gradient is computed). Every process reaches these points in the same order: the
rollout's chunks and the update's parts are SPMD programs over all of them. An evaluation (between a step
and its save) is stoppable too: its rollouts get the same hook (`evaluating`), and a stop agreed there ends
the evaluation at once; the step, final before it, is then saved.

A step abandoned mid-way whose start is not in a checkpoint (checkpoint_every > 1) does not lose the steps
since the last one: the state at its start (`StepStart`, held by reference: nothing copied) is saved instead,
unless the step has changed some of it in place (a donated buffer: the update applied, the spot trainer
trained; or the drafter's data buffer took the step's samples). Then the log says which part and the steps
lost (the learner's `_abandon`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
from absl import logging

from tlt_jax.config_sections import RunSection
from tlt_jax.rollout.hooks import ChunkView, RolloutHooks
from tlt_jax.utils.checkpoint import path_str
from tlt_jax.utils.phase import PhaseFile
from tlt_jax.utils.preemption import PreemptionGuard, StopAgreement, StopRequested, Vote
from tlt_jax.utils.watchdog import Watchdog

# the learner's phases inside a step where abandoning it is safe (nothing of the step is written yet)
MID_STEP_PHASES = ("rollout", "spot_after_rollout", "reward", "logprob", "update")
# phase -> the watchdog's kind (its limit: config.watchdog.<kind>); the rest are "other"
PHASE_KINDS = {
    "rollout": "rollout",
    "spot_after_rollout": "update",
    "logprob": "update",
    "update": "update",
    "buffer_save": "checkpoint",
    "checkpoint": "checkpoint",
    "close": "checkpoint",
    "eval": "eval",
}


class PhaseTee:
    """The learner's phase writer (`PhaseFile`'s `set` / `close`) that also tells `guards.on_phase`."""

    def __init__(self, phases: PhaseFile | PhaseTee, guards: LoopGuards):
        self.inner = phases.inner if isinstance(phases, PhaseTee) else phases  # a second `train`: one tee
        self.guards = guards

    @property
    def path(self) -> str | None:
        return self.inner.path

    def set(self, step: int, phase: str) -> None:
        self.inner.set(step, phase)
        self.guards.on_phase(step, phase)

    def close(self) -> None:
        self.inner.close()


class StopCheck(RolloutHooks):
    """A rollout hook: after every chunk, progress for the watchdog and a mid-step agreement point."""

    def __init__(self, guards: LoopGuards):
        self.guards = guards

    def on_chunk(self, view: ChunkView) -> None:
        del view
        self.guards.point("rollout chunk")


class LoopGuards:
    """The preemption guard (SIGTERM/SIGINT noted, the `run.stop_within` deadline), the stop agreement and
    the watchdog (`run.watchdog`) of one learner loop. A context manager around the loop (the signals); then
    `finish()` once the run's checkpoint writes are complete (the watchdog and the deadline cover them)."""

    def __init__(self, run: RunSection, watchdog: bool = True):
        self.step, self.phase, self.in_step, self._phases = 0, "init", False, 0
        self.in_eval = False
        self.guard = PreemptionGuard(within_s=run.stop_within, describe=self.where)
        self.agreement = StopAgreement(self.guard)
        self.watchdog = Watchdog(run.watchdog, PHASE_KINDS, enabled=watchdog)
        self.rollout_hook = StopCheck(self)
        self._checks = (0, 0.0)

    def where(self) -> str:
        return f"step {self.step}, phase {self.phase}"

    def on_phase(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase
        self.watchdog.phase(step, phase)
        if self.in_step and phase in MID_STEP_PHASES:
            self._phases += 1
            if self._phases > 1:  # the step's first phase follows the agreement before the step
                self.agreement.mid_step(step, f"{phase} start")

    def point(self, where: str) -> None:
        """A mid-step (or mid-evaluation) agreement point (progress too)."""
        self.watchdog.beat()
        if self.in_step:
            self.agreement.mid_step(self.step, where)
        elif self.in_eval:
            self.agreement.mid_step(self.step, "eval chunk")
        self.watchdog.beat()

    @contextlib.contextmanager
    def evaluating(self, step: int) -> Iterator[None]:
        """An evaluation after step `step` (its state final): its rollout chunks are agreement points where a
        stop abandons the evaluation (`StopRequested`; nothing of the step is lost: save it, then stop)."""
        self.in_eval, self.step = True, step
        self.agreement.begin_step(saved=True)  # abandoning loses only the evaluation
        try:
            yield
        finally:
            self.in_eval = False

    def update_part(self, acc: Any) -> None:
        """The trainer's callback after each update part: waits for its gradient, then agrees."""
        jax.block_until_ready(acc)
        self.point("update part")

    def begin_step(self, saved: bool) -> None:
        """A step starts (`saved`: the state it starts from is in a checkpoint)."""
        self.in_step, self._phases = True, 0
        self.agreement.begin_step(saved)

    def end_step(self) -> bool:
        """The step is complete; whether the processes agreed inside it to finish it and stop."""
        self.in_step = False
        self.agreement.end_step()
        self.watchdog.beat()
        return self.agreement.finishing

    def between_steps(self, step: int) -> bool:
        """The agreement before the step after `step`: whether every process stops there."""
        self.watchdog.beat()
        return self.agreement.between_steps(step)

    def timed_save(self, save: Callable[[], None], background_s: Callable[[], float] | None = None) -> None:
        """Run `save()` and record its time, what a finishing step's estimate adds: how long it blocked, plus
        its background write (`background_s()`: the checkpointer's, measured once written, the time so far
        while in flight; a stopping process waits for it before it exits)."""
        t0 = time.monotonic()
        save()
        self.agreement.saved(time.monotonic() - t0, background_s)

    def all_agree(self, ok: bool) -> bool:
        """Whether `ok` holds in every process (an agreement point every process reaches: a collective)."""
        return self.agreement.agree(int(Vote.GO_ON if ok else Vote.ABANDON)) == Vote.GO_ON

    def metrics(self) -> dict[str, float]:
        """stop/checks and stop/check_s since the last call (the agreement points and their cost)."""
        a, (n, s) = self.agreement, self._checks
        self._checks = (a.checks, a.check_seconds)
        return {"stop/checks": float(a.checks - n), "stop/check_s": a.check_seconds - s}

    def abandoned(self, e: StopRequested, saved_step: int, why: str = "") -> None:
        """Log the agreed abandonment of step `e.step` (every process writes the same line); `saved_step`:
        the newest checkpoint, what a rerun resumes from; `why`: what the stop saved or lost besides."""
        self.in_step = False
        resume = f"step {saved_step}'s checkpoint" if saved_step else "the start (no checkpoint yet)"
        logging.warning(
            "stop agreed by every process at %s of step %d: step %d abandoned (not saved); a rerun "
            "resumes from %s%s",
            e.where,
            e.step,
            e.step,
            resume,
            f"; {why}" if why else "",
        )

    def __enter__(self) -> LoopGuards:
        """Signals become stop requests, and the watchdog starts (it runs until `finish`)."""
        self.guard.__enter__()
        self.watchdog.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.guard.__exit__(*exc)  # the previous signal handlers back

    def finish(self) -> None:
        """The loop and its checkpoint writes are over: the watchdog stops and the stop deadline is off."""
        self.watchdog.__exit__()
        self.guard.disarm()


@dataclasses.dataclass(frozen=True)
class StepStart:
    """The learner's state at the start of step `step + 1` (`state`: the checkpoint tree, its arrays by
    reference; `meta`: its JSON meta), kept while that step runs so that a stop abandoning the step can save
    it when no checkpoint holds it (module docstring)."""

    step: int
    state: dict[str, Any]
    meta: dict[str, Any]

    def changed(self) -> list[str]:
        """The top-level parts of `state` whose buffers the step has donated since (gone: not saveable)."""
        flat, _ = jax.tree_util.tree_flatten_with_path(self.state)
        gone = {path_str(p).split("/")[0] for p, x in flat if isinstance(x, jax.Array) and x.is_deleted()}
        return sorted(gone)
