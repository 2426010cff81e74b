"""Build, load and register the CPU FFI kernels (`tlt_jax/kernels/cpu/*.cc`): one shared library.

The kernels are C++ XLA FFI handlers (AVX2/FMA with a scalar fallback) that run on XLA's intra-op thread
pool: `small_m_linear` (matmuls with few rows: decoding and verification) and `tree_attention` (the attention
contract of `kernels/tree_attention.py`). They exist because XLA:CPU handles both shapes poorly; measured
numbers are in docs/benchmarks.md.

`python -m tlt_jax.kernels.cpu_ffi --build` (run by `make setup`; needs g++ and jaxlib's FFI headers)
compiles them into a library named by the hash of the sources, the jaxlib version and the flags, so a stale
build is never loaded. If it is missing, the first use builds it; if that fails, `available()` is False with
the reason in `unavailable_reason()`, and callers fall back to XLA (or raise, when asked for the kernel).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax
import jaxlib

SOURCE_DIR = pathlib.Path(__file__).parent / "cpu"
SOURCES = ("small_m_linear.cc", "tree_attention.cc")
HEADERS = ("parallel.h",)
TARGETS = {
    "tlt_small_m_linear": "TltSmallMLinear",
    "tlt_small_m_linear_bf16": "TltSmallMLinearBf16",
    "tlt_tree_attention": "TltTreeAttention",
}
_CXXFLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-w")


def library_path() -> pathlib.Path:
    """The compiled library: in `$TLT_JAX_KERNEL_DIR` or `tlt_jax/kernels/cpu/build/`, named by hash."""
    h = hashlib.sha256(jaxlib.__version__.encode() + " ".join(_CXXFLAGS).encode())
    for name in SOURCES + HEADERS:
        h.update((SOURCE_DIR / name).read_bytes())
    folder = pathlib.Path(os.environ.get("TLT_JAX_KERNEL_DIR", SOURCE_DIR / "build"))
    return folder / f"libtlt_cpu_kernels-{h.hexdigest()[:16]}.so"


def build(force: bool = False) -> pathlib.Path:
    """Compile the library (idempotent); raises RuntimeError with the compiler's output on failure."""
    out = library_path()
    if out.exists() and not force:
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, g++, c++): install g++ to build the CPU kernels.")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name, then rename: an interrupted build never leaves a partial library.
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so.part", delete=False) as tmp:
        part = pathlib.Path(tmp.name)
    srcs = [str(SOURCE_DIR / s) for s in SOURCES]
    cmd = [cxx, *_CXXFLAGS, f"-I{jax.ffi.include_dir()}", f"-I{SOURCE_DIR}", *srcs, "-o", str(part)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        part.unlink(missing_ok=True)
        raise RuntimeError(f"building the CPU kernels failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    os.replace(part, out)
    return out


@functools.cache
def unavailable_reason() -> str | None:
    """Loads and registers the kernels once; None on success, else why they cannot run here."""
    if jax.default_backend() != "cpu":
        return f"the CPU kernels run on the CPU backend only (this is {jax.default_backend()!r})"
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (RuntimeError, OSError, AttributeError) as e:
        return str(e)
    return None


def available() -> bool:
    """Whether the kernels can run here: JAX's default backend is the CPU and the library loads."""
    return unavailable_reason() is None


def auto_enabled() -> bool:
    """What "auto" picks: the kernels on a single CPU device. They are opaque to the SPMD partitioner (it
    would replicate their operands), so multi-device runs keep XLA's own ops."""
    return jax.device_count() == 1 and available()


def require(what: str) -> None:
    """Raise a clear error if the kernels cannot run (`what` names the setting that asked for them)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(
            f"{what}: the CPU kernels are unavailable ({reason}). Build them with "
            "`python -m tlt_jax.kernels.cpu_ffi --build`, or choose the XLA implementation."
        )


def main() -> None:
    ap = argparse.ArgumentParser(description="Build the CPU FFI kernel library.")
    ap.add_argument("--build", action="store_true", help="compile it (skipped if an up-to-date build exists)")
    ap.add_argument("--force", action="store_true", help="recompile even if it exists")
    args = ap.parse_args()
    if args.build or args.force:
        print(build(force=args.force))
    else:
        print(library_path(), "(built)" if library_path().exists() else "(not built)")


if __name__ == "__main__":
    main()
