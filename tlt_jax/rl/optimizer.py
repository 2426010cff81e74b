"""The policy's optimizer: AdamW with global-norm clipping and a warm-up / decay schedule (the VeRL actor's),
which parameters it trains (`trainable_mask`: all, or the top decoder layers), and where its state lives
(`optimizer_shardings`: every moment with the parameter it tracks). `tlt_jax.rl.trainer.PolicyTrainer` owns
one."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from optax.transforms import MaskedNode

from tlt_jax.rl.schedules import lr_schedule


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    warmup_steps: int = 0
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0
    schedule: str = "constant"  # after the warm-up: constant | cosine | linear (tlt_jax.rl.schedules)
    decay_steps: int = 0  # the update at which a decay reaches lr * min_lr_ratio
    min_lr_ratio: float = 0.0


def policy_optimizer(oc: OptimConfig, trainable: Any = None) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and warm-up (the VeRL actor's optimizer). `trainable`: a pytree of
    bools like the params; False leaves get no update and no optimizer state (None: all trainable)."""
    parts = [optax.clip_by_global_norm(oc.grad_clip)] if oc.grad_clip > 0 else []
    parts.append(optax.adamw(lr_schedule(oc), b1=oc.b1, b2=oc.b2, weight_decay=oc.weight_decay))
    tx = optax.chain(*parts)
    if trainable is None:
        return tx
    labels = jax.tree_util.tree_map(lambda t: "train" if t else "frozen", trainable)
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)


def path_parts(path: tuple) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def trainable_mask(params: Any, num_layers: int, train_layers: int, stacked: bool = False) -> Any:
    """Which parameters train: all (train_layers=0), or only the top `train_layers` decoder layers and the
    final norm (embedding / tied LM head and lower layers frozen: their backward pass is never computed).
    `stacked` (the layers stored as one [L, ...] array per weight) trains every layer."""
    if not 0 <= train_layers <= num_layers:
        raise ValueError(f"train_layers={train_layers} must be in [0, {num_layers}] (0 = every parameter)")
    if stacked and train_layers:
        raise ValueError(
            f"train_layers={train_layers} with the layers scanned: the scanned trainer stores each weight of "
            "every layer as one stacked array and trains them all; set config.trainer.train_layers=0 or "
            "config.trainer.scan_layers=False."
        )

    def one(path: tuple, _: Any) -> bool:
        parts = path_parts(path)
        if train_layers == 0:
            return True
        if parts[0] == "layers":
            return int(parts[1]) >= num_layers - train_layers
        return parts[0] == "norm"

    return jax.tree_util.tree_map_with_path(one, params)


def optimizer_shardings(
    tx: optax.GradientTransformation, params: Any, param_shardings: Any, mesh: Mesh | AbstractMesh
) -> Any:
    """Where the optimizer state lives: every params-shaped part (AdamW's moments, masked or not) with the
    parameter it tracks, scalars (step counts) replicated. `jax.jit(tx.init)` alone would replicate the
    moments on every device: nothing flows from the params into those zeros (a 7B's moments take 56.7 GiB
    per device that way on 2 x 4 instead of 14.2)."""
    state = jax.eval_shape(tx.init, params)
    replicated = NamedSharding(mesh, P())
    masked = lambda x: isinstance(x, MaskedNode)  # noqa: E731  (frozen parameters have no state)
    return optax.tree_map_params(
        tx,
        lambda x, s: x if masked(x) else s,
        state,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=masked,
    )
