"""The sampling distribution's cost per step: threshold top-p (ours) vs the textbook sort, side by side.

`target_probs` turns a step's logits into the distribution plain decoding and speculative verification both
sample from. With top-p < 1 the textbook version sorts the vocabulary (`lax.top_k(x, V)`); ours finds the
top-p floor by bisection over the float bits (31 masked sums, `tlt_jax/rollout/sampling.py`). Both are
jitted on the same [B, V] logits (V = 49,152, SmolLM2's vocabulary; a verify pass over T tokens has B = rows
x T), interleaved over `--reps` rounds, medians reported; the kept sets are checked equal on every shape.

    python -m experiments.bench.bench_sampling --quick     # ~1 minute
    python -m experiments.bench.bench_sampling

Final line: `RESULT speedup_b1=<sort/ours> speedup_b64=... ms_ours_b64=... ms_sort_b64=...`; a PNG of ms per
step against the batch.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import harness as h
from tlt_jax.rollout.sampling import SamplingParams, target_probs


def sorted_top_p(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The baseline: sort the vocabulary, keep the smallest prefix with mass >= top_p, scatter back."""
    v = logits.shape[-1]
    vals, idx = jax.lax.top_k(logits.astype(jnp.float32) / params.temperature, v)
    p = jax.nn.softmax(vals, axis=-1)
    p = jnp.where(jnp.cumsum(p, axis=-1) - p < params.top_p, p, 0.0)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    rows = jnp.arange(logits.shape[0])[:, None]
    return jnp.zeros_like(p).at[rows, idx].set(p)


def main() -> None:
    ap = h.parser(__doc__, quick="batches 1, 8, 64 and 3 rounds", out="workdirs/bench_sampling")
    ap.add_argument("--vocab", type=int, default=49_152)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args()
    batches = (1, 8, 64) if args.quick else (1, 2, 4, 8, 16, 32, 64, 192)
    reps = args.reps or (3 if args.quick else 7)
    params = SamplingParams(temperature=0.9, top_p=args.top_p)
    fns = {
        "ours": jax.jit(lambda x: target_probs(x, params)),
        "sort": jax.jit(lambda x: sorted_top_p(x, params)),
    }
    rng = np.random.default_rng(0)
    logits, times = {}, {(name, b): [] for name in fns for b in batches}
    differing = 0  # rows whose kept sets differ by a boundary token
    for b in batches:  # language-model-like rows: a few peaked, most flat (logit scales 1-6)
        x = rng.standard_normal((b, args.vocab)).astype(np.float32) * np.linspace(1.0, 6.0, b)[:, None]
        logits[b] = jnp.asarray(x)
        got, want = (np.asarray(f(logits[b])) for f in fns.values())  # compiles both
        # the two sum the mass above a token in different orders, so a token whose mass-before lies within
        # float rounding of top_p can fall on either side: at most that one token per row may differ
        diff = ((got > 0) != (want > 0)).sum(axis=-1)
        if diff.max() > 1:
            raise SystemExit(f"batch {b}: kept sets differ by {diff.max()} tokens in a row (rounding: 1)")
        differing += int((diff > 0).sum())
    for _ in range(reps):
        for b in batches:
            for name, f in fns.items():
                t = time.perf_counter()
                f(logits[b]).block_until_ready()
                times[(name, b)].append(time.perf_counter() - t)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    print(f"rows whose kept set differs from the sort's by one boundary token: {differing} of {sum(batches)}")
    print(f"{'batch':>6} {'ours ms':>9} {'sort ms':>9} {'sort/ours':>9}")
    for b in batches:
        ours, srt = ms[("ours", b)], ms[("sort", b)]
        print(f"{b:>6} {ours:>9.2f} {srt:>9.2f} {srt / ours:>9.1f}")

    out = h.out_dir(args)
    try:
        fig, ax = h.pyplot().subplots(figsize=(6, 4))
        for name in fns:
            ax.plot(batches, [ms[(name, b)] for b in batches], marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="rows (batch x verify tokens)", ylabel="ms per call")
        ax.set_title(f"top-p {args.top_p} distribution, V = {args.vocab}")
        ax.legend()
        print(f"plot: {h.save_plot(fig, out / 'bench_sampling.png')}")
    except ImportError:
        print("matplotlib missing: no plot")
    res = {
        "speedup_b1": ms[("sort", 1)] / ms[("ours", 1)],
        "speedup_b64": ms[("sort", 64)] / ms[("ours", 64)],
        "ms_ours_b64": ms[("ours", 64)],
        "ms_sort_b64": ms[("sort", 64)],
    }
    h.result(res, args, fmt=".2f", formats={"speedup_b1": ".1f", "speedup_b64": ".1f"})


if __name__ == "__main__":
    main()
