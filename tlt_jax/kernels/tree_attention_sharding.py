"""How the tree-attention kernels split over a device mesh: by batch rows and KV heads, never by cache length.

A Pallas kernel is one opaque call to XLA's partitioner: Mosaic refuses to be partitioned automatically, and a
Triton call is replicated (its KV cache gathered onto every device). Tree attention is independent per batch
row and per KV-head group (a query head reads only its group's K/V), so `partitioned(kernel)` attaches a
partitioning rule (`custom_partitioning`): each device runs the kernel on its own rows and heads, with the
rollout's layout (rows on the data axis, heads on the model axis) kept as it is; only a cache sharded along
its length would be regathered. Query heads and KV heads are split alike (query head h belongs to KV head
h // group, so contiguous blocks of both line up), which needs the KV-head count divisible by that axis.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

Kernel = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
# factors: b rows, t new tokens, h query heads, d head dim, k KV heads, s cache length, u tree columns
_RULE = "b t h d, b k s d, b k s d, b, b t u -> b t h d"


def _axes(spec: P, ndim: int, dim: int) -> object:
    """The mesh axis (or axes) of one dimension of a partition spec (None: replicated)."""
    parts = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return parts[dim]


def _layout(mesh: jax.sharding.Mesh, arg_shapes: tuple, kv_heads: int) -> tuple[object, object]:
    """(rows axis, heads axis) taken from the KV cache's sharding (the engine's layout), the heads axis
    dropped when it does not divide the KV heads."""
    k = arg_shapes[1]
    spec = k.sharding.spec if isinstance(k.sharding, NamedSharding) else P()
    rows, heads = _axes(spec, 4, 0), _axes(spec, 4, 1)
    if heads is not None:
        names = heads if isinstance(heads, tuple) else (heads,)
        size = 1
        for n in names:
            size *= mesh.shape[n]
        if kv_heads % size:
            heads = None
    return rows, heads


def _shardings(mesh: jax.sharding.Mesh, rows: object, heads: object) -> tuple[tuple, NamedSharding]:
    ns = lambda *s: NamedSharding(mesh, P(*s))  # noqa: E731
    kv = ns(rows, heads, None, None)
    args = (ns(rows, None, heads, None), kv, kv, ns(rows), ns(rows, None, None))
    return args, ns(rows, None, heads, None)


def partitioned(kernel: Kernel) -> Kernel:
    """`kernel(q, k, v, lengths, tree_mask)` with the partitioning rule above (a no-op on one device)."""

    @custom_partitioning
    def call(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tree_mask: jax.Array) -> jax.Array:
        return kernel(q, k, v, lengths, tree_mask)

    def infer(mesh: jax.sharding.Mesh, arg_shapes: tuple, result_shape: object) -> NamedSharding:
        del result_shape
        return _shardings(mesh, *_layout(mesh, arg_shapes, arg_shapes[1].shape[1]))[1]

    def partition(mesh: jax.sharding.Mesh, arg_shapes: tuple, result_shape: object) -> tuple:
        del result_shape
        args, out = _shardings(mesh, *_layout(mesh, arg_shapes, arg_shapes[1].shape[1]))
        return mesh, kernel, out, args

    call.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=_RULE)
    return call
