"""Tree-verification attention: new tokens attend to a cached prefix plus each other under a tree mask.

One attention contract serves prefill (causal mask), plain decode (T=1) and speculative verification (tree
mask). The T new tokens' keys/values have ALREADY been written into the cache at positions
`[lengths[b], lengths[b] + T)` of row b. Query t of row b may attend to key position j when

    j < lengths[b]                                   (the committed prefix), or
    0 <= j - lengths[b] < T and tree_mask[b, t, j - lengths[b]]   (the tree / new tokens).

Shapes: q [B, T, Hq, D]; k_cache, v_cache [B, Hkv, S, D] (S = the live cache-length bucket, not the whole
preallocated cache); lengths [B] int32; tree_mask [B, T, T] bool. Hq is a multiple of Hkv (GQA).
Output [B, T, Hq, D] in q's dtype; softmax in float32.

`tree_attention_reference` is plain jnp (the test oracle, and what multi-device CPU runs use).
`tree_attention_pallas` is a flash-attention-style Pallas kernel for GPUs (Triton lowering; `interpret=True`
runs it anywhere). `tree_attention_cpu` is a C++ XLA FFI kernel for the CPU (`cpu/tree_attention.cc`: reads
each row's K/V once per KV group up to its live length; XLA's own lowering of the reference is dominated by
tiny batched dots and a copy of the V cache per layer). `tree_attention` is the jitted entry point that picks
one.

Kernel layout. One program handles one (batch row, KV head, block of query rows), where a query row is one
(token t, query head g of this KV group) pair: all G query heads of a group share every K/V tile, so the
cache is read once per KV group rather than once per query head (the point of GQA verification). Per program
it runs an online softmax in two phases:
  1. the committed prefix, key blocks of `block_k` over [0, lengths[b]) only (blocks past the live length are
     never read), with a `j < lengths[b]` mask;
  2. the T tree tokens, whose K/V the wrapper slices out of the cache into a small [B, T_pad, Hkv, D] array
     so that the tree mask (expanded to query rows, [B, rows, T_pad]) applies with no in-kernel gather.
With `kv_splits > 1` the prefix blocks are split over an extra grid axis (more programs for small batches,
flash-decoding style) and the partial results are merged in the wrapper; `kv_splits=0` picks the split count
per call from the grid size (a batch-1 call fills the GPU, a batch-32 one takes no split).
The tile and launch parameters (`BlockSizes`, and the tuned defaults) are in `tree_attention_blocks`; the
contract in jnp (reference, input checks, the reference-gradient wrapper) in `tree_attention_reference`; the
TPU (Mosaic) kernel in `tree_attention_tpu`, which `tree_attention(impl="auto")` picks on a TPU backend.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tlt_jax.kernels import cpu_ffi, tree_attention_tpu
from tlt_jax.kernels.tree_attention_blocks import BlockSizes, default_block_sizes
from tlt_jax.kernels.tree_attention_reference import (
    check_inputs,
    tree_attention_reference,
    with_reference_grad,
)

IMPLS = ("auto", "reference", "pallas", "pallas_tpu", "cpu_ffi")
_GPU_BACKENDS = ("gpu", "cuda", "rocm")
_NEG = -1e30  # finite "minus infinity" for masked logits: keeps exp2(m_prev - m_new) NaN-free
_LOG2E = math.log2(math.e)
_Carry = tuple[jax.Array, jax.Array, jax.Array]  # (acc [M, D], running max [M], running sum [M])


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _tree_attention_kernel(
    lengths_ref: Any,  # [] int32: committed prefix length of this batch row
    q_ref: Any,  # [block_m, D]: query rows (token-major, head-minor) of one KV group
    k_ref: Any,  # [S, D]: this row's key cache for one KV head
    v_ref: Any,  # [S, D]
    kt_ref: Any,  # [T_pad, D]: the tree tokens' keys (zero-padded past T)
    vt_ref: Any,  # [T_pad, D]
    tm_ref: Any,  # [block_m, T_pad] int8: tree visibility per query row
    *out_refs: Any,  # o [block_m, D] (kv_splits == 1), or o, m, l (unnormalised partials)
    sm_scale: float,
    block_k: int,
    block_t: int,
    kv_splits: int,
    precision: lax.Precision | None,
) -> None:
    """Online-softmax attention of one block of query rows over the live prefix, then the tree tokens."""
    block_m = q_ref.shape[0]
    length = lengths_ref[()]
    split = pl.program_id(3)
    q = q_ref[...]
    qk_scale = sm_scale * _LOG2E  # work in base 2: exp2 is the cheap instruction

    def step(k: jax.Array, v: jax.Array, vis: jax.Array, carry: _Carry) -> _Carry:
        acc, m_prev, l_prev = carry
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * qk_scale  # [block_m, keys] f32
        s = jnp.where(vis, s, _NEG)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        corr = jnp.exp2(m_prev - m_new)
        p = jnp.where(vis, jnp.exp2(s - m_new[:, None]), 0.0)  # masked keys add exactly 0
        l_new = corr * l_prev + jnp.sum(p, axis=1)
        acc = corr[:, None] * acc + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_new, l_new

    def prefix_body(kb: jax.Array, carry: _Carry) -> _Carry:
        start = pl.multiple_of(kb * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        vis = (start + jnp.arange(block_k, dtype=jnp.int32) < length)[None, :]
        return step(k, v, vis, carry)

    def tree_body(c: jax.Array, carry: _Carry) -> _Carry:
        start = pl.multiple_of(c * block_t, block_t)
        k = kt_ref[pl.ds(start, block_t), :]
        v = vt_ref[pl.ds(start, block_t), :]
        vis = tm_ref[:, pl.ds(start, block_t)] != 0
        return step(k, v, vis, carry)

    carry = (
        jnp.zeros((block_m, q_ref.shape[1]), jnp.float32),
        jnp.full((block_m,), _NEG, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
    )
    n_prefix = lax.div(length + block_k - 1, block_k)  # key blocks holding live prefix keys
    per_split = lax.div(n_prefix + kv_splits - 1, kv_splits)
    lo = split * per_split
    hi = jnp.minimum(n_prefix, lo + per_split)
    carry = lax.fori_loop(lo, hi, prefix_body, carry)
    # Loop bounds of one explicit type (scf.for requires it): Triton's lowering types a select of two Python
    # ints after its predicate (i1), so `where(last, n, 0)` made an i1 upper bound beside an i32 lower one.
    t_lo, t_hi = jnp.int32(0), jnp.int32(kt_ref.shape[0] // block_t)
    if kv_splits > 1:  # only the last split (the one with the fewest prefix blocks) takes the tree tokens
        t_hi = jnp.where(split == kv_splits - 1, t_hi, t_lo)
    acc, m, l_sum = lax.fori_loop(t_lo, t_hi, tree_body, carry)

    if kv_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = (acc / jnp.where(l_sum > 0, l_sum, 1.0)[:, None]).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l_sum


def _pallas_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    tree_mask: jax.Array,
    block_sizes: BlockSizes,
    interpret: bool,
) -> jax.Array:
    """Layout plumbing around the kernel: group query rows, slice the tree K/V, pad to Triton shapes, call the
    kernel, merge its KV splits and ungroup the rows."""
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    tiles = _tiles(t, g, d, s, block_sizes)
    lengths = lengths.astype(jnp.int32)
    operands = _kernel_operands(q, k, v, lengths, tree_mask, tiles)
    splits = block_sizes.splits_for(b * hkv * (tiles.rows_pad // tiles.block_m), tiles.s_pad // tiles.block_k)
    out = _call_kernel(operands, tiles, block_sizes, splits, d, q.dtype, interpret)
    if splits > 1:
        out = _merge_splits(*out, q.dtype)
    out = out[:, :, : tiles.rows, :d].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, hq, d)


class _Tiles(NamedTuple):
    """One call's static tile sizes and padded extents (Python ints)."""

    rows: int  # query rows of one KV group: row r = token (r // G), head (r % G)
    block_m: int  # query rows per program
    rows_pad: int
    t_pad: int  # tree tokens, padded
    block_t: int  # tree tokens per inner step
    d_pad: int  # head dim, padded
    block_k: int  # prefix keys per inner step
    s_pad: int  # cache length, padded


