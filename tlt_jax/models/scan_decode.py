"""The rollout's forward (prefill / decode / verify) with the decoder layers under `lax.scan` (issue #35).

An experiment, not the engine's path: `experiments/models/scan_rollout.py` compares these programs with the
unrolled `Transformer.__call__` over the per-layer cache tuple (memory, compile time, run time and what the
optimised HLO materialises), and `tests/experiments/test_scan_rollout.py` holds them equal to it.

The cache is natively stacked, `StackedKVCache.k/v` [L, B, Hkv, S, D], and the layers' parameters are stacked
once outside the program (`split_for_scan`), so a call stacks nothing (as the trainer's stacked layout,
`Transformer(stacked=True)`, whose scan threads the cache as "xs" does). Two ways to thread the cache
through the scan (`CACHE_MODES`):
  "carry"  the stacked buffers are the scan's carry: layer l writes its T new tokens into [l] by one scatter
           (the same in-bounds, unique-index scatter as `kv_cache.write_rows`) and attends to the slice
           `k[l]` (`lax.dynamic_index_in_dim`);
  "xs"     the stacked buffers are the scan's xs and the updated ones its ys: each layer gets its slice, runs
           the unmodified `DecoderLayer` (which writes into the slice) and emits the slice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from tlt_jax.kernels import tree_attention as ta
from tlt_jax.kernels.small_m_linear import linear
from tlt_jax.models.kv_cache import StackedKVCache
from tlt_jax.models.llama import Attention, DecoderLayer, Transformer, apply_rope, causal_mask, rope_cos_sin

CACHE_MODES = ("carry", "xs")


@dataclasses.dataclass(frozen=True)
class ScanDefs:
    """The static halves: the shell's graphdef (a 0-layer Transformer: embedding, final norm, head) and one
    decoder layer's graphdef (every layer has the same)."""

    shell: Any
    layer: Any


@flax.struct.dataclass
class ScanParams:
    """The arrays: the shell's state and the layers' states stacked to a leading [L] axis."""

    shell: Any
    layers: Any


def _shell(model: Transformer) -> Transformer:
    """A 0-layer Transformer sharing `model`'s embedding, final norm and head (no weight is copied)."""
    shell = nnx.eval_shape(lambda: Transformer(model.cfg.replace(num_layers=0), nnx.Rngs(0)))
    shell.embed, shell.norm, shell.lm_head = model.embed, model.norm, model.lm_head
    return shell


def split_for_scan(model: Transformer) -> tuple[ScanDefs, ScanParams]:
    """The model as (static defs, arrays) with the layers' parameters stacked to [L, ...] (done once, as the
    engine would when loading weights). Works on an abstract model (`nnx.eval_shape`) too."""
    shell_def, shell_state = nnx.split(_shell(model))
    states = [nnx.state(layer) for layer in model.layers]
    abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(states))

    def stack(*layer_states: Any) -> Any:
        return jax.tree.map(lambda *xs: jnp.stack(xs), *layer_states)

    stacked = jax.eval_shape(stack, *states) if abstract else stack(*states)
    return ScanDefs(shell_def, nnx.graphdef(model.layers[0])), ScanParams(shell_state, stacked)


def _store_layer(buf: jax.Array, layer: jax.Array, start_b: jax.Array, new_bthd: jax.Array) -> jax.Array:
    """buf[layer, b, :, start[b]:start[b]+T] = new[b] (token-major [B, T, Hkv, D]) as one in-bounds,
    unique-index scatter into the stacked [L, B, Hkv, S, D] buffer (`kv_cache._store_at` plus the layer)."""
    new = jnp.swapaxes(new_bthd, 1, 2).astype(buf.dtype)  # [B, Hkv, T, D]
    b, h, t, _ = new.shape
    pos = start_b[:, None, None] + jnp.arange(t, dtype=jnp.int32)[None, None, :]
    rows, heads = jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None]
    return buf.at[layer, rows, heads, pos].set(new, mode="promise_in_bounds", unique_indices=True)


