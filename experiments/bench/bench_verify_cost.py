"""What a verify pass over T tokens costs, in decode steps: the number that caps batch-1 SD speedup.

A speculative round costs (one target forward over the T = drafts + 1 verify tokens) + (the drafter's
steps), and emits `accept length` tokens, so its speedup is accept / (verify cost + draft cost) where costs
are in plain decode steps. On a GPU a few extra tokens are free (decoding is bound by reading the weights);
on this 2-core CPU they are not, and this script measures by how much, side by side in one process:

  1. forward: SmolLM2-135M (the GGUF, fp32) forwarding T new tokens against a KV cache with a `--prefix`
     token prefix (the engine's linear and attention implementations), for T = 1, 2, 3, 4, 6, 8;
     cost(T) = time(T) / time(1);
  2. matmuls: the model's own weight matrices (4 per layer + the tied LM head) applied to M rows, by the
     small-M CPU kernel (`tlt_jax/kernels/cpu/small_m_linear.cc`) and by XLA's dot, for the same M;
     GB/s = weight bytes / time, and each row's cost relative to M = 1.

Configurations are interleaved (round-robin over `--reps` rounds) and medians reported, so the VM's slow
drifts hit every column alike. Final line: `RESULT fwd_cost_t2=... fwd_cost_t4=... chain_gbs_m1=...`.

`--breakdown` (any backend) instead splits a whole speculative round into its phases, per strategy at TV 4..64
(bench_sd's mapping; `--strategies` to pick): draft, verify forward, accept + sample, commit, beside the round
as the engine runs it and one plain decode step, each its own jitted program on the same inputs
(`verify_breakdown.py`), in ms and in plain-step units, with the kernels, while loops and sequential loop
trips each phase's compiled program runs. `--trace DIR` records the timed calls with `jax.profiler.trace`
(each program named `<strategy>_<phase>`) and writes each program's optimized HLO to DIR/hlo/, which maps
a trace's kernel names to JAX source. Final line: `RESULT plain_step_ms=... round_tv64_steps=...
round_tv64_draft_steps=... kernels_tv64_accept=...` (plot: `--out`/verify_breakdown.png).

    python -m experiments.bench.bench_verify_cost --quick    # ~2 minutes
    python -m experiments.bench.bench_verify_cost
    python -m experiments.bench.bench_verify_cost --breakdown --quick --random-drafter --draft-vocab 8192
    python -m experiments.bench.bench_verify_cost --breakdown --drafter workdirs/drafter_tlt --trace tr
"""

from __future__ import annotations

import argparse
import contextlib
import math
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.bench import verify_breakdown as vb
from experiments.lib import harness as h
from experiments.lib.sd_pairs import strategy_for
from tlt_jax.kernels import cpu_ffi
from tlt_jax.kernels.small_m_linear import small_m_matmul
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import Transformer, causal_mask
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.strategy import Strategy


def forward_loop(model: Transformer, t: int, inner: int, attn_impl: str) -> Callable:
    """Jitted: `inner` forwards of T tokens at the cache's (fixed) length; the cache is the loop carry, so
    each forward overwrites the same T slots and attends over the same prefix."""
    graphdef, _ = nnx.split(model, nnx.Param)

    def run(params, cache, tok):  # noqa: ANN001, ANN202
        m = nnx.merge(graphdef, params)
        pos = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]

        def body(_, carry):  # noqa: ANN001, ANN202
            cache, tok = carry
            out = m(
                jnp.broadcast_to(tok[:, None], (1, t)), pos, cache, causal_mask(1, t), attn_impl=attn_impl
            )
            return out.cache, jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32)

        return jax.lax.fori_loop(0, inner, body, (cache, tok))

    return jax.jit(run, donate_argnums=1)


def weight_matrices(model: Transformer) -> list[jax.Array]:
    """The [N, K] matrices one decode step multiplies by, in order (QKV, O, gate-up, down per layer; head)."""
    ws = []
    for layer in model.layers:
        ws += [layer.attn.qkv[...], layer.attn.o_proj[...], layer.mlp.gate_up[...], layer.mlp.down[...]]
    return ws + [model.head_weight()]


def chain_loop(m_rows: int, inner: int, use_kernel: bool) -> Callable:
    """Jitted: `inner` passes over every weight matrix at M rows, each input depending on the last output
    (so XLA cannot overlap or drop the matmuls)."""

    def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
        return small_m_matmul(x, w) if use_kernel else jnp.einsum("mk,nk->mn", x, w)

    def run(ws, x0):  # noqa: ANN001, ANN202
        def body(_, x):  # noqa: ANN001, ANN202
            for w in ws:
                y = matmul(jnp.broadcast_to(x[:, :1], (m_rows, w.shape[1])) + 1e-3, w)
                x = x + jnp.sum(y[:, :8], axis=1, keepdims=True) * 1e-9
            return x

        return jax.lax.fori_loop(0, inner, body, x0)

    return jax.jit(run)


