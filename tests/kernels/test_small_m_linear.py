"""The CPU small-M linear kernel (XLA FFI) against float64 numpy, its dispatch rules, gradients and vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.kernels import cpu_ffi
from tlt_jax.kernels import small_m_linear as sml
from tlt_jax.models.config import ModelConfig, tiny_config
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import Transformer, causal_mask


def _data(m: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k), np.float32), rng.standard_normal((n, k), np.float32)


def _check(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """Within float32 rounding of the exact (float64) product: |err| <= 1e-5 * sum_k |x_k w_k| (K <= 1536)."""
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    assert y.shape == ref.shape
    assert np.all(np.abs(y - ref) <= 1e-5 * scale + 1e-30), np.max(np.abs(y - ref) / scale)


def test_library_builds_once_and_registers():
    path = cpu_ffi.build()
    assert path == cpu_ffi.build() and path.exists() and path.name.startswith("libtlt_cpu_kernels-")
    assert cpu_ffi.available()


# M: 1 (decode), 2..8 (verification): 4-row tiles up to M = 3, 2-row tiles with every row in one pass up to
# M = 6, passes of 6 rows above (7, 17, 32 leave a partial pass), up to MAX_ROWS.
# K: multiples of 8 and not (the scalar K tail). N: below and above the 4-row tile, and chunk tails.
@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 64, 4),
        (1, 576, 3072),
        (2, 7, 5),
        (3, 13, 37),
        (4, 576, 960),
        (5, 100, 1),
        (6, 576, 102),
        (7, 64, 10),
        (8, 1536, 576),
        (17, 40, 301),
        (32, 64, 130),
    ],
)
def test_kernel_matches_float64_reference(m, k, n):
    x, w = _data(m, k, n)
    y = jax.jit(sml.small_m_matmul)(jnp.asarray(x), jnp.asarray(w))
    _check(np.asarray(y), x, w)


@pytest.mark.parametrize("m,k,n", [(1, 576, 3072), (3, 13, 37), (4, 576, 962), (6, 100, 9), (9, 64, 130)])
def test_bfloat16_weights_widen_exactly(m, k, n):
    """bfloat16 weights (the engine's drafter on CPU): the kernel computes in fp32 on the exactly widened
    weights, so it matches the float64 product with the bfloat16 values to fp32 rounding; through `linear`
    the einsum path agrees too. Rows stay independent of M."""
    x, w = _data(m, k, n, seed=5)
    wb = jnp.asarray(w).astype(jnp.bfloat16)
    w_wide = np.asarray(wb.astype(jnp.float32))
    assert sml.use_kernel("cpu_ffi", jnp.asarray(x), wb)
    y = np.asarray(jax.jit(sml.small_m_matmul)(jnp.asarray(x), wb))
    assert y.dtype == np.float32
    _check(y, x, w_wide)
    y_lin = np.asarray(sml.linear(jnp.asarray(x), wb, "cpu_ffi"))
    np.testing.assert_array_equal(y_lin, y)
    np.testing.assert_allclose(np.asarray(sml.linear(jnp.asarray(x), wb, "xla")), y, rtol=1e-5, atol=1e-4)
    one = np.asarray(jax.jit(sml.small_m_matmul)(jnp.asarray(x[-1:]), wb))
    np.testing.assert_array_equal(one[0], y[-1])


def test_rows_are_independent_of_how_many_rows_share_the_call():
    """Row i of a 7-row call equals the 1-row call on row i, bit for bit: the summation order does not depend
    on M, so a verify pass (M = tokens to verify) and a decode step (M = 1) compute the same numbers."""
    x, w = _data(7, 576, 303, seed=1)  # N % 4 = 3: the scalar tail rows must not depend on M either
    f = jax.jit(sml.small_m_matmul)
    full = np.asarray(f(jnp.asarray(x), jnp.asarray(w)))
    for i in range(7):
        np.testing.assert_array_equal(full[i], np.asarray(f(jnp.asarray(x[i : i + 1]), jnp.asarray(w)))[0])
        np.testing.assert_array_equal(full[i], np.asarray(f(jnp.asarray(x[i : i + 4]), jnp.asarray(w)))[0])


def test_leading_dims_and_vmap_over_x():
    x, w = _data(6, 48, 20, seed=2)
    x3 = jnp.asarray(x.reshape(2, 3, 48))
    y = sml.linear(x3, jnp.asarray(w), "cpu_ffi")
    assert y.shape == (2, 3, 20)
    _check(np.asarray(y).reshape(6, 20), x, w)
    yv = jax.vmap(lambda r: sml.linear(r, jnp.asarray(w), "cpu_ffi"))(x3)
    np.testing.assert_array_equal(np.asarray(yv), np.asarray(y))


def test_gradients_equal_einsum_gradients():
    x, w = _data(3, 24, 10, seed=3)

    def loss(impl):
        return lambda x, w: jnp.sum(jnp.sin(sml.linear(x, w, impl)))

    g_ffi = jax.grad(loss("cpu_ffi"), argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    g_xla = jax.grad(loss("xla"), argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    for a, b in zip(g_ffi, g_xla, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.devices(2)  # "auto" with several devices keeps XLA
def test_dispatch_rules():
    w = jnp.zeros((16, 8), jnp.float32)
    small, big = jnp.zeros((2, 4, 8), jnp.float32), jnp.zeros((sml.MAX_ROWS + 1, 8), jnp.float32)
    assert sml.use_kernel("cpu_ffi", small, w)
    assert not sml.use_kernel("cpu_ffi", big, w)  # large M: XLA's GEMM
    assert not sml.use_kernel("cpu_ffi", small.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert sml.use_kernel("cpu_ffi", small, w.astype(jnp.bfloat16))  # fp32 x, bf16 weights: the kernel
    assert not sml.use_kernel("cpu_ffi", small, w.astype(jnp.float16))
    assert not sml.use_kernel("xla", small, w)
    # the test session has 8 (fake) devices: "auto" keeps XLA, whose dots the SPMD partitioner understands
    assert jax.device_count() > 1 and not sml.use_kernel("auto", small, w)
    with pytest.raises(ValueError, match="linear_impl='fast'"):
        sml.use_kernel("fast", small, w)
    with pytest.raises(ValueError, match="in-size"):
        sml.linear(small, jnp.zeros((16, 9), jnp.float32), "cpu_ffi")
    hlo = jax.jit(lambda x, w: sml.linear(x, w, "cpu_ffi")).lower(small, w).as_text()
    assert "tlt_small_m_linear" in hlo
    hlo = jax.jit(lambda x, w: sml.linear(x, w, "cpu_ffi")).lower(big, w).as_text()
    assert "tlt_small_m_linear" not in hlo


def test_model_config_rejects_unknown_linear_impl():
    with pytest.raises(ValueError, match="linear_impl 'fast'"):
        tiny_config(linear_impl="fast")


def test_transformer_with_kernel_equals_xla():
    """Tiny Qwen2 (QKV bias), a 5-token prefill then 6 cached decode steps: logits agree to fp32 rounding."""
    outs = {}
    for impl in ("xla", "cpu_ffi"):
        cfg: ModelConfig = tiny_config("qwen2", linear_impl=impl)
        model = Transformer(cfg, nnx.Rngs(0))
        cache = KVCache.init(cfg, 2, 16)
        toks = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
        logits = []
        forward = nnx.jit(lambda m, *args: m(*args))  # the prefill and one decode program, not op by op
        out = forward(model, toks[:, :5], jnp.broadcast_to(jnp.arange(5), (2, 5)), cache, causal_mask(2, 5))
        logits.append(out.logits)
        cache = out.cache.advance(5)
        for t in range(5, 11):
            out = forward(model, toks[:, t : t + 1], jnp.full((2, 1), t), cache, causal_mask(2, 1))
            cache = out.cache.advance(1)
            logits.append(out.logits)
        outs[impl] = np.concatenate([np.asarray(x) for x in logits], axis=1)
    np.testing.assert_allclose(outs["cpu_ffi"], outs["xla"], rtol=1e-5, atol=1e-5)
