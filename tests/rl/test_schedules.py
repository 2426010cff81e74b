"""The policy's learning-rate schedules (tlt_jax/rl/schedules.py) at chosen updates against hand-computed
values, the optimizer and the optim/lr metric reading them, and the config's errors for bad values."""

from __future__ import annotations

import math
import pathlib

import ml_collections as mlc
import numpy as np
import pytest

from tlt_jax import config_lib
from tlt_jax.rl import config as rl_config
from tlt_jax.rl.metrics import scheduled_lr
from tlt_jax.rl.optimizer import OptimConfig
from tlt_jax.rl.plan import StepPlan
from tlt_jax.rl.schedules import lr_schedule

SMOKE = pathlib.Path(__file__).resolve().parents[2] / "configs" / "smoke.py"


def smoke() -> mlc.ConfigDict:
    return config_lib.load_config_file(SMOKE)


def values(oc: OptimConfig, counts: list[int]) -> list[float]:
    s = lr_schedule(oc)
    return [float(s(c)) for c in counts]


def test_constant_with_warmup_is_unchanged() -> None:
    # lr * (c + 1) / (W + 1) during the warm-up (W = 3), then lr; W = 0: lr from the first update
    oc = OptimConfig(lr=0.1, warmup_steps=3)
    np.testing.assert_allclose(values(oc, [0, 1, 2, 3, 10, 1000]), [0.025, 0.05, 0.075, 0.1, 0.1, 0.1])
    assert values(OptimConfig(lr=0.1), [0, 7]) == pytest.approx([0.1, 0.1])


def test_cosine_with_warmup() -> None:
    # W = 2, T = 12, m = 0.1: p = (c - 2) / 10 after the warm-up; lr * (0.1 + 0.9 * (1 + cos(pi p)) / 2)
    oc = OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine", decay_steps=12, min_lr_ratio=0.1)
    want = [
        1 / 3,
        2 / 3,
        1.0,
        0.1 + 0.9 * (1 + math.cos(math.pi * 0.5)) / 2,
        0.1 + 0.9 * (1 + math.cos(math.pi * 0.9)) / 2,
        0.1,
        0.1,
    ]
    np.testing.assert_allclose(values(oc, [0, 1, 2, 7, 11, 12, 50]), want, rtol=1e-6)


def test_linear_decay_with_and_without_warmup() -> None:
    # no warm-up, T = 4, m = 0: lr * (1 - c / 4), floor 0 at and after T
    oc = OptimConfig(lr=2.0, schedule="linear", decay_steps=4)
    np.testing.assert_allclose(values(oc, [0, 1, 2, 3, 4, 9]), [2.0, 1.5, 1.0, 0.5, 0.0, 0.0], atol=1e-7)
    # W = 1, T = 5, m = 0.5: warm-up lr/2, then lr * (0.5 + 0.5 * (1 - (c - 1) / 4))
    oc = OptimConfig(lr=1.0, warmup_steps=1, schedule="linear", decay_steps=5, min_lr_ratio=0.5)
    np.testing.assert_allclose(values(oc, [0, 1, 3, 5, 6]), [0.5, 1.0, 0.75, 0.5, 0.5], rtol=1e-6)


def test_bad_schedules_raise() -> None:
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'step'"):
        lr_schedule(OptimConfig(schedule="step"))
    with pytest.raises(ValueError, match="decay_steps > warmup_steps"):
        lr_schedule(OptimConfig(schedule="cosine", warmup_steps=4, decay_steps=4))


def test_config_reaches_optimizer_and_metric() -> None:
    """decay_steps defaults to the run's optimizer updates (num_steps x mini_batches); the optim/lr metric
    is the schedule at the step's last update."""
    c = smoke()  # 4 steps
    c.rl.lr, c.rl.lr_schedule, c.rl.mini_batches, c.trainer.micro_batch_size = 1.0, "linear", 2, 8
    job = rl_config.validate_grpo(c)
    assert rl_config.optim_config(job) == OptimConfig(
        lr=1.0, weight_decay=0.0, schedule="linear", decay_steps=8, min_lr_ratio=0.0
    )
    plan = StepPlan.from_config(job)
    assert scheduled_lr(plan, 1) == pytest.approx(1 - 1 / 8) and scheduled_lr(plan, 4) == pytest.approx(1 / 8)
    c.rl.decay_steps = 20
    assert rl_config.optim_config(rl_config.validate_grpo(c)).decay_steps == 20


def test_config_errors() -> None:
    c = smoke()
    c.rl.lr_schedule, c.rl.min_lr_ratio, c.rl.decay_steps = "exp", 1.5, -1
    with pytest.raises(ValueError) as e:
        rl_config.validate_grpo(c)
    msg = str(e.value)
    assert "config.rl.lr_schedule='exp': use one of ('constant', 'cosine', 'linear')" in msg
    assert "config.rl.min_lr_ratio=1.5: must be in [0, 1]" in msg
    assert "config.rl.decay_steps=-1: must be >= 0" in msg
    c = smoke()  # 4 steps x 1 update: a warm-up of 4 leaves nothing to decay over
    c.rl.lr_schedule, c.rl.warmup_steps = "cosine", 4
    with pytest.raises(ValueError, match=r"warmup_steps=4 updates, but the run's 4 optimizer updates leave"):
        rl_config.validate_grpo(c)
    c.rl.decay_steps = 3
    with pytest.raises(ValueError, match=r"config.rl.decay_steps=3 leave none to decay over"):
        rl_config.validate_grpo(c)
