"""Linear layers `y = x @ w.T` (weights [out, in]) with a CPU kernel for few rows: decode and verification.

Why: on XLA:CPU a dot with M = 2..32 activation rows (batch-1 speculative verification, small-batch decoding)
runs at 6-10 GB/s, because it goes to a GEMM that packs the large weight first; a decode step at M = 1 gets
a single-threaded GEMV. Both are bound by reading the weights once, so `cpu/small_m_linear.cc`, an XLA FFI
kernel, streams each weight row once against all M rows and splits the output rows over XLA's intra-op thread
pool. Measured on the project's 2-core CPU (docs/benchmarks.md): 1.5-2.5x XLA's dot at M = 2..16, on par at
M = 1.

`linear(x, w, impl)` is what the models call:
- "xla": `jnp.einsum` (any backend, any dtype, any sharding).
- "cpu_ffi": the kernel for float32 with M <= MAX_ROWS rows (einsum above that, where XLA's GEMM is good);
  differentiable (a custom JVP whose tangent uses einsum, so training works unchanged).
- "auto": "cpu_ffi" when JAX runs on one CPU device and the kernel library is available, else "xla". The
  kernel is opaque to the SPMD partitioner (it would replicate its operands), so multi-device runs keep XLA.

The shared library is compiled from the C++ source by `python -m tlt_jax.kernels.small_m_linear --build`
(`make setup` runs it; it needs g++ and jaxlib's FFI headers) into a file named by the hash of the source and
the jaxlib version, so a stale build is never loaded. If it is missing, the first use builds it; if that
fails, "auto" logs why and falls back to XLA, and "cpu_ffi" raises.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib

from tlt_jax.models.config import LINEAR_IMPLS

log = logging.getLogger(__name__)

MAX_ROWS = 32  # above this XLA's GEMM is as fast (measured: 1.0x at M = 32 and 64)
_TARGET = "tlt_small_m_linear"
_SOURCE = pathlib.Path(__file__).parent / "cpu" / "small_m_linear.cc"
_CXXFLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-w")


def library_path() -> pathlib.Path:
    """The compiled kernel: in `$TLT_JAX_KERNEL_DIR` or `tlt_jax/kernels/cpu/build/`, named by hash."""
    digest = hashlib.sha256(_SOURCE.read_bytes() + jaxlib.__version__.encode() + " ".join(_CXXFLAGS).encode())
    folder = pathlib.Path(os.environ.get("TLT_JAX_KERNEL_DIR", _SOURCE.parent / "build"))
    return folder / f"libtlt_small_m_linear-{digest.hexdigest()[:16]}.so"


def build(force: bool = False) -> pathlib.Path:
    """Compile the kernel library (idempotent); raises RuntimeError with the compiler's output on failure."""
    out = library_path()
    if out.exists() and not force:
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, g++, c++): install g++ to build the kernel.")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name, then rename: an interrupted build never leaves a partial library.
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so.part", delete=False) as tmp:
        part = pathlib.Path(tmp.name)
    cmd = [cxx, *_CXXFLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(part)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        part.unlink(missing_ok=True)
        raise RuntimeError(f"building {_SOURCE.name} failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    os.replace(part, out)
    return out


@functools.cache
def _registered() -> str | None:
    """Loads and registers the kernel once; returns None on success or the reason it is unavailable."""
    try:
        path = build()
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.TltSmallMLinear), platform="cpu")
    except (RuntimeError, OSError) as e:
        return str(e)
    return None


def available() -> bool:
    """Whether "cpu_ffi" can run here: JAX's default backend is the CPU and the library loads."""
    return jax.default_backend() == "cpu" and _registered() is None


def _require() -> None:
    if jax.default_backend() != "cpu":
        raise ValueError(
            f"linear_impl='cpu_ffi' runs only on the CPU backend (not {jax.default_backend()!r}): use 'auto'."
        )
    reason = _registered()
    if reason is not None:
        raise RuntimeError(
            f"linear_impl='cpu_ffi': the kernel library is unavailable ({reason}). Build it with "
            "`python -m tlt_jax.kernels.small_m_linear --build`, or use linear_impl='xla'."
        )


def _ffi_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[0],), jnp.float32)
    # vmap over x only: the unbatched weight gets a unit leading dimension, which the kernel accepts.
    return jax.ffi.ffi_call(_TARGET, out, vmap_method="expand_dims")(x, w)


@jax.custom_jvp
def small_m_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w.T` for float32 x [..., K] and w [N, K] by the CPU kernel (call `_require()` first)."""
    return _ffi_matmul(x, w)


@small_m_matmul.defjvp
def _small_m_matmul_jvp(primals: tuple, tangents: tuple) -> tuple[jax.Array, jax.Array]:
    # Linear in both arguments: the tangent is plain einsum, so JAX can transpose it for reverse mode.
    x, w = primals
    dx, dw = tangents
    return small_m_matmul(x, w), _einsum(dx, w) + _einsum(x, dw)


def _einsum(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("...k,nk->...n", x, w)


def use_kernel(impl: str, x: jax.Array, w: jax.Array) -> bool:
    """Whether `linear(x, w, impl)` runs the CPU kernel (decided at trace time from static shapes)."""
    if impl not in LINEAR_IMPLS:
        raise ValueError(f"linear_impl={impl!r} is not one of {LINEAR_IMPLS}.")
    if impl == "xla":
        return False
    if impl == "auto" and (jax.device_count() != 1 or not available()):
        return False
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    fits = x.dtype == jnp.float32 and w.dtype == jnp.float32 and w.ndim == 2 and rows <= MAX_ROWS
    if fits and impl == "cpu_ffi":
        _require()
    return fits


def linear(
    x: jax.Array, w: jax.Array, impl: str = "xla", preferred_element_type: jnp.dtype | None = None
) -> jax.Array:
    """`x [..., K] @ w[N, K].T -> [..., N]`, by XLA or the CPU small-M kernel (see the module docstring)."""
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"linear: x's last dimension {x.shape[-1]} != the weight's in-size {w.shape[-1]}.")
    if use_kernel(impl, x, w):
        return small_m_matmul(x, w)
    return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=preferred_element_type)


def main() -> None:
    ap = argparse.ArgumentParser(description="Build the CPU small-M linear kernel library.")
    ap.add_argument("--build", action="store_true", help="compile it (skipped if an up-to-date build exists)")
    ap.add_argument("--force", action="store_true", help="recompile even if it exists")
    args = ap.parse_args()
    if args.build or args.force:
        print(build(force=args.force))
    else:
        print(library_path(), "(built)" if library_path().exists() else "(not built)")


if __name__ == "__main__":
    main()
