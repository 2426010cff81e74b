"""Linear layers `y = x @ w.T` (weights [out, in]) with a CPU kernel for few rows: decode and verification.

Why: on XLA:CPU a dot with M = 2..32 activation rows (batch-1 speculative verification, small-batch decoding)
runs at 6-10 GB/s, because it goes to a GEMM that packs the large weight first; a decode step at M = 1 gets
a single-threaded GEMV. Both are bound by reading the weights once, so `cpu/small_m_linear.cc`, an XLA FFI
kernel, streams each weight row once against all M rows and splits the output rows over XLA's intra-op thread
pool. Measured on the project's 2-core CPU (docs/benchmarks.md): 1.5-2.5x XLA's dot at M = 2..16, on par at
M = 1.

`linear(x, w, impl)` is what the models call:
- "xla": `jnp.einsum` (any backend, any dtype, any sharding).
- "cpu_ffi": the kernel for float32 activations with M <= MAX_ROWS rows and float32 or bfloat16 weights
  (einsum above that, where XLA's GEMM is good); differentiable (a custom JVP whose tangent uses einsum, so
  training works unchanged). bfloat16 weights widen exactly inside the kernel (fp32 arithmetic) and halve
  the bytes a step streams: the engine keeps the drafter's weights that way
  (`SpecConfig.drafter_weight_dtype`).
- "auto": "cpu_ffi" when JAX runs on one CPU device and the kernel library is available, else "xla". The
  kernel is opaque to the SPMD partitioner (it would replicate its operands), so multi-device runs keep XLA.

The kernel is built and registered by `tlt_jax.kernels.cpu_ffi` (`make setup` compiles it); "auto" falls
back to XLA when it is unavailable, "cpu_ffi" raises with the reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax.kernels import cpu_ffi

LINEAR_IMPLS = ("auto", "xla", "cpu_ffi")  # "auto": the CPU kernel on one CPU device, else XLA

MAX_ROWS = 32  # above this XLA's GEMM is as fast (measured: 1.0x at M = 32 and 64)
_TARGETS = {jnp.dtype(jnp.float32): "tlt_small_m_linear", jnp.dtype(jnp.bfloat16): "tlt_small_m_linear_bf16"}


def _ffi_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    cpu_ffi.require("small_m_matmul")
    if x.dtype != jnp.float32 or w.dtype not in _TARGETS:
        raise TypeError(
            f"small_m_matmul: needs float32 x and float32/bfloat16 w, got {x.dtype} and {w.dtype}"
        )
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[0],), jnp.float32)
    # vmap over x only: the unbatched weight gets a unit leading dimension, which the kernel accepts.
    return jax.ffi.ffi_call(_TARGETS[jnp.dtype(w.dtype)], out, vmap_method="expand_dims")(x, w)


@jax.custom_jvp
def small_m_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w.T` for float32 x [..., K] and float32 or bfloat16 w [N, K] by the CPU kernel (registered by
    `cpu_ffi`); the result is float32 (bfloat16 weights are widened exactly)."""
    return _ffi_matmul(x, w)


@small_m_matmul.defjvp
def _small_m_matmul_jvp(primals: tuple, tangents: tuple) -> tuple[jax.Array, jax.Array]:
    # Linear in both arguments: the tangent is plain einsum, so JAX can transpose it for reverse mode.
    x, w = primals
    dx, dw = tangents
    return small_m_matmul(x, w), _einsum(dx, w) + _einsum(x, dw)


def _einsum(x: jax.Array, w: jax.Array, preferred_element_type: jnp.dtype | None = None) -> jax.Array:
    return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=preferred_element_type)


def kernel_enabled(impl: str) -> bool:
    """Whether `linear_impl=impl` runs the CPU kernel at all here ("auto": one CPU device + the library)."""
    return impl == "cpu_ffi" or (impl == "auto" and cpu_ffi.auto_enabled())


def use_kernel(impl: str, x: jax.Array, w: jax.Array) -> bool:
    """Whether `linear(x, w, impl)` runs the CPU kernel (decided at trace time from static shapes)."""
    if impl not in LINEAR_IMPLS:
        raise ValueError(f"linear_impl={impl!r} is not one of {LINEAR_IMPLS}.")
    if impl == "xla":
        return False
    if impl == "auto" and not cpu_ffi.auto_enabled():
        return False
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    fits = x.dtype == jnp.float32 and w.dtype in _TARGETS and w.ndim == 2 and rows <= MAX_ROWS
    if fits and impl == "cpu_ffi":
        cpu_ffi.require("linear_impl='cpu_ffi'")
    return fits


def linear(
    x: jax.Array, w: jax.Array, impl: str = "xla", preferred_element_type: jnp.dtype | None = None
) -> jax.Array:
    """`x [..., K] @ w[N, K].T -> [..., N]`, by XLA or the CPU small-M kernel (see the module docstring)."""
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"linear: x's last dimension {x.shape[-1]} != the weight's in-size {w.shape[-1]}.")
    if use_kernel(impl, x, w):
        return small_m_matmul(x, w)
    return _einsum(x, w, preferred_element_type)
