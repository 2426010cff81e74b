"""The learner's checkpoint: one tree of arrays per saved step (tlt_jax.utils.checkpoint.Checkpointer).

    params, opt_state   the policy and its AdamW state
    drafter             the rollout drafter's weights, when no spot trainer trains them (else None)
    spot                the spot trainer's state: the drafter's weights, its optimizer, step and key
    bandit              the strategy selector's state
    rng                 the run's base key (step s uses fold_in(rng, s))

The drafter is stored once. When a spot trainer runs, its state holds the drafter's weights and the engine
holds a copy (the one pushed after every step, cast to the engine's drafter weight dtype); on restore the
engine gets that copy again from the spot trainer's weights, the same cast of the same arrays. Checkpoints
written before this layout stored both ("drafter" too, with a spot trainer): `restore_state` still reads
them, and drops the second copy. The step, data position and step count go into the JSON meta.
"""

from __future__ import annotations

from typing import Any

import jax
from absl import logging

from tlt_jax.drafter.spot_trainer import SpotTrainer
from tlt_jax.rl.selector import selector_state
from tlt_jax.rl.trainer import PolicyTrainer
from tlt_jax.rollout.adaptive import AdaptivePolicy
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.utils.checkpoint import Checkpointer

CHECKPOINT_DIR = "checkpoints"


def checkpoint_state(
    trainer: PolicyTrainer,
    engine: RolloutEngine,
    spot: SpotTrainer | None,
    selector: AdaptivePolicy | None,
    rng: jax.Array,
) -> dict[str, Any]:
    """The tree one checkpoint stores (see the module docstring); also the target a restore fills."""
    return {
        "params": trainer.params,
        "opt_state": trainer.opt_state,
        "drafter": engine.drafter_params if spot is None else None,
        "spot": None if spot is None else spot.state_dict(),
        "bandit": selector_state(selector),
        "rng": rng,
    }


def restore_state(
    ckpt: Checkpointer, step: int, like: dict[str, Any], engine: RolloutEngine
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Checkpoint `step` in the layout of `like` (`checkpoint_state`'s tree) and its meta. A checkpoint of
    the older layout (the drafter in "drafter" as well as in the spot trainer's state) is read too, its
    "drafter" copy dropped; a checkpoint that fits neither raises the current layout's ValueError, which
    names the leaves that differ."""
    try:
        return ckpt.restore(step, like)
    except ValueError as current:
        if like["spot"] is None or engine.drafter_params is None:
            raise  # without a spot trainer the layout did not change
        try:
            state, meta = ckpt.restore(step, {**like, "drafter": engine.drafter_params})
        except ValueError:
            raise current from None
    logging.warning(
        "step %d in %s has the older checkpoint layout (the drafter stored twice); read it, and its second "
        "drafter copy dropped: the next checkpoint stores the drafter once",
        step,
        ckpt.directory,
    )
    return {**state, "drafter": None}, meta


def restore_drafter(engine: RolloutEngine, spot: SpotTrainer | None, saved: Any) -> None:
    """Give the engine the restored drafter: the spot trainer's weights when it trains them (as the push
    after every step does), else the checkpoint's "drafter" weights (`saved`; None: no drafter)."""
    if spot is not None:
        engine.set_drafter_params(spot.params)
    elif saved is not None:
        engine.set_drafter_params(saved)
