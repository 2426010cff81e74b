"""Node scaling (paper: TLT over VeRL 1.21 / 1.45 / 1.62 / 1.76x at 1 / 2 / 4 / 8 nodes, Qwen-7B): PROJECTED.

    python -m experiments.models.node_scaling            # the H200's measured 7B costs (docs/gpu_runs/...)
    python -m experiments.models.node_scaling --roofline # project_sd's roofline of the H100 run instead

The RL-step simulator (experiments/models/simulate_rl.py, `project_steps`) on the paper's 7B workload: one
step of `--prompts` x `--samples` rollouts (the paper's 64 x 8 = 512 on a node), responses up to 32K tokens
(log-normal long tail, median `--median`), split data-parallel over 8 GPUs per node at 1 / 2 / 4 / 8 nodes
(the same global batch: fewer rows per GPU, so the tail is a larger share of each GPU's rollout), SD below
`--threshold` running rows per GPU with the fastest of plain and TV 4..64 per bucket (converged BEG-MAB), the
rest of the step the paper's 15% of the plain step. Step and round costs: the measured Qwen2.5-7B steps and
rounds of the H200 run (`measured_costs.py`, default) or the roofline; accept lengths from project_sd's
sources ("ours": the SmolLM2 drafter's curve, "paper": Table 6's 6.53). Every number is a projection.

What the simulator leaves out: tensor parallelism (one replica per GPU; the paper's rollout runs TP 4, so a
replica holds 4x the rows and its tail is a smaller share), communication (the policy's broadcast to the
replicas, gradient all-reduce across nodes), the update's own scaling (the non-rollout time is a share of
the plain step), stragglers between nodes.

Final line: `RESULT e2e_<source>_n{1,2,4,8}=.. rollout_<source>_n{1,2,4,8}=.. paper_n{1,2,4,8}=..`;
`node_scaling.png` in --out.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from typing import Any

import numpy as np

from experiments.lib import harness as h

PAPER = {1: 1.21, 2: 1.45, 4: 1.62, 8: 1.76}
H200 = h.ROOT / "docs" / "gpu_runs" / "2026-11-26-h200"
MEASURED = ",".join(str(H200 / f"call{i}_summary.json") for i in (1, 3, 4))


def simulate(args: argparse.Namespace, nodes: int) -> dict[str, tuple[float, float]]:
    """{source: (e2e speedup, rollout speedup)} at `nodes` x 8 GPUs."""
    from experiments.models import measured_costs as mc
    from experiments.models import project_sd as ps
    from experiments.models import rl_model as rm
    from experiments.models import simulate_rl as sim

    d = 8 * nodes
    gpu = ps.load_gpu_run(ps.GPU_RUN)
    rows = max(args.prompts * args.samples // d, 1)
    roof, _, _, args.spot_step = mc.projection_costs(gpu, args.measured, None, rows, ps.accept_bias(gpu))
    sources = {k: v for k, v in sim.project_sources(gpu).items() if k in ("ours", "paper")}
    kw = dict(
        devices=d,
        shape=rm.EngineShape(16, 1024, args.prompt_len + args.max_new),
        max_new=args.max_new,
        max_lookahead=max(m.lookahead for ms, _ in sources.values() for m in ms),
        prefill=roof.forward(max(args.prompts // d, 1), args.prompt_len, args.prompt_len),
        chunk_overhead=args.chunk_overhead,
        rollout_overhead=args.rollout_overhead,
    )
    stats, _ = sim.project_steps(args, roof, sources, kw)
    out = {}
    for name, st in stats.items():
        rp, rt = (float(np.mean(x)) for x in zip(*st["roll"], strict=True))
        sp, stl = (float(np.mean(x)) for x in zip(*st["step"], strict=True))
        out[name] = (sp / stl, rp / rt)
    return out


def main() -> None:
    ap = h.parser(__doc__, quick=None, out=None)
    ap.add_argument("--roofline", action="store_true", help="the roofline, not the H200's measured costs")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--median", type=float, default=4096.0)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--threshold", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = h.out_dir(args, "node_scaling")
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    ns: Any = argparse.Namespace(
        prompts=args.prompts, samples=args.samples, median=args.median, sigma=args.sigma, seed=args.seed,
        max_new=32768, prompt_len=512, threshold=args.threshold, steps=args.steps, lengths=None,
        lengths_cap=384, accept_scale=[1.0], chunk_overhead=2.7e-3, rollout_overhead=0.13,
        measured=None if args.roofline else MEASURED, spot_step=None,
    )  # fmt: skip
    print(
        f"PROJECTION (not measured): Qwen2.5-7B GRPO, {args.prompts} x {args.samples} rollouts a step, "
        f"responses log-normal (median {args.median:.0f}, sigma {args.sigma}) cut at 32,768, 8 GPUs a node "
        f"(one replica each), SD below {args.threshold} rows per GPU; costs: "
        f"{'roofline (H100 run)' if args.roofline else 'MEASURED on the H200 (' + str(H200) + ')'}"
    )
    res: dict[str, float] = {}
    for nodes in PAPER:
        r = simulate(ns, nodes)
        line = ", ".join(f"{s}: e2e {e:.2f}x (rollout {ro:.2f}x)" for s, (e, ro) in r.items())
        print(f"{nodes} node(s), {8 * nodes} GPUs: {line}; paper {PAPER[nodes]:.2f}x", flush=True)
        for s, (e, ro) in r.items():
            res[f"e2e_{s}_n{nodes}"], res[f"rollout_{s}_n{nodes}"] = e, ro
    for nodes, v in PAPER.items():
        res[f"paper_n{nodes}"] = v
    plt = h.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = list(PAPER)
    for s in ("ours", "paper"):
        ax.plot(xs, [res[f"e2e_{s}_n{n}"] for n in xs], marker="o", label=f"simulated, accept: {s}")
    ax.plot(xs, list(PAPER.values()), marker="s", color="k", label="paper (measured)")
    ax.set(xlabel="nodes (8 GPUs each)", ylabel="TLT step speedup over plain", xscale="log", xticks=xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_title("node scaling, Qwen2.5-7B (PROJECTED)", fontsize=9)
    ax.legend(fontsize=7)
    h.save_plot(fig, pathlib.Path(out) / "node_scaling.png")
    print("left out: TP (one replica a GPU; paper TP 4), communication, the update's own scaling, stragglers")
    h.result(res, args)


if __name__ == "__main__":
    main()
