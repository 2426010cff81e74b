"""Training attention (`tlt_jax.kernels.flash_attention`): every implementation that runs here equals the
masked-softmax reference, forward and gradients (q, k, v), with GQA, padding, a query offset (responses on a
cached prompt), packed segments and lengths that are not multiples of the block; the reference equals the
tree-attention oracle under a causal mask; the blockwise program holds no [T, T] buffer.

Implementations: "blockwise" (jnp) runs everywhere; "pallas_tpu" (jax's TPU kernel) runs here under
`pltpu.force_tpu_interpret_mode()` (its 128-token blocks make it the slow one, ~3 s) and lowers for a TPU at
model shapes; "cudnn" needs an NVIDIA GPU (tested where the backend is one; it cannot even lower here:
"cuDNN is not detected"). Tolerances: float32 1e-5 absolute on outputs and gradients of O(1)
inputs (summation order differs), bfloat16 3e-2 (one rounding of a bf16 output / gradient).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.kernels import flash_attention as fa
from tlt_jax.kernels.tree_attention_reference import tree_attention_reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}


def _inputs(b: int, t: int, s: int, hq: int, hkv: int, d: int, dtype=jnp.float32, seed: int = 0):  # noqa: ANN001, ANN202
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, hkv, s, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, hkv, s, d), jnp.float32).astype(dtype)
    g = jax.random.normal(ks[3], (b, t, hq, d), jnp.float32).astype(dtype)
    return q, k, v, g


def _value_and_grads(impl: str, q, k, v, g, off, kvl, segs=(None, None), **kw):  # noqa: ANN001, ANN202
    """Output and d<out, g>/d(q, k, v) under `impl`, jitted."""

    def f(q, k, v):  # noqa: ANN001, ANN202
        return fa.flash_attention(q, k, v, off, kvl, *segs, impl=impl, **kw)

    def loss(q, k, v):  # noqa: ANN001, ANN202
        return jnp.sum(f(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))

    return jax.jit(lambda q, k, v: (f(q, k, v), jax.grad(loss, (0, 1, 2))(q, k, v)))(q, k, v)


def _assert_close(got, want, tol: float) -> None:  # noqa: ANN001
    (o1, g1), (o2, g2) = got, want
    np.testing.assert_allclose(np.float32(o1), np.float32(o2), atol=tol, rtol=tol)
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(np.float32(a), np.float32(b), atol=tol, rtol=tol)


# (B, T, S, q_offset, kv_length, blocks): whole sequences, a prompt cache under responses with ragged rows,
# lengths that are not multiples of the blocks
CASES = {
    "self_causal": (2, 12, 12, [0, 0], [12, 12], (4, 4)),
    "padded_rows": (2, 11, 11, [0, 0], [11, 6], (4, 3)),
    "cached_prompt": (3, 9, 17, [2, 8, 5], [11, 17, 14], (4, 5)),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_blockwise_equals_reference(case: str, dtype) -> None:  # noqa: ANN001
    b, t, s, off, kvl, (bq, bk) = CASES[case]
    q, k, v, g = _inputs(b, t, s, 4, 2, 8, dtype)
    off, kvl = jnp.asarray(off, jnp.int32), jnp.asarray(kvl, jnp.int32)
    want = _value_and_grads("reference", q, k, v, g, off, kvl)
    got = _value_and_grads("blockwise", q, k, v, g, off, kvl, block_q=bq, block_k=bk)
    _assert_close(got, want, TOL[dtype])


def _packed_segments(b: int, t: int, s: int, off: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """Three documents per row in slot order (boundaries at slots 4 and 10), queries labelled by slot."""
    kv = np.searchsorted(np.asarray([4, 10]), np.arange(s), side="right")[None].repeat(b, 0)
    q = np.stack([kv[i, off[i] : off[i] + t] for i in range(b)])
    return jnp.asarray(q, jnp.int32), jnp.asarray(kv, jnp.int32)


def test_blockwise_packed_segments_equal_reference_and_separate_documents() -> None:
    b, t, s = 2, 13, 16
    off = np.asarray([0, 3])
    q, k, v, g = _inputs(b, t, s, 6, 3, 8)
    qs, ks = _packed_segments(b, t, s, off)
    offs, kvl = jnp.asarray(off, jnp.int32), jnp.asarray([13, 16], jnp.int32)
    want = _value_and_grads("reference", q, k, v, g, offs, kvl, (qs, ks))
    got = _value_and_grads("blockwise", q, k, v, g, offs, kvl, (qs, ks), block_q=4, block_k=3)
    _assert_close(got, want, 1e-5)
    # the last document (slots 10..) of row 0 alone, as its own sequence, gives the same outputs
    alone = fa.flash_attention_reference(
        q[:1, 10:], k[:1, :, 10:13], v[:1, :, 10:13], jnp.zeros(1, jnp.int32), jnp.asarray([3], jnp.int32)
    )
    np.testing.assert_allclose(got[0][0, 10:13], alone[0], atol=1e-5)


def test_reference_is_the_tree_attention_oracle_under_a_causal_mask() -> None:
    """q_offset = the cache length and kv_length = q_offset + T is tree attention with a causal tree mask
    (how the trainer's response pass ran before); keys past kv_length hold garbage that must not leak."""
    b, t, s = 2, 7, 15
    q, k, v, _ = _inputs(b, t, s, 4, 1, 8)
    lengths = jnp.asarray([3, 8], jnp.int32)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    want = tree_attention_reference(q, k, v, lengths, causal)
    got = fa.flash_attention(q, k, v, lengths, lengths + t, impl="blockwise", block_q=3, block_k=4)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_auto_and_bad_impls() -> None:
    q = jnp.zeros((1, 4, 2, 8), jnp.float32)
    assert fa.resolve_impl("auto", q, segments=False) in ("blockwise", "cudnn", "pallas_tpu")
    if jax.default_backend() == "cpu":
        assert fa.resolve_impl("auto", q, segments=False) == "blockwise"
    with pytest.raises(ValueError, match="impl must be one of"):
        fa.resolve_impl("flash", q, segments=False)
    with pytest.raises(ValueError, match="cannot take dtype float32"):
        fa.resolve_impl("cudnn", q, segments=False)
    with pytest.raises(ValueError, match="segment ids"):
        fa.resolve_impl("cudnn", q.astype(jnp.bfloat16), segments=True)


def test_auto_falls_back_to_blockwise_where_cudnn_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "auto" that picked cuDNN (as on a GPU) runs blockwise when cuDNN's checks raise while tracing (here:
    no cuDNN at all); an explicit "cudnn" raises."""
    if jax.default_backend() != "cpu":
        pytest.skip("needs a backend without cuDNN")
    q, k, v, _ = _inputs(1, 8, 8, 2, 1, 8, jnp.bfloat16)
    off, kvl = jnp.zeros(1, jnp.int32), jnp.full(1, 8, jnp.int32)
    monkeypatch.setattr(fa, "resolve_impl", lambda impl, q, segments: "cudnn")
    got = fa.flash_attention(q, k, v, off, kvl, impl="auto")
    np.testing.assert_allclose(
        np.float32(got), np.float32(fa.flash_attention_reference(q, k, v, off, kvl)), atol=3e-2
    )
    with pytest.raises(RuntimeError):
        fa.flash_attention(q, k, v, off, kvl, impl="cudnn")


def test_blockwise_program_holds_no_t_by_t_buffer() -> None:
    """Forward + backward at T = 4096 (tiny heads): XLA's temporaries stay far below one [T, T] float32
    score matrix (64 MiB), let alone the reference's [Hq, T, T]."""
    t = 4096
    q = jax.ShapeDtypeStruct((1, t, 2, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 1, t, 8), jnp.float32)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)

    def loss(q, k, v, off, kvl):  # noqa: ANN001, ANN202
        out = fa.flash_attention(q, k, v, off, kvl, impl="blockwise", block_q=256, block_k=256)
        return jnp.sum(out * out)

    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, k, lens, lens).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < t * t * 4 / 16, temp  # measured 3.1 MiB; the reference: 640 MiB