BREAKDOWN_TV = (4, 8, 16, 32, 64)
PROMPT_TEXT = (
    "Speculative decoding drafts a few tokens with a small model and verifies them with one forward of the "
    "large one; a verify round costs the draft, the verify pass, the acceptance walk and the commit. "
)


def _prompts(tok, n: int, length: int) -> list[list[int]]:  # noqa: ANN001
    """n different prompts of `length` tokens from a fixed text (row i starts i tokens later)."""
    ids = tok.encode(PROMPT_TEXT)
    ids = ids * (1 + (length + n) // max(len(ids), 1))
    return [ids[i : i + length] for i in range(n)]


def breakdown_setup(args: argparse.Namespace) -> tuple[RolloutEngine, dict[str, str], Any, str]:
    """The engine (one mode per strategy), the state every program starts from, a description."""
    loaded, model = h.load_target(args.gguf)
    vocab_n = args.draft_vocab.isdigit()
    dargs = argparse.Namespace(**{**vars(args), "draft_vocab": "none" if vocab_n else args.draft_vocab})
    drafter, dname, vocab, note = h.load_drafter_or_exit(dargs, model)
    if vocab_n:  # the first N ids (a smoke-test stand-in for a warm-up's draft vocabulary)
        vocab, note = (
            list(range(int(args.draft_vocab))),
            f"draft vocabulary: the first {args.draft_vocab} ids",
        )
    names = args.strategies.split(",") if args.strategies else [strategy_for(t) for t in BREAKDOWN_TV]
    strategies = [Strategy.parse(n) for n in names]
    max_new = 64  # the budget rows keep (every program repeats a round on the same rows)
    cache = 1 << math.ceil(math.log2(args.prefix + max(s.lookahead for s in strategies) + 1))
    ecfg = EngineConfig(max_new_tokens=max_new, max_cache_len=args.prefix + max_new + 1, chunk_steps=16)
    engine = RolloutEngine(model, ecfg, eos_ids=[], drafter=drafter, draft_vocab=vocab)
    modes = {s.name: engine.add_mode("eagle", s) for s in strategies}
    sp = SamplingParams(temperature=args.temperature)
    prompts = _prompts(loaded.tokenizer, args.batch, args.prefix)
    state, _ = engine.prefill(
        prompts, n=1, key=jax.random.key(args.seed), sampling=sp, max_new_tokens=max_new
    )
    state = engine.resize_cache(state, cache)
    desc = (
        f"drafter {dname} ({note}, {engine.drafter_weight_dtype or 'float32'} weights); batch {args.batch}, "
        f"prefix {args.prefix}, cache {cache}; temperature {args.temperature}"
    )
    return engine, modes, state, desc


def breakdown(args: argparse.Namespace) -> None:
    """`--breakdown`: per-phase cost of a round vs TV (see the module docstring)."""
    t_start = time.perf_counter()
    engine, modes, state, desc = breakdown_setup(args)
    sp = SamplingParams(temperature=args.temperature)
    dev = jax.devices()[0]
    print(
        f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}); SmolLM2-135M "
        f"{engine.model_config.dtype}; {desc}; {args.inner} runs per call, median of {args.reps} interleaved "
        f"rounds; matmul precision {getattr(engine.programs, 'matmul_precision', None) or 'default'}"
    )
    dump = pathlib.Path(args.trace) / "hlo" if args.trace else None
    timed = {"plain": vb.build(engine, "plain", state, sp, args.inner, dump)["plain"]}
    for name, mode in modes.items():
        for prog, t in vb.build(engine, mode, state, sp, args.inner, dump).items():
            timed[f"{name}/{prog}"] = t
    print(f"compiled {len(timed)} programs in {time.perf_counter() - t_start:.0f} s")
    trace = jax.profiler.trace(args.trace) if args.trace else contextlib.nullcontext()
    with trace:
        sec = vb.interleaved(timed, args.reps)
    ms = {k: v / args.inner * 1e3 for k, v in sec.items()}
    step = ms["plain"]
    tvs = [Strategy.parse(n).tokens_to_verify for n in modes]
    cols = {n: (f"tv{tv}" if tvs.count(tv) == 1 else f"s{n}") for n, tv in zip(modes, tvs, strict=True)}
    results: dict[str, float] = {"plain_step_ms": step, "plain_kernels": timed["plain"].counts.kernels}
    head = ["strategy", "TV", *vb.PHASES, "sum", "round"]
    print(f"\nplain decode step {step:.2f} ms; per round in ms (in plain steps):")
    print(" ".join(f"{h:>14}" for h in head))
    for n, col in cols.items():
        row = {p: ms[f"{n}/{p}"] for p in vb.PROGRAMS}
        row["sum"] = sum(row[p] for p in vb.PHASES)
        cells = [f"{row[p]:7.2f} ({row[p] / step:4.2f})" for p in (*vb.PHASES, "sum", "round")]
        print(f"{n:>14} {Strategy.parse(n).tokens_to_verify:>14} " + " ".join(f"{c:>14}" for c in cells))
        results[f"round_{col}_steps"] = row["round"] / step
        results[f"round_{col}_ms"] = row["round"]
        results[f"round_{col}_phases_steps"] = row["sum"] / step
        for p in vb.PHASES:
            results[f"round_{col}_{p}_steps"] = row[p] / step
    platform, plain_k = jax.devices()[0].platform, timed["plain"].counts.kernels
    print(
        "\ncompiled programs per run: kernels launched (+ those only a conditional's costlier branch "
        f"launches) / while loops / sequential loop trips / sorts+TopK ({platform} HLO; plain step: "
        f"{plain_k:.0f} kernels)"
    )
    print(" ".join(f"{h:>16}" for h in ["strategy", *vb.PROGRAMS]))
    for n, col in cols.items():
        cs = {p: timed[f"{n}/{p}"].counts for p in vb.PROGRAMS}
        cells = [
            f"{c.kernels - c.optional:.0f}{f'+{c.optional:.0f}' if c.optional else ''}/{c.loops:.0f}/"
            f"{c.trips:.0f}/{c.sorts:.0f}"
            for c in cs.values()
        ]
        print(f"{n:>16} " + " ".join(f"{c:>16}" for c in cells))
        for p, c in cs.items():
            results[f"kernels_{col}_{p}"] = c.kernels
            results[f"trips_{col}_{p}"] = c.trips
    last = list(cols)[-1]
    for p in vb.PHASES:
        where = timed[f"{last}/{p}"].counts.where
        print(f"loops of {last} {p}: " + (", ".join(f"{k} x{v:.0f}" for k, v in where.items()) or "none"))
    if any(t.counts.unknown for t in timed.values()):
        print("(loops with no known trip count were counted once)")
    plot_breakdown(h.out_dir(args), cols, ms, timed, vb.PHASES)
    results["wall_s"] = time.perf_counter() - t_start
    print(f"wall {results['wall_s']:.0f} s")
    h.result(results, args, fmt=".4g")


