"""The learner's checkpoint: one tree of arrays per saved step (tlt_jax.utils.checkpoint.Checkpointer).

    params, opt_state   the policy's trained parameters and their AdamW state (frozen layers are not stored)
    drafter             the rollout drafter's weights, when no spot trainer trains them (else None)
    spot                the spot trainer's state: the drafter's weights, its optimizer, step and key
    bandit              the strategy selector's state
    rng                 the run's base key (step s uses fold_in(rng, s))
    frozen              with frozen layers (config.trainer.train_layers > 0): their fingerprint, not them
    history             with the history drafter (tlt_jax.rollout.history): the responses it keeps, so a
                        resumed run drafts as the uninterrupted one (restored at the shapes saved)

The drafter is stored once. When a spot trainer runs, its state holds the drafter's weights (the engine
keeps none: each rollout drafts with a snapshot of them). Checkpoints written before this layout stored the
engine's cast copy too ("drafter", with a spot trainer): `restore_state` still reads them, and drops it.
The step, data position and step count go into the JSON meta. The policy's decoder layers are stored in
the trainer's layout: stacked ([L, ...] per weight) when config.trainer.scan_layers is on, else one entry per
layer; a run resumed with the other setting reads the checkpoint and converts it (`PolicyTrainer.adopt`).

With config.trainer.train_layers > 0 the embedding, tied head and lower layers never change (no update, no
optimizer state): they are not stored (`Unsaved`), and a restore keeps the values the resumed run built from
its model file, the same arrays the uninterrupted run trains beside. "frozen" holds a fingerprint of them
(per leaf: the sum and the sum of squares) that a restore checks, so a run resumed over a different model file
stops instead of mixing two models. Checkpoints written before (every parameter stored) still restore.

A resumed run restores the newest step that reads back (`restore_newest`). A finalised step whose files were
damaged afterwards (a truncated or missing array file, missing metadata) is moved aside to
`checkpoints/corrupt-<step>` with a warning naming it, and the run resumes from the step before.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from tlt_jax.drafter.spot_trainer import SpotTrainer
from tlt_jax.rl.selector import selector_state
from tlt_jax.rl.trainer import PolicyTrainer
from tlt_jax.rollout.adaptive import AdaptivePolicy
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.utils.checkpoint import Checkpointer, Unsaved

CHECKPOINT_DIR = "checkpoints"
CORRUPT_PREFIX = "corrupt-"  # `checkpoints/corrupt-<step>`: a step that did not read back, kept to inspect
_R = TypeVar("_R")


def _fingerprint(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return jnp.stack([jnp.sum(x), jnp.sum(x * x)])


_FINGERPRINT = jax.jit(_fingerprint)


def frozen_fingerprint(trainer: PolicyTrainer) -> Any:
    """Per frozen parameter leaf, [sum, sum of squares] in float32 (None when every parameter trains)."""
    if all(jax.tree_util.tree_leaves(trainer.trainable)):
        return None
    return jax.tree_util.tree_map(
        lambda t, x: None if t else _FINGERPRINT(x), trainer.trainable, trainer.params
    )


def checkpoint_state(
    trainer: PolicyTrainer,
    engine: RolloutEngine,
    spot: SpotTrainer | None,
    selector: AdaptivePolicy | None,
    rng: jax.Array,
) -> dict[str, Any]:
    """The tree one checkpoint stores (see the module docstring); also the target a restore fills."""
    state = {
        "params": jax.tree_util.tree_map(
            lambda t, x: x if t else Unsaved(x), trainer.trainable, trainer.params
        ),
        "opt_state": trainer.opt_state,
        "drafter": engine.drafter_params if spot is None else None,
        "spot": None if spot is None else spot.state_dict(),
        "bandit": selector_state(selector),
        "rng": rng,
    }
    frozen = frozen_fingerprint(trainer)
    if frozen is not None:
        state["frozen"] = frozen
    if engine.history is not None:
        state["history"] = engine.history.state_arrays()
    return state


Convert = Callable[[dict[str, Any]], dict[str, Any]]


def _other_layouts(
    like: dict[str, Any], engine: RolloutEngine, trainer: PolicyTrainer
) -> list[tuple[str, dict[str, Any], Convert | None]]:
    """Targets for checkpoints in another layout, each with what converts the state it reads (None: as it
    is): the decoder layers stored the other way (stacked / unrolled: written with the other
    config.trainer.scan_layers), and older layouts (`_older_layouts`)."""
    out: list[tuple[str, dict[str, Any], Convert | None]] = [
        (n, t, None) for n, t in _older_layouts(like, engine)
    ]
    other = trainer.other_layout()
    if other is not None:
        saved = "unrolled" if trainer.stacked else "stacked"

        def adopt(state: dict[str, Any]) -> dict[str, Any]:
            params, opt_state = trainer.adopt(state["params"], state["opt_state"])
            return {**state, "params": params, "opt_state": opt_state}

        out.append(
            (f"the decoder layers {saved}", {**like, "params": other[0], "opt_state": other[1]}, adopt)
        )
    return out


def _older_layouts(like: dict[str, Any], engine: RolloutEngine) -> list[tuple[str, dict[str, Any]]]:
    """Targets for checkpoints written before this layout: every parameter stored (no "frozen"), and/or the
    engine's drafter copy stored beside the spot trainer's state."""
    full = {k: v for k, v in like.items() if k != "frozen"}
    full["params"] = jax.tree_util.tree_map(
        lambda x: x.value if isinstance(x, Unsaved) else x,
        like["params"],
        is_leaf=lambda x: isinstance(x, Unsaved),
    )
    out = []
    if "frozen" in like:
        out.append(("every parameter stored", full))
    if like["spot"] is not None and engine.drafter_graphdef is not None:
        twice = "the drafter stored twice"  # the engine's cast copy of the spot trainer's weights
        copy = engine.snapshot_drafter(like["spot"]["state"].params)
        out.append((twice, {**like, "drafter": copy}))
        if "frozen" in like:
            out.append((f"every parameter stored, {twice}", {**full, "drafter": copy}))
    return out


def _check_frozen(saved: Any, like: Any, where: str) -> None:
    """The frozen parameters' fingerprint in the checkpoint against the resumed run's."""
    if like is None:
        return
    paths = []
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(like), jax.tree_util.tree_leaves(saved), strict=True
    ):
        if not np.allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6):
            paths.append(jax.tree_util.keystr(path))
    if paths:
        raise ValueError(
            f"{where}: the frozen parameters (not stored: the run rebuilds them from its model) differ from "
            f"the saved run's at {', '.join(paths[:4])}{' ...' if len(paths) > 4 else ''}: resume with the "
            "model file (config.model.path) and config.trainer.train_layers of the run that wrote it."
        )


def _history_like(ckpt: Checkpointer, step: int, like: dict[str, Any]) -> dict[str, Any]:
    """`like` with its "history" arrays at the shapes step `step` saved (they grow with the history)."""
    if "history" not in like:
        return like
    leaves = ckpt.layout(step)["leaves"]
    saved = {k: leaves.get(f"history/{k}") for k in like["history"]}
    hist = {k: np.zeros(v["shape"], np.int32) if v else like["history"][k] for k, v in saved.items()}
    return {**like, "history": hist}


def restore_state(
    ckpt: Checkpointer, step: int, like: dict[str, Any], engine: RolloutEngine, trainer: PolicyTrainer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Checkpoint `step` in the layout of `like` (`checkpoint_state`'s tree) and its meta, with the frozen
    parameters (not stored) taken from `like`; the history drafter's responses, when stored, go straight into
    the engine's store (`HistoryStore.load`) and out of the returned state. Checkpoints of other layouts are
    read too and converted (`_restore_layout`)."""
    state, meta = _restore_layout(ckpt, step, _history_like(ckpt, step, like), engine, trainer)
    history = state.pop("history", None)
    if history is not None and engine.history is not None:
        engine.history.load({k: np.asarray(v) for k, v in history.items()})
    return state, meta