def _attention_stacked(
    attn: Attention, x_bth: jax.Array, rope: tuple[jax.Array, jax.Array], kv: tuple, ctx: tuple
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`Attention.__call__` (tree attention) against the stacked cache: the new keys/values are scattered
    into layer `ctx[0]`'s rows of the carried buffers, attention reads that layer's slice. `kv`: (k, v)
    stacked; `ctx`: (layer index, lengths [B], mask [B, T, T], attn_impl)."""
    layer, lengths_b, mask_btt, attn_impl = ctx
    cfg = attn.cfg
    g = cfg.num_heads // cfg.num_kv_heads
    b, t = x_bth.shape[:2]
    qkv = linear(x_bth, attn.qkv[...], cfg.linear_impl)
    if attn.qkv_bias is not None:
        qkv = qkv + attn.qkv_bias[...]
    qkv = qkv.reshape(b, t, cfg.num_kv_heads, g + 2, cfg.head_dim)
    q = apply_rope(qkv[:, :, :, :g], *rope).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k_all = _store_layer(kv[0], layer, lengths_b, apply_rope(qkv[:, :, :, g], *rope))
    v_all = _store_layer(kv[1], layer, lengths_b, qkv[:, :, :, g + 1])
    k_l = lax.dynamic_index_in_dim(k_all, layer, keepdims=False)
    v_l = lax.dynamic_index_in_dim(v_all, layer, keepdims=False)
    out = ta.tree_attention(q, k_l, v_l, lengths_b, mask_btt, impl=attn_impl)
    out = out.reshape(b, t, cfg.num_heads * cfg.head_dim)
    return linear(out, attn.o_proj[...], cfg.linear_impl), k_all, v_all


def _scan_layers(
    defs: ScanDefs,
    layers: Any,
    x: jax.Array,
    rope: tuple,
    cache: StackedKVCache,
    ctx: tuple[jax.Array, str, str, int | bool],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The layers as one scan; `ctx` = (mask, attn_impl, cache_mode, unroll). "carry": the carry is (x,
    stacked k, stacked v), the xs (layer states, l); "xs": the xs are (layer states, k[l], v[l]) and the
    updated slices the ys."""
    mask, impl, mode, unroll = ctx

    def body_carry(carry: tuple, xs: tuple) -> tuple[tuple, None]:
        x, k_all, v_all = carry
        state, layer_idx = xs
        layer: DecoderLayer = nnx.merge(defs.layer, state)
        h = layer.input_norm(x)
        a, k_all, v_all = _attention_stacked(
            layer.attn, h, rope, (k_all, v_all), (layer_idx, cache.lengths, mask, impl)
        )
        x = x + a
        x = x + layer.mlp(layer.post_attn_norm(x))
        return (x, k_all, v_all), None

    def body_xs(x: jax.Array, xs: tuple) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        state, kc, vc = xs
        x, kc, vc = nnx.merge(defs.layer, state)(x, *rope, kc, vc, cache.lengths, mask, impl)
        return x, (kc, vc)

    if mode == "carry":
        idx = jnp.arange(cache.k.shape[0], dtype=jnp.int32)
        (x, k_all, v_all), _ = lax.scan(body_carry, (x, cache.k, cache.v), (layers, idx), unroll=unroll)
    else:
        x, (k_all, v_all) = lax.scan(body_xs, x, (layers, cache.k, cache.v), unroll=unroll)
    return x, k_all, v_all


def scan_forward(
    defs: ScanDefs,
    params: ScanParams,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    cache: StackedKVCache,
    mask_btt: jax.Array | None = None,
    *,
    cache_mode: str = "carry",
    attn_impl: str = "reference",
    unroll: int | bool = 1,
) -> tuple[jax.Array, jax.Array, StackedKVCache]:
    """`Transformer.__call__` with a cache (T new tokens written at [lengths, lengths + T), lengths not
    advanced; mask default causal) with the layers under `lax.scan` (`unroll` as `lax.scan`'s: True unrolls
    every layer, the slices then have constant offsets). Returns (logits [B, T, V] float32,
    final normed hidden [B, T, H], the updated cache)."""
    if cache_mode not in CACHE_MODES:
        raise ValueError(f"cache_mode={cache_mode!r}: use one of {CACHE_MODES}")
    shell: Transformer = nnx.merge(defs.shell, params.shell)
    b, t = tokens_bt.shape
    mask_btt = causal_mask(b, t) if mask_btt is None else mask_btt
    rope = rope_cos_sin(positions_bt, shell.cfg.head_dim, shell.cfg.rope_theta)
    x = shell.embed_tokens(tokens_bt)
    ctx = (mask_btt, attn_impl, cache_mode, unroll)
    x, k_all, v_all = _scan_layers(defs, params.layers, x, rope, cache, ctx)
    hidden = shell.norm(x)
    return shell.logits(hidden), hidden, cache.replace(k=k_all, v=v_all)
