"""Tree-verification attention for TPUs: a Pallas Mosaic kernel with the GPU kernel's contract.

`tree_attention_tpu` is a drop-in for `tree_attention.tree_attention_pallas` (same arguments, shapes, masking
and outputs; see `tree_attention`'s module docstring for the contract) whose kernel lowers through Mosaic to a
TPU custom call instead of through Triton. Why a second kernel: the Triton one uses GPU-only primitives and
tiles (power-of-two, 16-row `tl.dot`), while Mosaic wants VMEM blocks whose last two dims are multiples of
(8, 128) or full extents, grid-pipelined DMA of K/V blocks, and lane-wide softmax state.

Design. The grid is (B, Hkv, query-row blocks, prefix KV blocks); the last axis is sequential ("arbitrary"),
the others parallel (megacore). A query row is one (tree token t, query head g of the KV group) pair, so all
G heads of a group share each K/V tile (the cache is read once per KV group). Per grid step VMEM holds: the
query rows [block_m, D]; one prefix K and one V block [block_k, D] (double-buffered by the Pallas pipeline);
the tree tokens' K/V [T_pad, D] and their visibility per query row [block_m, T_pad] (int32), both sliced
out of the cache in the wrapper; and, as scratch across the KV axis, the float32 accumulator [block_m, D]
and the running max and sum [block_m, 128] (lane-replicated: Mosaic slices lanes at 128-lane granularity).
Key blocks (block_k, T_pad) are multiples of 128: the scores' lane axis stays aligned.
`lengths` is scalar-prefetched into SMEM: the K/V index maps clamp the block index to the row's last live
block (a repeated index issues no DMA, so blocks past `lengths[b]` are never read) and `pl.when` skips their
compute. The last KV step adds the T tree tokens under the tree mask and writes the normalised output.
The backward pass recomputes the same math in jnp (like the GPU kernel: forward-only kernel, exact grads).
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
from jax.experimental.pallas import tpu as pltpu

from tlt_jax.kernels.tree_attention_blocks import BlockSizes
from tlt_jax.kernels.tree_attention_reference import check_inputs, with_reference_grad

# TPU defaults (untuned): 128 query rows fill the MXU's rows; 512-key blocks amortise the ~0.35 us grid step
# over a 256 KiB K+V DMA (D=128, bf16).
TPU_BLOCK_SIZES = BlockSizes(block_q=128, block_k=512)
_LANES = 128
_NEG = -1e30  # finite "minus infinity": keeps exp(m_prev - m_next) NaN-free on fully masked rows
_NT_DIMS = (((1,), (1,)), ((), ()))  # q @ k.T without a transpose
_NN_DIMS = (((1,), (0,)), ((), ()))


class _Tiles(NamedTuple):
    """One call's static block sizes and padded extents (Python ints)."""

    rows: int  # query rows of one KV group: row r = token (r // G), head (r % G)
    block_m: int  # query rows per program
    rows_pad: int
    t_pad: int  # tree tokens, padded to 128 (the scores' lane axis)
    block_k: int  # prefix keys per grid step
    s_pad: int  # cache length, padded to a multiple of 128 (a copy of the cache only when S is not one)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def tpu_tiles(t: int, g: int, s: int, itemsize: int, block_sizes: BlockSizes) -> _Tiles:
    """Mosaic-legal, lane-aligned blocks. Query rows: multiples of the sublane tile (8 rows of 32 bits, so
    16 for bf16). Keys (the scores' lane axis, prefix and tree alike): multiples of 128, as jax's own TPU
    attention kernels keep them, so `block_sizes.block_k` under 128 is raised to 128. The head dim stays
    whole (a full-extent minor dim). A cache no longer than `block_k` is one block, a longer one is cut into
    the largest multiple of 128 <= `block_k` that divides it; S is padded (a copy of the cache) only up to
    the next multiple of 128 (power-of-two cache buckets >= 128 never are)."""
    sub = 8 * max(1, 4 // itemsize)
    rows = t * g
    block_m = min(block_sizes.block_q, _round_up(rows, sub))
    s_pad = _round_up(s, _LANES)
    want = max(block_sizes.block_k, _LANES)
    block_k = s_pad if s_pad <= want else next(c for c in range(want, 0, -_LANES) if s_pad % c == 0)
    return _Tiles(rows, block_m, _round_up(rows, block_m), _round_up(t, _LANES), block_k, s_pad)


def _lanes(x: jax.Array, d: int) -> jax.Array:
    """A lane-replicated [M, 128] statistic as [M, d] (slices at lane 0, concatenation of whole vregs)."""
    if d > _LANES:
        x = jnp.concatenate([x] * -(-d // _LANES), axis=1)
    return x if x.shape[1] == d else x[:, :d]


def _online_softmax_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    vis: jax.Array,
    scratch: tuple[Any, Any, Any],
    sm_scale: float,
    precision: lax.Precision | None,
) -> None:
    """Fold one block of keys into the running (acc, max, sum): block-local softmax, then rescale both sides
    to the new running max (the max and sum stay [M, 128], never sliced to a column)."""
    acc_ref, m_ref, l_ref = scratch
    s = lax.dot_general(q, k, _NT_DIMS, precision=precision, preferred_element_type=jnp.float32)
    s = jnp.where(vis, s * sm_scale, _NEG)
    m_cur = jnp.max(s, axis=1, keepdims=True)  # [M, 1]
    p = jnp.where(vis, jnp.exp(s - m_cur), 0.0)  # masked keys add exactly 0, even on fully masked rows
    m_prev, l_prev = m_ref[...], l_ref[...]
    m_cur = jnp.broadcast_to(m_cur, m_prev.shape)
    m_next = jnp.maximum(m_prev, m_cur)
    alpha, beta = jnp.exp(m_prev - m_next), jnp.exp(m_cur - m_next)
    l_ref[...] = alpha * l_prev + beta * jnp.broadcast_to(jnp.sum(p, axis=1, keepdims=True), l_prev.shape)
    m_ref[...] = m_next
    pv = lax.dot_general(
        p.astype(v.dtype), v, _NN_DIMS, precision=precision, preferred_element_type=jnp.float32
    )
    d = acc_ref.shape[1]
    acc_ref[...] = _lanes(alpha, d) * acc_ref[...] + _lanes(beta, d) * pv


def _tree_attention_tpu_kernel(
    lengths_ref: Any,  # SMEM [B] int32 (scalar prefetch)
    q_ref: Any,  # [block_m, D] query rows of one KV group
    k_ref: Any,  # [block_k, D] one prefix key block
    v_ref: Any,  # [block_k, D]
    kt_ref: Any,  # [T_pad, D] the tree tokens' keys (zero past T)
    vt_ref: Any,  # [T_pad, D]
    tm_ref: Any,  # [block_m, T_pad] int32 tree visibility per query row
    o_ref: Any,  # [block_m, D]
    acc_ref: Any,  # VMEM scratch [block_m, D] f32
    m_ref: Any,  # VMEM scratch [block_m, 128] f32 running max (lane-replicated)
    l_ref: Any,  # VMEM scratch [block_m, 128] f32 running sum
    *,
    sm_scale: float,
    precision: lax.Precision | None,
) -> None:
    """One (row, KV head, query block) over KV step j: init at j == 0, the prefix block if live, and at the
    last step the tree tokens and the normalised output."""
    kv_step = pl.program_id(3)
    block_k = k_ref.shape[0]
    length = lengths_ref[pl.program_id(0)]
    scratch = (acc_ref, m_ref, l_ref)
    step = functools.partial(_online_softmax_step, scratch=scratch, sm_scale=sm_scale, precision=precision)

    @pl.when(kv_step == 0)
    def _init() -> None:
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

    @pl.when(kv_step * block_k < length)
    def _prefix() -> None:
        shape = (q_ref.shape[0], block_k)
        cols = kv_step * block_k + lax.broadcasted_iota(jnp.int32, shape, 1)
        step(q_ref[...], k_ref[...], v_ref[...], cols < length)

    @pl.when(kv_step == pl.num_programs(3) - 1)
    def _tree_and_output() -> None:
        step(q_ref[...], kt_ref[...], vt_ref[...], tm_ref[...] != 0)
        l_sum = _lanes(l_ref[...], acc_ref.shape[1])
        o_ref[...] = (acc_ref[...] / jnp.where(l_sum > 0, l_sum, 1.0)).astype(o_ref.dtype)


def live_block(kv_step: jax.Array, length: jax.Array, block_k: int) -> jax.Array:
    """The K/V block a grid step fetches: the step's own block while it holds live prefix keys, else the
    row's last live block again (block 0 for an empty prefix), which the pipeline does not re-fetch."""
    last = jnp.maximum(lax.div(length + block_k - 1, block_k) - 1, 0)
    return jnp.minimum(kv_step, last)


def _kernel_operands(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tree_mask: jax.Array, tiles: _Tiles
) -> tuple[jax.Array, ...]:
    """The kernel's inputs, zero-padded to `tiles`: lengths [B] int32; the query rows [B, Hkv, rows_pad, D]
    in the cache dtype; the K/V cache [B, Hkv, s_pad, D]; the tree tokens' K/V [B, Hkv, T_pad, D]; the tree
    mask per query row [B, rows_pad, T_pad] int32."""
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv

    def take_new(cache_hsd: jax.Array, start: jax.Array) -> jax.Array:
        return lax.dynamic_slice_in_dim(cache_hsd, start, t, axis=1)

    pad_t = ((0, 0), (0, 0), (0, tiles.t_pad - t), (0, 0))
    k_new, v_new = (jnp.pad(jax.vmap(take_new)(x, lengths), pad_t) for x in (k, v))
    q_rows = (
        q.astype(k.dtype).reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, tiles.rows, d)
    )
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, tiles.rows_pad - tiles.rows), (0, 0)))
    tm_rows = jnp.repeat(tree_mask, g, axis=1).astype(jnp.int32)
    tm_rows = jnp.pad(tm_rows, ((0, 0), (0, tiles.rows_pad - tiles.rows), (0, tiles.t_pad - t)))
    if tiles.s_pad != s:
        k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, tiles.s_pad - s), (0, 0))) for x in (k, v))
    return lengths, q_rows, k, v, k_new, v_new, tm_rows


