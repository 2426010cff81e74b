"""Meshes and logical-axis sharding rules for params, KV cache and batch.

Every array names its dims with logical axes (`batch`, `vocab`, `embed`, `kv_heads`, `mlp`, ...); a rules
table maps logical axes to mesh axes (`data`, `model`). A dim whose size the mesh axis does not divide is
replicated (and logged once), so one config runs on 1 device, on 8 fake CPU devices and on a GPU node.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

# logical axis -> mesh axis (None = replicated). Rollout and training use the same table today.
DEFAULT_RULES: dict[str, str | None] = {
    "batch": "data",
    "vocab": "model",
    "embed": None,
    "kv_heads": "model",
    "mlp": "model",
    "seq": None,
}

# parameter name (last path element) -> logical axes of its dims
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("vocab", "embed"),
    # fused rows ordered per KV group / per MLP unit, so a contiguous split hands out whole groups/units
    "qkv": ("kv_heads", "embed"),
    "qkv_bias": ("kv_heads",),
    "o_proj": ("embed", "kv_heads"),
    "gate_up": ("mlp", "embed"),
    "down": ("embed", "mlp"),
    "weight": (None,),  # RMSNorm scales
    "fc": ("embed", None),  # EAGLE drafter fusion layer
}

CACHE_AXES = ("batch", "kv_heads", "seq", None)


def make_mesh(data: int = -1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh. data=-1 takes all remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    if data == -1:
        if len(devices) % model:
            raise ValueError(f"mesh: {len(devices)} devices are not divisible by model={model}.")
        data = len(devices) // model
    if data * model > len(devices):
        raise ValueError(
            f"mesh data={data} x model={model} needs {data * model} devices, only {len(devices)} available. "
            "Set config.mesh.data / config.mesh.model "
            "(or XLA_FLAGS=--xla_force_host_platform_device_count=N on CPU)."
        )
    arr = np.asarray(devices[: data * model]).reshape(data, model)
    return Mesh(arr, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def logical_spec(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Mapping[str, str | None] = DEFAULT_RULES,
) -> P:
    """PartitionSpec for an array with the given logical axes; fails if two dims map to one mesh axis."""
    if len(axes) != len(shape):
        raise ValueError(
            f"logical axes {tuple(axes)} do not match an array of rank {len(shape)} {tuple(shape)}"
        )
    out: list[str | None] = []
    used: set[str] = set()
    for ax, size in zip(axes, shape, strict=True):
        mesh_ax = rules.get(ax) if ax is not None else None
        if mesh_ax is not None:
            if mesh_ax in used:
                raise ValueError(f"logical axes {tuple(axes)} map mesh axis {mesh_ax!r} twice")
            n = mesh.shape[mesh_ax]
            if size % n:
                if n > 1:
                    log.info("dim %s=%d not divisible by mesh axis %s=%d: replicated", ax, size, mesh_ax, n)
                mesh_ax = None
            else:
                used.add(mesh_ax)
        out.append(mesh_ax)
    return P(*out)


def _param_name(path: tuple) -> str:
    for p in reversed(path):
        key = getattr(p, "key", getattr(p, "name", None))
        if isinstance(key, str) and key != "value":  # nnx Variables add a trailing `.value`
            return key
    raise ValueError(f"cannot name parameter at path {path}")


def param_shardings(params: object, mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES) -> object:
    """NamedShardings for a parameter pytree (nnx State or dict), by parameter name."""

    def one(path: tuple, x: jax.Array) -> NamedSharding:
        name = _param_name(path)
        if name not in PARAM_AXES:
            raise KeyError(
                f"no logical axes registered for parameter {name!r} (path {jax.tree_util.keystr(path)})"
            )
        axes = PARAM_AXES[name]
        if len(axes) != x.ndim:
            axes = (None,) * x.ndim
        return NamedSharding(mesh, logical_spec(axes, x.shape, mesh, rules))

    return jax.tree_util.tree_map_with_path(one, params)


def batch_sharding(
    mesh: Mesh, ndim: int, batch: int, rules: Mapping[str, str | None] = DEFAULT_RULES
) -> NamedSharding:
    """Leading-dim batch sharding for an array of rank `ndim` (other dims replicated)."""
    return NamedSharding(
        mesh, logical_spec(("batch",) + (None,) * (ndim - 1), (batch,) + (1,) * (ndim - 1), mesh, rules)
    )


def cache_sharding(
    mesh: Mesh, shape: Sequence[int], rules: Mapping[str, str | None] = DEFAULT_RULES
) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(CACHE_AXES, shape, mesh, rules))


def shard_pytree_batch(tree: object, mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES) -> object:
    """Shardings for a pytree of batch-major arrays; 4-D [B, Hkv, S, D] leaves get the KV-cache layout."""

    def one(x: jax.Array) -> NamedSharding:
        if x.ndim == 4:
            return cache_sharding(mesh, x.shape, rules)
        if x.ndim == 0:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, logical_spec(("batch",) + (None,) * (x.ndim - 1), x.shape, mesh, rules))

    return jax.tree_util.tree_map(one, tree)
