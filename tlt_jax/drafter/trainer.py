"""The drafter trainer shared by the offline warm-up and the spot trainer: state, pure steps, a host class.

The step is split into pure functions that run under `jit` and per device inside `jax.shard_map`:

- `TrainState(step, params, opt_state, key)`: the drafter's own trainable params (fc + its one layer; the
  target's embedding and LM head are arguments, never state), their optimizer state, the optimizer-step
  count and the base PRNG key of the run.
- `micro_step_key(key, step, device, micro)`: the random stream of one micro-step (CE subsample, TTT
  positions, feature noise) is `fold_in(fold_in(fold_in(key, step), device), micro)`: deterministic, and
  different on every device, micro-step and optimizer step (the old step folded one fixed key).
- `drafter_grads(graphdef, loss_cfg, params, batch, key, embed_w, head_w) -> (grads, metric_sums)`: the
  gradient of the SUM loss S of one packed micro-batch, NOT divided by its loss-token count N (see
  `tlt_jax.drafter.loss`), and metric sums/counts that include N as `num_tokens`.
- `mean_grads(grad_sums, num_tokens)` divides summed gradients by the summed N: the gradient of the mean
  loss over the union of the micro-batches; `apply_grads(tx, state, grads)` applies mean gradients once and
  advances `step`; `apply_mean_grads` does both and leaves the state untouched when N = 0 (no device
  trained: AdamW's momentum would otherwise still move the weights).

A spot trainer (one SPMD program over the data axis; state replicated, micro-batches sharded, `active` says
which devices are idle and train):

    def per_device(state, batch, active):            # inside jax.shard_map
        key = micro_step_key(state.key, state.step, jax.lax.axis_index("data"), micro)
        g, m = drafter_grads_if(
            active, graphdef, loss_cfg, state.params, batch, key, embed_w, head_w, axis_name="data"
        )                                            # this device's own gradient, or exact zeros if busy
        g, m = jax.lax.psum((g, m), "data")
        return apply_mean_grads(tx, state, g, m["num_tokens"]), normalize_metrics(m)

`axis_name` matters: under shard_map's type rules the gradient of the replicated params is otherwise the
implicit SUM over devices (a hidden psum: counted D times by the explicit psum, and a deadlock inside the
per-device cond, where only the idle devices reach it); tests/drafter/test_trainer.py runs this pattern.

Shapes are static: every micro-batch is a [rows, seq_len] `PackedBatch` and the loss-position budget
`LossConfig.max_loss_tokens` is a static size the packer respects, so nothing recompiles across steps.
`DrafterTrainer` wraps the pieces for one device (jitted grads + apply, the state donated), builds the state
from a drafter and saves / restores the full train state (params, optimizer, step, key) with orbax.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tlt_jax.drafter.loss import LossConfig, loss_sums, normalize_metrics
from tlt_jax.drafter.packing import PackedBatch
from tlt_jax.models.drafter import Drafter
from tlt_jax.utils.checkpoint import Checkpointer, SaveInfo

# ----------------------------------------------------------------------------------------------------------
# Optimizer

TRAIN_STATE_DIR = "train_state"  # a drafter workdir's full train state (params + optimizer), orbax


def make_schedule(
    lr: float, total_steps: int, warmup_steps: int, schedule: str = "cosine", end_lr_ratio: float = 0.1
) -> optax.Schedule:
    """Linear warm-up to `lr`, then cosine decay to `end_lr_ratio * lr` at `total_steps` (or constant)."""
    if total_steps < 1 or warmup_steps < 0:
        raise ValueError(f"need total_steps >= 1 and warmup_steps >= 0, got {total_steps}, {warmup_steps}")
    warmup_steps = min(warmup_steps, total_steps)
    warm = optax.linear_schedule(0.0 if warmup_steps else lr, lr, max(warmup_steps, 1))
    if schedule == "constant":
        rest = optax.constant_schedule(lr)
    elif schedule == "cosine":
        rest = optax.cosine_decay_schedule(lr, max(total_steps - warmup_steps, 1), alpha=end_lr_ratio)
    else:
        raise ValueError(f"unknown lr schedule {schedule!r}: use 'cosine' or 'constant'")
    return optax.join_schedules([warm, rest], [warmup_steps])


def make_optimizer(
    schedule: optax.Schedule,
    weight_decay: float = 0.0,
    clip_norm: float = 0.5,
    b1: float = 0.9,
    b2: float = 0.95,
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (decay on matrices only, not on norm weights)."""
    chain = [optax.clip_by_global_norm(clip_norm)] if clip_norm and clip_norm > 0 else []
    chain.append(
        optax.adamw(
            schedule,
            b1=b1,
            b2=b2,
            weight_decay=weight_decay,
            mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
        )
    )
    return optax.chain(*chain)