def _call_kernel(
    operands: tuple[jax.Array, ...], tiles: _Tiles, out_dtype: jnp.dtype, interpret: bool | Any
) -> jax.Array:
    """The pallas_call over the grid (B, Hkv, query blocks, KV blocks); output [B, Hkv, rows_pad, D]."""
    b, hkv, _, d = operands[1].shape
    block_m, block_k, t_pad = tiles.block_m, tiles.block_k, tiles.t_pad
    cache_dtype = operands[2].dtype

    def kv_map(bi: Any, h: Any, i: Any, j: Any, lengths_ref: Any) -> tuple[Any, ...]:
        return bi, h, live_block(j, lengths_ref[bi], block_k), 0

    rows_spec = pl.BlockSpec((None, None, block_m, d), lambda bi, h, i, j, _: (bi, h, i, 0))
    tree_spec = pl.BlockSpec((None, None, t_pad, d), lambda bi, h, i, j, _: (bi, h, 0, 0))
    kv_spec = pl.BlockSpec((None, None, block_k, d), kv_map)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, hkv, tiles.rows_pad // block_m, tiles.s_pad // block_k),
        in_specs=[
            rows_spec,
            kv_spec,
            kv_spec,
            tree_spec,
            tree_spec,
            pl.BlockSpec((None, block_m, t_pad), lambda bi, h, i, j, _: (bi, i, 0)),
        ],
        out_specs=rows_spec,
        scratch_shapes=[
            pltpu.VMEM((block_m, d), jnp.float32),
            pltpu.VMEM((block_m, _LANES), jnp.float32),
            pltpu.VMEM((block_m, _LANES), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _tree_attention_tpu_kernel,
        sm_scale=1.0 / math.sqrt(d),
        precision=lax.Precision.HIGHEST if cache_dtype == jnp.float32 else None,  # f32: full-precision MXU
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, hkv, tiles.rows_pad, d), out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="tree_attention_tpu",
    )(*operands)