def _tiles(t: int, g: int, d: int, s: int, block_sizes: BlockSizes) -> _Tiles:
    """Triton-friendly shapes: power-of-two tiles >= 16 (the smallest `tl.dot`) clipped to the problem. The
    head dim is padded only when not a power of two >= 16 and the cache only when S is not a multiple of
    block_k (either is a copy of the cache, so keep head dims 32/64/128)."""
    rows = t * g
    block_m = min(block_sizes.block_q, max(16, pl.next_power_of_2(rows)))
    t_pad = max(16, pl.next_power_of_2(t))
    block_k = min(block_sizes.block_k, max(16, pl.next_power_of_2(s)))
    return _Tiles(
        rows=rows,
        block_m=block_m,
        rows_pad=_round_up(rows, block_m),
        t_pad=t_pad,
        block_t=min(t_pad, block_sizes.block_k),
        d_pad=max(16, pl.next_power_of_2(d)),
        block_k=block_k,
        s_pad=_round_up(s, block_k),
    )


def _kernel_operands(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tree_mask: jax.Array, tiles: _Tiles
) -> tuple[jax.Array, ...]:
    """The kernel's inputs, zero-padded to `tiles`: lengths [B]; the query rows of each KV group [B, Hkv,
    rows, D] in the cache dtype (`tl.dot` wants equal operand types); the K and V cache [B, Hkv, S, D]; the
    tree tokens' K and V sliced out of it [B, Hkv, T, D] (tiny next to the cache); the tree mask per query
    row [B, rows, T] int8."""
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv

    def take_new(cache_hsd: jax.Array, start: jax.Array) -> jax.Array:
        return lax.dynamic_slice_in_dim(cache_hsd, start, t, axis=1)

    k_new = jax.vmap(take_new)(k, lengths)
    v_new = jax.vmap(take_new)(v, lengths)
    q_rows = (
        q.astype(k.dtype).reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, tiles.rows, d)
    )
    tm_rows = jnp.repeat(tree_mask, g, axis=1).astype(jnp.int8)  # [B, rows, T]
    pad_rows, pad_t, pad_d = tiles.rows_pad - tiles.rows, tiles.t_pad - t, tiles.d_pad - d
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, pad_rows), (0, pad_d)))
    tm_rows = jnp.pad(tm_rows, ((0, 0), (0, pad_rows), (0, pad_t)))
    k_new, v_new = (jnp.pad(x, ((0, 0), (0, 0), (0, pad_t), (0, pad_d))) for x in (k_new, v_new))
    if tiles.s_pad != s or tiles.d_pad != d:
        k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, tiles.s_pad - s), (0, pad_d))) for x in (k, v))
    return lengths, q_rows, k, v, k_new, v_new, tm_rows


