"""The GRPO job's config: its checks across sections on top of the schema, and the trainer built from them.

`validate_grpo(config)` parses the config (`config_schema.collect`: every section typed, with its own checks)
and adds the GRPO job's checks across sections (sampling, group size, mini- and micro-batches, the task's keys
and the task's and eval sets' data files read through, idle_devices needs a data axis, meshes known to
deadlock: rl/mesh_checks.py). It raises ONE ValueError listing every problem, each with the field and the fix,
and returns the typed `GrpoConfig` the learner is built from.
"""

from __future__ import annotations

import contextlib
from typing import Any

import ml_collections as mlc
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from tlt_jax import config_schema
from tlt_jax.config_schema import GrpoConfig
from tlt_jax.drafter.spot_trainer import window_problems
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.llama import Transformer
from tlt_jax.rl import grpo
from tlt_jax.rl.batch import micro_problem
from tlt_jax.rl.evaluation import eval_set_configs
from tlt_jax.rl.losses import loss_option_problems
from tlt_jax.rl.mesh_checks import layout_problems
from tlt_jax.rl.optimizer import OptimConfig
from tlt_jax.rl.reward import overlong_problems
from tlt_jax.rl.schedules import decay_updates, schedule_problems
from tlt_jax.rl.trainer import PolicyLossConfig, PolicyTrainer, TrainerOptions
from tlt_jax.tasks.datasets import FILE_KINDS, TASK_KINDS, check_task_config, make_task
from tlt_jax.utils.plain import plain_dict


