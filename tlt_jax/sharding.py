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


class MeshError(ValueError):
    """A mesh the devices cannot form (the config's mistake: the CLI prints it without a traceback)."""


def make_mesh(data: int = -1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh. data=-1 takes all remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    if data == -1:
        if model < 1 or len(devices) % model:
            divisors = [d for d in range(1, len(devices) + 1) if len(devices) % d == 0]
            raise MeshError(
                f"mesh: config.mesh.model={model} does not divide the {len(devices)} devices: set "
                f"config.mesh.model to one of {divisors}, or config.mesh.data explicitly (data x model "
                f"<= {len(devices)} devices are used)."
            )
        data = len(devices) // model
    if data * model > len(devices):
        raise MeshError(
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
    """NamedShardings for a parameter pytree (nnx State or dict), by parameter name; a stacked model's layer
    weights lead with an [L] axis, which is replicated (each device holds its slice of every layer)."""

    def one(path: tuple, x: jax.Array) -> NamedSharding:
        name = _param_name(path)
        if name not in PARAM_AXES:
            raise KeyError(
                f"no logical axes registered for parameter {name!r} (path {jax.tree_util.keystr(path)})"
            )
        axes = PARAM_AXES[name]
        if x.ndim == len(axes) + 1:  # stacked layers: [L, *axes]
            axes = (None, *axes)
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


# ---- several processes: moving values between the host and arrays that span every process's devices ------
def _spans_other_processes(x: object) -> bool:
    """A jax.Array with shards only other processes hold (replicated arrays have a copy here)."""
    return isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated)


def to_host_tree(tree: object) -> object:
    """`jax.device_get` that also works with several processes: every array leaf as numpy, the whole array.

    A leaf sharded over other processes' devices (the rollout's batch-sharded decode state on a multi-host
    mesh, where `np.asarray` fails with "spans non-addressable devices") is gathered from every process with
    `multihost_utils.process_allgather` (a collective: every process must make the same call). On one process
    this is `jax.device_get` and nothing else."""
    from jax.experimental import multihost_utils

    leaves, treedef = jax.tree.flatten(tree)
    remote = [i for i, x in enumerate(leaves) if _spans_other_processes(x)]
    local = sorted(set(range(len(leaves))) - set(remote))
    out: list[object] = list(leaves)
    for i, v in zip(local, jax.device_get([leaves[i] for i in local]), strict=True):
        out[i] = np.asarray(v)
    if remote:
        gathered = multihost_utils.process_allgather([leaves[i] for i in remote], tiled=True)
        for i, v in zip(remote, gathered, strict=True):
            out[i] = np.asarray(v)
    return jax.tree.unflatten(treedef, out)


def to_host(x: object) -> np.ndarray:
    """One array as numpy, from whichever processes hold it (`to_host_tree`)."""
    return to_host_tree(x)  # type: ignore[return-value]


def put_global(tree: object, sharding: jax.sharding.Sharding, *, may_alias: bool | None = None) -> object:
    """`jax.device_put(tree, sharding)` that also works when `sharding` spans several processes' devices.

    JAX refuses to put an array that lives on this process's devices (a freshly initialised state, typed PRNG
    keys included) onto a sharding over every process's devices; each process holds the same value, so its
    host copy is put instead (typed keys through their key data). Arrays already global (a checkpoint
    restored on other shardings) are resharded by an identity program; host values are put. On one process
    (or a sharding this process holds entirely) this is `jax.device_put` and nothing else."""
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding, may_alias=may_alias)

    def one(x: object) -> object:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:  # global already: reshard it
            if x.sharding.is_equivalent_to(sharding, x.ndim):
                return x
            return jax.jit(lambda a: a, out_shardings=sharding)(x)
        if not isinstance(x, jax.Array):
            return jax.device_put(x, sharding, may_alias=may_alias)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.device_put(np.asarray(x), sharding)

    return jax.tree.map(one, tree)


def process_mean(values: np.ndarray) -> np.ndarray:
    """The mean over processes of a host array each process measured itself (wall-clock speeds): the same
    float32 array in every process, so decisions taken from it agree. On one process: the values (float32)."""
    values = np.asarray(values, np.float32)
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(values), np.float32).mean(axis=0, dtype=np.float32)
