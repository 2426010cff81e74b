"""A HF safetensors checkpoint placed straight into the model's sharded device arrays, no host copy.

The all-float32 path (`loading.load_hf_dir` + `llama.from_hf_tensors`) reads every tensor into host memory
as float32 (~30 GB for a 7B model) and fuses the whole model before placing it. Here the model is first built
abstractly (`random_init.abstract_params`: shapes, dtypes and the caller's shardings, nothing allocated);
each parameter is then made by `jax.make_array_from_callback`, whose callback receives the index (slices)
one device holds and reads only those rows of the HF tensors it is fused from (`SafetensorsDir.read`), in
the stored dtype, then fuses and casts them to the parameter's dtype. Host memory peaks at about one
parameter (the largest is the embedding), never the model; with several processes each one reads only the
slices its own devices hold (row slices are read exactly; a column slice reads its rows and keeps the
columns, since the format is row-major).

Fused layouts (see `tlt_jax.models.llama`): qkv rows are [Hkv, G + 2, D] (per KV group: its G query heads,
its key head, its value head), gate_up rows are [F, 2] (unit f's gate, then its up). A row range of the
fused matrix maps to whole KV groups / MLP units of the HF tensors, read and fused, then trimmed to the
range. The values equal the float32 path's bit for bit (the same numbers, cast once to the model dtype).

Stacked layers (one parameter per kind with a leading [num_layers] axis, as a scanned decoder holds them)
are read layer by layer over the index's first slice; per-layer modules (`layers/<i>/...`) one by one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
import numpy as np
from flax import nnx

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.llama import Transformer
from tlt_jax.models.random_init import ShardFn, abstract_params

Index = tuple[slice, ...]


class TensorReader(Protocol):
    """What the conversion reads from: rows of a HF-named tensor in its stored dtype (`SafetensorsDir`)."""

    def read(self, name: str, rows: slice = slice(None)) -> np.ndarray: ...


# our parameter path (after `layers/<i>/` for a layer's) -> the HF tensor it is a copy of
GLOBAL_TENSORS = {
    ("embed",): "model.embed_tokens.weight",
    ("norm", "weight"): "model.norm.weight",
    ("lm_head",): "lm_head.weight",
}
LAYER_TENSORS = {
    ("attn", "o_proj"): "self_attn.o_proj.weight",
    ("input_norm", "weight"): "input_layernorm.weight",
    ("post_attn_norm", "weight"): "post_attention_layernorm.weight",
    ("mlp", "down"): "mlp.down_proj.weight",
}


def _bounds(rows: slice, n: int, unit: int) -> tuple[int, int, int, int]:
    """(r0, r1) of a row slice over n rows, and the whole units [u0, u1) of `unit` rows that cover it."""
    r0, r1, _ = rows.indices(n)
    return r0, r1, r0 // unit, -(-r1 // unit)


def _qkv_rows(src: TensorReader, cfg: ModelConfig, prefix: str, kind: str, index: Index) -> np.ndarray:
    """Rows `index[0]` (and columns `index[1:]`) of the fused qkv weight ("weight") or bias ("bias")."""
    g, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    per = (g + 2) * d
    r0, r1, k0, k1 = _bounds(index[0], cfg.num_kv_heads * per, per)
    cols = (slice(None), *index[1:])
    parts = []
    for name, heads in (("q_proj", g), ("k_proj", 1), ("v_proj", 1)):
        rows = src.read(f"{prefix}self_attn.{name}.{kind}", slice(k0 * heads * d, k1 * heads * d))[cols]
        parts.append(rows.reshape(k1 - k0, heads, d, *rows.shape[1:]))
    fused = np.concatenate(parts, axis=1)
    return fused.reshape(-1, *fused.shape[3:])[r0 - k0 * per : r1 - k0 * per]


def _gate_up_rows(src: TensorReader, cfg: ModelConfig, prefix: str, index: Index) -> np.ndarray:
    """Rows `index[0]` (and columns `index[1:]`) of the fused [F, 2] gate/up weight."""
    r0, r1, u0, u1 = _bounds(index[0], 2 * cfg.intermediate_size, 2)
    cols = (slice(None), *index[1:])
    gate = src.read(f"{prefix}mlp.gate_proj.weight", slice(u0, u1))[cols]
    up = src.read(f"{prefix}mlp.up_proj.weight", slice(u0, u1))[cols]
    fused = np.stack([gate, up], axis=1)
    return fused.reshape(-1, *fused.shape[2:])[r0 - 2 * u0 : r1 - 2 * u0]


def layer_param_slice(
    src: TensorReader, cfg: ModelConfig, layer: int, tail: tuple[str, ...], index: Index
) -> np.ndarray:
    """The slice `index` of layer `layer`'s parameter `tail` (e.g. ("attn", "qkv")) in our fused layout,
    in the checkpoint's dtype, reading only the HF rows it needs."""
    prefix = f"model.layers.{layer}."
    if tail in LAYER_TENSORS:
        return src.read(prefix + LAYER_TENSORS[tail], index[0])[(slice(None), *index[1:])]
    if tail == ("attn", "qkv"):
        return _qkv_rows(src, cfg, prefix, "weight", index)
    if tail == ("attn", "qkv_bias"):
        return _qkv_rows(src, cfg, prefix, "bias", index)
    if tail == ("mlp", "gate_up"):
        return _gate_up_rows(src, cfg, prefix, index)
    raise KeyError(f"no HF tensor maps to layer parameter {'/'.join(tail)}: update sharded_loading.py")