def plot_breakdown(out: pathlib.Path, cols: dict, ms: dict, timed: dict, phases: tuple) -> None:
    """Stacked phases per strategy in plain steps (the whole round as a marker), and kernels per phase."""
    try:
        plt = h.pyplot()
    except ImportError:
        print("matplotlib missing: no plot")
        return
    names = list(cols)
    x = list(range(len(names)))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, value, label in (
        (axes[0], lambda n, p: ms[f"{n}/{p}"] / ms["plain"], "plain decode steps"),
        (axes[1], lambda n, p: timed[f"{n}/{p}"].counts.kernels, "kernels launched per round"),
    ):
        bottom = [0.0] * len(names)
        for p in phases:
            v = [value(n, p) for n in names]
            ax.bar(x, v, bottom=bottom, label=p)
            bottom = [b + y for b, y in zip(bottom, v, strict=True)]
        ax.plot(x, [value(n, "round") for n in names], "k_", markersize=28, mew=2, label="whole round")
        ax.set_xticks(x, [f"{cols[n]}\n{n}" for n in names])
        ax.set_ylabel(label)
    axes[0].axhline(1.0, ls="--", color="gray", lw=1, label="plain step")
    axes[1].axhline(timed["plain"].counts.kernels, ls="--", color="gray", lw=1, label="plain step")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"a verify round by phase ({jax.devices()[0].platform})")
    print(f"plot: {h.save_plot(fig, out / 'verify_breakdown.png', dpi=110)}")


