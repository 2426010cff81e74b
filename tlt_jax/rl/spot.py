"""The RL loop's side of the adaptive drafter: the EAGLE drafter the engine drafts with, and the spot trainer
that trains it during the rollouts (tlt_jax.drafter.spot_trainer).

The spot trainer owns the drafter's weights; each rollout drafts with one snapshot of them (the learner
passes `spot.params` to `engine.generate`), so the drafter trained during step t's rollout drafts for step
t + 1. The
spot trainer's data buffer is saved beside each checkpoint (one folder per step) so a resumed run trains
on the same data as an uninterrupted one.
"""

from __future__ import annotations

import os
import pathlib

from absl import logging
from flax import nnx

from tlt_jax.config_sections import DrafterSection
from tlt_jax.drafter.spot_trainer import SpotConfig, SpotTrainer
from tlt_jax.drafter.trainer import TRAIN_STATE_DIR
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.eagle3 import AnyDrafter, make_drafter
from tlt_jax.rl.checkpointing import CHECKPOINT_DIR
from tlt_jax.rl.speculation import ResolvedDrafter
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.utils.checkpoint import prune_steps

BUFFER_DIR = "spot_buffer"  # the spot trainer's data buffer, one folder per checkpointed step


def engine_drafter(
    rollout_drafter: ResolvedDrafter,
    cfg: SpotConfig,
    policy: ModelConfig,
    seed: int,
    section: DrafterSection | None = None,
) -> AnyDrafter | None:
    """The EAGLE drafter the engine holds: the warmed one, or (spot training without one) a fresh drafter of
    `section.arch` (EAGLE-1 by default; EAGLE-3 over the full vocabulary, reading `section.aux_layers`) that
    the spot trainer trains from scratch while the rollouts draft with the n-gram drafter."""
    arch = section.arch if section is not None else "eagle"
    warm = rollout_drafter.drafter
    if warm is None and cfg.mode != "off":
        aux = tuple(section.aux_layers) if section is not None and section.aux_layers else None
        return make_drafter(arch, policy, nnx.Rngs(params=seed), aux_layers=aux)
    if warm is not None and warm.arch != arch:
        raise ValueError(
            f"the drafter in {rollout_drafter.path or 'config.drafter'} is {warm.arch!r}, "
            f"config.drafter.arch is {arch!r}: set config.drafter.arch={warm.arch}, or warm up a drafter of "
            "this arch"
        )
    return warm


def build_spot(
    cfg: SpotConfig,
    drafter: AnyDrafter | None,
    engine: RolloutEngine,
    rollout_drafter: ResolvedDrafter,
    announce: bool,
) -> SpotTrainer | None:
    """The spot trainer of `drafter` (None when `cfg.mode` is "off"). A warmed drafter's optimizer moments
    come along (its workdir's train_state/, when there is one): fresh moments would move a converged drafter
    off its optimum in the first online steps (`SpotTrainer.warm_start`)."""
    if cfg.mode == "off":
        return None
    if drafter is None:
        raise ValueError("the spot trainer needs the engine's EAGLE drafter (engine_drafter)")
    spot = SpotTrainer(cfg, drafter, engine)
    if rollout_drafter.kind == "eagle":
        warm = pathlib.Path(rollout_drafter.path).parent / TRAIN_STATE_DIR
        if spot.warm_start(warm) and announce:
            logging.info("spot trainer: AdamW moments carried over from %s", warm)
    return spot


def spot_metrics(spot: SpotTrainer | None) -> dict[str, float]:
    """The step's spot-training metrics (spot/*, buffer/*), none without a spot trainer."""
    return {} if spot is None else spot.metrics()


def buffer_dir(workdir: str, step: int) -> str:
    """Where the spot trainer's data buffer of checkpoint `step` lives."""
    return os.path.join(workdir, BUFFER_DIR, str(step))


def save_buffer(spot: SpotTrainer, workdir: str, step: int) -> None:
    """Write the data buffer of checkpoint `step` (synchronously: every complete checkpoint has its buffer)
    and remove the buffers whose checkpoint retention has removed (`prune_buffers`); the checkpointer of
    `<workdir>/checkpoints` removes the rest when it closes (its `followers`: `buffer_root`)."""
    spot.buffer.save(buffer_dir(workdir, step))
    prune_buffers(workdir, keep_step=step)


def buffer_root(workdir: str) -> str:
    """The folder of every step's data buffer (a `Checkpointer` follower: pruned with its retention)."""
    return os.path.join(workdir, BUFFER_DIR)


def prune_buffers(workdir: str, keep_step: int | None = None) -> list[int]:
    """Remove every buffer folder whose checkpoint step is gone from `<workdir>/checkpoints` (deleted by
    retention, or never finalised by a process killed mid-save), except `keep_step` (the one whose
    checkpoint is about to be written); returns the steps removed (`tlt_jax.utils.checkpoint.prune_steps`)."""
    return prune_steps(os.path.join(workdir, CHECKPOINT_DIR), os.path.join(workdir, BUFFER_DIR), keep_step)
