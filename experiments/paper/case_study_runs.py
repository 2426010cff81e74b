"""The case study's timed runs and what is computed from them (case_study.py measures, this module reports).

`Config` is one way to decode the rollout (an engine, a hook, a selector's learned state) with its timed runs
and their drift-corrected times (each run's seconds over plain's, same key, interpolated to its moment);
`oracle_bound` cuts plain's decode time per batch bucket by the best SD speedup any timed run reached there;
`report` prints the table, writes the PNG (`plot`: running rows over decode time, where SD was on, the arm
each selector chose per chunk) and the RESULT line.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from experiments.lib import harness as h
from tlt_jax.rollout.adaptive import AdaptivePolicy
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import RolloutHooks
from tlt_jax.rollout.types import Rollout

PAPER = "paper Fig 14 (Qwen-7B, H100): 128 requests, SD on below 32 running rows, 2.44x rollout speedup"


class Config:
    """One way to decode the rollout: an engine, a hook factory and (for selectors) a persistent policy."""

    def __init__(self, name: str, engine: RolloutEngine, hook: Callable[[], RolloutHooks | None]):
        self.name, self.engine, self.make_hook = name, engine, hook
        self.policy: AdaptivePolicy | None = None
        self.snapshot: dict[str, Any] | None = None
        self.runs: list[Rollout] = []
        self.key_of: list[int] = []  # per timed run: the index of its measured key
        self.norm: list[float] = []  # per timed run: rollout seconds / plain's (same key) at that time
        self.norm_cpu: list[float] = []  # the same for the process's CPU seconds (all threads)
        self.untimed = 0  # passes that compiled a program (not timed)
        self.compiled_in_timed = 0  # programs compiled during the timed passes (should stay 0)

    def hook(self) -> RolloutHooks | None:
        if self.policy is not None:
            self.policy.policy.load_state_dict(self.snapshot)  # the learned state, never the measured run's
            return self.policy
        return self.make_hook()

    def of_key(self, values: list, j: int) -> list:
        """The entries of a per-timed-run list (runs, norm, norm_cpu) that belong to measured key j."""
        return [v for v, k in zip(values, self.key_of, strict=True) if k == j]

    def rel_key(self, j: int, cpu: bool = False) -> float:
        """Median rollout time relative to plain decoding's with measured key j (drift-corrected; in process
        CPU seconds with `cpu`)."""
        return float(np.median(self.of_key(self.norm_cpu if cpu else self.norm, j)))

    @property
    def rel(self) -> float:
        """Rollout time relative to plain's (1 / speedup): the geometric mean over measured keys of each key's
        median (one key: its median)."""
        return geomean([self.rel_key(j) for j in sorted(set(self.key_of))])

    rel_cpu = property(lambda self: geomean([self.rel_key(j, cpu=True) for j in sorted(set(self.key_of))]))

    def median_run(self, j: int = 0) -> Rollout:
        """The run with measured key j at the median of that key's timings."""
        idx = [i for i, k in enumerate(self.key_of) if k == j]
        return self.runs[idx[int(np.argsort([self.norm[i] for i in idx])[len(idx) // 2])]]


def geomean(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values))))


def sd_share(r: Rollout) -> float:
    return r.stats.sd_seconds / max(r.stats.decode_seconds, 1e-9)


def per_bucket(r: Rollout, spec: bool) -> dict[tuple[int, str], list[float]]:
    """(batch bucket, mode) -> [decode seconds, tokens] of the rollout's plain (spec False) or SD chunks."""
    out: dict[tuple[int, str], list[float]] = {}
    for c in r.stats.chunks:
        if (c.mode != "plain") == spec and c.seconds > 0:
            acc = out.setdefault((c.batch_bucket, c.mode), [0.0, 0.0])
            acc[0], acc[1] = acc[0] + c.seconds, acc[1] + c.new_tokens
    return out


def oracle_bound(plain: Rollout, runs: list[Rollout]) -> tuple[float, dict[int, tuple[float, str]]]:
    """(plain's rollout time / the time with each batch bucket's plain decode time cut by the best SD
    speedup any timed run's SD chunks reached in that bucket, {bucket: (that speedup, its mode)})."""
    base = {b: v for (b, _), v in per_bucket(plain, spec=False).items() if v[1] > 0}
    best: dict[int, tuple[float, str]] = {}
    for r in runs:
        for (b, mode), (s, t) in per_bucket(r, spec=True).items():
            if b in base and (t / s) / (base[b][1] / base[b][0]) > best.get(b, (0.0, ""))[0]:
                best[b] = ((t / s) / (base[b][1] / base[b][0]), mode)
    saved = sum(base[b][0] * (1 - 1 / max(x, 1.0)) for b, (x, _) in best.items())
    return plain.stats.wall_seconds / max(plain.stats.wall_seconds - saved, 1e-9), best


def timeline(r: Rollout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step edges in decode seconds [steps + 1], running rows [steps], SD on [steps]) per step or round."""
    edges = np.concatenate([[0.0], np.cumsum(r.stats.seconds_per_step)])
    return edges, np.asarray(r.stats.running_per_step), np.asarray(r.stats.sd_per_step, bool)


def plot(configs: dict[str, Config], best_fixed: str, path: pathlib.Path, title: str) -> None:
    """Running rows over decode time (SD on shaded) + the arm per chunk of the two selectors."""
    plt = h.pyplot()
    shown = [k for k in ("plain", best_fixed, "sglang", "adaptive") if k in configs]
    fig, axes = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True, gridspec_kw={"height_ratios": [2.2, 1, 1]})
    colors = dict(zip(shown, ["#555555", "#1f77b4", "#ff7f0e", "#2ca02c"], strict=False))
    for name in shown:
        r = configs[name].median_run()
        edges, running, sd = timeline(r)
        label = (
            f"{name} ({r.stats.wall_seconds:.1f} s raw; {1 / configs[name].rel:.2f}x plain, drift-corrected)"
        )
        line = np.maximum(np.append(running, running[-1:]), 1)
        axes[0].step(edges, line, where="post", color=colors[name], label=label, lw=1.4)
        for i in np.nonzero(sd)[0] if name in ("adaptive", best_fixed) else ():
            axes[0].axvspan(edges[i], edges[i + 1], color=colors[name], alpha=0.12, lw=0)
    axes[0].set_yscale("log", base=2)
    axes[0].set_ylabel("running rows (log2)")
    axes[0].legend(fontsize=8, loc="upper right")
    axes[0].set_title(f"{title}\nshaded: SD on (adaptive, {best_fixed})", fontsize=9)
    for ax, name in zip(axes[1:], ("adaptive", "sglang"), strict=True):
        if name not in configs:
            continue
        chunks = configs[name].median_run().stats.chunks
        starts = np.concatenate([[0.0], np.cumsum([c.seconds for c in chunks])])
        arms = sorted({c.mode for c in chunks}, key=lambda a: (a != "plain", a))
        for c, t0 in zip(chunks, starts, strict=False):
            ax.broken_barh([(t0, c.seconds)], (arms.index(c.mode) - 0.4, 0.8), color=colors[name])
        ax.set_yticks(range(len(arms)), arms)
        ax.set_ylabel(f"{name}: arm")
    axes[-1].set_xlabel(
        "decode seconds, raw (chunks only; prefill and host excluded; each run at its own drift)"
    )
    h.save_plot(fig, path, dpi=110)


def report(args: argparse.Namespace, configs: dict[str, Config], info: dict[str, Any]) -> None:
    """The table, the explanation lines, the PNG and the RESULT line. Ratios over several measured keys are
    geometric means of each key's; the table's seconds, accept, SD share and arms are key 0's median run."""
    new, flips, diverged, t_start = info["new"], info["flips"], info["diverged"], info["t_start"]
    keys = sorted(set(configs["plain"].key_of))
    fixed = {k: c for k, c in configs.items() if "@thr" in k}
    best_fixed = min(fixed, key=lambda k: fixed[k].rel)  # ONE strategy for every key, chosen in hindsight
    print(
        f"\n{'configuration':>18} {'rollout s':>9} {'decode s':>8} {'vs plain':>8} {'accept':>6} "
        f"{'cpu vs':>6} {'SD share':>8} {'chunks':>6} {'untimed':>7}  per key vs plain; arms chosen (chunks)"
    )
    for name, c in configs.items():
        r = c.median_run()
        used = sorted(Counter(ch.mode for ch in r.stats.chunks).items())
        arms = ", ".join(f"{a} {k}" for a, k in used) if c.policy is not None else ""
        flag = "  COMPILED WHILE TIMED" if c.compiled_in_timed else ""
        print(
            f"{name:>18} {r.stats.wall_seconds:>9.2f} {r.stats.decode_seconds:>8.2f} {1 / c.rel:>7.2f}x "
            f"{r.stats.mean_accept_length:>6.2f} {1 / c.rel_cpu:>5.2f}x {sd_share(r):>8.2f} "
            f"{len(r.stats.chunks):>6} {c.untimed:>7}  "
            f"{'/'.join(f'{1 / c.rel_key(j):.2f}' for j in keys)}; {arms}{flag}"
        )
    for name in ("sglang", "adaptive"):  # what each selector has learned: median reward, plays
        m = configs[name].policy.policy.summary()
        rewards = [k for k in m if k.endswith("/reward")]
        text = [
            f"{k.split('/')[1]} {k.split('/')[2]} {m[k]:.0f} ({m[k[:-6] + 'count']:.0f})" for k in rewards
        ]
        print(
            f"{name} per bucket b0.. (<= {args.buckets}, rest), arm: median tok/s (chunks): {', '.join(text)}"
        )
    for name, c in fixed.items():
        if sd_share(c.median_run()) == 0.0:
            print(
                f"{name}: never reached <= {args.threshold} running rows, so it decoded exactly as plain "
                "(same programs, same tokens): its ratio to plain is timing noise, not a speedup"
            )
    bounds = []
    for j in keys:  # the tail differs from key to key: lengths, where SD could pay, the bound
        plain = configs["plain"].median_run(j)
        runs = [r for c in configs.values() for r in c.of_key(c.runs, j)]
        bound, best_b = oracle_bound(plain, runs)
        bounds.append(bound)
        tail = plain.stats.seconds_at_running(args.threshold) / max(plain.stats.decode_seconds, 1e-9)
        lens = plain.lengths
        best = ", ".join(f"b{b} {x:.2f}x ({m})" for b, (x, m) in sorted(best_b.items())) or "SD never ran"
        key_best = min(fixed, key=lambda k: fixed[k].rel_key(j))
        print(
            f"key {j}: response lengths p50 {np.median(lens):.0f}, p90 {np.percentile(lens, 90):.0f}, max "
            f"{lens.max()}; {int(np.sum(lens >= new))} rows at the {new}-token cap; {tail:.0%} of plain's "
            f"decode time at <= {args.threshold} running rows; best SD speedup per batch bucket (SD chunks "
            f"vs plain): {best}; bound {bound:.2f}x; best fixed for this key {key_best} "
            f"{1 / fixed[key_best].rel_key(j):.2f}x; adaptive {1 / configs['adaptive'].rel_key(j):.2f}x"
        )
    print(
        f"same tokens as plain in every rollout: {'yes' if not flips + diverged else 'no'} (coupled "
        f"verification); {flips} sequences differ by a float-rounding flip, {diverged} diverge for real"
    )
    print(PAPER)
    out = h.out_dir(args)
    plot(
        configs,
        best_fixed,
        out / "case_study.png",
        f"{info['title']}, SmolLM2-135M ({jax.devices()[0].platform})",
    )
    print(f"plot: {out / 'case_study.png'}; wall {time.perf_counter() - t_start:.0f} s")
    if diverged and not args.allow_mismatch:
        sys.exit(
            "error: SD changed sampled tokens beyond rounding (coupled verification must not): see above"
        )
    rel = lambda k: configs[k].rel  # noqa: E731
    per_key = lambda a, b: [configs[b].rel_key(j) / configs[a].rel_key(j) for j in keys]  # noqa: E731
    res: dict[str, object] = {
        "keys": len(keys),
        "adaptive_vs_plain": rel("plain") / rel("adaptive"),
        "adaptive_vs_best_fixed": rel(best_fixed) / rel("adaptive"),
        "adaptive_vs_plain_min": min(per_key("adaptive", "plain")),
        "adaptive_vs_plain_max": max(per_key("adaptive", "plain")),
        "adaptive_vs_best_fixed_min": min(per_key("adaptive", best_fixed)),
        "adaptive_vs_best_fixed_max": max(per_key("adaptive", best_fixed)),
        "adaptive_vs_ema": rel("sglang") / rel("adaptive"),
        "adaptive_vs_plain_cpu": configs["plain"].rel_cpu / configs["adaptive"].rel_cpu,
        "best_fixed": best_fixed,
        "best_fixed_vs_plain": rel("plain") / rel(best_fixed),
        "sglang_vs_plain": rel("plain") / rel("sglang"),
        "oracle_bound": geomean(bounds),
        "best_fixed_accept": fixed[best_fixed].median_run().stats.mean_accept_length,
        "best_fixed_sd_share": sd_share(fixed[best_fixed].median_run()),
        "adaptive_sd_share": sd_share(configs["adaptive"].median_run()),
        "same_tokens": int(not flips + diverged),
        "flips": flips,
    }
    if "adaptive_fresh" in configs:
        res["fresh_vs_plain"] = rel("plain") / rel("adaptive_fresh")
    res |= {f"{k.split('@')[0]}_vs_plain": rel("plain") / rel(k) for k in fixed}
    res["wall_s"] = time.perf_counter() - t_start
    h.result(res, args)