def main() -> None:
    ap = h.parser(
        __doc__,
        quick="fewer rounds (~2 minutes)",
        out="workdirs/bench_verify_cost",
        out_help="--breakdown: plot directory",
    )
    ap.add_argument("--breakdown", action="store_true", help="per-phase cost of a round vs TV (see above)")
    ap.add_argument("--batch", type=int, default=1, help="--breakdown: rows")
    ap.add_argument("--strategies", default=None, help="--breakdown: depth_topk_tv list (default: TV 4..64)")
    h.add_drafter_args(
        ap,
        "workdirs/drafter_tlt",
        prefix="--breakdown: ",
        draft_vocab_help="--breakdown: 'auto' | 'none' | a .npy file | N (the first N ids)",
    )
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--trace",
        default=None,
        help="--breakdown: jax.profiler.trace directory (and each program's HLO in hlo/)",
    )
    h.add_model_args(ap)
    ap.add_argument("--tokens", default="1,2,3,4,6,8", help="T values of the forward (1 must be first)")
    ap.add_argument("--rows", default="1,2,3,4,6,8", help="M values of the matmuls (1 must be first)")
    ap.add_argument("--prefix", type=int, default=192, help="cached tokens the forward attends over")
    ap.add_argument("--cache", type=int, default=256, help="KV cache bucket (>= prefix + max T)")
    ap.add_argument("--inner", type=int, default=8, help="forwards / matmul passes per timed call")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds (default 5 quick, 15 full)")
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 15)
    if args.breakdown:
        args.reps = reps
        return breakdown(args)
    ts = [int(x) for x in args.tokens.split(",")]
    ms = [int(x) for x in args.rows.split(",")]
    if ts[0] != 1 or ms[0] != 1:
        sys.exit("--tokens and --rows must start with 1 (the decode step every cost is relative to)")
    if args.prefix + max(ts) > args.cache:
        sys.exit(f"--cache {args.cache} cannot hold --prefix {args.prefix} + T={max(ts)}: raise --cache")
    if not cpu_ffi.available():
        sys.exit(
            f"the CPU kernels are unavailable ({cpu_ffi.unavailable_reason()}); this script measures them"
        )

    _, model = h.load_target(args.gguf)
    cfg = model.cfg
    attn_impl = EngineConfig().attn_impl
    _, params = nnx.split(model, nnx.Param)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; SmolLM2-135M fp32 "
        f"(linear_impl={cfg.linear_impl}, attn_impl={attn_impl}); prefix {args.prefix}, cache {args.cache}; "
        f"{args.inner} calls per timing, median of {reps} interleaved rounds"
    )

    # 1. the model forward at T tokens
    state: dict[int, tuple] = {}

    def fwd_call(t: int) -> Callable[[], None]:
        f = forward_loop(model, t, args.inner, attn_impl)
        cache = KVCache.init(cfg, 1, args.cache)
        state[t] = (cache.replace(lengths=jnp.full((1,), args.prefix, jnp.int32)), jnp.zeros((1,), jnp.int32))

        def call() -> None:
            state[t] = jax.block_until_ready(f(params, *state[t]))

        return call

    fwd = vb.interleaved({f"T{t}": fwd_call(t) for t in ts}, reps)
    step = fwd["T1"] / args.inner
    results: dict[str, float] = {"decode_step_ms": step * 1e3}
    print(f"\n{'T':>3} {'forward ms':>10} {'cost (steps)':>12}")
    for t in ts:
        sec = fwd[f"T{t}"] / args.inner
        results[f"fwd_cost_t{t}"] = sec / step
        print(f"{t:>3} {sec * 1e3:>10.2f} {sec / step:>12.3f}")

    # 2. the matmuls alone, kernel vs XLA
    ws = weight_matrices(model)
    nbytes = sum(w.size * w.dtype.itemsize for w in ws)
    calls = {}
    for m in ms:
        for kern in (True, False):
            f = chain_loop(m, args.inner, kern)
            x0 = jnp.zeros((m, cfg.hidden_size), jnp.float32)
            calls[f"{'kernel' if kern else 'xla'}_m{m}"] = lambda f=f, x0=x0: jax.block_until_ready(f(ws, x0))
    mm = vb.interleaved(calls, reps)
    print(f"\nweights per pass: {len(ws)} matrices, {nbytes / 1e6:.0f} MB")
    head = ("M", "kernel ms", "GB/s", "cost vs M=1", "XLA ms", "GB/s", "kernel speedup")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (3, 9, 5, 11, 8, 5, 14), strict=True)))
    base = mm["kernel_m1"]
    for m in ms:
        k_s, x_s = mm[f"kernel_m{m}"] / args.inner, mm[f"xla_m{m}"] / args.inner
        results[f"chain_gbs_m{m}"] = nbytes / k_s / 1e9
        results[f"chain_cost_m{m}"] = mm[f"kernel_m{m}"] / base
        results[f"kernel_vs_xla_m{m}"] = x_s / k_s
        print(
            f"{m:>3} {k_s * 1e3:>9.2f} {nbytes / k_s / 1e9:>5.1f} {mm[f'kernel_m{m}'] / base:>11.3f} "
            f"{x_s * 1e3:>8.2f} {nbytes / x_s / 1e9:>5.1f} {x_s / k_s:>13.2f}x"
        )
    h.result(results, args)


if __name__ == "__main__":
    main()
