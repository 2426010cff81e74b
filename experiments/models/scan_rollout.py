"""Can the rollout's decode / verify step run its layers under `lax.scan` without extra cache memory or
traffic? (issue #35 item 1). Compiled programs compared, per variant:

  unrolled  today's `Transformer.__call__` (a Python loop) over the per-layer `KVCache` tuple, donated;
  carry     `scan_decode.scan_forward(cache_mode="carry")`: the stacked [L, B, Hkv, S, D] cache in the scan's
            carry, the new tokens scattered into layer l, attention on the slice k[l];
  xs        `cache_mode="xs"`: the stacked cache as the scan's xs, the updated slices as its ys (donated);
  carry_unrolled  "carry" with `lax.scan(unroll=True)`: the stacked layout with constant layer offsets.
The scans take the layers' weights stacked once outside the program (`scan_decode.split_for_scan`).

Part 1 (the decisive one): a Qwen2.5-7B-width model (`presets.arch_config("qwen2_5_7b")`) with --layers
layers, batch --batch, cache bucket --cache, a decode step (T=1, causal) and a verify pass (T=16, tree mask),
compiled from `jax.ShapeDtypeStruct`s (nothing materialised), in the settings (--settings):
  bf16_ref  bfloat16, the jnp reference attention and XLA dots (the rollout's dtype). XLA:CPU converts
            bfloat16 caches and weights to float32 around its scatters and dots in every variant (a CPU
            artefact, see memory_plans.py), so these rows give memory, not the copy answer;
  f32_ref   float32, the reference attention and XLA dots: XLA-native consumers of every layer slice;
  f32_cc    float32, the CPU FFI kernels for attention AND the projections (`cpu_ffi`): every consumer of
            a layer's cache or weights is a custom call that needs its operand as one buffer, as the
            Pallas attention (and cuBLAS / Pallas matmuls) are on a GPU;
  bf16_pallas  (--settings bf16_pallas --run-layers 0, on a GPU only) bfloat16, the Pallas attention: the
            GPU's own answer, XLA:GPU's dynamic-slice fusion included. On a CPU Pallas runs in its
            interpreter, whose emulation copies operand blocks in every variant: it says nothing there.
For each: XLA's `memory_analysis()` (argument, output, temp, alias bytes), lower+compile seconds, and from
the optimised HLO (`compiled.as_text()`) the buffers a step materialises with the shape of one layer's
K/V cache or of one layer's weight, other than in-place updates (counted per step: a while body's ops once
per trip), with the bytes they write and the op that makes them (dynamic-slice, slice, convert, copy).
Part 2: run time on this CPU of one step (f32/custom-call) at the 7B cache geometry (28 query / 4 KV heads of
128, batch --batch, cache --cache, --run-layers layers) with a narrow residual stream (hidden 256: the step
is then the cache's traffic), caches donated and fed back.
Part 3: lower+compile seconds vs depth (--depths) at the tiny test config (f32, T=1), unrolled vs scanned;
max |logits - unrolled| and |caches - unrolled| of both scans at the tiny config (T=1 and a T=4 tree).

    python -m experiments.models.scan_rollout [--quick] [--out workdirs/scan_rollout]

Final line: `RESULT <setting>_<variant>_t<T>_temp_mib=.. <...>_cache_copies=.. <...>_weight_copy_mib=..
(at the deepest --layers) compile_s_<variant>_l<L>=.. run_ms_<variant>_t<T>=.. max_abs_logits_<mode>_t<T>=..
max_abs_cache_<mode>_t<T>=.. wall_s=..`; the table in --out/table.txt, the plot --out/compile_vs_depth.png.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.lib import harness as h
from tlt_jax.models import scan_decode as sd
from tlt_jax.models.config import ModelConfig, tiny_config
from tlt_jax.models.kv_cache import KVCache, StackedKVCache
from tlt_jax.models.llama import Transformer
from tlt_jax.models.presets import arch_config
from tlt_jax.rollout.programs import memory_fields

VARIANTS = ("unrolled", "carry", "xs", "carry_unrolled")
SETTINGS = {
    "bf16_ref": ("bfloat16", "reference", "xla"),
    "f32_ref": ("float32", "reference", "xla"),
    "f32_cc": ("float32", "cpu_ffi", "cpu_ffi"),
    "bf16_pallas": ("bfloat16", "pallas", "xla"),  # for a GPU only (on a CPU: Pallas's interpreter)
}
CPU_SETTINGS = ("bf16_ref", "f32_ref", "f32_cc")
MIB = 2**20
SDS = jax.ShapeDtypeStruct
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\](?:\{[^}]*\})? ([\w\-]+)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_SKIP = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant"}
_IN_PLACE = {"scatter", "dynamic-update-slice"}
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1, "f16": 2}


def tree_mask(batch: int, t: int) -> jax.Array:
    """A [B, T, T] tree: token i's parent is (i - 1) // 2 (a binary tree), each token sees its ancestors."""
    parent = [-1] + [(i - 1) // 2 for i in range(1, t)]
    m = np.eye(t, dtype=bool)
    for i in range(1, t):
        m[i] = m[parent[i]] | m[i]
    return jnp.broadcast_to(jnp.asarray(m), (batch, t, t))


def step_fn(cfg: ModelConfig, variant: str, model: Transformer, impl: str) -> tuple[Callable, Any]:
    """(fn(params, tokens, positions, cache, mask) -> (logits, cache), params) of `variant`; `model` may be
    abstract (`nnx.eval_shape`). The cache argument is a `KVCache` (unrolled) or a `StackedKVCache`."""
    if variant == "unrolled":
        graphdef, state = nnx.split(model)

        def unrolled(p: Any, tok: jax.Array, pos: jax.Array, cache: Any, mask: jax.Array) -> tuple:
            out = nnx.merge(graphdef, p)(tok, pos, cache, mask, attn_impl=impl)
            return out.logits, out.cache

        return unrolled, state
    defs, params = sd.split_for_scan(model)

    def scanned(p: Any, tok: jax.Array, pos: jax.Array, cache: Any, mask: jax.Array) -> tuple:
        mode, unroll = variant.split("_")[0], variant.endswith("_unrolled")
        logits, _, cache = sd.scan_forward(
            defs, p, tok, pos, cache, mask, cache_mode=mode, attn_impl=impl, unroll=unroll
        )
        return logits, cache

    return scanned, params


def abstract_cache(cfg: ModelConfig, variant: str, batch: int, seq: int) -> Any:
    """The variant's cache as `ShapeDtypeStruct`s."""
    shape = (batch, cfg.num_kv_heads, seq, cfg.head_dim)
    lengths = SDS((batch,), jnp.int32)
    if variant == "unrolled":
        layer = tuple(SDS(shape, cfg.dtype) for _ in range(cfg.num_layers))
        return KVCache(k=layer, v=layer, lengths=lengths)
    full = SDS((cfg.num_layers, *shape), cfg.dtype)
    return StackedKVCache(k=full, v=full, lengths=lengths)


def compile_step(cfg: ModelConfig, variant: str, impl: str, batch: int, seq: int, t: int) -> dict[str, Any]:
    """Lower and compile one step from abstract shapes (cache donated): memory fields, seconds, HLO text."""
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    fn, params = step_fn(cfg, variant, model, impl)
    tok = SDS((batch, t), jnp.int32)
    args = (params, tok, tok, abstract_cache(cfg, variant, batch, seq), SDS((batch, t, t), jnp.bool_))
    t0 = time.perf_counter()
    lowered = jax.jit(fn, donate_argnums=(3,)).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    out = {"compile_s": time.perf_counter() - t0, "lower_s": t1 - t0, **memory_fields(compiled)}
    out["hlo"] = compiled.as_text()
    return out


def layer_shapes(cfg: ModelConfig, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
    """The shapes a per-layer slice has: one layer's K or V cache and each of one layer's 2-D weights."""
    g = cfg.num_heads // cfg.num_kv_heads
    hid, d, kv = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads
    return {
        "cache": (batch, kv, seq, d),
        "w_qkv": (kv * (g + 2) * d, hid),
        "w_o": (hid, cfg.num_heads * d),
        "w_gate_up": (2 * cfg.intermediate_size, hid),
        "w_down": (hid, cfg.intermediate_size),
    }


def _computations(hlo: str) -> dict[str, list[str]]:
    """The optimised HLO module's computations: name -> instruction lines."""
    comps: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in hlo.splitlines():
        head = _HEADER.match(line)
        if head:
            current = comps.setdefault(head.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return comps


def _fused_kind(lines: list[str]) -> str:
    """What a fused computation makes: its root's opcode, looking through a root bitcast/reshape."""
    ops = {m.group(1): m for m in (_INSTR.match(x) for x in lines) if m}
    root = next((m for x in lines if x.lstrip().startswith("ROOT") and (m := _INSTR.match(x))), None)
    while root is not None and root.group(4) in ("bitcast", "reshape"):
        operand = re.match(r"%([\w.\-]+)", root.group(5))
        root = ops.get(operand.group(1)) if operand else None
    return root.group(4) if root is not None else "?"


def materialised(hlo: str, shapes: dict[str, tuple[int, ...]], trips: int) -> dict[str, dict[str, float]]:
    """Per kind of `shapes`: how many buffers of that shape one step writes outside fusions (not counting
    parameters, tuples, bitcasts or in-place scatters / dynamic-update-slices), by what made them, and the
    bytes written. Instructions of a while body count once per trip (its known trip count, else `trips`);
    computations called from a while body are not followed (a scanned step has no such nesting)."""
    comps = _computations(hlo)
    fused: set[str] = set()
    bodies: dict[str, int] = {}  # while body -> its known trip count (else `trips`)
    for lines in comps.values():
        for line in lines:
            fused.update(re.findall(r"calls=%([\w.\-]+)", line) if " fusion(" in line else ())
            for body in re.findall(r"body=%([\w.\-]+)", line):
                n = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                bodies[body] = int(n.group(1)) if n else trips
    by_dims = {dims: kind for kind, dims in shapes.items()}
    out: dict[str, dict[str, float]] = {k: {"count": 0, "bytes": 0} for k in shapes}
    for name, lines in comps.items():
        if name in fused:
            continue
        weight = bodies.get(name, 1)
        for m in filter(None, (_INSTR.match(x) for x in lines)):
            dims = tuple(int(x) for x in m.group(3).split(",") if x)
            op = m.group(4)
            if dims not in by_dims or op in _SKIP:
                continue
            if op == "fusion":
                op = _fused_kind(comps.get(re.search(r"calls=%([\w.\-]+)", m.group(5)).group(1), []))
            if op in _IN_PLACE:
                continue
            rec = out[by_dims[dims]]
            rec["count"] += weight
            rec["bytes"] += weight * int(np.prod(dims)) * _BYTES.get(m.group(2), 4)
            rec[op] = rec.get(op, 0) + weight
    return out


def part1(args: Any, rows: list[dict]) -> None:
    """The 7B-width compiles: memory accounting and materialised per-layer buffers, per setting/variant."""
    for setting in args.settings:
        dtype, impl, linear_impl = SETTINGS[setting]
        for layers in args.layers:
            cfg = arch_config("qwen2_5_7b", num_layers=layers, dtype=dtype, linear_impl=linear_impl)
            shapes = layer_shapes(cfg, args.batch, args.cache)
            cache_bytes = 2 * layers * int(np.prod(shapes["cache"])) * jnp.dtype(dtype).itemsize
            for t in (1, 16):
                for variant in VARIANTS:
                    r = compile_step(cfg, variant, impl, args.batch, args.cache, t)
                    mat = materialised(r.pop("hlo"), shapes, layers)
                    weights = {k: v for k, v in mat.items() if k.startswith("w_")}
                    row = dict(setting=setting, variant=variant, layers=layers, t=t, cache_bytes=cache_bytes)
                    row.update({k: v for k, v in r.items()})
                    row["cache_copies"] = mat["cache"]["count"]
                    row["cache_copy_bytes"] = mat["cache"]["bytes"]
                    row["cache_copy_ops"] = _ops([mat["cache"]])
                    row["weight_copies"] = sum(w["count"] for w in weights.values())
                    row["weight_copy_bytes"] = sum(w["bytes"] for w in weights.values())
                    row["weight_copy_ops"] = _ops(weights.values())
                    rows.append(row)
                    print(_row_line(row), flush=True)


def _ops(recs: Any) -> dict[str, int]:
    """The per-opcode counts of `materialised` records, summed."""
    out: dict[str, int] = {}
    for rec in recs:
        for k, v in rec.items():
            if k not in ("count", "bytes"):
                out[k] = out.get(k, 0) + int(v)
    return out


def _row_line(r: dict) -> str:
    return (
        f"{r['setting']:8s} {r['variant']:8s} L={r['layers']:<2d} T={r['t']:<2d} "
        f"arg={r['argument_bytes'] / MIB:9.1f} out={r['output_bytes'] / MIB:8.1f} "
        f"temp={r['temp_bytes'] / MIB:8.1f} alias={r['alias_bytes'] / MIB:8.1f} MiB  "
        f"compile={r['compile_s']:5.1f}s  cache_copies/step={r['cache_copies']:3d} "
        f"({r['cache_copy_bytes'] / r['cache_bytes']:.2f}x cache) {r['cache_copy_ops']}  "
        f"weight_copies/step={r['weight_copies']:3d} ({r['weight_copy_bytes'] / MIB:.0f} MiB) "
        f"{r['weight_copy_ops']}"
    )


def run_times(args: Any) -> dict[str, float]:
    """Seconds per step (median of --reps after one warm-up) of each variant, f32 with the FFI kernels, at
    the 7B cache geometry with a narrow residual stream; caches donated and fed back."""
    cfg = arch_config("qwen2_5_7b", num_layers=args.run_layers, dtype="float32", linear_impl="cpu_ffi")
    cfg = dataclasses.replace(cfg, hidden_size=256, intermediate_size=512, vocab_size=512)
    model = Transformer(cfg, nnx.Rngs(0))
    out = {}
    for t in (1, 16):
        tok = jnp.zeros((args.batch, t), jnp.int32)
        pos = jnp.full((args.batch, t), args.cache - 32, jnp.int32) + jnp.arange(t)
        mask = tree_mask(args.batch, t)
        for variant in VARIANTS:
            fn, params = step_fn(cfg, variant, model, "cpu_ffi")
            cache = KVCache.init(cfg, args.batch, args.cache).advance(args.cache - 32)
            cache = cache if variant == "unrolled" else StackedKVCache.from_cache(cache)
            step = jax.jit(fn, donate_argnums=(3,))
            times = []
            for _ in range(args.reps + 1):
                t0 = time.perf_counter()
                logits, cache = step(params, tok, pos, cache, mask)
                jax.block_until_ready((logits, cache))
                times.append(time.perf_counter() - t0)
            ms = out[f"run_ms_{variant}_t{t}"] = 1e3 * float(np.median(times[1:]))
            print(f"run  {variant:14s} T={t:<2d} L={cfg.num_layers}: {ms:8.1f} ms/step", flush=True)
            del cache
    return out


def compile_vs_depth(depths: list[int], reps: int = 2) -> dict[str, dict[int, float]]:
    """Lower+compile seconds (the least of `reps`, after one warm-up compile) of the tiny f32 decode step
    (T=1, reference attention, XLA dots, batch 4, cache 64) per depth; also the trace+lower share."""
    out: dict[str, dict[int, float]] = {v: {} for v in VARIANTS}
    lower: dict[str, dict[int, float]] = {v: {} for v in VARIANTS}
    compile_step(tiny_config("qwen2", linear_impl="xla"), "unrolled", "reference", 4, 64, 1)  # warm-up
    for layers in depths:
        cfg = tiny_config("qwen2", num_layers=layers, linear_impl="xla")
        for variant in VARIANTS:
            runs = [compile_step(cfg, variant, "reference", 4, 64, 1) for _ in range(reps)]
            best = min(runs, key=lambda r: r["compile_s"])
            out[variant][layers], lower[variant][layers] = best["compile_s"], best["lower_s"]
        print(
            f"compile L={layers:<3d} "
            + "  ".join(f"{v}={out[v][layers]:.2f}s (lower {lower[v][layers]:.2f}s)" for v in VARIANTS),
            flush=True,
        )
    return out


def tiny_diffs() -> dict[str, float]:
    """max |logits - unrolled| and max |cache - unrolled| of each scan at the tiny f32 config (T=1, T=4)."""
    cfg = tiny_config("qwen2", num_layers=3, linear_impl="xla")
    model = Transformer(cfg, nnx.Rngs(0))
    out: dict[str, float] = {}
    for t in (1, 4):
        cache, tok, pos, mask = tiny_inputs(cfg, batch=2, seq=32, t=t)
        ref = model(tok, pos, cache, mask)
        defs, params = sd.split_for_scan(model)
        for mode in sd.CACHE_MODES:
            logits, _, got = sd.scan_forward(
                defs, params, tok, pos, StackedKVCache.from_cache(cache), mask, cache_mode=mode
            )
            out[f"max_abs_logits_{mode}_t{t}"] = float(jnp.max(jnp.abs(logits - ref.logits)))
            k_err = jnp.max(jnp.abs(got.k - jnp.stack(ref.cache.k)))
            out[f"max_abs_cache_{mode}_t{t}"] = float(
                max(k_err, jnp.max(jnp.abs(got.v - jnp.stack(ref.cache.v))))
            )
    return out


def tiny_inputs(
    cfg: ModelConfig, batch: int, seq: int, t: int
) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
    """A random filled cache (lengths differ per row), T random tokens at the rows' positions, a tree mask."""
    key = jax.random.PRNGKey(1)
    shape = (batch, cfg.num_kv_heads, seq, cfg.head_dim)
    k = tuple(jax.random.normal(jax.random.fold_in(key, i), shape) for i in range(cfg.num_layers))
    v = tuple(jax.random.normal(jax.random.fold_in(key, 100 + i), shape) for i in range(cfg.num_layers))
    lengths = jnp.asarray([5 + 4 * i for i in range(batch)], jnp.int32)
    tok = jax.random.randint(jax.random.fold_in(key, 7), (batch, t), 0, cfg.vocab_size)
    pos = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
    return KVCache(k=k, v=v, lengths=lengths), tok, pos, tree_mask(batch, t)


def plot(depths: dict[str, dict[int, float]], rows: list[dict], path: pathlib.Path) -> None:
    """Compile seconds vs depth: the tiny config (left), the 7B-width steps of part 1 (right)."""
    plt = h.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for variant, secs in depths.items():
        axes[0].plot(list(secs), list(secs.values()), "o-", label=variant)
    axes[0].set(xlabel="decoder layers", ylabel="lower + compile (s)", title="tiny f32 decode step (T=1)")
    setting = rows[-1]["setting"] if rows else ""
    for variant in VARIANTS:
        pts = sorted(
            (r["layers"], r["compile_s"])
            for r in rows
            if r["variant"] == variant and r["t"] == 1 and r["setting"] == setting
        )
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=variant)
    axes[1].set(xlabel="decoder layers", ylabel="lower + compile (s)", title=f"7B width, T=1 ({setting})")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(alpha=0.3)
    h.save_plot(fig, path)


def result_values(rows: list[dict], depths: dict, runs: dict, diffs: dict, wall: float) -> dict[str, Any]:
    """The RESULT line: per setting, variant and T at the deepest compile, temp MiB, copies of a layer's
    cache per step and MiB of weight copies per step; compile seconds per depth; run ms; max differences."""
    deepest = max(r["layers"] for r in rows)
    out: dict[str, Any] = {"layers": deepest}
    for r in rows:
        if r["layers"] != deepest:
            continue
        key = f"{r['setting']}_{r['variant']}_t{r['t']}"
        out[f"{key}_temp_mib"] = r["temp_bytes"] / MIB
        out[f"{key}_cache_copies"] = r["cache_copies"]
        out[f"{key}_weight_copy_mib"] = r["weight_copy_bytes"] / MIB
    for r in rows:
        if r["t"] == 1 and r["layers"] == deepest and r["variant"] == "unrolled":
            out[f"{r['setting']}_arg_mib"] = r["argument_bytes"] / MIB
            out[f"{r['setting']}_alias_mib"] = r["alias_bytes"] / MIB
    for variant, secs in depths.items():
        out.update({f"compile_s_{variant}_l{n}": s for n, s in secs.items()})
    out.update(runs)
    out.update(diffs)
    out["wall_s"] = wall
    return out


def main() -> None:
    ap = h.parser(__doc__, quick="2 layers, depths 2,4, 2 timed steps", out="workdirs/scan_rollout")
    ap.add_argument("--layers", type=h.ints, default=[2, 4, 8], help="depths of the 7B-width compiles")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cache", type=int, default=4096, help="cache-length bucket")
    ap.add_argument(
        "--depths", type=h.ints, default=[2, 4, 8, 16, 28], help="depths of the tiny compile sweep"
    )
    ap.add_argument("--run-layers", type=int, default=4, help="layers of the timed steps (0: no timing)")
    ap.add_argument("--reps", type=int, default=5, help="timed steps per variant (after one warm-up)")
    ap.add_argument("--settings", default=",".join(CPU_SETTINGS), help=f"of {', '.join(SETTINGS)}")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.depths, args.run_layers, args.reps = [2], [2, 4], 2, 2
    args.settings = [s for s in args.settings.split(",") if s]
    out = h.out_dir(args, "scan_rollout")
    print(h.device_line())
    t0 = time.perf_counter()
    rows: list[dict] = []
    part1(args, rows)
    runs = run_times(args) if args.run_layers else {}
    depths = compile_vs_depth(args.depths)
    diffs = tiny_diffs()
    print("  ".join(f"{k}={v:.2e}" for k, v in diffs.items()))
    (out / "table.txt").write_text("\n".join(_row_line(r) for r in rows) + "\n")
    plot(depths, rows, out / "compile_vs_depth.png")
    print(f"table: {out / 'table.txt'}  plot: {out / 'compile_vs_depth.png'}")
    h.result(result_values(rows, depths, runs, diffs, time.perf_counter() - t0), args, fmt=".4g")


if __name__ == "__main__":
    main()