def test_pallas_tpu_kernel_in_interpret_mode_equals_reference() -> None:
    """jax's TPU flash attention under the TPU interpreter: a cached prompt with ragged rows, GQA (heads
    repeated for the MHA kernel), packed segments; forward and gradients."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    if not hasattr(pltpu, "force_tpu_interpret_mode") and jax.default_backend() != "tpu":
        pytest.skip("this jax has no TPU interpret mode")
    b, t, s = 2, 9, 16
    off = np.asarray([2, 7])
    q, k, v, g = _inputs(b, t, s, 4, 2, 8)
    qs, ks = _packed_segments(b, t, s, off)
    offs, kvl = jnp.asarray(off, jnp.int32), jnp.asarray([11, 16], jnp.int32)
    want = _value_and_grads("reference", q, k, v, g, offs, kvl, (qs, ks))
    ctx = pltpu.force_tpu_interpret_mode() if jax.default_backend() != "tpu" else contextlib.nullcontext()
    with ctx:
        got = _value_and_grads("pallas_tpu", q, k, v, g, offs, kvl, (qs, ks))
    _assert_close(got, want, 1e-5)


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "cuda"), reason="cuDNN needs an NVIDIA GPU")
def test_cudnn_equals_reference_on_gpu() -> None:
    b, t, s = 2, 40, 64
    q, k, v, g = _inputs(b, t, s, 8, 2, 64, jnp.bfloat16)
    offs, kvl = jnp.asarray([5, 24], jnp.int32), jnp.asarray([45, 64], jnp.int32)
    want = _value_and_grads("reference", q, k, v, g, offs, kvl)
    _assert_close(_value_and_grads("cudnn", q, k, v, g, offs, kvl), want, 3e-2)
    zero, full = jnp.zeros(b, jnp.int32), jnp.full(b, t, jnp.int32)  # T == S: no slot placement
    k, v = k[:, :, :t], v[:, :, :t]
    want = _value_and_grads("reference", q, k, v, g, zero, full)
    _assert_close(_value_and_grads("cudnn", q, k, v, g, zero, full), want, 3e-2)


def test_pallas_tpu_path_lowers_for_tpu_at_model_shapes() -> None:
    """Forward and backward of the Mosaic path at a 7B-like head size (D = 128, GQA 4:1, bf16, lengths not
    multiples of 128) lower for a TPU without one: three Mosaic kernels (forward, dK/dV, dQ)."""
    sds = jax.ShapeDtypeStruct
    q, k, n = sds((2, 200, 8, 128), jnp.bfloat16), sds((2, 2, 300, 128), jnp.bfloat16), sds((2,), jnp.int32)

    def loss(q, k, v, off, kvl):  # noqa: ANN001, ANN202
        return jnp.sum(fa.flash_attention_pallas_tpu(q, k, v, off, kvl).astype(jnp.float32))

    traced = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, k, k, n, n)
    assert traced.lower(lowering_platforms=("tpu",)).as_text().count("tpu_custom_call") == 3
