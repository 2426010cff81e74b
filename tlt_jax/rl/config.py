"""Validation of the GRPO job's own config sections (rl, trainer, task, steps) on top of the shared ones.

`validate_grpo(config)` raises ONE ValueError listing every problem of the whole config (shared sections via
`config_lib.validate`'s checks, then these: keys the base config lacks with the nearest valid ones, values out
of range, the task's keys and a JSONL task file's lines), each with the field and the fix.
"""

from __future__ import annotations

from typing import Any

import ml_collections as mlc
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from tlt_jax import config_lib
from tlt_jax.drafter.spot_trainer import SpotConfig
from tlt_jax.models.build import DTYPES
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.llama import Transformer
from tlt_jax.rl import grpo
from tlt_jax.rl.evaluation import EvalConfig
from tlt_jax.rl.trainer import OptimConfig, PolicyLossConfig, PolicyTrainer, TrainerOptions
from tlt_jax.tasks.datasets import check_task_config, make_task
from tlt_jax.utils.config_checks import Range, range_problems, unknown_key_problems

# the allowed values of config.rl and config.rollout keys (key, predicate, the range in words)
RL_RANGES: tuple[Range, ...] = (
    ("prompts_per_step", lambda v: v >= 1, ">= 1"),
    ("lr", lambda v: v > 0, "> 0 (the paper uses 1e-6)"),
    ("warmup_steps", lambda v: v >= 0, ">= 0 (optimizer updates)"),
    ("weight_decay", lambda v: v >= 0, ">= 0"),
    ("grad_clip", lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    ("kl_coef", lambda v: v >= 0, ">= 0 (0 disables the KL term)"),
    ("b1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("b2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("adv_eps", lambda v: v >= 0, ">= 0"),
)
ROLLOUT_RANGES: tuple[Range, ...] = (
    ("chunk_steps", lambda v: v >= 1, ">= 1 (decode steps per device call)"),
    ("min_cache_bucket", lambda v: v >= 1, ">= 1"),
    ("prompt_bucket", lambda v: v >= 1, ">= 1"),
    ("hidden_window", lambda v: v >= 1, ">= 1"),
)
# config sections whose keys are not fixed: ModelConfig fields, the task kind's constructor arguments
OPEN_SECTIONS = ("model.random", "task")


def rl_problems(config: mlc.ConfigDict) -> list[str]:
    """Problems of the GRPO sections: steps, task, rl, trainer, and GRPO's need for sampling."""
    out = []
    ro, rl, tr = config.rollout, config.rl, config.trainer
    if config.num_steps < 1:
        out.append(f"config.num_steps={config.num_steps}: must be >= 1.")
    if config.checkpoint_every < 0:
        out.append(f"config.checkpoint_every={config.checkpoint_every}: must be >= 0 (0 = only at the end).")
    if not config.task.get("kind"):
        out.append("config.task.kind is empty: set it to one of reasoning_gym | jsonl | counting.")
    if config.task.get("kind") == "jsonl" and not config.task.get("path"):
        out.append(
            "config.task.path is empty: pass --config.task.path=/path/to/train.jsonl (question/answer)."
        )
    if tr.master_dtype not in DTYPES:
        out.append(f"config.trainer.master_dtype={tr.master_dtype!r}: use one of {DTYPES}.")
    if tr.train_layers < 0:
        out.append(f"config.trainer.train_layers={tr.train_layers}: must be >= 0 (0 = all parameters).")
    if tr.logits_chunk < 0:
        out.append(f"config.trainer.logits_chunk={tr.logits_chunk}: must be >= 0 (0 = no chunking).")
    if ro.temperature <= 0:
        out.append(
            f"config.rollout.temperature={ro.temperature}: GRPO needs sampling (> 0; the paper uses 0.9), "
            "greedy samples of a group are identical and carry no advantage."
        )
    if rl.samples_per_prompt < 2:
        out.append(
            f"config.rl.samples_per_prompt={rl.samples_per_prompt}: GRPO compares samples within a group, "
            "use >= 2 (the paper uses 8)."
        )
    if rl.advantage not in grpo.ADVANTAGE_METHODS:
        out.append(f"config.rl.advantage={rl.advantage!r}: use one of {sorted(grpo.ADVANTAGE_METHODS)}.")
    if rl.loss_agg not in grpo.LOSS_AGGREGATIONS:
        out.append(f"config.rl.loss_agg={rl.loss_agg!r}: use one of {sorted(grpo.LOSS_AGGREGATIONS)}.")
    if rl.clip_low < 0 or rl.clip_high < 0 or rl.clip_low >= 1:
        out.append(
            f"config.rl.clip_low={rl.clip_low} / clip_high={rl.clip_high}: need 0 <= clip_low < 1, "
            "clip_high >= 0."
        )
    out += range_problems(rl, "rl", RL_RANGES) + range_problems(ro, "rollout", ROLLOUT_RANGES)
    rows = rl.prompts_per_step * rl.samples_per_prompt
    if rl.mini_batches < 1 or rows % rl.mini_batches:
        out.append(
            f"config.rl.mini_batches={rl.mini_batches} must divide the {rows} rows of a step "
            f"(prompts_per_step * samples_per_prompt)."
        )
    elif (
        tr.micro_batch_size < 1
        or (rows // rl.mini_batches) % tr.micro_batch_size
        or tr.micro_batch_size % rl.samples_per_prompt
    ):
        mini = rows // rl.mini_batches
        n = rl.samples_per_prompt
        options = [d for d in range(n, mini + 1, n) if mini % d == 0]
        out.append(
            f"config.trainer.micro_batch_size={tr.micro_batch_size} must be a multiple of "
            f"samples_per_prompt={n} (micro-batches hold whole groups) that divides the mini-batch of {mini} "
            f"rows (prompts_per_step * samples_per_prompt / mini_batches); valid: {options}."
        )
    if tr.seq_bucket < 1:
        out.append(f"config.trainer.seq_bucket={tr.seq_bucket}: must be >= 1.")
    return out


def task_problems(task: mlc.ConfigDict, check_paths: bool = True) -> list[str]:
    """config.task's keys for its kind, and a JSONL task file read through (a malformed line fails here,
    naming the line, before any model is built or anything is written)."""
    kind = task.get("kind")
    if not kind or (kind == "jsonl" and not task.get("path")):
        return []  # rl_problems says what to set
    try:
        if check_paths and kind == "jsonl":
            make_task(task)
        else:
            check_task_config(task)
    except (OSError, ValueError) as e:
        return [f"config.task: {e}"]
    return []


def spot_config_from(config: mlc.ConfigDict) -> SpotConfig:
    """`SpotConfig` from `config.spot` (mode "off" when the config has no spot section)."""
    try:
        return SpotConfig(**dict(config.get("spot", {})))
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.spot is invalid: {e}") from e


def eval_config_from(config: mlc.ConfigDict) -> EvalConfig:
    """`EvalConfig` from `config.eval` (off when the config has no eval section)."""
    try:
        return EvalConfig(**dict(config.get("eval", {})))
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.eval is invalid: {e}") from e


def loss_config_from(config: mlc.ConfigDict) -> PolicyLossConfig:
    """The GRPO-family loss of `config.rl` at the rollout's temperature (old log-probs fused into the update's
    forward when `trainer.fuse_old_logprobs` and one mini-batch per step)."""
    rl, tc = config.rl, config.trainer
    return PolicyLossConfig(
        temperature=float(config.rollout.temperature),
        clip_low=float(rl.clip_low),
        clip_high=float(rl.clip_high),
        aggregation=rl.loss_agg,
        max_len=int(config.rollout.max_new_tokens),
        kl_coef=float(rl.kl_coef),
        fuse_old_logprobs=bool(tc.fuse_old_logprobs) and int(rl.mini_batches) == 1,
        logits_chunk=int(tc.logits_chunk),
    )


def optim_config_from(config: mlc.ConfigDict) -> OptimConfig:
    """The policy's AdamW settings from `config.rl`."""
    rl = config.rl
    return OptimConfig(
        lr=float(rl.lr),
        warmup_steps=int(rl.warmup_steps),
        weight_decay=float(rl.weight_decay),
        b1=float(rl.b1),
        b2=float(rl.b2),
        grad_clip=float(rl.grad_clip),
    )


def trainer_options_from(config: mlc.ConfigDict) -> TrainerOptions:
    """`TrainerOptions` from `config.trainer` (a reference copy when the loss has a KL term)."""
    tc = config.trainer
    return TrainerOptions(
        micro_batch_size=int(tc.micro_batch_size),
        with_reference=float(config.rl.kl_coef) > 0,
        master_dtype=str(tc.master_dtype),
        fsdp=bool(tc.fsdp),
        train_layers=int(tc.train_layers),
    )


def policy_trainer(config: mlc.ConfigDict, model: Transformer, mesh: Mesh) -> PolicyTrainer:
    """The learner's `PolicyTrainer` for `model` (which it takes over) as `config` sets it up."""
    return PolicyTrainer(
        model, mesh, loss_config_from(config), optim_config_from(config), trainer_options_from(config)
    )


def abstract_policy_trainer(
    config: mlc.ConfigDict, graphdef: nnx.GraphDef, params: Any, cfg: ModelConfig, mesh: Mesh | AbstractMesh
) -> PolicyTrainer:
    """The same trainer from abstract parameters (`PolicyTrainer.abstract`: nothing materialised), for
    compiling its programs ahead of time at shapes that do not fit this machine."""
    return PolicyTrainer.abstract(
        graphdef,
        params,
        cfg,
        mesh,
        loss_config_from(config),
        optim_config_from(config),
        trainer_options_from(config),
    )


def validate_grpo(config: mlc.ConfigDict, check_paths: bool = True) -> None:
    """Every problem of a GRPO config (shared sections and the job's own), in one ValueError."""
    problems = []
    try:
        config_lib.validate(config, check_paths)
    except ValueError as e:
        problems += [line.strip()[2:] for line in str(e).splitlines()[1:]]
    if config.job == "grpo":
        problems += unknown_key_problems(config, config_lib.base_config(), OPEN_SECTIONS)
        problems += rl_problems(config) + task_problems(config.task, check_paths)
        try:
            eval_config_from(config)
        except ValueError as e:
            problems.append(str(e))
        try:
            spot = spot_config_from(config)
        except ValueError as e:
            problems.append(str(e))
        else:
            if spot.mode == "idle_devices" and config.mesh.data == 1:
                problems.append(
                    "config.spot.mode=idle_devices needs a data axis of >= 2 devices (config.mesh.data; on "
                    "CPU XLA_FLAGS=--xla_force_host_platform_device_count=2); on one device: between_chunks."
                )
    config_lib.fail(problems)