def param_slice(src: TensorReader, cfg: ModelConfig, path: tuple[str | int, ...], index: Index) -> np.ndarray:
    """The slice `index` of the parameter at `path` (an nnx state path) in the checkpoint's dtype."""
    if path in GLOBAL_TENSORS:
        return src.read(GLOBAL_TENSORS[path], index[0])[(slice(None), *index[1:])]
    if path[:1] == ("layers",) and len(path) > 1:
        if isinstance(path[1], int):
            return layer_param_slice(src, cfg, path[1], tuple(map(str, path[2:])), index)
        layers = range(*index[0].indices(cfg.num_layers))  # stacked: [num_layers, ...]
        tail = tuple(map(str, path[1:]))
        return np.stack([layer_param_slice(src, cfg, i, tail, index[1:]) for i in layers])
    raise KeyError(f"no HF tensor maps to parameter {'/'.join(map(str, path))}: update sharded_loading.py")


def _full_index(index: Index | None, ndim: int) -> Index:
    """The callback's index as one slice per dim (a scalar parameter's index is empty)."""
    return tuple(index) if index is not None else (slice(None),) * ndim


class _MemoReader:
    """`SafetensorsDir.read` remembered for one parameter: the devices that hold the same rows (replicas,
    column shards of a row-major tensor, two halves of one KV group) share one read."""

    def __init__(self, src: TensorReader) -> None:
        self.src, self.memo = src, {}

    def read(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        key = (name, rows.start, rows.stop, rows.step)
        if key not in self.memo:
            self.memo[key] = self.src.read(name, rows)
        return self.memo[key]


def _place(src: TensorReader, cfg: ModelConfig, path: tuple, sds: jax.ShapeDtypeStruct) -> jax.Array:
    """One parameter as a device array with the sharding of `sds`, each distinct row range read once and
    each distinct shard converted once (host memory: about this one parameter, freed on return)."""
    reader = _MemoReader(src)
    cache: dict[tuple, np.ndarray] = {}  # replicated shards: one host buffer for all devices

    def callback(index: Index | None) -> np.ndarray:
        idx = _full_index(index, len(sds.shape))
        key = tuple((s.start, s.stop, s.step) for s in idx)
        if key not in cache:
            cache[key] = np.asarray(param_slice(reader, cfg, path, idx), dtype=sds.dtype)
        return cache[key]

    out = jax.make_array_from_callback(sds.shape, sds.sharding, callback)
    if out.shape != sds.shape:  # pragma: no cover - make_array_from_callback checks shard shapes
        raise ValueError(f"parameter {'/'.join(map(str, path))}: built {out.shape}, expected {sds.shape}")
    return out


def _default_shardings(params: nnx.State) -> nnx.State:
    """Every parameter on the default device (what `jnp.asarray` does in the float32 path)."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda _: device, params)


def place_hf_params(
    cfg: ModelConfig,
    src: TensorReader,
    shard_fn: ShardFn | None = None,
    progress: Callable[[str], None] | None = None,
) -> Transformer:
    """A `Transformer` of `cfg` whose parameters are read from `src` straight into device arrays laid out by
    `shard_fn` (default: the default device). `cfg` must match the checkpoint: validate it first
    (`loading.open_hf_dir` does). progress(name) is called before each parameter (for logs)."""
    graphdef, params = abstract_params(lambda: Transformer(cfg, nnx.Rngs(0)), shard_fn or _default_shardings)

    def fill(path: tuple, var: nnx.Variable) -> nnx.Variable:
        if progress is not None:
            progress("/".join(map(str, path)))
        return var.replace(_place(src, cfg, tuple(path), var.get_value()))

    return nnx.merge(graphdef, nnx.map_state(fill, params))
