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

    python experiments/bench_verify_cost.py --quick    # ~2 minutes
    python experiments/bench_verify_cost.py
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tlt_jax.kernels import cpu_ffi  # noqa: E402
from tlt_jax.kernels.small_m_linear import small_m_matmul  # noqa: E402
from tlt_jax.models.kv_cache import KVCache  # noqa: E402
from tlt_jax.models.llama import Transformer, causal_mask, from_hf_tensors  # noqa: E402
from tlt_jax.models.loading import DEFAULT_GGUF_PATH, load_gguf  # noqa: E402
from tlt_jax.rollout.engine import EngineConfig  # noqa: E402


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


def interleaved(calls: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median seconds per call of each entry, timed round-robin (one untimed call each first)."""
    for f in calls.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(reps):
        for k, f in calls.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds (~2 minutes)")
    ap.add_argument("--gguf", default=str(DEFAULT_GGUF_PATH))
    ap.add_argument("--tokens", default="1,2,3,4,6,8", help="T values of the forward (1 must be first)")
    ap.add_argument("--rows", default="1,2,3,4,6,8", help="M values of the matmuls (1 must be first)")
    ap.add_argument("--prefix", type=int, default=192, help="cached tokens the forward attends over")
    ap.add_argument("--cache", type=int, default=256, help="KV cache bucket (>= prefix + max T)")
    ap.add_argument("--inner", type=int, default=8, help="forwards / matmul passes per timed call")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds (default 5 quick, 15 full)")
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 15)
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

    loaded = load_gguf(args.gguf)
    model = from_hf_tensors(loaded.config, loaded.tensors)
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

    fwd = interleaved({f"T{t}": fwd_call(t) for t in ts}, reps)
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
    mm = interleaved(calls, reps)
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
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