def optimizer_from_config(
    train_cfg: Mapping[str, Any] | Any,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimizer, schedule) from a config with lr, steps, warmup, weight_decay, clip_norm (+ optional b1,
    b2, schedule, end_lr_ratio)."""
    get = train_cfg.get
    sched = make_schedule(
        float(train_cfg["lr"]),
        int(train_cfg["steps"]),
        int(train_cfg["warmup"]),
        str(get("schedule", "cosine")),
        float(get("end_lr_ratio", 0.1)),
    )
    tx = make_optimizer(
        sched,
        float(get("weight_decay", 0.0)),
        float(get("clip_norm", 0.5)),
        float(get("b1", 0.9)),
        float(get("b2", 0.95)),
    )
    return tx, sched


# ----------------------------------------------------------------------------------------------------------
# Pure step pieces


@flax.struct.dataclass
class TrainState:
    """The drafter's trainable params (nnx.Param state), their optimizer state, the optimizer-step count and
    the run's base PRNG key (a typed `jax.random.key`; micro-step keys are folded from it)."""

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    key: jax.Array


def init_train_state(
    drafter: Drafter, tx: optax.GradientTransformation, key: jax.Array
) -> tuple[nnx.GraphDef, TrainState]:
    """Split the drafter into (graphdef, TrainState). The drafter holds only its own params (no target
    embedding/head), so everything in `params` is trainable."""
    graphdef, params = nnx.split(drafter, nnx.Param)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), key=key)
    return graphdef, state