def _call_kernel(
    operands: tuple[jax.Array, ...],
    tiles: _Tiles,
    block_sizes: BlockSizes,
    splits: int,
    head_dim: int,
    out_dtype: jnp.dtype,
    interpret: bool,
) -> Any:
    """The pallas_call over the grid (B, Hkv, query-row blocks, KV splits). Returns the output [B, Hkv,
    rows_pad, d_pad] in `out_dtype`, or with `splits` > 1 the float32 partials: the unnormalised output
    [B, Hkv, splits, rows_pad, d_pad], its running max and sum [B, Hkv, splits, rows_pad]."""
    b, hkv = operands[1].shape[:2]
    cdt = operands[2].dtype
    block_m, d_pad, s_pad, t_pad = tiles.block_m, tiles.d_pad, tiles.s_pad, tiles.t_pad
    kernel = functools.partial(
        _tree_attention_kernel,
        sm_scale=1.0 / math.sqrt(head_dim),
        block_k=tiles.block_k,
        block_t=tiles.block_t,
        kv_splits=splits,
        precision=lax.Precision.HIGHEST if cdt == jnp.float32 else None,  # fp32: IEEE dots, not TF32
    )
    in_specs = [
        pl.BlockSpec((None,), lambda bi, h, i, sp: (bi,)),
        pl.BlockSpec((None, None, block_m, d_pad), lambda bi, h, i, sp: (bi, h, i, 0)),
        pl.BlockSpec((None, None, s_pad, d_pad), lambda bi, h, i, sp: (bi, h, 0, 0)),
        pl.BlockSpec((None, None, s_pad, d_pad), lambda bi, h, i, sp: (bi, h, 0, 0)),
        pl.BlockSpec((None, None, t_pad, d_pad), lambda bi, h, i, sp: (bi, h, 0, 0)),
        pl.BlockSpec((None, None, t_pad, d_pad), lambda bi, h, i, sp: (bi, h, 0, 0)),
        pl.BlockSpec((None, block_m, t_pad), lambda bi, h, i, sp: (bi, i, 0)),
    ]
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((b, hkv, tiles.rows_pad, d_pad), out_dtype)
        out_specs = pl.BlockSpec((None, None, block_m, d_pad), lambda bi, h, i, sp: (bi, h, i, 0))
    else:
        out_shape = (
            jax.ShapeDtypeStruct((b, hkv, splits, tiles.rows_pad, d_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, tiles.rows_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, tiles.rows_pad), jnp.float32),
        )
        out_specs = (
            pl.BlockSpec((None, None, None, block_m, d_pad), lambda bi, h, i, sp: (bi, h, sp, i, 0)),
            pl.BlockSpec((None, None, None, block_m), lambda bi, h, i, sp: (bi, h, sp, i)),
            pl.BlockSpec((None, None, None, block_m), lambda bi, h, i, sp: (bi, h, sp, i)),
        )
    num_warps = block_sizes.num_warps or (4 if d_pad <= 64 else 8)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(b, hkv, tiles.rows_pad // block_m, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=block_sizes.num_stages),
        interpret=interpret,
        name="tree_attention",
    )(*operands)