def rl_problems(config: mlc.ConfigDict) -> list[str]:
    """The GRPO job's checks across sections (each section's own checks ran when it was built)."""
    out = []
    ro, rl, tr = config.rollout, config.rl, config.trainer
    if not config.task.get("kind"):
        out.append(f"config.task.kind is empty: set it to one of {' | '.join(TASK_KINDS)}.")
    if config.task.get("kind") in FILE_KINDS and not config.task.get("path"):
        out.append(
            "config.task.path is empty: pass --config.task.path=/path/to/train.parquet (or .jsonl; a glob, "
            "or several separated by commas)."
        )
    if ro.temperature <= 0:
        out.append(
            f"config.rollout.temperature={ro.temperature}: GRPO needs sampling (> 0; the paper uses 0.9), "
            "greedy samples of a group are identical and carry no advantage."
        )
    if rl.advantage not in grpo.ADVANTAGE_METHODS:
        out.append(f"config.rl.advantage={rl.advantage!r}: use one of {sorted(grpo.ADVANTAGE_METHODS)}.")
    if rl.loss_agg not in grpo.LOSS_AGGREGATIONS:
        out.append(f"config.rl.loss_agg={rl.loss_agg!r}: use one of {sorted(grpo.LOSS_AGGREGATIONS)}.")
    rows = rl.prompts_per_step * rl.samples_per_prompt
    if rl.mini_batches < 1 or rows % rl.mini_batches:
        out.append(
            f"config.rl.mini_batches={rl.mini_batches} must divide the {rows} rows of a step "
            f"(prompts_per_step * samples_per_prompt)."
        )
    elif problem := micro_problem(rows // rl.mini_batches, rl.samples_per_prompt, tr.micro_batch_size):
        out.append(problem)
    out += overlong_problems(rl.overlong_buffer, ro.max_new_tokens)
    out += loss_option_problems(rl)
    out += schedule_problems(
        rl.lr_schedule, rl.warmup_steps, rl.decay_steps, config.num_steps * rl.mini_batches * rl.ppo_epochs
    )
    if config.spot.mode == "idle_devices" and config.mesh.data == 1:
        out.append(
            "config.spot.mode=idle_devices needs a data axis of >= 2 devices (config.mesh.data; on "
            "CPU XLA_FLAGS=--xla_force_host_platform_device_count=2); on one device: between_chunks."
        )
    with contextlib.suppress(ValueError):  # a spot section that does not build: collect names its problems
        out += window_problems(config_schema.section(config, "spot"), ro.hidden_window)
    return out


def task_problems(task: mlc.ConfigDict, check_paths: bool = True) -> list[str]:
    """config.task's keys for its kind, and a task's data files read through (a malformed row fails here,
    naming the file, row and field, before any model is built or anything is written; the read is cached)."""
    kind = task.get("kind")
    if not kind or (kind in FILE_KINDS and not task.get("path")):
        return []  # rl_problems says what to set
    try:
        if check_paths and kind in FILE_KINDS:
            make_task(task)
        else:
            check_task_config(task)
    except (OSError, ValueError) as e:
        return [f"config.task: {e}"]
    return []


def eval_set_problems(config: mlc.ConfigDict, check_paths: bool = True) -> list[str]:
    """Every config.eval.sets entry: its keys, its files read through (as the task's), its sampling."""
    sets = config.get("eval", {}).get("sets", {})
    try:
        specs = eval_set_configs(plain_dict(sets), plain_dict(config.task))
    except ValueError as e:
        return [str(e)]
    out = []
    for name, (task, sampling) in specs.items():
        try:
            make_task(task) if check_paths else check_task_config(task)
        except (OSError, ValueError) as e:
            out.append(f"config.eval.sets.{name}: {e}")
        bad = {k: v for k, v in sampling.items() if not isinstance(v, (int, float)) or v < 0}
        if bad or sampling.get("samples", 1) < 1:
            out.append(f"config.eval.sets.{name}: {bad or sampling}: need numbers >= 0 and samples >= 1.")
        if sampling.get("max_new_tokens", 0) > config.rollout.max_new_tokens:
            out.append(
                f"config.eval.sets.{name}.max_new_tokens={sampling['max_new_tokens']}: at most "
                f"config.rollout.max_new_tokens={config.rollout.max_new_tokens} (the engine's cache)."
            )
    return out


def policy_loss_config(job: GrpoConfig) -> PolicyLossConfig:
    """The GRPO-family loss of `rl` at the rollout's temperature. Old log-probs are fused into the update's
    forward when `trainer.fuse_old_logprobs` and the step makes one update (one mini-batch, one epoch) and
    no KL in the reward (which needs them before the advantages); else computed before the update."""
    rl, tc = job.rl, job.trainer
    one_update = rl.mini_batches == 1 and rl.ppo_epochs == 1
    return PolicyLossConfig(
        temperature=job.rollout.temperature,
        clip_low=rl.clip_low,
        clip_high=rl.clip_high,
        aggregation=rl.loss_agg,
        max_len=job.rollout.max_new_tokens,
        kl_coef=rl.kl_coef,
        fuse_old_logprobs=tc.fuse_old_logprobs and one_update and rl.reward_kl_coef == 0,
        logits_chunk=tc.logits_chunk,
        clip_ratio_c=rl.clip_ratio_c,
        entropy_coeff=rl.entropy_coeff,
        kl_loss_type=rl.kl_loss_type,
        rollout_is=rl.rollout_is,
        rollout_is_threshold=rl.rollout_is_threshold,
    )


def optim_config(job: GrpoConfig) -> OptimConfig:
    """The policy's AdamW settings from `rl`."""
    rl = job.rl
    return OptimConfig(
        lr=rl.lr,
        warmup_steps=rl.warmup_steps,
        weight_decay=rl.weight_decay,
        b1=rl.b1,
        b2=rl.b2,
        grad_clip=rl.grad_clip,
        schedule=rl.lr_schedule,
        decay_steps=decay_updates(rl.decay_steps, job.run.num_steps, rl.mini_batches * rl.ppo_epochs),
        min_lr_ratio=rl.min_lr_ratio,
    )


def trainer_options(job: GrpoConfig) -> TrainerOptions:
    """`TrainerOptions` from `trainer` (a reference copy when the loss or the reward has a KL term)."""
    tc = job.trainer
    return TrainerOptions(
        micro_batch_size=tc.micro_batch_size,
        with_reference=job.rl.kl_coef > 0 or job.rl.reward_kl_coef > 0,
        master_dtype=tc.master_dtype,
        fsdp=tc.fsdp,
        train_layers=tc.train_layers,
        attn_impl=tc.attn_impl,
        remat=tc.remat,
        scan_layers=tc.scan_layers,
        mlp_chunk=tc.mlp_chunk,
        seq_parallel=tc.seq_parallel,
    )


def policy_trainer(job: GrpoConfig, model: Transformer, mesh: Mesh) -> PolicyTrainer:
    """The learner's `PolicyTrainer` for `model` (which it takes over) as the config sets it up."""
    return PolicyTrainer(model, mesh, policy_loss_config(job), optim_config(job), trainer_options(job))


def abstract_policy_trainer(
    job: GrpoConfig, graphdef: nnx.GraphDef, params: Any, cfg: ModelConfig, mesh: Mesh | AbstractMesh
) -> PolicyTrainer:
    """The same trainer from abstract parameters (`PolicyTrainer.abstract`: nothing materialised), for
    compiling its programs ahead of time at shapes that do not fit this machine."""
    return PolicyTrainer.abstract(
        graphdef, params, cfg, mesh, policy_loss_config(job), optim_config(job), trainer_options(job)
    )


def validate_grpo(config: mlc.ConfigDict, check_paths: bool = True) -> GrpoConfig:
    """Every problem of a GRPO config (each section's, the model's, and the job's across sections) in one
    ValueError; the typed config when there is none."""
    if config.get("job", "grpo") != "grpo":
        config_schema.fail([f"config.job={config.job!r}: this is the GRPO job's validation (job=grpo)."])
    built, problems = config_schema.collect(config, check_paths)
    problems += rl_problems(config) + task_problems(config.task, check_paths)
    problems += eval_set_problems(config, check_paths)
    problems += layout_problems(config, check_paths)  # meshes known to deadlock (rl/mesh_checks.py)
    config_schema.fail(problems)
    return GrpoConfig(raw=config, **built)
