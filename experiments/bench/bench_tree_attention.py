"""Time the Pallas tree-attention kernel against the jnp reference on verify-like shapes; tune its blocks.

Shapes: B in {1, 8, 32} rows, T in {8, 16, 32, 48, 64} tokens to verify (`--batches`, `--tokens`), a live
cache bucket S=1024 (row lengths 75-100% full), heads of SmolLM2-135M (Hq=9, Hkv=3, D=64) and Qwen-7B (Hq=28,
Hkv=4, D=128). Each timing is the median over `--iters` samples of `--inner` back-to-back calls (one
block_until_ready per sample, so dispatch overlaps as in a decode loop) after a compile and warm-up. The
table also prints the kernel's max |kernel - reference| (a free correctness check on a new machine) and the
K/V bytes it streams per second. The last line is `RESULT key=value ...` with kernel/reference time ratios
(< 1: the kernel wins), the Pallas lowering that compiled (`triton` / `mosaic_gpu`, or `interpret`) and
`faster_t16_64` (1 when the kernel is at least as fast as the reference at every T in 16..64).

`--tune` first sweeps the block sizes by coordinate descent from the defaults (target_programs,
min_split_blocks, block_k, block_q, num_warps, num_stages, one at a time, keeping the best) on a few tuning
shapes (decode T=1 and verify T=16..64 at the smallest and largest batch), scoring the geometric mean of the
kernel's times; candidates that fail to compile or exceed the error tolerance are dropped. Split-K is the
lever at B=1 (SmolLM2 heads at T=16 make a grid of 3 programs): kv_splits=0 (the default, kept by the tuner)
picks the split count per call from the grid size and the cache length, so one tuned setting splits at B=1
and not at B=32, and more at 32K than at 1K, where a fixed count trades one for the other.
The table then runs with the winner, and `--tuned-out FILE` writes it as
{"by_dtype": {dtype: BlockSizes fields}}: `TLT_TREE_ATTENTION_BLOCK_SIZES=FILE` makes the kernel use it for
every caller that passes no block sizes (`tree_attention.default_block_sizes`). `--json FILE` writes
everything; `--budget-s` stops starting new work when exceeded (what ran is still reported).

Meant for a GPU (`python -m experiments.bench.bench_tree_attention [--tune]`); on CPU the kernel runs in
Pallas interpret mode, which is slow by design, so use `--quick` there (B=1, T in {8, 16}) to check the
script.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import harness as h
from tlt_jax.kernels import tree_attention as ta
from tlt_jax.kernels import tree_attention_blocks as tab

MODELS = {"smollm2": (9, 3, 64), "qwen7b": (28, 4, 128), "tiny": (4, 2, 16)}  # (Hq, Hkv, D); tiny: dry runs
TUNE_SPACE = {  # coordinate-descent order: the parameters that move time most first
    # split-K stays per call (kv_splits=0): a fixed count tuned at one cache length is wrong at another (at
    # S=1024 it picked 4; a batch-1 decode at 32K needs ~64), so the tuner moves the rule's two knobs
    "target_programs": (128, 256, 512, 1024),
    "min_split_blocks": (1, 2, 4, 8),
    "block_k": (32, 64, 128),
    "block_q": (16, 32, 64, 128),
    "num_warps": (4, 8),
    "num_stages": (1, 2, 3),
}
TOL = {"float32": 1e-4, "bfloat16": 5e-2}  # max |kernel - reference| accepted from a tuning candidate
TRITON_CALL = "__gpu$xla.gpu.triton"


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


def time_fn(
    fn: Callable[..., jax.Array], args: tuple[jax.Array, ...], iters: int, inner: int = 1
) -> tuple[float, jax.Array]:
    """Median ms per call over `iters` samples of `inner` back-to-back calls, after compile + 2 warm-ups."""
    out = fn(*args).block_until_ready()
    for _ in range(2):
        fn(*args).block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(inner - 1):
            fn(*args)
        fn(*args).block_until_ready()
        times.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(times), out


def lowering_of(fn: Callable[..., jax.Array], args: tuple[jax.Array, ...], interpret: bool) -> str:
    """Which Pallas backend the compiled program used: "triton", "mosaic_gpu", "interpret" or "unknown"."""
    if interpret:
        return "interpret"
    text = fn.lower(*args).as_text()
    if TRITON_CALL in text:
        return "triton"
    return "mosaic_gpu" if "mosaic_gpu" in text else "unknown"


class Bench:
    """Times the reference and the kernel on one shape at a time, with one dtype and interpret setting."""

    def __init__(self, dtype: jnp.dtype, seq: int, interpret: bool, iters: int, inner: int) -> None:
        self.dtype, self.seq, self.interpret, self.iters, self.inner = dtype, seq, interpret, iters, inner
        self._ref: dict[tuple[str, int, int], tuple[float, jax.Array, tuple[jax.Array, ...]]] = {}
        self._fns: dict[tab.BlockSizes, Callable[..., jax.Array]] = {}

    def reference(self, model: str, b: int, t: int) -> tuple[float, jax.Array, tuple[jax.Array, ...]]:
        """(ms, output, inputs) of the jnp reference; cached per shape (tuning reuses it)."""
        key = (model, b, t)
        if key not in self._ref:
            hq, hkv, d = MODELS[model]
            inputs = make_inputs(0, b, t, self.seq, hq, hkv, d, self.dtype)
            ref_fn = jax.jit(functools.partial(ta.tree_attention, impl="reference"))
            ms, out = time_fn(ref_fn, inputs, self.iters, self.inner)
            self._ref[key] = (ms, out.astype(jnp.float32), inputs)
        return self._ref[key]

    def kernel_fn(self, bs: tab.BlockSizes) -> Callable[..., jax.Array]:
        """One jitted function per block-size choice, so each (shape, choice) compiles once."""
        if bs not in self._fns:
            self._fns[bs] = jax.jit(
                functools.partial(ta.tree_attention, impl="pallas", interpret=self.interpret, block_sizes=bs)
            )
        return self._fns[bs]

    def kernel(self, model: str, b: int, t: int, bs: tab.BlockSizes) -> dict[str, Any]:
        """One table row: reference and kernel times, ratio, max error, streamed K/V GB/s."""
        ref_ms, ref_out, inputs = self.reference(model, b, t)
        ker_ms, ker_out = time_fn(self.kernel_fn(bs), inputs, self.iters, self.inner)
        err = float(jnp.max(jnp.abs(ker_out.astype(jnp.float32) - ref_out)))
        hkv, d = MODELS[model][1:]
        live = int(jnp.sum(inputs[3])) + b * t  # keys each KV head streams: prefix + tree
        kv_bytes = 2 * live * hkv * d * jnp.dtype(self.dtype).itemsize
        return {
            "model": model,
            "B": b,
            "T": t,
            "ref_ms": ref_ms,
            "kernel_ms": ker_ms,
            "ratio": ker_ms / ref_ms,
            "max_err": err,
            "kv_gb_s": kv_bytes / ker_ms / 1e6,
        }


def tune(bench: Bench, shapes: list[tuple[str, int, int]], deadline: float, max_evals: int) -> dict[str, Any]:
    """Coordinate descent over TUNE_SPACE from the defaults; score = geomean kernel ms over `shapes`."""
    tol = TOL[jnp.dtype(bench.dtype).name]
    tried: dict[tab.BlockSizes, dict[str, Any]] = {}

    def score(bs: tab.BlockSizes) -> float:
        if bs in tried:
            return tried[bs]["geomean_ms"]
        rec: dict[str, Any] = {"block_sizes": bs.to_dict()}
        try:
            rows = [bench.kernel(m, b, t, bs) for m, b, t in shapes]
            worst = max(r["max_err"] for r in rows)
            rec["max_err"] = worst
            if not worst <= tol:  # NaN fails too
                raise ValueError(f"max error {worst:.2e} > {tol:.0e}")
            rec["geomean_ms"] = math.exp(statistics.fmean(math.log(r["kernel_ms"]) for r in rows))
        except Exception as e:  # a candidate that does not compile (shared memory, ...) is dropped
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rec["geomean_ms"] = float("inf")
        tried[bs] = rec
        print(f"  tune {bs}: {rec.get('geomean_ms', 0):.4f} ms {rec.get('error', '')}", flush=True)
        return rec["geomean_ms"]

    best = tab.BlockSizes()
    best_ms = default_ms = score(best)
    stopped = ""
    for name, values in TUNE_SPACE.items():
        for val in values:
            if time.perf_counter() > deadline or len(tried) >= max_evals:
                stopped = "budget" if time.perf_counter() > deadline else "max_evals"
                break
            try:
                cand = dataclasses.replace(best, **{name: val})
            except ValueError:
                continue
            ms = score(cand)
            if ms < best_ms:
                best, best_ms = cand, ms
    return {
        "shapes": [list(s) for s in shapes],
        "candidates": list(tried.values()),
        "best": best.to_dict(),
        "best_geomean_ms": best_ms,
        "default_geomean_ms": default_ms,
        "speedup_vs_default": default_ms / best_ms if math.isfinite(best_ms) else float("nan"),
        "stopped_early": stopped,
    }


def tuning_shapes(
    models: list[str], batches: list[int], tokens: list[int], limit: int = 0
) -> list[tuple[str, int, int]]:
    """Verify shapes (the smallest and largest batch, tokens_to_verify in 16..64) and decode (T=1), most
    important first; at most `limit` of them (0: all)."""
    verify = [t for t in tokens if 16 <= t <= 64] or tokens
    b_lo, b_hi = min(batches), max(batches)
    m = models[0]
    shapes = [(m, b_lo, verify[-1]), (m, b_lo, 1), (m, b_hi, verify[0]), (m, b_lo, verify[0]), (m, b_hi, 1)]
    if len(models) > 1:  # the other heads where split-K matters most and least
        shapes += [(models[1], b_lo, verify[-1]), (models[1], b_hi, verify[0])]
    shapes = list(dict.fromkeys(shapes))
    return shapes[:limit] if limit > 0 else shapes


def main() -> None:
    parser = h.parser(__doc__, quick="B=1, T in {8,16} only (for CPU/interpret)", out=None)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument(
        "--iters", type=int, default=0, help="timed samples per shape (0: 20 on GPU, 3 on CPU)"
    )
    parser.add_argument("--inner", type=int, default=0, help="calls per sample (0: 10 on GPU, 1 on CPU)")
    parser.add_argument("--seq", type=int, default=1024, help="live cache bucket S")
    parser.add_argument("--models", default="smollm2,qwen7b")
    parser.add_argument("--batches", default=None, help="comma-separated B (default 1,8,32; --quick: 1)")
    parser.add_argument(
        "--tokens", default=None, help="comma-separated T (default 8,16,32,48,64; --quick: 8,16)"
    )
    parser.add_argument("--block-q", type=int, default=tab.BlockSizes.block_q)
    parser.add_argument("--block-k", type=int, default=tab.BlockSizes.block_k)
    parser.add_argument("--kv-splits", type=int, default=tab.BlockSizes.kv_splits, help="0: per call")
    parser.add_argument("--target-programs", type=int, default=tab.BlockSizes.target_programs)
    parser.add_argument("--min-split-blocks", type=int, default=tab.BlockSizes.min_split_blocks)
    parser.add_argument("--num-warps", type=int, default=0, help="0: the kernel's default")
    parser.add_argument("--num-stages", type=int, default=tab.BlockSizes.num_stages)
    parser.add_argument(
        "--tune", action="store_true", help="sweep the block sizes first; table uses the best"
    )
    parser.add_argument("--tune-max-evals", type=int, default=40, help="candidates tried at most")
    parser.add_argument("--tune-shapes", type=int, default=0, help="tuning shapes used at most (0: all)")
    parser.add_argument(
        "--tuned-out", default="", help="write the tuned block sizes here (the kernel's hook)"
    )
    parser.add_argument("--budget-s", type=float, default=0.0, help="stop starting new shapes after this")
    args = parser.parse_args()
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s if args.budget_s > 0 else float("inf")

    backend = jax.default_backend()
    on_gpu = backend in ("gpu", "cuda", "rocm")
    interpret = not on_gpu
    dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    dtype = dtypes[args.dtype] if args.dtype != "auto" else (jnp.bfloat16 if on_gpu else jnp.float32)
    dname = jnp.dtype(dtype).name
    bench = Bench(
        dtype, args.seq, interpret, args.iters or (20 if on_gpu else 3), args.inner or (10 if on_gpu else 1)
    )
    block_sizes = tab.BlockSizes(
        block_q=args.block_q,
        block_k=args.block_k,
        kv_splits=args.kv_splits,
        target_programs=args.target_programs,
        min_split_blocks=args.min_split_blocks,
        num_warps=args.num_warps or None,
        num_stages=args.num_stages,
    )
    models = args.models.split(",")
    batches = [int(x) for x in (args.batches or ("1" if args.quick else "1,8,32")).split(",")]
    tokens = [int(x) for x in (args.tokens or ("8,16" if args.quick else "8,16,32,48,64")).split(",")]
    device = jax.devices()[0].device_kind
    print(
        f"# backend={backend} device={device} jax={jax.__version__} dtype={dname} S={args.seq} "
        f"interpret={interpret}"
    )
    probe = bench.reference(models[0], batches[0], tokens[0])[2]
    try:
        lowering = lowering_of(bench.kernel_fn(block_sizes), probe, interpret)
    except Exception as e:  # reported, and every kernel row below will show the error too
        lowering = f"error: {type(e).__name__}: {str(e)[:300]}"
    print(f"# pallas lowering: {lowering}", flush=True)

    tuning = None
    if args.tune:
        shapes = tuning_shapes(models, batches, tokens, args.tune_shapes)
        tune_deadline = min(deadline, t_start + 0.6 * args.budget_s) if args.budget_s > 0 else deadline
        print(f"# tuning on {len(shapes)} shapes: {shapes}", flush=True)
        tuning = tune(bench, shapes, tune_deadline, args.tune_max_evals)
        if math.isfinite(tuning["best_geomean_ms"]):
            block_sizes = tab.BlockSizes.from_dict(tuning["best"])
        print(f"# tuned: {block_sizes} ({tuning['speedup_vs_default']:.2f}x the defaults' geomean)")
        if args.tuned_out:
            out = {"by_dtype": {dname: block_sizes.to_dict()}, "device": device, "jax": jax.__version__}
            pathlib.Path(args.tuned_out).write_text(json.dumps({**out, "tuning": tuning}, indent=2))
    print(f"# table with {block_sizes}")
    cols = ("ref_ms", "kernel_ms", "ratio", "max_err", "kv_GB/s")
    print(f"{'model':8s} {'B':>3s} {'T':>3s} " + " ".join(f"{c:>9s}" for c in cols))
    meta = {"backend": backend, "device": device, "jax": jax.__version__, "dtype": dname, "seq": args.seq}
    meta.update(interpret=interpret, lowering=lowering, block_sizes=block_sizes.to_dict())
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    json_path = h.json_path(args)  # --json: all rows, tuning and the summary (rewritten after every row)

    def dump(complete: bool) -> dict[str, Any]:
        """The summary so far; also rewritten to --json after every row (a crash keeps what finished)."""
        summary = {**meta, **summarize(rows), "skipped_for_budget": skipped, "complete": complete}
        summary["wall_s"] = time.perf_counter() - t_start
        if json_path is not None:
            json_path.write_text(json.dumps({**summary, "rows": rows, "tuning": tuning}, indent=2))
        return summary

    dump(False)
    for model in models:
        for b in batches:
            for t in tokens:
                if time.perf_counter() > deadline:
                    skipped.append(f"{model}_B{b}_T{t}")
                    continue
                try:
                    r = bench.kernel(model, b, t, block_sizes)
                except Exception as e:  # keep going: a shape that fails to compile is a finding, not the end
                    nan = float("nan")
                    r = {"model": model, "B": b, "T": t, "ref_ms": bench.reference(model, b, t)[0]}
                    r.update(kernel_ms=nan, ratio=nan, max_err=nan, kv_gb_s=nan)
                    r["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                    print(f"{model:8s} {b:3d} {t:3d} kernel failed: {r['error'][:200]}", flush=True)
                rows.append(r)
                print(
                    f"{model:8s} {b:3d} {t:3d} {r['ref_ms']:9.3f} {r['kernel_ms']:9.3f} {r['ratio']:9.2f} "
                    f"{r['max_err']:9.1e} {r['kv_gb_s']:9.1f}",
                    flush=True,
                )
                dump(False)
    summary = dump(True)
    tag = lowering.split(":")[0].replace(" ", "_")  # "error" when the kernel did not lower
    res = {"backend": backend, "dtype": dname, "lowering": tag, "geomean_ratio": summary["geomean_ratio"]}
    res |= {"max_err": summary["max_err"], "faster_t16_64": summary["faster_t16_64"]}
    res |= {f"{r['model']}_B{r['B']}_T{r['T']}": r["ratio"] for r in rows}
    h.result(res, args, formats={"max_err": ".2e"})


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Geomean kernel/reference ratio, max error, and the target: kernel <= reference at every T in 16..64
    (a failed row counts against it)."""
    finite = [r["ratio"] for r in rows if math.isfinite(r["ratio"])]
    verify = [r["ratio"] for r in rows if 16 <= r["T"] <= 64]
    return {
        "geomean_ratio": math.exp(statistics.fmean(math.log(v) for v in finite)) if finite else float("nan"),
        "max_err": max((r["max_err"] for r in rows if math.isfinite(r["max_err"])), default=float("nan")),
        "worst_ratio_t16_64": max(verify) if verify and all(map(math.isfinite, verify)) else float("nan"),
        "faster_t16_64": int(bool(verify) and all(v <= 1.0 for v in verify)),
        "kernel_errors": sum("error" in r for r in rows),
    }


if __name__ == "__main__":
    main()