def micro_step_key(
    key: jax.Array, step: jax.Array | int, device: jax.Array | int = 0, micro: int = 0
) -> jax.Array:
    """The key of micro-step `micro` on device `device` (its index along the trainer's mesh axis) in
    optimizer step `step`: distinct for every (step, device, micro) and a pure function of them."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, step), device), micro)


def _vary(tree: Any, axis_name: str | tuple[str, ...]) -> Any:
    """Mark a replicated pytree as varying over `axis_name` inside shard_map (jax.lax.pcast, or pvary)."""
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    pcast = getattr(jax.lax, "pcast", None)
    if pcast is not None:
        return pcast(tree, axes, to="varying")
    return jax.lax.pvary(tree, axes)


def drafter_grads(
    graphdef: nnx.GraphDef,
    loss_cfg: LossConfig,
    params: nnx.State,
    batch: PackedBatch,
    key: jax.Array,
    embed_w: jax.Array,
    head_w: jax.Array,
    *,
    axis_name: str | tuple[str, ...] | None = None,
) -> tuple[nnx.State, dict[str, jax.Array]]:
    """(grad of the SUM loss S w.r.t. params, metric sums) of one packed micro-batch; nothing is divided by
    the batch's loss tokens N (`metrics["num_tokens"]`): sum (g, N) over micro-batches, then `mean_grads`.

    Inside `jax.shard_map`, pass the mesh axis the devices differ along as `axis_name`: the replicated
    params are then cast to varying, so the gradient is THIS device's. Without it, shard_map's type rules
    (check_vma=True) differentiate a replicated input into the SUM over all devices, i.e. an implicit psum:
    a caller's own psum would then count every device D times, and inside a per-device `lax.cond` (see
    `drafter_grads_if`) that collective is reached by only some devices and deadlocks. (With
    check_vma=False the gradient is per-device either way; the cast is then a no-op.)
    """
    chex.assert_rank(batch.tokens, 2)
    chex.assert_rank(batch.hidden, 3)
    if axis_name is not None:
        params = _vary(params, axis_name)
    grad_fn = jax.grad(loss_sums, has_aux=True)
    grads, metrics = grad_fn(params, graphdef, batch, embed_w, head_w, loss_cfg, key)
    return grads, metrics


def drafter_grads_if(
    active: jax.Array | bool,
    graphdef: nnx.GraphDef,
    loss_cfg: LossConfig,
    params: nnx.State,
    batch: PackedBatch,
    key: jax.Array,
    embed_w: jax.Array,
    head_w: jax.Array,
    *,
    axis_name: str | tuple[str, ...] | None = None,
) -> tuple[nnx.State, dict[str, jax.Array]]:
    """`drafter_grads` where `active` (a per-device scalar under shard_map), else exact zeros of the same
    structure without computing anything (a `lax.cond`: a busy device skips the drafter's forward). Under
    shard_map pass `axis_name` (see `drafter_grads`), else the branch holds a collective and deadlocks."""

    def run(_: None) -> tuple[nnx.State, dict[str, jax.Array]]:
        return drafter_grads(graphdef, loss_cfg, params, batch, key, embed_w, head_w, axis_name=axis_name)

    def skip(_: None) -> tuple[nnx.State, dict[str, jax.Array]]:
        # zeros_like of the abstract outputs keeps their type, incl. the axes they vary over in shard_map
        return jax.tree.map(jnp.zeros_like, jax.eval_shape(run, None))

    return jax.lax.cond(jnp.asarray(active, bool), run, skip, None)


def mean_grads(grad_sums: nnx.State, num_tokens: jax.Array) -> nnx.State:
    """Summed SUM-loss gradients / summed loss tokens: the gradient of the mean loss over the union."""
    scale = 1.0 / jnp.maximum(jnp.asarray(num_tokens, jnp.float32), 1.0)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grad_sums)


def apply_grads(tx: optax.GradientTransformation, state: TrainState, grads: nnx.State) -> TrainState:
    """One optimizer update with MEAN-loss gradients (`mean_grads`); step + 1, key unchanged."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state)


def apply_mean_grads(
    tx: optax.GradientTransformation, state: TrainState, grad_sums: nnx.State, num_tokens: jax.Array
) -> TrainState:
    """`apply_grads(mean_grads(grad_sums, num_tokens))`, or the state unchanged when num_tokens is 0."""
    grads = mean_grads(grad_sums, num_tokens)
    return jax.lax.cond(jnp.asarray(num_tokens) > 0, lambda s: apply_grads(tx, s, grads), lambda s: s, state)


def train_step(
    state: TrainState,
    batch: PackedBatch,
    embed_w: jax.Array,
    head_w: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    loss_cfg: LossConfig,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on one device's packed batch (device 0, micro-step 0): grads + apply, normalised
    metrics plus `grad_norm` (of the mean gradient, before clipping)."""
    key = micro_step_key(state.key, state.step)
    grad_sums, sums = drafter_grads(graphdef, loss_cfg, state.params, batch, key, embed_w, head_w)
    grads = mean_grads(grad_sums, sums["num_tokens"])
    new_state = apply_mean_grads(tx, state, grad_sums, sums["num_tokens"])
    return new_state, dict(normalize_metrics(sums), grad_norm=optax.global_norm(grads))


# ----------------------------------------------------------------------------------------------------------
# Host class


class DrafterTrainer:
    """One device's drafter training: state init, a jitted step, save / restore of the full train state.

    `init_state(drafter)` fixes the drafter's graph (architecture) and returns a fresh state whose key is
    `jax.random.key(seed)`; `step(state, batch, embed_w, head_w)` is `train_step` jitted with the state
    donated (one compile for the fixed batch shape); `save` / `restore` write / read params, optimizer
    state, step and key through a `Checkpointer` (orbax; async unless the Checkpointer says otherwise), so a
    resumed run continues bit-identically.
    """

    def __init__(self, tx: optax.GradientTransformation, loss_cfg: LossConfig, seed: int = 0):
        self.tx, self.loss_cfg, self.seed = tx, loss_cfg, int(seed)
        self._graphdef: nnx.GraphDef | None = None
        self._template: TrainState | None = None
        self._step_fn: Any = None

    @property
    def graphdef(self) -> nnx.GraphDef:
        if self._graphdef is None:
            raise RuntimeError("DrafterTrainer.init_state(drafter) first: it fixes the drafter's graph")
        return self._graphdef

    def init_state(self, drafter: Drafter) -> TrainState:
        """A fresh train state for `drafter` (its current params; step 0; key from the seed)."""
        graphdef, state = init_train_state(drafter, self.tx, jax.random.key(self.seed))
        if self._graphdef is not None and graphdef != self._graphdef:
            raise ValueError("init_state got a drafter of another architecture than this trainer's")
        self._graphdef, self._template = graphdef, jax.eval_shape(lambda: state)
        return state

    def step(
        self, state: TrainState, batch: PackedBatch, embed_w: jax.Array, head_w: jax.Array
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step (the input state is donated: use the returned one)."""
        if self._step_fn is None:
            graphdef, tx, loss_cfg = self.graphdef, self.tx, self.loss_cfg

            def fn(state, batch, embed_w, head_w):  # noqa: ANN001, ANN202
                return train_step(state, batch, embed_w, head_w, graphdef=graphdef, tx=tx, loss_cfg=loss_cfg)

            self._step_fn = jax.jit(fn, donate_argnums=(0,))
        return self._step_fn(state, batch, embed_w, head_w)

    def save(self, ckpt: Checkpointer, state: TrainState, meta: dict[str, Any] | None = None) -> SaveInfo:
        """Save the full train state as checkpoint `state.step` (returns once orbax holds a host copy)."""
        return ckpt.save(int(state.step), state, meta)

    def restore(
        self, ckpt: Checkpointer, step: int | None = None, like: TrainState | None = None
    ) -> TrainState:
        """The train state of checkpoint `step` (default: the latest), shaped like `like` (default: the
        state `init_state` built; with its shardings when `like` holds arrays)."""
        target = like if like is not None else self._template
        if target is None:
            raise RuntimeError("DrafterTrainer.restore needs init_state(drafter) first (or like=)")
        state, _ = ckpt.restore(step, abstract_state=target)
        return state
