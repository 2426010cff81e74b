"""The RL step's metrics: what the step learned from (rewards, lengths, advantages), what the update did,
how far the engine's sampling log-probs are from the trainer's, and where the step's time went.

`StepClock` splits the step's wall time into disjoint parts that add up to time/step: each phase less the
compilation inside it, all compilation, the spot trainer's added time, and "other". The hooks' own metrics
(speculation, spot trainer, selector) come from their modules; `finish_metrics` adds the rollout's
statistics and the clock last, so time/step covers the metric assembly too. `RolloutWatch` (a rollout hook)
and `LearnerStatus` feed the console's heartbeat and the run's plots while the step runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import numpy as np

from tlt_jax.rl.advantages import Advantages
from tlt_jax.rl.plan import StepPlan
from tlt_jax.rl.reward import Scores
from tlt_jax.rl.schedules import lr_schedule
from tlt_jax.rl.update import UpdateResult
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import ChunkView, RolloutHooks, RolloutInfo
from tlt_jax.rollout.types import Rollout
from tlt_jax.utils import compile_stats
from tlt_jax.utils.phase import read_phase
from tlt_jax.utils.tracking import TIME_PARTS


class StepClock:
    """One step's wall time as disjoint parts that add up to it (time/<part>, `TIME_PARTS`):
    - rollout, reward, logprob, update: each phase's wall time less the compilation inside it;
    - compile: all compilation inside the phases (JAX's compile events: trace, lower, XLA or a cache read);
    - spot: the spot trainer's added time, `carve`d out of the rollout, plus its own phase after it;
    - other: what no phase covers (the learner between phases, metric assembly).
    `walls` keeps each phase's whole wall time (throughput, rollout/share). `on_phase(name)` is told when each
    phase starts (the learner's phase file, tlt_jax.utils.phase)."""

    def __init__(self, engine: RolloutEngine, on_phase: Callable[[str], None] | None = None):
        self.start = time.perf_counter()
        self.engine = engine
        self.on_phase = on_phase
        self.parts = dict.fromkeys(TIME_PARTS[:-1], 0.0)
        self.walls: dict[str, float] = {}
        self.compiled: dict[str, compile_stats.Snapshot] = {}

    @contextlib.contextmanager
    def phase(self, name: str, part: str | None = None) -> Iterator[None]:
        """Time the block: its compilation goes to "compile", the rest to `part` (default: `name`); not
        recorded when it raises."""
        if self.on_phase is not None:
            self.on_phase(name)
        log = compile_stats.compile_log()
        t0, c0 = time.perf_counter(), log.snapshot()
        yield
        wall, part = time.perf_counter() - t0, part or name
        self.compiled[name] = log.snapshot().delta(c0)
        compiled = min(self.compiled[name].total(), wall)
        self.walls[name] = self.walls.get(name, 0.0) + wall
        self.parts[part] = self.parts.get(part, 0.0) + wall - compiled
        self.parts["compile"] += compiled

    def carve(self, src: str, dst: str, seconds: float, compiled_kind: str | None = None) -> None:
        """Move `seconds` spent inside phase `src` to part `dst` (the spot trainer's training between chunks
        is inside the rollout), less what compiled inside `src` under `compiled_kind` (already "compile")."""
        if compiled_kind is not None and src in self.compiled:
            seconds -= sum(v for (k, _), v in self.compiled[src].seconds.items() if k == compiled_kind)
        moved = min(max(seconds, 0.0), self.parts.get(src, 0.0))
        self.parts[src] = self.parts.get(src, 0.0) - moved
        self.parts[dst] = self.parts.get(dst, 0.0) + moved

    def breakdown(self) -> dict[str, float]:
        """time/<part> for every part and time/step, read now; time/other is what the parts leave over."""
        total = time.perf_counter() - self.start
        out = {f"time/{k}": v for k, v in self.parts.items()}
        out["time/other"] = max(total - sum(self.parts.values()), 0.0)
        out["time/step"] = total
        return out


class RolloutWatch(RolloutHooks):
    """A rollout hook that keeps the live counters of the rollout in progress (rows finished and running,
    tokens, the chunk's mode: what the console's heartbeat prints) and its chunk timeline (`timeline()`:
    the running rows over the rollout's wall time with each chunk's mode, what the run's plot draws)."""

    def __init__(self) -> None:
        self.on_start(RolloutInfo(0, 0, 0, 1, ()))

    def on_start(self, info: RolloutInfo) -> None:
        self.t0, self.rows = time.perf_counter(), info.num_sequences
        self.running, self.finished, self.tokens, self.mode = self.rows, 0, 0, ""
        self.chunks: list[tuple[float, float, str, tuple[int, ...], int]] = []

    def on_chunk(self, view: ChunkView) -> None:
        rec, end = view.record, time.perf_counter() - self.t0
        self.running, self.finished = view.live_rows, self.rows - view.live_rows
        self.tokens += rec.new_tokens
        self.mode = rec.mode
        self.chunks.append((max(end - rec.seconds, 0.0), end, rec.mode, rec.running, view.live_rows))

    @property
    def tok_per_s(self) -> float:
        return self.tokens / max(time.perf_counter() - self.t0, 1e-9)

    def timeline(self) -> dict[str, list]:
        """Per chunk: start and end seconds since the rollout began (the chunk's compilation, if any, comes
        before its start), its mode, the running rows at each of its decode steps and the rows left after."""
        return {
            "t0": [round(c[0], 3) for c in self.chunks],
            "t1": [round(c[1], 3) for c in self.chunks],
            "mode": [c[2] for c in self.chunks],
            "running": [list(c[3]) for c in self.chunks],
            "left": [c[4] for c in self.chunks],
        }


class LearnerStatus:
    """The console heartbeat's view of a learner (`tlt_jax.utils.heartbeat.Heartbeat`): the phase from the
    workdir's phase file, the rollout's live counters (`RolloutWatch`) and what compiled in the phase."""

    def __init__(self, workdir: str, watch: RolloutWatch, num_steps: int):
        self.workdir, self.watch, self.num_steps = workdir, watch, num_steps
        self._key: str | None = None
        self._compiled0 = compile_stats.compile_log().snapshot()

    def key(self) -> str | None:
        phase = read_phase(self.workdir)
        key = None if phase is None else f"{phase[0]} {phase[1]}"
        if key != self._key:  # a new phase: count its compilations from here
            self._key, self._compiled0 = key, compile_stats.compile_log().snapshot()
        return key

    def line(self, elapsed: float) -> str:
        step, phase = (self._key or "0 ?").split(" ", 1)
        where = f"step {step}/{self.num_steps} {phase}"
        if phase == "eval":
            where = "eval " + ("before training" if step == "0" else f"after step {step}")
        parts = [f"{where} {int(elapsed) // 60}:{int(elapsed) % 60:02d}"]
        w = self.watch
        if phase == "rollout" and w.rows:
            if not w.chunks:
                parts.append(f"{w.rows} rows: prefill and first chunk")
            else:
                mode = "plain decoding" if w.mode == "plain" else f"SD on ({w.mode})"
                parts.append(f"{w.finished}/{w.rows} rows finished, {w.running} running, {mode}")
                parts.append(f"{w.tokens} tok at {w.tok_per_s:.0f} tok/s")
        compiled = compile_stats.compile_log().snapshot().delta(self._compiled0)
        n = int(sum(compiled.programs.values()))
        if n:
            parts.append(f"compiled {n} program{'s' * (n > 1)} ({compiled.total():.0f} s) in this phase")
        return " | ".join(parts)


def length_metrics(lengths: np.ndarray) -> dict[str, float]:
    """Mean, median, p90 and max of the response lengths."""
    x = lengths.astype(np.float64)
    return {
        "length/mean": float(x.mean()),
        "length/p50": float(np.percentile(x, 50)),
        "length/p90": float(np.percentile(x, 90)),
        "length/max": float(x.max()),
    }


def scheduled_lr(plan: StepPlan, step: int) -> float:
    """The policy's learning rate at the end of `step`: the trainer's schedule at the step's last optimizer
    update (`updates_per_step`: mini-batches x PPO epochs)."""
    return float(lr_schedule(plan.optim)(step * plan.updates_per_step - 1))


def learning_metrics(
    step: int,
    plan: StepPlan,
    rollout: Rollout,
    scores: Scores,
    adv: Advantages,
    update: UpdateResult,
    next_position: int,
    clock: StepClock,
) -> dict[str, float]:
    """The update's metrics (mean over mini-batches), then rewards, lengths, advantages and throughput
    (response tokens per second of the rollout phase)."""
    metrics = {k: float(np.mean([u[k] for u in update.metrics])) for k in (update.metrics or [{}])[0]}
    metrics.update(
        {
            "reward/mean": float(scores.rewards.mean()),
            "reward/std": float(scores.rewards.std()),
            **scores.overlong_metrics(),
            "accuracy": scores.accuracy,
            "format": scores.format_rate,
            **length_metrics(rollout.lengths),
            "length/clip_frac": float(np.mean(np.asarray(rollout.finish_reason) == "length")),
            "rl/kept_frac": float(adv.keep.mean()),
            "rl/skipped_updates": float(update.skipped),
            "rl/adv_abs_mean": float(np.abs(adv.values).mean()),
            # response columns the update computed (each micro-batch at its own bucket), as a share of
            # padding every row to the step's longest response
            "update/column_share": update.trained_cols / max(plan.rows * update.num_response, 1),
            "optim/lr": scheduled_lr(plan, step),
            "data/position": float(next_position),
            "throughput/tok_per_s": float(rollout.lengths.sum() / max(clock.walls["rollout"], 1e-9)),
        }
    )
    return metrics


def engine_gap_metrics(rollout: Rollout, update: UpdateResult, fused: bool) -> dict[str, float]:
    """Mean and max |engine log-prob - trainer log-prob| over response tokens: the sampler and the trainer
    must agree on the policy. Only where the trainer's log-probs were computed: by the update (fused, when
    a mini-batch trained) or before it (`fused` False)."""
    mask = rollout.mask
    n = min(mask.shape[1], update.train_logp.shape[1])
    gap = np.abs(rollout.logprobs[:, :n] - update.train_logp[:, :n])[mask[:, :n]]
    if not gap.size or not (update.metrics or not fused):
        return {}
    return {"logprob/engine_gap": float(gap.mean()), "logprob/engine_gap_max": float(gap.max())}


def finish_metrics(metrics: dict[str, float], rollout: Rollout, clock: StepClock) -> dict[str, float]:
    """Add the rollout's statistics (where no phase reported the same name), the engine's program and
    speculative-mode counts, and the step's time breakdown (the step's total read now); returns `metrics`."""
    for k, v in rollout.stats.summary().items():
        metrics.setdefault(k, v)
    metrics["programs/count"] = float(clock.engine.compile_count)
    metrics["spec/modes"] = float(len(clock.engine.modes))
    metrics.update(clock.breakdown())
    metrics["rollout/share"] = clock.walls["rollout"] / max(metrics["time/step"], 1e-9)
    return metrics