def _forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    tree_mask: jax.Array,
    block_sizes: BlockSizes,
    interpret: bool | Any,
) -> jax.Array:
    """Layout plumbing: group query rows per KV head, pad, call the kernel, ungroup the rows."""
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    tiles = tpu_tiles(t, g, s, jnp.dtype(k.dtype).itemsize, block_sizes)
    operands = _kernel_operands(q, k, v, lengths.astype(jnp.int32), tree_mask, tiles)
    out = _call_kernel(operands, tiles, q.dtype, interpret)
    out = out[:, :, : tiles.rows].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, hq, d)


_with_grad = with_reference_grad(_forward)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def tree_attention_tpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    tree_mask: jax.Array,
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Pallas (Mosaic TPU) tree attention; same contract and result as `tree_attention_reference`.

    block_sizes: `block_q` (query rows per program) and `block_k` (prefix keys per grid step) are used;
      the GPU-only fields (kv_splits, target_programs, num_warps, num_stages) are ignored. None:
      `TPU_BLOCK_SIZES`.
    interpret: False compiles for the TPU; True runs Pallas's generic interpreter (any backend); a
      `pltpu.InterpretParams` runs the TPU interpreter (simulated VMEM/DMA, NaN-filled scratch).
    Differentiable (the backward recomputes in jnp). Like the GPU kernel, rows whose query sees no key at
    all return zeros, and cache slots past lengths + T must hold finite values.
    """
    check_inputs(q, k, v, lengths, tree_mask)
    chex.assert_type([k, v], k.dtype)
    return _with_grad(q, k, v, lengths, tree_mask, block_sizes or TPU_BLOCK_SIZES, interpret)
