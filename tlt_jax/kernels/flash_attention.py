"""Causal attention for training in O(T x block) memory (forward and backward): never [T, S] scores.

Contract (every implementation). q [B, T, Hq, D]; k, v [B, Hkv, S, D] (the KV cache's layout, Hq = G * Hkv,
GQA); q_offset [B] int32; kv_length [B] int32; optional q_segment_ids [B, T] and kv_segment_ids [B, S] int32
(packed sequences). Query i of row b sits at key slot q_offset[b] + i and sees key j iff

    j <= q_offset[b] + i          (causal, in slot order)
    j < kv_length[b]              (padding / the live part of a cache)
    q_segment_ids[b, i] == kv_segment_ids[b, j]     (when segment ids are given)

with 0 <= q_offset[b] and q_offset[b] + T <= S. A trainer's full sequence is q_offset = 0, S = T; responses
on top of a cached prompt are q_offset = the prompt's length, kv_length = prompt + response length (keys in
slots [q_offset, q_offset + T) are the queries' own). Output [B, T, Hq, D] in q's dtype; softmax in float32,
scale 1/sqrt(D). Queries that see no key return zeros (blockwise, reference; unspecified for fused kernels).

Implementations (`flash_attention(impl=...)`):
- "blockwise": jnp, FlashAttention-2 style. Forward: a scan over query blocks, each an online softmax over
  the key blocks it can see (a loop whose trip count skips blocks past the causal edge and kv_length). Its own
  VJP saves only the output and the log-sum-exp and recomputes the probabilities block by block (a scan over
  key blocks accumulating dK/dV, dQ accumulated in one [T, D]-sized buffer). Any backend; the CPU path.
- "reference": the plain masked softmax (materialises [B, Hq, T, S]): the oracle for tests.
- "cudnn": cuDNN's fused flash attention through `jax.nn.dot_product_attention` (NVIDIA GPUs; bf16/fp16,
  no segment ids). cuDNN's causal mask is top-left aligned, so with q_offset != 0 (T < S) the queries are
  scattered to their slots ([B, S, Hq, D]) and gathered back: S/T times the work of the query block.
- "pallas_tpu": jax's Pallas TPU flash attention (`jax.experimental.pallas.ops.tpu.flash_attention`,
  causal + segment ids, forward and backward kernels): padding becomes a segment, queries go to slot space
  as for cuDNN, K/V heads are repeated to Hq (the kernel is MHA), lengths are padded to 128. Off TPU it runs
  only under the caller's `pltpu.force_tpu_interpret_mode()` (the tests do).
- "auto": pallas_tpu on TPU; cudnn on GPU for bf16/fp16 without segment ids and a head dim cuDNN takes
  (blockwise, with a warning, where cuDNN's own checks refuse the call while tracing); blockwise otherwise.

Sequence (context) parallelism: `impl=SequenceParallel(mesh, axis, impl)` computes the same contract with the
query tokens split over a mesh axis (`flash_attention_seq_parallel`): each device holds T / n queries and
S / n key slots, all-gathers K and V (cheap with GQA: Hkv heads, not Hq) and runs `impl` on its query shard at
its global offset; the transpose of the gather reduce-scatters dK and dV back to their slots.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
from absl import logging
from jax import lax
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

FLASH_IMPLS = ("auto", "blockwise", "reference", "cudnn", "pallas_tpu")
_NEG = -1e30  # finite "minus infinity": masked logits never make exp() of inf - inf
_GPU_BACKENDS = ("gpu", "cuda", "rocm")
_TPU_BLOCK = 128  # the Pallas TPU kernel's minimum block (lengths are padded to a multiple of it)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_inputs(
    q: jax.Array, k: jax.Array, v: jax.Array, q_offset: jax.Array, kv_length: jax.Array
) -> None:
    """Shapes and dtypes of the contract (raises at trace time)."""
    chex.assert_rank([q, k, v, q_offset, kv_length], [4, 4, 4, 1, 1])
    b, t, hq, d = q.shape
    chex.assert_equal_shape([k, v])
    chex.assert_axis_dimension(k, 0, b)
    chex.assert_axis_dimension(k, 3, d)
    chex.assert_shape([q_offset, kv_length], (b,))
    chex.assert_type([q_offset, kv_length], int)
    chex.assert_is_divisible(hq, k.shape[1])
    chex.assert_axis_dimension_gteq(k, 2, t)


def _visible(q_slot: jax.Array, k_slot: jax.Array, kv_length: jax.Array, qs: jax.Array, ks: jax.Array):  # noqa: ANN202
    """[B, Tq, Sk] bool from query slots [B, Tq], key slots [Sk], lengths [B], segments [B, Tq] / [B, Sk]."""
    causal = k_slot[None, None, :] <= q_slot[:, :, None]
    valid = (k_slot[None, :] < kv_length[:, None])[:, None, :]
    return causal & valid & (qs[:, :, None] == ks[:, None, :])


def _segments(seg: jax.Array | None, b: int, n: int) -> jax.Array:
    return jnp.zeros((b, n), jnp.int32) if seg is None else seg.astype(jnp.int32)


def flash_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_offset: jax.Array,
    kv_length: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
) -> jax.Array:
    """The contract as one masked softmax over [B, Hkv, G, T, S] float32 scores (tests' oracle)."""
    _check_inputs(q, k, v, q_offset, kv_length)
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qf = q.reshape(b, t, hkv, hq // hkv, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bksd->bkgts", qf, k.astype(jnp.float32)) / math.sqrt(d)
    q_slot = q_offset[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    vis = _visible(
        q_slot,
        jnp.arange(s, dtype=jnp.int32),
        kv_length,
        _segments(q_segment_ids, b, t),
        _segments(kv_segment_ids, b, s),
    )[:, None, None]
    probs = jax.nn.softmax(jnp.where(vis, scores, _NEG), axis=-1) * jnp.any(vis, -1, keepdims=True)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v.astype(jnp.float32))
    return out.reshape(b, t, hq, d).astype(q.dtype)


# ---- blockwise (jnp) -------------------------------------------------------------------------------------


def _q_blocks(x: jax.Array, bq: int, hkv: int) -> jax.Array:
    """[B, T, Hq, X] -> [nq, B, Hkv, G, bq, X] (T zero-padded to nq * bq)."""
    b, t, hq = x.shape[:3]
    nq = _cdiv(t, bq)
    x = jnp.pad(x, ((0, 0), (0, nq * bq - t)) + ((0, 0),) * (x.ndim - 2))
    x = x.reshape((b, nq, bq, hkv, hq // hkv) + x.shape[3:])
    return jnp.moveaxis(x, (1, 2), (0, 4))


def _from_q_blocks(x: jax.Array, t: int) -> jax.Array:
    """Inverse of `_q_blocks`: [nq, B, Hkv, G, bq, X] -> [B, T, Hq, X]."""
    nq, b, hkv, g, bq = x.shape[:5]
    x = jnp.moveaxis(x, (0, 4), (1, 2)).reshape((b, nq * bq, hkv * g) + x.shape[5:])
    return x[:, :t]


def _kv_blocks(x: jax.Array, bk: int) -> jax.Array:
    """[B, Hkv, S, D] -> [nk, B, Hkv, bk, D] (S zero-padded to nk * bk)."""
    b, h, s, d = x.shape
    nk = _cdiv(s, bk)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, nk * bk - s), (0, 0)))
    return jnp.moveaxis(x.reshape(b, h, nk, bk, d), 2, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _blockwise(q, k, v, q_offset, kv_length, qseg, kseg, bq: int, bk: int):  # noqa: ANN001, ANN202
    return _blockwise_fwd(q, k, v, q_offset, kv_length, qseg, kseg, bq, bk)[0]


def _blockwise_fwd(q, k, v, q_offset, kv_length, qseg, kseg, bq: int, bk: int):  # noqa: ANN001, ANN202
    """Online softmax per query block over the key blocks it can see; returns (out, residuals)."""
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    nk = _cdiv(s, bk)
    qb = _q_blocks(q.astype(jnp.float32) / math.sqrt(d), bq, hkv)  # [nq, B, Hkv, G, bq, D]
    qsb = _q_blocks(qseg[..., None, None], bq, 1)[..., 0, 0, :, 0]  # [nq, B, bq]
    kb, vb = _kv_blocks(k.astype(jnp.float32), bk), _kv_blocks(v.astype(jnp.float32), bk)
    ksb = jnp.moveaxis(jnp.pad(kseg, ((0, 0), (0, nk * bk - s))).reshape(b, nk, bk), 1, 0)
    max_len = jnp.max(kv_length)

    def q_block(_: None, xs: tuple) -> tuple[None, tuple[jax.Array, jax.Array]]:
        i, qi, qsi = xs
        q_slot = q_offset[:, None] + i * bq + jnp.arange(bq, dtype=jnp.int32)[None]
        # key blocks this query block can see: up to its last slot and the longest row
        hi = jnp.minimum(jnp.max(q_slot[:, -1]) + 1, max_len)
        hi = jnp.clip((hi + bk - 1) // bk, 0, nk)

        def kv_step(j: jax.Array, carry: tuple) -> tuple:
            acc, m, denom = carry
            sc = jnp.einsum("bkgqd,bksd->bkgqs", qi, kb[j])
            k_slot = j * bk + jnp.arange(bk, dtype=jnp.int32)
            vis = _visible(q_slot, k_slot, kv_length, qsi, ksb[j])[:, None, None]
            sc = jnp.where(vis, sc, _NEG)
            m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
            p = jnp.where(vis, jnp.exp(sc - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            acc = corr[..., None] * acc + jnp.einsum("bkgqs,bksd->bkgqd", p, vb[j])
            return acc, m_new, corr * denom + jnp.sum(p, axis=-1)

        init = (jnp.zeros(qi.shape, jnp.float32), jnp.full(qi.shape[:-1], _NEG), jnp.zeros(qi.shape[:-1]))
        acc, m, denom = lax.fori_loop(0, hi, kv_step, init)
        denom = jnp.where(denom == 0.0, 1.0, denom)  # no visible key: output 0 (acc is 0)
        return None, (acc / denom[..., None], m + jnp.log(denom))

    nq = qb.shape[0]
    _, (ob, lse) = lax.scan(q_block, None, (jnp.arange(nq, dtype=jnp.int32), qb, qsb))
    out = _from_q_blocks(ob, t).astype(q.dtype)
    return out, (q, k, v, q_offset, kv_length, qseg, kseg, out, lse)


def _blockwise_bwd(bq: int, bk: int, res: tuple, g_out: jax.Array):  # noqa: ANN202
    """Recompute P block by block from the saved log-sum-exp: a scan over key blocks (dK, dV of the block as
    its output) whose inner loop visits the query blocks that see it, adding into one dQ buffer."""
    q, k, v, q_offset, kv_length, qseg, kseg, out, lse = res
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    nk = _cdiv(s, bk)
    scale = 1.0 / math.sqrt(d)
    qb = _q_blocks(q.astype(jnp.float32) * scale, bq, hkv)
    dob = _q_blocks(g_out.astype(jnp.float32), bq, hkv)
    delta = jnp.sum(dob * _q_blocks(out.astype(jnp.float32), bq, hkv), axis=-1)  # [nq, B, Hkv, G, bq]
    qsb = _q_blocks(qseg[..., None, None], bq, 1)[..., 0, 0, :, 0]
    ksb = jnp.moveaxis(jnp.pad(kseg, ((0, 0), (0, nk * bk - s))).reshape(b, nk, bk), 1, 0)
    nq = qb.shape[0]
    max_len = jnp.max(kv_length)

    def kv_block(dq: jax.Array, xs: tuple) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        j, kj, vj, ksj = xs
        k_slot = j * bk + jnp.arange(bk, dtype=jnp.int32)
        # the first query block with a slot at or past this key block (none if past every row's length)
        lo = jnp.clip(jnp.min(j * bk - q_offset) // bq, 0, nq)
        lo = jnp.where(j * bk >= max_len, nq, lo)

        def q_step(i: jax.Array, carry: tuple) -> tuple:
            dk, dv, dq = carry
            qi, doi = qb[i], dob[i]
            q_slot = q_offset[:, None] + i * bq + jnp.arange(bq, dtype=jnp.int32)[None]
            vis = _visible(q_slot, k_slot, kv_length, qsb[i], ksj)[:, None, None]
            sc = jnp.einsum("bkgqd,bksd->bkgqs", qi, kj)
            p = jnp.where(vis, jnp.exp(sc - lse[i][..., None]), 0.0)
            dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p, doi)
            ds = p * (jnp.einsum("bkgqd,bksd->bkgqs", doi, vj) - delta[i][..., None])
            dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds, qi)
            dq_i = jnp.einsum("bkgqs,bksd->bkgqd", ds, kj) * scale
            return dk, dv, lax.dynamic_update_index_in_dim(dq, dq[i] + dq_i, i, 0)

        zeros = jnp.zeros(kj.shape, jnp.float32)
        dk, dv, dq = lax.fori_loop(lo, nq, q_step, (zeros, zeros, dq))
        return dq, (dk, dv)

    kb, vb = _kv_blocks(k.astype(jnp.float32), bk), _kv_blocks(v.astype(jnp.float32), bk)
    xs = (jnp.arange(nk, dtype=jnp.int32), kb, vb, ksb)
    dq, (dk, dv) = lax.scan(kv_block, jnp.zeros(qb.shape, jnp.float32), xs)
    dk, dv = (jnp.moveaxis(x, 0, 2).reshape(b, hkv, nk * bk, d)[:, :, :s] for x in (dk, dv))
    dq = _from_q_blocks(dq, t)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def flash_attention_blockwise(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_offset: jax.Array,
    kv_length: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    *,
    block_q: int = 512,
    block_k: int = 512,
) -> jax.Array:
    """The contract in jnp with O(T x block) memory forward and backward (module docstring)."""
    _check_inputs(q, k, v, q_offset, kv_length)
    b, t = q.shape[:2]
    s = k.shape[2]
    qseg, kseg = _segments(q_segment_ids, b, t), _segments(kv_segment_ids, b, s)
    bq, bk = min(block_q, t), min(block_k, s)
    return _blockwise(q, k, v, q_offset.astype(jnp.int32), kv_length.astype(jnp.int32), qseg, kseg, bq, bk)


# ---- fused kernels ---------------------------------------------------------------------------------------


def _to_slots(x: jax.Array, slots: jax.Array, s: int, fill: float | int = 0) -> jax.Array:
    """[B, T, ...] rows placed at their key slots [B, T] of a [B, S, ...] array (the rest `fill`)."""
    full = jnp.full((x.shape[0], s) + x.shape[2:], fill, x.dtype)
    return full.at[jnp.arange(x.shape[0])[:, None], slots].set(x, mode="promise_in_bounds")


def _from_slots(x: jax.Array, slots: jax.Array) -> jax.Array:
    return x[jnp.arange(x.shape[0])[:, None], slots]


def cudnn_supported(q: jax.Array, segments: bool) -> str | None:
    """Why cuDNN's flash attention cannot take these inputs (None: it can)."""
    if segments:
        return "segment ids (jax.nn.dot_product_attention has none)"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (cuDNN flash attention takes bfloat16/float16)"
    if q.shape[-1] % 8 or q.shape[-1] > 128:
        return f"head dim {q.shape[-1]} (a multiple of 8, at most 128 before Hopper)"
    return None


def flash_attention_cudnn(
    q: jax.Array, k: jax.Array, v: jax.Array, q_offset: jax.Array, kv_length: jax.Array
) -> jax.Array:
    """The contract by cuDNN (top-left causal + key padding lengths; queries in slot space when T < S)."""
    _check_inputs(q, k, v, q_offset, kv_length)
    b, t = q.shape[:2]
    s = k.shape[2]
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # token-major [B, S, Hkv, D]
    slots = q_offset[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None]
    qs = q if t == s else _to_slots(q, slots, s)  # T == S implies q_offset == 0 (contract)
    out = jax.nn.dot_product_attention(
        qs, kt, vt, is_causal=True, key_value_seq_lengths=kv_length.astype(jnp.int32), implementation="cudnn"
    )
    return out if t == s else _from_slots(out, slots)


def flash_attention_pallas_tpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_offset: jax.Array,
    kv_length: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
) -> jax.Array:
    """The contract by jax's Pallas TPU flash attention (causal + segment ids; see the module docstring)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_fa

    _check_inputs(q, k, v, q_offset, kv_length)
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    sp = _cdiv(s, _TPU_BLOCK) * _TPU_BLOCK
    slots = q_offset[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None]
    # padding is a segment of its own (-1): a key past kv_length, or a slot no query occupies, sees only it
    kseg = jnp.where(jnp.arange(s)[None] < kv_length[:, None], _segments(kv_segment_ids, b, s), -1)
    kseg = jnp.pad(kseg, ((0, 0), (0, sp - s)), constant_values=-1)
    qseg = _to_slots(_segments(q_segment_ids, b, t), slots, sp, fill=-1)
    qs = jnp.swapaxes(_to_slots(q, slots, sp), 1, 2)  # [B, Hq, Sp, D]
    pad = ((0, 0), (0, 0), (0, sp - s), (0, 0))
    ks, vs = (jnp.pad(jnp.repeat(x, hq // hkv, axis=1), pad) for x in (k, v))
    blk = max(c for c in (512, 256, 128) if sp % c == 0)
    sizes = tpu_fa.BlockSizes(
        block_q=blk,
        block_k_major=blk,
        block_k=blk,
        block_b=1,
        block_q_major_dkv=blk,
        block_k_major_dkv=blk,
        block_k_dkv=blk,
        block_q_dkv=blk,
        block_k_major_dq=blk,
        block_k_dq=blk,
        block_q_dq=blk,
    )
    out = tpu_fa.flash_attention(
        qs,
        ks,
        vs,
        segment_ids=tpu_fa.SegmentIds(q=qseg, kv=kseg),
        causal=True,
        sm_scale=1.0 / math.sqrt(d),
        block_sizes=sizes,
    )
    return _from_slots(jnp.swapaxes(out, 1, 2), slots)


# ---- sequence parallelism --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """`flash_attention(impl=SequenceParallel(mesh, axis, impl))`: the query tokens (and key slots) split over
    `axis` of `mesh`, `impl` (a `FLASH_IMPLS` name) on each shard. Hashable: it can be a static argument."""

    mesh: Mesh | AbstractMesh
    axis: str
    impl: str = "auto"

    @property
    def size(self) -> int:
        """Devices one sequence is spread over."""
        return int(self.mesh.shape[self.axis])

    def shard(self, x: jax.Array, dim: int) -> jax.Array:
        """`x` with dimension `dim` split over the axis (the others left to the compiler)."""
        spec = [P.UNCONSTRAINED] * x.ndim
        spec[dim] = self.axis
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(self.mesh, P(*spec)))


def flash_attention_seq_parallel(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_offset: jax.Array,
    kv_length: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    *,
    sp: SequenceParallel,
    block_q: int = 512,
    block_k: int = 512,
) -> jax.Array:
    """The contract with q's token axis and k/v's slot axis split over `sp.axis` (T and S multiples of its
    size n), by a `jax.shard_map` manual over that axis only (rows stay with the compiler: the data axis).
    Shard i holds queries [i T/n, (i+1) T/n), i.e. key slots from q_offset + i T/n, and gathers every key: the
    causal mask, padding and segments are the contract's, evaluated at global slots, so each query's result
    is the unsplit one's (the same key blocks in the same order). Memory per device: T/n queries and their
    activations, the whole K/V of its rows ([B, Hkv, S, D], the gathered part of GQA attention); the causal
    work is uneven (the last shard sees every key), which costs time, not memory. cudnn and pallas_tpu take a
    shard's queries in slot space (module docstring): S / (T/n) times a shard's work, n times at least."""
    n = sp.size
    t, s = q.shape[1], k.shape[2]
    if t % n or s % n:
        raise ValueError(
            f"sequence-parallel attention over {n} devices needs T={t} queries and S={s} key slots in "
            f"multiples of {n} (pad the tokens: rl.forward.response_logprobs does)"
        )
    segs = q_segment_ids is not None

    def body(q, k, v, q_offset, kv_length, *seg):  # noqa: ANN001, ANN202
        # gathered in float32, so the gather's transpose (the reduce-scatter adding every shard's partial
        # dK, dV) sums in float32 like the kernels' own accumulators; a bfloat16 reduce-scatter also crashes
        # XLA:CPU under a shard_map manual over some axes (jax 0.10.2: "Invalid binary instruction opcode
        # copy"). K/V are the small GQA part; the blockwise kernel takes them in float32 anyway.
        k, v = (
            lax.all_gather(x.astype(jnp.float32), sp.axis, axis=2, tiled=True).astype(x.dtype) for x in (k, v)
        )
        off = q_offset + lax.axis_index(sp.axis).astype(jnp.int32) * (t // n)
        if seg:
            seg = (seg[0], lax.all_gather(seg[1], sp.axis, axis=1, tiled=True))
        return flash_attention(q, k, v, off, kv_length, *seg, impl=sp.impl, block_q=block_q, block_k=block_k)

    tok, slots = P(None, sp.axis, None, None), P(None, None, sp.axis, None)
    specs = (tok, slots, slots, P(), P()) + ((P(None, sp.axis),) * 2 if segs else ())
    args = (q, k, v, q_offset.astype(jnp.int32), kv_length.astype(jnp.int32))
    args += (q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)) if segs else ()
    # check_vma off: the kernels' loop carries start as constants (and Pallas calls need it); every
    # differentiable input is split over the axis, so no replicated input's cotangent needs a psum
    fn = jax.shard_map(
        body, mesh=sp.mesh, in_specs=specs, out_specs=tok, axis_names={sp.axis}, check_vma=False
    )
    return fn(*args)


def resolve_impl(impl: str, q: jax.Array, segments: bool) -> str:
    """The implementation `impl` runs as on this backend ("auto" picked; an impossible choice raises)."""
    if impl not in FLASH_IMPLS:
        raise ValueError(f"flash_attention: impl must be one of {FLASH_IMPLS}, got {impl!r}")
    backend = jax.default_backend()
    if impl == "auto":
        if backend == "tpu":
            return "pallas_tpu"
        if backend in _GPU_BACKENDS and cudnn_supported(q, segments) is None:
            return "cudnn"
        return "blockwise"
    if impl == "cudnn" and (why := cudnn_supported(q, segments)):
        raise ValueError(f"flash_attention(impl='cudnn') cannot take {why}: use 'auto' or 'blockwise'.")
    return impl


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_offset: jax.Array,
    kv_length: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    *,
    impl: str | SequenceParallel = "auto",
    block_q: int = 512,
    block_k: int = 512,
) -> jax.Array:
    """Causal training attention (module contract) by `impl`: auto | blockwise | reference | cudnn |
    pallas_tpu, or a `SequenceParallel` (the tokens split over a mesh axis). Differentiable in q, k, v by
    every implementation."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("flash_attention: give both q_segment_ids and kv_segment_ids, or neither")
    segs = (q_segment_ids, kv_segment_ids)
    if isinstance(impl, SequenceParallel):
        return flash_attention_seq_parallel(
            q, k, v, q_offset, kv_length, *segs, sp=impl, block_q=block_q, block_k=block_k
        )
    chosen = resolve_impl(impl, q, q_segment_ids is not None)
    if chosen == "reference":
        return flash_attention_reference(q, k, v, q_offset, kv_length, *segs)
    if chosen == "cudnn":
        try:
            return flash_attention_cudnn(q, k, v, q_offset, kv_length)
        except (NotImplementedError, RuntimeError) as e:  # raised while tracing: cuDNN's own checks
            if impl != "auto":
                raise
            logging.warning("flash_attention(impl='auto'): cuDNN cannot run this (%s); blockwise instead", e)
    if chosen == "pallas_tpu":
        return flash_attention_pallas_tpu(q, k, v, q_offset, kv_length, *segs)
    return flash_attention_blockwise(q, k, v, q_offset, kv_length, *segs, block_q=block_q, block_k=block_k)