def _restore_layout(
    ckpt: Checkpointer, step: int, like: dict[str, Any], engine: RolloutEngine, trainer: PolicyTrainer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Checkpoint `step` in the layout of `like`. Checkpoints of other layouts are read too and converted: the
    decoder layers stored the other way (stacked / unrolled), older layouts (every parameter stored; the
    drafter in "drafter" as well as in the spot trainer's state, the second copy dropped); a checkpoint that
    fits none raises the current layout's ValueError, which names the leaves that differ."""
    where = f"step {step} in {ckpt.directory}"
    try:
        state, meta = ckpt.restore(step, like)
    except ValueError as current:
        for name, target, convert in _other_layouts(like, engine, trainer):
            try:
                state, meta = ckpt.restore(step, target)
            except ValueError:
                continue
            logging.warning(
                "%s has another checkpoint layout (%s); read it: the next checkpoint has this run's",
                where,
                name,
            )
            state = state if convert is None else convert(state)
            return {**state, "drafter": None} if like["spot"] is not None else state, meta
        raise current from None
    _check_frozen(state.pop("frozen", None), like.get("frozen"), where)
    return state, meta


def restore_drafter(engine: RolloutEngine, spot: SpotTrainer | None, saved: Any) -> None:
    """Give the engine the checkpoint's "drafter" weights (`saved`; None: no drafter) when no spot trainer
    trains them (the spot trainer's restored state holds them otherwise, and the learner passes them to
    every rollout)."""
    if spot is None and saved is not None:
        engine.set_drafter_params(saved)


def set_aside(ckpt: Checkpointer, step: int) -> str:
    """Move checkpoint `step`'s folder to `<dir>/corrupt-<step>` (process 0; kept, not deleted) and make every
    process forget the step (a later save of `step` then writes it anew); returns the new path."""
    dst = os.path.join(ckpt.directory, f"{CORRUPT_PREFIX}{step}")
    n = 1
    while os.path.exists(dst if n == 1 else f"{dst}-{n}"):
        n += 1
    dst = dst if n == 1 else f"{dst}-{n}"
    if jax.process_index() == 0:
        os.rename(os.path.join(ckpt.directory, str(step)), dst)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"tlt_jax_set_aside_{step}")
    ckpt.reload()
    return dst


def _short(e: BaseException) -> str:
    """An error's type and first line, without orbax's dump of the TensorStore spec."""
    first = (str(e).strip().splitlines() or [""])[0].split(" See full TensorStore details")[0]
    return f"{type(e).__name__}: {first[:200]}"


def restore_newest(ckpt: Checkpointer, restore: Callable[[int], _R]) -> tuple[int, _R] | None:
    """`(step, restore(step))` for the newest checkpoint step that restores; None when there is none.

    A step that fails while an older one restores is damaged (orbax finalises a step only once it is complete,
    so this is a truncated or missing file, or missing metadata, from after the save): it is moved aside
    (`set_aside`) with a warning naming it and the step resumed from. When no step restores, nothing is moved
    and the newest step's error is raised: a failure every step shares (another model, another config) is the
    run's, not the files'."""
    failed: list[tuple[int, Exception]] = []
    for step in reversed(ckpt.all_steps()):
        try:
            result = restore(step)
        except Exception as e:  # orbax / tensorstore / JSON errors of damaged files, or a mismatch
            logging.warning("checkpoint step %d in %s does not restore (%s)", step, ckpt.directory, _short(e))
            failed.append((step, e))
            continue
        for bad, err in failed:
            moved = set_aside(ckpt, bad)
            logging.warning(
                "checkpoint step %d in %s is unreadable (%s) while step %d restores: moved it to %s (kept "
                "for inspection; delete it when done) and resuming from step %d",
                bad,
                ckpt.directory,
                _short(err),
                step,
                moved,
                step,
            )
        return step, result
    if failed:
        logging.error("no checkpoint in %s restores (steps %s)", ckpt.directory, [s for s, _ in failed])
        raise failed[0][1]
    return None