def _merge_splits(o_part: jax.Array, m_part: jax.Array, l_part: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """Merge the per-split partial softmaxes (base-2 logits) into the output [B, Hkv, rows_pad, d_pad]."""
    m_all = jnp.max(m_part, axis=2, keepdims=True)
    w = jnp.exp2(m_part - m_all)  # [B, Hkv, splits, rows_pad]; empty splits weigh 0
    l_all = jnp.sum(w * l_part, axis=2)
    o_sum = jnp.sum(w[..., None] * o_part, axis=2)
    return (o_sum / jnp.where(l_all > 0, l_all, 1.0)[..., None]).astype(out_dtype)


_pallas_with_grad = with_reference_grad(_pallas_forward)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def tree_attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    tree_mask: jax.Array,
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Pallas (Triton) tree attention; same contract and result as `tree_attention_reference`.

    `block_sizes=None`: `default_block_sizes(cache dtype)` (tuned sizes from $TLT_TREE_ATTENTION_BLOCK_SIZES,
    else `BlockSizes()`). Differentiable: the backward pass recomputes through the reference, so a trainer
    forward may use it too.
    Rows whose query sees no key at all (not a valid tree) return zeros where the reference averages V.
    """
    check_inputs(q, k, v, lengths, tree_mask)
    chex.assert_type([k, v], k.dtype)
    block_sizes = block_sizes or default_block_sizes(jnp.dtype(k.dtype).name)
    return _pallas_with_grad(q, k, v, lengths, tree_mask, block_sizes, interpret)


def _cpu_ffi_call(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tree_mask: jax.Array
) -> jax.Array:
    cpu_ffi.require("attn_impl='cpu_ffi'")
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call("tlt_tree_attention", out, vmap_method="sequential")(
        q, k, v, lengths.astype(jnp.int32), tree_mask.astype(bool)
    )


@jax.custom_vjp
def tree_attention_cpu(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tree_mask: jax.Array
) -> jax.Array:
    """Tree attention (module contract) by the CPU FFI kernel; float32 only. Differentiable: the backward
    pass recomputes the reference and differentiates it (training forwards are rare on this path)."""
    return _cpu_ffi_call(q, k, v, lengths, tree_mask)


def _cpu_fwd(q, k, v, lengths, tree_mask):  # noqa: ANN001, ANN202
    return _cpu_ffi_call(q, k, v, lengths, tree_mask), (q, k, v, lengths, tree_mask)


def _cpu_bwd(res, g):  # noqa: ANN001, ANN202
    q, k, v, lengths, tree_mask = res
    _, vjp = jax.vjp(lambda q, k, v: tree_attention_reference(q, k, v, lengths, tree_mask), q, k, v)
    return (*vjp(g), None, None)


tree_attention_cpu.defvjp(_cpu_fwd, _cpu_bwd)


def _on_gpu() -> bool:
    return jax.default_backend() in _GPU_BACKENDS


def _on_tpu() -> bool:
    return jax.default_backend() == "tpu"


@functools.partial(jax.jit, static_argnames=("impl", "interpret", "block_sizes"))
def tree_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    tree_mask: jax.Array,
    *,
    impl: str = "auto",
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
) -> jax.Array:
    """Tree attention (module contract) with a chosen implementation.

    impl: "reference" (jnp), "pallas" (the kernel; `interpret` defaults to True off-GPU; on a TPU backend the
    Mosaic kernel), "pallas_tpu" (the Mosaic kernel, `tree_attention_tpu`; `interpret` defaults to True
    off-TPU), "cpu_ffi" (the CPU kernel; float32 inputs, else the reference), or "auto": Pallas on GPU and
    TPU, the CPU kernel on a single CPU device (`cpu_ffi.auto_enabled`), the reference otherwise.
    """
    if impl not in IMPLS:
        raise ValueError(f"tree_attention: impl must be one of {IMPLS}, got {impl!r}")
    check_inputs(q, k, v, lengths, tree_mask)
    f32 = all(x.dtype == jnp.float32 for x in (q, k, v))
    if impl in ("auto", "pallas") and _on_tpu():
        impl = "pallas_tpu"  # the Triton kernel cannot compile for a TPU
    if impl == "pallas_tpu":
        interpret = not _on_tpu() if interpret is None else interpret
        return tree_attention_tpu.tree_attention_tpu(
            q, k, v, lengths, tree_mask, block_sizes=block_sizes, interpret=interpret
        )
    if impl == "auto" and not _on_gpu():
        impl = "cpu_ffi" if f32 and cpu_ffi.auto_enabled() else "reference"
    if impl == "cpu_ffi":
        if f32:
            return tree_attention_cpu(q, k, v, lengths, tree_mask)
        impl = "reference"
    if impl == "reference":
        return tree_attention_reference(q, k, v, lengths, tree_mask)
    if interpret is None:
        interpret = not _on_gpu()
    return tree_attention_pallas(q, k, v, lengths, tree_mask, block_sizes=block_sizes, interpret=interpret)
