"""GRPO config validation (tlt_jax/rl/config.py): every problem of the whole config in one error, with
the fix; the drafter section's errors."""

from __future__ import annotations

import pathlib

import pytest

from tlt_jax import config_lib
from tlt_jax.rl import config as rl_config

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def load_config(name: str, arg: str | None = None):
    return config_lib.load_config_file(CONFIGS / f"{name}.py", arg)


def test_validate_lists_every_problem_with_its_fix() -> None:
    c = load_config("smoke")
    rl_config.validate_grpo(c)
    c.rollout.temperature = 0.0
    c.rl.samples_per_prompt = 1
    c.rl.loss_agg = "sum"
    c.model.path = "/nonexistent/model.gguf"  # and random is set too
    c.model.linear_impl = "fast"
    with pytest.raises(ValueError) as e:
        rl_config.validate_grpo(c)
    msg = str(e.value)
    assert "config.rollout.temperature=0.0: GRPO needs sampling" in msg
    assert "config.rl.samples_per_prompt=1" in msg
    assert "config.rl.loss_agg='sum'" in msg and "seq_mean_token_mean" in msg
    assert "set exactly one of config.model.path" in msg
    assert "does not exist" in msg
    assert "config.model.linear_impl='fast': use one of ('auto', 'xla', 'cpu_ffi')" in msg


def test_validate_micro_batches_hold_whole_groups_or_sub_groups() -> None:
    c = load_config("smoke")  # 2 prompts x 8 samples = 16 rows
    c.trainer.micro_batch_size = 3
    with pytest.raises(
        ValueError, match=r"micro_batch_size=3 must divide the mini-batch of 16 rows.*\[1, 2, 4, 8, 16\]"
    ):
        rl_config.validate_grpo(c)
    c.trainer.micro_batch_size = 2  # sub-groups of a group (tlt_jax.rl.batch.regroup)
    rl_config.validate_grpo(c)
    c.trainer.micro_batch_size = 4
    c.rl.mini_batches = 3
    with pytest.raises(ValueError, match="mini_batches=3 must divide the 16 rows"):
        rl_config.validate_grpo(c)


def test_validate_drafter_section() -> None:
    c = load_config("smoke")
    c.drafter.kind = "medusa"
    with pytest.raises(ValueError, match=r"config.drafter.kind='medusa': use one of \('none', 'ngram'"):
        rl_config.validate_grpo(c)
    c.drafter.kind = "eagle"
    with pytest.raises(ValueError, match=r"needs config.drafter.path.*configs/drafter_warmup.py:tlt"):
        rl_config.validate_grpo(c)
    c.drafter.path = "/nonexistent/warmup"
    with pytest.raises(ValueError, match=r"does not exist: create it with .*--workdir /nonexistent/warmup"):
        rl_config.validate_grpo(c)
    c.drafter.kind, c.spec.acceptance = "ngram", "exact"
    with pytest.raises(ValueError, match="config.spec is invalid: SpecConfig.acceptance must be one of"):
        rl_config.validate_grpo(c)
