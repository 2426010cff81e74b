"""The policy's learning-rate schedule: linear warm-up, then constant, cosine or linear decay.

    warm-up  (count < W)        lr * (count + 1) / (W + 1)          (never 0: the first update moves)
    constant (count >= W)       lr
    cosine                      lr * (m + (1 - m) * (1 + cos(pi * p)) / 2)
    linear                      lr * (m + (1 - m) * (1 - p))
    with p = clip((count - W) / (T - W), 0, 1)

`count` is the optimizer's update count (0 for the first update), W = `warmup_steps`, T = `decay_steps` (the
update at which the decay reaches lr * m; the GRPO job sets it to the run's updates, num_steps x
mini_batches, unless config.rl.decay_steps says otherwise), m = `min_lr_ratio`. The decays follow VeRL's
`get_cosine_schedule_with_warmup` (progress over T - W updates after the warm-up, floor min_lr_ratio); the
warm-up is this project's (VeRL's starts at 0). A run extended past T (a larger num_steps on resume) moves T
with it: the schedule is a function of the config, not of the checkpoint.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import optax

from tlt_jax.config_sections import LR_SCHEDULES


class ScheduleSettings(Protocol):
    """The optimizer settings a schedule reads (`tlt_jax.rl.optimizer.OptimConfig` has them)."""

    lr: float
    warmup_steps: int
    schedule: str
    decay_steps: int
    min_lr_ratio: float


def lr_schedule(oc: ScheduleSettings) -> optax.Schedule:
    """The learning rate at optimizer update `count` (see the module docstring)."""
    if oc.schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {oc.schedule!r}: use one of {LR_SCHEDULES}")
    w, lr = oc.warmup_steps, oc.lr
    if oc.schedule == "constant":
        if w <= 0:
            return optax.constant_schedule(lr)
        return lambda count: lr * jnp.minimum(1.0, (count + 1.0) / (w + 1.0))
    if oc.decay_steps <= w:
        raise ValueError(
            f"a {oc.schedule} schedule needs decay_steps > warmup_steps, got {oc.decay_steps} <= {w}"
        )
    span, m, cosine = float(oc.decay_steps - w), oc.min_lr_ratio, oc.schedule == "cosine"

    def schedule(count: jax.Array | int) -> jax.Array:
        c = jnp.asarray(count, jnp.float32)
        warm = jnp.minimum(1.0, (c + 1.0) / (w + 1.0)) if w > 0 else 1.0
        p = jnp.clip((c - w) / span, 0.0, 1.0)
        decay = 0.5 * (1.0 + jnp.cos(jnp.pi * p)) if cosine else 1.0 - p
        return lr * warm * (m + (1.0 - m) * decay)

    return schedule


def decay_updates(decay_steps: int, num_steps: int, mini_batches: int) -> int:
    """T, the update at which a decay ends: config.rl.decay_steps, else (0) the run's optimizer updates."""
    return decay_steps or num_steps * mini_batches


def schedule_problems(schedule: str, warmup_steps: int, decay_steps: int, updates: int) -> list[str]:
    """A decaying schedule must have updates left after its warm-up (a GRPO job check: `updates` is the
    run's, num_steps x mini_batches)."""
    t = decay_updates(decay_steps, updates, 1)
    if schedule == "constant" or t > warmup_steps:
        return []
    what = f"config.rl.decay_steps={decay_steps}" if decay_steps else f"the run's {t} optimizer updates"
    return [
        f"config.rl.lr_schedule={schedule!r} decays after config.rl.warmup_steps={warmup_steps} updates, but "
        f"{what} leave none to decay over: shorten the warm-up, or raise decay_steps (or num_steps)."
    ]
