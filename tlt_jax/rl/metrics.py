"""The RL step's metrics: what the step learned from (rewards, lengths, advantages), what the update did,
how far the engine's sampling log-probs are from the trainer's, and where the step's time went.

`StepClock` times the phases (time/<phase>, time/step, rollout/share) and the rollout's compilation
(time/compile_rollout). The hooks' own metrics (speculation, spot trainer, selector) come from their
modules; `finish_metrics` adds the rollout's statistics and the clock last, so time/step covers the
metric assembly too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np

from tlt_jax.rl.advantages import Advantages
from tlt_jax.rl.plan import StepPlan
from tlt_jax.rl.reward import Scores
from tlt_jax.rl.trainer import lr_schedule
from tlt_jax.rl.update import UpdateResult
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.types import Rollout


class StepClock:
    """Wall seconds of one step and of its named phases, and the engine's compile seconds since the start."""

    def __init__(self, engine: RolloutEngine):
        self.start = time.perf_counter()
        self.engine = engine
        self.compile0 = engine.programs.compile_seconds
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as time/`name` (not recorded when it raises)."""
        t0 = time.perf_counter()
        yield
        self.times[name] = time.perf_counter() - t0


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
    update (`mini_batches` updates per step)."""
    return float(lr_schedule(plan.optim)(step * plan.mini_batches - 1))


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
            "throughput/tok_per_s": float(rollout.lengths.sum() / max(clock.times["rollout"], 1e-9)),
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
    """Add the rollout's statistics (where no phase reported the same name), the engine's program count,
    the rollout's compile seconds and the step's times (the step's total read now); returns `metrics`."""
    for k, v in rollout.stats.summary().items():
        metrics.setdefault(k, v)
    metrics["programs/count"] = float(clock.engine.compile_count)
    metrics["time/compile_rollout"] = clock.engine.programs.compile_seconds - clock.compile0
    total = time.perf_counter() - clock.start
    for k, v in clock.times.items():
        metrics[f"time/{k}"] = v
    metrics["time/step"] = total
    metrics["rollout/share"] = clock.times["rollout"] / max(total, 1e-9)
    return metrics
