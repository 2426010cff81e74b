"""Compilation in a researcher's way: a config's first RL steps compiled from nothing, then rerun on the
persistent compilation cache, each run in its own process, side by side.

    python -m experiments.bench.compile_time --quick     # configs/tlt.py:quick, 1 step per run
    python -m experiments.bench.compile_time --steps 2   # configs/tlt.py (make run's config), 2 steps per run
    python -m experiments.bench.compile_time --xla-flags=--xla_gpu_autotune_level=0  # GPU autotuning's cost

Run 1 starts from an empty cache folder and a fresh workdir; run 2 uses the same cache folder and another
fresh workdir (same config and seed, hence the same programs: a rerun of the same command, minus the
checkpoint that would make it resume past step 1). The learner logs what compiled in each step
(`compile/*`, tlt_jax.utils.compile_stats): seconds of tracing, lowering and XLA per kind (rollout/<program
kind>, update, drafter, eval, other), programs compiled and persistent-cache hits. Step 1 includes the
learner's setup. A program read from the cache still pays tracing and lowering (the cache key is the HLO),
so the rerun's seconds are that floor plus the reads.

Final line: `RESULT compile_first_s=.. compile_rerun_s=.. rerun_ratio=.. steps_first_s=.. steps_rerun_s=..
programs_first=.. cache_hits_rerun=.. backend_first_s=.. backend_rerun_s=..`, and a bar chart per kind.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import time

from experiments.lib import harness as h
from tlt_jax.utils.tracking import read_metrics


def run_once(args: argparse.Namespace, cache: pathlib.Path, workdir: pathlib.Path) -> dict[str, float]:
    """One `tlt_jax.main` process on `cache`; returns the summed `compile/*` and `time/*` metrics of its steps
    plus its wall time (`process_s`)."""
    cmd = [
        sys.executable,
        "-m",
        "tlt_jax.main",
        f"--config={args.config}",
        f"--workdir={workdir}",
        f"--config.num_steps={args.steps}",
        f"--config.compilation_cache_dir={cache}",
        "--config.progress_bar=False",
        *args.extra,
    ]
    env = dict(os.environ)
    env.pop("TLT_JAX_COMPILATION_CACHE", None)
    env["TLT_JAX_COMPILE_LOG"] = str(workdir.parent / f"{workdir.name}_programs.json")
    if args.xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=h.ROOT, env=env, check=True)
    wall = time.perf_counter() - t0
    out: dict[str, float] = collections.defaultdict(float)
    for row in read_metrics(workdir / "metrics.jsonl"):
        if int(row["step"]) < 1:
            continue  # the held-out evaluation before training (its compile is counted in step 1)
        for k, v in row.items():
            if (k.startswith("compile/") or k.startswith("time/")) and isinstance(v, (int, float)):
                out[k] += float(v)
    out["process_s"] = wall
    return dict(out)


def kinds(m: dict[str, float]) -> dict[str, float]:
    """Compile seconds per kind (compile/<kind>_s, without the per-phase totals)."""
    skip = {"compile/trace_s", "compile/lower_s", "compile/backend_s", "compile/total_s"}
    return {
        k[len("compile/") : -2]: v
        for k, v in m.items()
        if k.startswith("compile/") and k.endswith("_s") and k not in skip
    }


def plot(first: dict[str, float], rerun: dict[str, float], path: pathlib.Path) -> None:
    plt = h.pyplot()
    a, b = kinds(first), kinds(rerun)
    names = sorted(set(a) | set(b), key=lambda k: -a.get(k, 0.0))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names)), 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [a.get(n, 0.0) for n in names], 0.4, label="first run (empty cache)")
    ax.bar([x + 0.2 for x in xs], [b.get(n, 0.0) for n in names], 0.4, label="rerun (persistent cache)")
    ax.set_xticks(list(xs), names, rotation=30, ha="right")
    ax.set_ylabel("compile seconds (trace + lower + XLA)")
    ax.set_title("Where a run's compilation goes, first run vs rerun")
    ax.legend()
    print(f"plot: {h.save_plot(fig, path)}")


def main() -> None:
    ap = h.parser(
        __doc__,
        quick="configs/tlt.py:quick, 1 step",
        out=None,
        out_help="folder for the cache, workdirs and plot (default: a temp dir)",
    )
    ap.add_argument("--config", default="configs/tlt.py", help="a config file[:args] (default: make run's)")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--xla-flags", default="", help="added to XLA_FLAGS of both runs")
    ap.add_argument("--top", type=int, default=15, help="costliest programs to list")
    ap.add_argument("extra", nargs="*", help="more --config.x=y overrides, after --")
    args = ap.parse_args()
    if args.quick:
        args.config, args.steps = "configs/tlt.py:quick", 1
    out = h.out_dir(args, "compile_time")
    cache = out / "xla_cache"
    if cache.exists() and any(cache.iterdir()):
        raise SystemExit(f"{cache} is not empty: the first run must start from an empty cache (a new --out)")
    first = run_once(args, cache, out / "run1")
    rerun = run_once(args, cache, out / "run2")
    for name, m in (("first", first), ("rerun", rerun)):
        top = sorted(kinds(m).items(), key=lambda kv: -kv[1])
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}s" for k, v in top))
    programs = json.loads((out / "run1_programs.json").read_text())
    print("the first run's costliest XLA compilations (kind, program, seconds, count):")
    for r in programs[: args.top]:
        print(f"  {r['kind']:<22} {r['name']:<40} {r['backend_s']:7.1f}s  x{r['count']}")
    plot(first, rerun, out / "compile_time.png")
    total = "compile/total_s"
    result = {
        "compile_first_s": first[total],
        "compile_rerun_s": rerun[total],
        "rerun_ratio": rerun[total] / max(first[total], 1e-9),
        "steps_first_s": first.get("time/step", 0.0),
        "steps_rerun_s": rerun.get("time/step", 0.0),
        "process_first_s": first["process_s"],
        "process_rerun_s": rerun["process_s"],
        "programs_first": first.get("compile/programs", 0.0),
        "cache_hits_rerun": rerun.get("compile/cache_hits", 0.0),
        "backend_first_s": first.get("compile/backend_s", 0.0),
        "backend_rerun_s": rerun.get("compile/backend_s", 0.0),
    }
    h.result(result, args)


if __name__ == "__main__":
    main()
