"""The GPU suite's env probe, run in a subprocess by the `env` phase: what the machine is (versions, device,
memory bandwidth, bf16 matmul rate, which Pallas GPU backends import, the bundle's imports), written to a JSON
file as it goes, so a probe that hangs or fails still leaves what came before it.

    python -m gpu.env OUT.json [--dry-run]     # --dry-run (or a CPU): small sizes
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

from gpu import bundle, stack

ROOT = pathlib.Path(__file__).resolve().parents[1]


def worker_env(out: pathlib.Path, dry: bool) -> None:
    """(In a subprocess) what the machine is: versions, device, memory bandwidth, bf16 matmul rate, which
    Pallas GPU backends import, the bundle's imports. Each probe is guarded: one that fails is recorded as
    its error and the others still run (only the backend decides whether the GPU phases go ahead)."""
    import importlib
    import importlib.metadata as md
    import shutil
    import subprocess
    import time

    import jax
    import jax.numpy as jnp

    info: dict[str, Any] = {"python": sys.version.split()[0], "versions": {}, "probe_errors": {}}
    dists = "jax jaxlib jax-cuda13-plugin flax optax orbax-checkpoint chex numpy torch transformers triton"
    for dist in (dists + " tokenizers ml-collections gguf reasoning-gym").split():
        try:
            info["versions"][dist] = md.version(dist)
        except md.PackageNotFoundError:
            info["versions"][dist] = None
    dev = jax.devices()[0]
    info.update(backend=jax.default_backend(), device=dev.device_kind, device_count=jax.device_count())
    info.update(on_gpu=info["backend"] in ("gpu", "cuda", "rocm"), jax=jax.__version__)
    out.write_text(json.dumps(info, indent=2, default=str))  # the essentials first
    small = dry or not info["on_gpu"]  # a CPU (dry run, --allow-cpu) gets the small sizes

    def probe(name: str, fn: Any) -> None:
        try:
            info[name] = fn()
        except Exception as e:  # noted, and the next probe runs
            info["probe_errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"

    def best_ms(f: Any, *a: Any) -> float:
        f(*a).block_until_ready()
        times = []
        for _ in range(10):
            t = time.perf_counter()
            f(*a).block_until_ready()
            times.append(time.perf_counter() - t)
        return 1e3 * min(times)

    def bandwidth() -> float:  # GB/s of a device copy (x + 1: read + write), 1 GiB (16 MiB dry)
        x = jnp.ones(((1 << 22) if small else (1 << 28),), jnp.float32) * 1.5
        return 2 * x.nbytes / best_ms(jax.jit(lambda a: a + 1.0), x) / 1e6

    def matmul() -> float:  # bf16 TFLOP/s of an m^3 product on random data
        m, key = (256 if small else 8192), jax.random.key(0)
        a = jax.random.normal(key, (m, m), jnp.bfloat16)
        b = jax.random.normal(jax.random.fold_in(key, 1), (m, m), jnp.bfloat16)
        return 2 * m**3 / best_ms(jax.jit(jnp.matmul), a, b) / 1e9

    def smi() -> str:
        q = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu"
        cmd = ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()

    def project() -> dict[str, Any]:  # imports with no CPU kernel library built (the GPU case)
        from tlt_jax.kernels import cpu_ffi, tree_attention  # noqa: F401
        from tlt_jax.rollout import engine  # noqa: F401

        return {"imports": "ok", "cpu_ffi_library_built": cpu_ffi.library_path().exists()}

    def failed_imports(mods: tuple[str, ...]) -> str:
        bad = []
        for mod in mods:
            try:
                importlib.import_module(mod)
            except Exception as e:
                bad.append(f"{mod} ({type(e).__name__}: {str(e)[:120]})")
        return "; ".join(bad) or "none"

    probe("memory_limit", lambda: {k: v for k, v in (dev.memory_stats() or {}).items() if "limit" in k})
    if shutil.which("nvidia-smi"):
        probe("nvidia_smi", smi)
    for mod in ("triton", "mosaic_gpu"):
        name = f"jax.experimental.pallas.{mod}"
        probe(f"pallas_{mod}", lambda name=name: "imports" if failed_imports((name,)) == "none" else "fails")
    probe("project", project)
    # the installed stack against the GPU-tested pins (requirements/jax-gpu.txt, setup.py; issue #47)
    probe("stack", lambda: stack.compare_stack().as_dict())
    probe("bandwidth_gb_s", bandwidth)
    probe("bf16_matmul_tflops", matmul)
    probe("wheels_missing", lambda: failed_imports((*bundle.IMPORTS, "flax.nnx")))
    out.write_text(json.dumps(info, indent=2, default=str))


if __name__ == "__main__":
    worker_env(pathlib.Path(sys.argv[1]), "--dry-run" in sys.argv[2:])
