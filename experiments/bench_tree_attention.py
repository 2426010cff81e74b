"""Time the Pallas tree-attention kernel against the jnp reference on verify-like shapes.

Shapes: B in {1, 8, 32} rows, T in {8, 16, 64} tokens to verify, a live cache bucket S=1024 (row lengths
75-100% full), heads of SmolLM2-135M (Hq=9, Hkv=3, D=64) and Qwen-7B (Hq=28, Hkv=4, D=128). Each timing is
the median of `--iters` calls after a compile and warm-up, with block_until_ready. The table also prints the
kernel's max |kernel - reference| (a free correctness check on a new machine) and the K/V bytes it streams
per second. The last line is `RESULT key=value ...` with kernel/reference time ratios (< 1: the kernel wins).

Meant for a GPU (`python experiments/bench_tree_attention.py`); on CPU the kernel runs in Pallas interpret
mode, which is slow by design, so use `--quick` there (B=1, T in {8, 16}) to check that the script works.
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

try:
    from tlt_jax.kernels import tree_attention as ta
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from tlt_jax.kernels import tree_attention as ta

MODELS = {"smollm2": (9, 3, 64), "qwen7b": (28, 4, 128)}  # (Hq, Hkv, D)


def make_inputs(
    seed: int, b: int, t: int, s: int, hq: int, hkv: int, d: int, dtype: jnp.dtype
) -> tuple[jax.Array, ...]:
    """Random q/k/v, lengths in [0.75 S, S - T], and a random valid tree (each node sees its ancestors)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d), dtype=np.float32), dtype)
    k = jnp.asarray(rng.standard_normal((b, hkv, s, d), dtype=np.float32), dtype)
    v = jnp.asarray(rng.standard_normal((b, hkv, s, d), dtype=np.float32), dtype)
    lengths = rng.integers(min(3 * s // 4, s - t), s - t + 1, size=b).astype(np.int32)
    masks = np.zeros((b, t, t), dtype=bool)
    for row in range(b):
        for i in range(t):
            parent = int(rng.integers(0, i)) if i > 0 else -1
            if parent >= 0:
                masks[row, i] = masks[row, parent]
            masks[row, i, i] = True
    return q, k, v, jnp.asarray(lengths), jnp.asarray(masks)


def time_fn(fn: Callable[..., jax.Array], args: tuple[jax.Array, ...], iters: int) -> tuple[float, jax.Array]:
    """Median wall time (ms) of `fn(*args)` after compile + 2 warm-up calls; also returns the output."""
    out = fn(*args).block_until_ready()
    for _ in range(2):
        fn(*args).block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B=1, T in {8,16} only (for CPU/interpret)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--iters", type=int, default=0, help="timed calls per shape (0: 20 on GPU, 3 on CPU)")
    parser.add_argument("--seq", type=int, default=1024, help="live cache bucket S")
    parser.add_argument("--models", default="smollm2,qwen7b")
    parser.add_argument("--block-q", type=int, default=ta.BlockSizes.block_q)
    parser.add_argument("--block-k", type=int, default=ta.BlockSizes.block_k)
    parser.add_argument("--kv-splits", type=int, default=ta.BlockSizes.kv_splits)
    parser.add_argument("--num-warps", type=int, default=0, help="0: the kernel's default")
    parser.add_argument("--num-stages", type=int, default=ta.BlockSizes.num_stages)
    args = parser.parse_args()

    backend = jax.default_backend()
    on_gpu = backend in ("gpu", "cuda", "rocm")
    interpret = not on_gpu
    dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    dtype = dtypes[args.dtype] if args.dtype != "auto" else (jnp.bfloat16 if on_gpu else jnp.float32)
    iters = args.iters or (20 if on_gpu else 3)
    block_sizes = ta.BlockSizes(
        block_q=args.block_q,
        block_k=args.block_k,
        kv_splits=args.kv_splits,
        num_warps=args.num_warps or None,
        num_stages=args.num_stages,
    )
    batches, tokens = ((1,), (8, 16)) if args.quick else ((1, 8, 32), (8, 16, 64))
    print(
        f"# backend={backend} device={jax.devices()[0].device_kind} jax={jax.__version__} "
        f"dtype={jnp.dtype(dtype).name} S={args.seq} interpret={interpret} {block_sizes}"
    )
    cols = ("ref_ms", "kernel_ms", "ratio", "max_err", "kv_GB/s")
    print(f"{'model':8s} {'B':>3s} {'T':>3s} " + " ".join(f"{c:>9s}" for c in cols))
    ratios: dict[str, float] = {}
    max_err = 0.0
    for model in args.models.split(","):
        hq, hkv, d = MODELS[model]
        for b in batches:
            for t in tokens:
                inputs = make_inputs(0, b, t, args.seq, hq, hkv, d, dtype)
                ref_fn = jax.jit(functools.partial(ta.tree_attention, impl="reference"))
                ker_fn = jax.jit(
                    functools.partial(
                        ta.tree_attention, impl="pallas", interpret=interpret, block_sizes=block_sizes
                    )
                )
                ref_ms, ref_out = time_fn(ref_fn, inputs, iters)
                ker_ms, ker_out = time_fn(ker_fn, inputs, iters)
                err = float(jnp.max(jnp.abs(ker_out.astype(jnp.float32) - ref_out.astype(jnp.float32))))
                live = int(jnp.sum(inputs[3])) + b * t  # keys each KV head streams: prefix + tree
                kv_bytes = 2 * live * hkv * d * jnp.dtype(dtype).itemsize
                key = f"{model}_B{b}_T{t}"
                ratios[key] = ker_ms / ref_ms
                max_err = max(max_err, err)
                print(
                    f"{model:8s} {b:3d} {t:3d} {ref_ms:9.3f} {ker_ms:9.3f} {ratios[key]:9.2f} {err:9.1e} "
                    f"{kv_bytes / ker_ms / 1e6:9.1f}",
                    flush=True,
                )
    geomean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
    fields = " ".join(f"{k}={v:.3f}" for k, v in ratios.items())
    print(
        f"RESULT backend={backend} dtype={jnp.dtype(dtype).name} geomean_ratio={geomean:.3f} "
        f"max_err={max_err:.2e} {fields}"
    )


if __name__ == "__main__":
    main()
