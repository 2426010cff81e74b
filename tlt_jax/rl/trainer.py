"""The learner's side of GRPO: trainer forward (response log-probs, hidden states) and the jitted update.

Batches come in the host layout of `tlt_jax.rl.batch` (prompt columns [0, Tp), response columns [Tp, Tp+Nb),
padding masked out of attention and positions restarting at the first real token, so a row's log-probs do not
depend on its padding).

The log-prob of response token j is read from the hidden state at column Tp - 1 + j; logits are computed only
for those Nb columns, divided by the rollout temperature (as VeRL does) so that they are comparable with the
engine's sampling log-probs. Optionally in chunks of `logits_chunk` columns under `jax.checkpoint` (the last
chunk zero-padded: any Nb), so a long response never materialises [B, Nb, V] logits for the backward pass.
Attention is causal by `tlt_jax.kernels.flash_attention` (`attn_impl`: O(T x block) memory, no [T, S] scores)
and each decoder layer may be rematerialised in the backward pass (`remat`, a `jax.checkpoint_policies` name),
the layers running as one `lax.scan` (`scan_layers`): the trainer then stores the policy in the stacked
layout (`layouts.stack_layers`: masters, AdamW moments, gradients and checkpoints hold one [L, ...] array per
weight, so its programs do not grow with depth) and hands the rollout the unrolled one (`rollout_params`).

`PolicyTrainer` owns the policy parameters (float32 masters when the model computes in bfloat16), the optax
state and an optional frozen reference copy. One `update` is one optimizer step on a mini-batch given as parts
(device stacks of micro-batches, each part with its own Nb): each part's gradient is accumulated in a
`lax.scan` into one donated buffer, each micro-batch's loss weighted by its share of the mini-batch (tokens,
sequences or rows, by loss aggregation), so the accumulated gradient equals the gradient of the whole
mini-batch's loss; then the optimizer applies it once. Programs: one accumulation per part shape, one apply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax import sharding as shd
from tlt_jax.kernels.flash_attention import SequenceParallel
from tlt_jax.models import layouts
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.llama import Transformer
from tlt_jax.rl.batch import TrainBatch, micro_problem, regroup, split_micro
from tlt_jax.rl.forward import ForwardOut, response_logprobs
from tlt_jax.rl.losses import PolicyLossConfig, merge_stats, micro_loss, reduce_stat, update_metrics
from tlt_jax.rl.optimizer import (
    OptimConfig,
    optimizer_shardings,
    path_parts,
    policy_optimizer,
    trainable_mask,
)


def _micro_spec(mesh: Mesh, x: Any) -> NamedSharding:
    """[K, G, ...] micro-batches: groups sharded over the data axis, everything else replicated."""
    axes = (None, "batch") + (None,) * (x.ndim - 2)
    return NamedSharding(mesh, shd.logical_spec(axes, x.shape, mesh))


# Sequence (context) parallelism (`TrainerOptions.seq_parallel`) reuses the mesh's model axis: the rollout's
# tensor-parallel group becomes the update's sequence-parallel group, as the paper's recipe runs Ulysses SP 4
# on the devices of its TP-4 rollout. Why not a third `seq` axis: the rollout, the parameter and optimizer
# layouts and the checkpoints stay on the one (data, model) mesh (no resharding between rollout and update,
# no mesh the rollout would leave idle), and the two axes' devices are the same NVLink group either way.
# With it on, every layer's tokens are split over the axis (a 33K-token row is 8K tokens per device on 4),
# each scanned layer's weights are gathered whole (stored sharded over data x model: FSDP over all devices,
# as the paper's FSDP2) and attention all-gathers K/V (GQA: 4 KV heads against 28 query heads for 7B), where
# tensor parallelism all-gathers and reduce-scatters the [rows, T, H] activations twice per layer.
SEQ_AXIS = "model"


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
    """How the trainer holds the policy: rows per micro-batch, a frozen reference copy (KL), the masters'
    dtype, FSDP (the hidden dim also split over the data axis), how many top layers train (0: all), and how
    its forward computes: attention (`flash_attention` impl) and per-layer rematerialisation (a
    `jax.checkpoint_policies` name, or "none"), in the update and the reference / old log-prob passes, with
    the layers under `lax.scan` (`scan_layers`) or unrolled; `seq_parallel`: the update's tokens split over
    the model axis instead of its weights (`SEQ_AXIS`)."""

    micro_batch_size: int
    with_reference: bool = False
    master_dtype: str = "float32"
    fsdp: bool = False
    train_layers: int = 0
    attn_impl: str = "auto"
    remat: str = "none"
    scan_layers: bool = False
    mlp_chunk: int = 0
    seq_parallel: bool = False


class PolicyTrainer:
    """Policy params + optimizer state + the jitted trainer forward and GRPO update (see module docstring).

    The trainer takes over the model's parameter buffers (its update donates them): do not use `model` after
    constructing it; get weights from `params` / `compute_params()` (the trainer's layout) or
    `rollout_params()` (the engine's).
    """

    # called after each part of `update` with the gradient accumulated so far: the learner's stop agreement
    # (tlt_jax.rl.stopping), which may raise to abandon the step (the caller then never saves this state)
    between_parts: Callable[[Any], None] | None = None

    def __init__(
        self,
        model: Transformer,
        mesh: Mesh,
        loss: PolicyLossConfig,
        optim: OptimConfig,
        options: TrainerOptions,
    ):
        graphdef, params = nnx.split(model, nnx.Param)
        self._configure(graphdef, params, model.cfg, mesh, loss, optim, options)
        self.params = jax.jit(
            lambda p: jax.tree_util.tree_map(lambda x: x.astype(self.master_dtype), self._layout(p)),
            out_shardings=self.param_shardings,
        )(params)
        self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)
        # A real copy: the policy's buffers are donated by every update.
        self.ref_params = self.compute_params(copy=True) if options.with_reference else None

    @classmethod
    def abstract(
        cls,
        graphdef: nnx.GraphDef,
        params: Any,
        cfg: ModelConfig,
        mesh: Mesh | AbstractMesh,
        loss: PolicyLossConfig,
        optim: OptimConfig,
        options: TrainerOptions,
    ) -> PolicyTrainer:
        """A trainer built from abstract parameters (`jax.ShapeDtypeStruct`s): every layout, the optimizer and
        the jitted programs as `__init__` makes them, with `params` / `opt_state` / `ref_params` abstract too,
        so its programs compile ahead of time with nothing materialised (memory plans at 7B-32B shapes)."""
        t = cls.__new__(cls)
        t._configure(graphdef, params, cfg, mesh, loss, optim, options)
        t.params = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, t.master_dtype, sharding=s),
            t._layout(params),
            t.param_shardings,
        )
        state = jax.eval_shape(t.tx.init, t.params)
        t.opt_state = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, t.opt_shardings
        )
        t.ref_params = (
            jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, t.compute_dtype, sharding=x.sharding), t.params
            )
            if options.with_reference
            else None
        )
        return t

    def _configure(
        self,
        graphdef: nnx.GraphDef,
        params: Any,
        cfg: ModelConfig,
        mesh: Mesh | AbstractMesh,
        loss: PolicyLossConfig,
        optim: OptimConfig,
        options: TrainerOptions,
    ) -> None:
        """Everything but the buffers: layouts, the optimizer, the jitted programs (from shapes only).
        `graphdef` / `params`: the model's (unrolled layout); the trainer's own are stacked when its layers
        are scanned."""
        self.stacked = bool(options.scan_layers)
        self.graphdef = layouts.layout_graphdef(cfg, True) if self.stacked else graphdef
        self.mesh, self.loss, self.optim = mesh, loss, optim
        self.micro_batch_size = int(options.micro_batch_size)
        self.compute_dtype, self.master_dtype = jnp.dtype(cfg.dtype), jnp.dtype(options.master_dtype)
        fsdp, train_layers = options.fsdp, options.train_layers
        self.fsdp, self.mlp_chunk = bool(fsdp), int(options.mlp_chunk)
        self.attn_impl, self.remat = options.attn_impl, options.remat
        self.seq_parallel = bool(options.seq_parallel)
        # the forward's attention: a SequenceParallel wrapping attn_impl when the tokens are split
        self._attn = SequenceParallel(mesh, SEQ_AXIS, self.attn_impl) if self.seq_parallel else self.attn_impl
        # fsdp: the hidden ("embed") dim of every weight is also split over the data axis, so master weights
        # and AdamW moments are sharded over all devices (XLA gathers each weight where it is used).
        self.rules = {**shd.DEFAULT_RULES, "embed": "data"} if fsdp else dict(shd.DEFAULT_RULES)
        rollout_shapes = jax.eval_shape(lambda p: p, params)
        shapes = jax.eval_shape(self._layout, params)
        self.param_shardings = shd.param_shardings(shapes, mesh, self.rules)
        self.rollout_shardings = shd.param_shardings(rollout_shapes, mesh, self.rules)
        self.trainable = trainable_mask(shapes, cfg.num_layers, train_layers, self.stacked)
        self.train_layers = int(train_layers)
        self.tx = policy_optimizer(optim, self.trainable if train_layers else None)
        self.opt_shardings = optimizer_shardings(self.tx, shapes, self.param_shardings, mesh)
        self._zeros = jax.jit(
            lambda p: jax.tree_util.tree_map(jnp.zeros_like, p), out_shardings=self.param_shardings
        )
        self._accum = jax.jit(self._accum_fn, donate_argnums=(1,), out_shardings=(self.param_shardings, None))
        self._apply = jax.jit(
            self._apply_fn,
            donate_argnums=(0, 1),
            out_shardings=(self.param_shardings, self.opt_shardings, None),
        )
        self._logprobs = jax.jit(self._logprobs_fn, static_argnames=("return_hidden",))
        self._cast = jax.jit(self._cast_fn, out_shardings=self.param_shardings)
        self._rollout_cast = jax.jit(
            lambda p: layouts.unstack_layers(self._cast_fn(p)), out_shardings=self.rollout_shardings
        )
        self._surrogate = jax.jit(self._surrogate_fn)
        self._copy = jax.jit(
            lambda p: jax.tree_util.tree_map(jnp.copy, p), out_shardings=self.param_shardings
        )

    # ---- params -------------------------------------------------------------------------------------------
    def _layout(self, params: Any) -> Any:
        """The model's (unrolled) parameter state in the trainer's layout (stacked when scanned)."""
        return layouts.stack_layers(params) if self.stacked else params

    def _cast_fn(self, params: Any) -> Any:
        return jax.tree_util.tree_map(lambda x: x.astype(self.compute_dtype), params)

    def rollout_params(self) -> Any:
        """The policy as the rollout engine runs it: compute dtype, unrolled layout (new buffers when the
        trainer stores it stacked or in another dtype; the masters themselves otherwise)."""
        return self._rollout_cast(self.params) if self.stacked else self.compute_params()

    def other_layout(self) -> tuple[Any, Any] | None:
        """Abstract (params, opt_state) in the other layout of the decoder layers (stacked <-> unrolled),
        sharded as this trainer would shard them: the restore target of a checkpoint written with the other
        config.trainer.scan_layers (`adopt` converts what it reads). None with frozen layers (not stored)."""
        if self.train_layers:
            return None
        shapes = jax.eval_shape(lambda p: layouts.to_layout(p, not self.stacked), self.params)
        shardings = shd.param_shardings(shapes, self.mesh, self.rules)
        opt = jax.eval_shape(self.tx.init, shapes)
        opt_shardings = optimizer_shardings(self.tx, shapes, shardings, self.mesh)
        sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
        return jax.tree.map(sds, shapes, shardings), jax.tree.map(sds, opt, opt_shardings)

    def adopt(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """(params, opt_state) read in the other layout (`other_layout`) -> this trainer's layout."""
        return jax.jit(
            lambda p, o: layouts.to_layout((p, o), self.stacked),
            out_shardings=(self.param_shardings, self.opt_shardings),
        )(params, opt_state)

    def compute_params(self, copy: bool = False) -> Any:
        """Policy params in the model's compute dtype (what the rollout engine runs); `copy` forces new
        buffers (otherwise float32 masters of a float32 model are returned as they are)."""
        if all(x.dtype == self.compute_dtype for x in jax.tree_util.tree_leaves(self.params)):
            return self._copy(self.params) if copy else self.params
        return self._cast(self.params)

    def model(self, params: Any | None = None) -> Transformer:
        return nnx.merge(self.graphdef, self._cast_fn(self.params if params is None else params))

    # ---- device placement ---------------------------------------------------------------------------------
    def put_micro(self, batch: TrainBatch) -> TrainBatch:
        """Split a host batch into micro-batches of `micro_batch_size` rows (whole groups, or whole
        sub-groups of a group: `regroup`) and shard each micro-batch's groups over the data axis."""
        rows = batch.prompt.shape[0] * batch.group_size
        problem = micro_problem(rows, batch.group_size, self.micro_batch_size)
        if problem:
            raise ValueError(problem)
        batch = regroup(batch, self.micro_batch_size)
        micro = split_micro(batch, rows // self.micro_batch_size)
        return jax.tree_util.tree_map(lambda x: jax.device_put(x, _micro_spec(self.mesh, x)), micro)

    # ---- forward ------------------------------------------------------------------------------------------
    def _forward(self, params: Any, mb: TrainBatch, return_hidden: bool) -> ForwardOut:
        gathers = self.fsdp or self.seq_parallel
        # a stacked model's layers are cast to the compute dtype one layer at a time inside the scan (with
        # FSDP's gather), not as a compute-dtype copy of every layer up front (by the memory plan, 10 GiB less
        # in the 32B log-prob pass)
        late = lambda path: self.stacked and path_parts(path)[0] == "layers"  # noqa: E731
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: x if late(path) else x.astype(self.compute_dtype), params
        )
        layer_hook = (lambda s: self._gather(self._cast_fn(s))) if gathers else self._cast_fn
        # the LM head gathered once (a data-sharded contraction would give every row's logits), to the tensor-
        # parallel layout also with sequence parallelism (its vocabulary split over the model axis: 1.1 GiB
        # less than a whole head per device in the 7B update at 32K, by the memory plan)
        # and an untied embedding split by hidden dim over the model axis: each device looks up its slice of
        # every token and the lookup's gradient (a scatter-add) stays [V, H / model], where the data x model
        # FSDP layout had XLA gather the whole table and scatter into a whole [V, H] float32 gradient
        # (-4.9 GiB per device in the 32B update at 32K, by the memory plan)
        if gathers:
            head = "lm_head" if "lm_head" in params else "embed"
            params[head] = self._gather_tp(params)[head]
            if head == "lm_head":
                split = NamedSharding(self.mesh, P(None, SEQ_AXIS))
                params["embed"] = jax.lax.with_sharding_constraint(params["embed"], split)
        model = nnx.merge(self.graphdef, params)
        return response_logprobs(
            model,
            mb,
            temperature=self.loss.temperature,
            logits_chunk=self.loss.logits_chunk,
            return_hidden=return_hidden,
            attn_impl=self._attn,
            remat=self.remat,
            shard_rows=self._shard_rows,
            gather_layer=layer_hook,
            mlp_chunk=self.mlp_chunk,
            shard_carry=self._shard_carry,
        )

    def _shard_carry(self, x: jax.Array) -> jax.Array:
        """The residual stream [B, T, H] between layers: rows over the data axis, tokens over the model axis
        (tensor parallelism replicates it there: what the backward keeps per layer is split, not copied)."""
        names = (self.rules["batch"], self.rules["kv_heads"])
        spec = [
            a if a is not None and n % self.mesh.shape[a] == 0 else None
            for a, n in zip(names, x.shape[:2], strict=True)
        ]
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec, None)))

    def _gather(self, params: Any) -> Any:
        """FSDP's all-gather of a layer: `params` constrained to the tensor-parallel layout (`_gather_tp`);
        with sequence parallelism, whole on every device (the tokens, not the weights, are split)."""
        if self.seq_parallel:
            return jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P())), params
            )
        return self._gather_tp(params)

    def _gather_tp(self, params: Any) -> Any:
        """`params` constrained to the tensor-parallel layout (the data axis dropped)."""
        return jax.lax.with_sharding_constraint(params, shd.param_shardings(params, self.mesh))

    def _shard_rows(self, tree: Any) -> Any:
        """Rows of every array over the data axis where they divide it, the other axes left to the compiler
        (a cache's KV heads stay on the model axis); with sequence parallelism also the token axis over
        `SEQ_AXIS`: tokens [B, T] and hidden states [B, T, H] at axis 1, a cache's [B, Hkv, S, D] slots at
        axis 2 (the layout its attention takes them in)."""
        axis = self.rules["batch"]
        free = P.UNCONSTRAINED

        def one(x: jax.Array) -> jax.Array:
            spec = [free] * x.ndim
            if axis is not None and x.shape[0] % self.mesh.shape[axis] == 0:
                spec[0] = axis
            tok = {2: 1, 3: 1, 4: 2}.get(x.ndim) if self.seq_parallel else None
            if tok is not None and x.shape[tok] % self.mesh.shape[SEQ_AXIS] == 0:
                spec[tok] = SEQ_AXIS
            if all(a is free for a in spec):
                return x
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec)))

        return jax.tree.map(one, tree)

    def _logprobs_fn(self, params: Any, micro: TrainBatch, return_hidden: bool = False) -> ForwardOut:
        return jax.lax.map(lambda mb: self._forward(params, mb, return_hidden), micro)

    def logprobs(self, micro: TrainBatch, params: Any = None, return_hidden: bool = False) -> ForwardOut:
        """Trainer forward without gradients on device micro-batches ([K, ...] from `put_micro`): log-probs
        [K, rows per micro, Nb] under `params` (default: the policy; `ref_params` for the reference)."""
        return self._logprobs(self.params if params is None else params, micro, return_hidden=return_hidden)

    # ---- update -------------------------------------------------------------------------------------------
    def _loss_fn(self, params: Any, mb: TrainBatch, weight: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        if self.train_layers:  # frozen weights are constants: no backward through the layers below
            params = jax.tree_util.tree_map(
                lambda x, t: x if t else jax.lax.stop_gradient(x), params, self.trainable
            )
        return micro_loss(self._forward(params, mb, return_hidden=False), mb, self.loss, weight)

    def _accumulate(
        self, params: Any, micro: TrainBatch, weights: jax.Array, init: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        """`init` (default zeros) + sum over micro-batches of weight_k * grad(loss_k)."""

        def body(acc: Any, xs: tuple[TrainBatch, jax.Array]) -> tuple[Any, dict[str, Any]]:
            mb, w = xs
            (_, aux), g = jax.value_and_grad(self._loss_fn, has_aux=True)(params, mb, w)
            return jax.tree_util.tree_map(jnp.add, acc, g), aux

        zeros = jax.tree_util.tree_map(jnp.zeros_like, params) if init is None else init
        return jax.lax.scan(body, zeros, (micro, weights))

    def gradients(self, micro: TrainBatch, weights: np.ndarray) -> Any:
        """The accumulated gradient of one part (for tests and diagnostics; no state change)."""
        if not hasattr(self, "_gradients"):
            self._gradients = jax.jit(lambda p, m, w: self._accumulate(p, m, w)[0])
        return self._gradients(self.params, micro, jnp.asarray(weights, jnp.float32))

    def _accum_fn(self, params: Any, acc: Any, micro: TrainBatch, weights: jax.Array):  # noqa: ANN202
        acc, aux = self._accumulate(params, micro, weights, init=acc)
        stats = {k: reduce_stat(k, v) for k, v in aux.items() if k != "logp"}
        return acc, {"stats": stats, "logp": aux["logp"]}

    def _apply_fn(self, params: Any, opt_state: Any, grads: Any):  # noqa: ANN202
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        norms = {"grad_norm": optax.global_norm(grads), "update_norm": optax.global_norm(updates)}
        return params, opt_state, norms

    def update(
        self, parts: Sequence[TrainBatch], weights: Sequence[np.ndarray]
    ) -> tuple[dict[str, float], list[jax.Array]]:
        """One optimizer step on a mini-batch given as `parts`: device stacks of micro-batches ([K_i, ...]
        from `put_micro`, Nb may differ between parts) with per-micro-batch loss weights (weights[i]: [K_i],
        summing to 1 over all parts).

        Returns (metrics, the log-probs of the forward before the step, per part [K_i, rows, Nb_i]);
        metrics: `tlt_jax.rl.losses.update_metrics`.
        """
        if len(parts) != len(weights) or not parts:
            raise ValueError(f"update needs one weight vector per part: {len(parts)} parts, {len(weights)}")
        acc = self._zeros(self.params)
        logps, sums = [], {}
        for micro, w in zip(parts, weights, strict=True):
            chex.assert_shape(w, (micro.prompt.shape[0],))
            acc, out = self._accum(self.params, acc, micro, jnp.asarray(w, jnp.float32))
            logps.append(out["logp"])
            sums = merge_stats(sums, out["stats"])
            if self.between_parts is not None:
                self.between_parts(acc)
        self.params, self.opt_state, norms = self._apply(self.params, self.opt_state, acc)
        s = {k: float(v) for k, v in jax.device_get({**sums, **norms}).items()}
        return update_metrics(s), logps

    def surrogate_loss(self, micro: TrainBatch, weights: np.ndarray, params: Any = None) -> float:
        """The weighted loss (policy + KL terms) of `params` (default: the policy) on a batch, no update.
        With fused old log-probs this is -mean advantage at any params; pass old_logp and a trainer with
        fuse_old_logprobs=False to measure the PPO surrogate."""
        p = self.params if params is None else params
        return float(self._surrogate(p, micro, jnp.asarray(weights, jnp.float32)))

    def _surrogate_fn(self, params: Any, micro: TrainBatch, weights: jax.Array) -> jax.Array:
        losses, _ = jax.lax.map(lambda xs: self._loss_fn(params, xs[0], xs[1]), (micro, weights))
        return jnp.sum(losses)
