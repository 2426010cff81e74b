"""Projected SD speedup at the paper's shapes: speedup(batch, TV) = accept length / round cost.

Validation first, where we can measure directly:
  * GPU (the H100 run in `--gpu-run`, SmolLM2-135M + its warmed drafter): bench_sd's per-cell accept length
    over its round cost (a verify round in plain decode steps) against the speedup it measured (one run's
    own numbers: at batch 1 nearly an identity; what it tests is the formula at batch > 1);
  * CPU (`--cpu-bench LOG --cpu-costs JSON`: a bench_sd run's output and `step_costs.py --bench-shapes` on
    the same machine): bench_sd's accept over the round cost measured separately with the engine's chunk
    programs, against bench_sd's measured speedup.
Each cell agrees within 10% or is listed with the reason.

Then the projection, labelled as such: Qwen2.5-7B (bf16, HF config shapes) on one H100 (on a GPU: the GPU
it runs on, its ceilings measured first), every cost from a roofline scaled to the measured device
(`--gpu-run`: copy bandwidth, bf16 matmul peak): a decode step reads the weights and the batch's KV cache
(our engine reads the whole power-of-two cache bucket) and is bound by the bandwidth unless its FLOPs at the
measured peak take longer; a verify round is one target pass over B x TV
tokens plus `depth` drafter passes (one decoder layer + fc + the target's LM head: TLT's EAGLE-1 drafter,
full vocabulary), each bound the same way. Fixed per-kernel costs, which bound SmolLM2 on the H100 (0.10-0.28
of its roofline), are assumed hidden under the 7B's memory time (Table 2 also adds them, scaled by layers:
the pessimistic bound). Accept length per TV, two sources:
  * ours: the warmed SmolLM2 drafter's sampled per-position acceptance on the H100 (73/54/40/30/23/18% at
    depth 6: accept 3.39, placed at TV 7), scaled to other TVs by the shape of bench_sd's measured
    accept-vs-TV curve at batch 1 (TV 4..64; log-linear in TV);
  * paper: Table 6's adaptive drafter during RL, 6.53 (4.59 for the base-aligned one), placed at TV 48 (the
    reference BEG-MAB's batch-1 bucket) and scaled by the same curve.
Tables: Table 2 (batch 1 tokens/s without / with SD; paper Qwen-7B H100 164.65 / 430.24, 2.61x) and Table 4
(batch 1..32 x TV 4..64, strategies as bench_sd's mapping; the paper's Qwen-32B TP4 cells beside), and
`table4_projection.png` in `--out`.

With `--measured JSON` (a GPU call's 7B costs: `docs/gpu_runs/<date>-<device>/summary.json` of the GPU
suite's call 1, issue #38), the projection's costs are the measured plain steps and rounds at Qwen2.5-7B
shape (fixed per-kernel costs included) instead of the roofline (`measured_costs.py`: the roofline only
interpolates between measured cells, rounds by cache too); Table 2 also at every other cache bucket the call
measured (RESULT keys suffixed `_c<cache>`); the output says which inputs are measured and which assumed, and
a BIAS line what still biases the projection (rounds at one cache only, batch buckets not measured, the
acceptance's source).

    python -m experiments.models.project_sd
    python -m experiments.models.project_sd --measured docs/gpu_runs/<date>-<device>/summary.json
    python -m experiments.models.project_sd --cpu-bench bench_sd.log --cpu-costs bench_costs.json
Final line: `RESULT [measured_t2_plain_tok_s=.. measured_t2_speedup_<source>=..
measured_t4_bs{1,32}_tv{16,64}_<source>=..] t2_speedup_ours=.. t2_speedup_paper=.. t2_speedup_paper_base=..
t2_plain_tok_s=.. t2_speedup_<source>_fixed=.. t4_bs{1,32}_tv{16,64}_{paper,ours}=..
gpu_cells_within_10pct=k/n [cpu_cells_within_10pct=k/n]`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from experiments.lib import harness as h
from experiments.models.roofline import QWEN2_5_7B, Roofline

# the first GPU run's outputs (one H100, 2026-11-24), kept in the repository: what --gpu-run reads by default
GPU_RUN = h.ROOT / "docs" / "gpu_runs" / "2026-11-24-h100"
PAPER_T2 = {"plain_tok_s": 164.65, "sd_tok_s": 430.24, "speedup": 2.61}  # Qwen2.5-7B, batch 1, H100
PAPER_T4 = {(1, 16): 3.22, (32, 16): 2.48, (1, 64): 3.62, (32, 64): 1.70}  # Qwen2.5-32B TP4, H100
PAPER_ACCEPT = {"adaptive": 6.53, "base-aligned": 4.59}  # Table 6, during RL
PAPER_ACCEPT_TV = 48
TVS = (4, 8, 16, 32, 64)
BATCHES = (1, 2, 4, 8, 16, 32)
TOLERANCE = 0.10
Accept = Callable[[int], float]  # tokens_to_verify -> accept length (or accept - 1: a TV curve)


def with_fixed_costs(roof: Roofline, gpu: dict[str, Any], layers: int = 30) -> Roofline:
    """`roof` plus SmolLM2-135M's whole measured batch-1 step and round times on the GPU (launch-bound:
    0.10-0.28 of its roofline), scaled by the layer count: the pessimistic case, nothing overlapped."""
    scale = roof.model.layers / layers
    step = scale / gpu["plain_tok_s_bs1"]
    rounds = {c["tv"]: step * c["round"] for (b, _), c in gpu["cells"].items() if b == 1}
    return dataclasses.replace(roof, fixed_plain=step, fixed_round=rounds)


def tv_curve(accepts: dict[int, float]) -> Accept:
    """f(TV) = accept - 1, interpolated linearly in log2 TV between the measured TVs (flat beyond)."""
    xs = sorted(accepts)
    lx, ly = [math.log2(x) for x in xs], [accepts[x] - 1.0 for x in xs]
    return lambda tv: float(np.interp(math.log2(tv), lx, ly))


def scaled_accept(anchor: float, anchor_tv: int, curve: Accept, tv: int) -> float:
    """Accept length at `tv` of a drafter with accept `anchor` at `anchor_tv`, following `curve`'s shape."""
    return 1.0 + (anchor - 1.0) * curve(tv) / curve(anchor_tv)


def load_gpu_run(folder: pathlib.Path) -> dict[str, Any]:
    """From the GPU suite's outputs: the bench_sd cells (accept, round cost, speedup per batch and TV), the
    drafter's sampled per-position acceptance, the measured bandwidth and bf16 peak."""
    d = json.loads((folder / "call3_summary.json").read_text())
    res = d["lease_results"]
    sd = res["sd"]["metrics"]
    cells = {}
    for k, v in sd.items():
        m = re.fullmatch(r"speedup_bs(\d+)_tv(\d+)", k)
        if m:
            b, tv = int(m[1]), int(m[2])
            acc, rc = sd[f"accept_bs{b}_tv{tv}"], sd[f"round_cost_bs{b}_tv{tv}"]
            cells[(b, f"tv{tv}")] = dict(speedup=v, accept=acc, round=rc, tv=tv)
    ev = d["phases"]["drafter"]["details"]["eval"]["after"]
    env = res["env"]["metrics"]
    bws = [
        env["bandwidth_gb_s"],
        res["decode"]["metrics"].get("bfloat16_bandwidth_gb_s", env["bandwidth_gb_s"]),
    ]
    return dict(
        device=d["device"],
        cells=cells,
        per_position=ev["sampled_per_position"],
        depth=int(ev["depth"]),
        bw=(min(bws) * 1e9, max(bws) * 1e9),
        flops=env["bf16_matmul_tflops"] * 1e12,
        plain_tok_s_bs1=sd["plain_tok_s_bs1"],
    )


def check_cells(
    cells: dict[tuple[int, str], dict[str, Any]], round_of: Callable[[int, dict[str, Any]], float]
) -> list[tuple]:
    """Per cell (batch, column): projected = accept / round cost (round_of(batch, cell), in plain steps)
    against the measured speedup; rows (batch, column, projected, measured, relative error)."""
    out = []
    for (b, col), c in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[1].get("tv", 0), kv[0][1])):
        proj = c["accept"] / round_of(b, c)
        out.append((b, col, proj, c["speedup"], (proj - c["speedup"]) / c["speedup"]))
    return out


def print_check(title: str, rows: list[tuple], why_bs1: str) -> str:
    """Print the cells, flag those outside 10% with the reason (`why_bs1` at batch 1, plus `BATCH_WHY` at
    larger batches); returns "within/total"."""
    print(f"\n{title}\n{'batch':>5} {'column':>6} {'projected':>9} {'measured':>8} {'error':>7}")
    bad = []
    for b, col, p, m, e in rows:
        flag = "" if abs(e) <= TOLERANCE else "  <- outside 10%"
        print(f"{b:>5} {col:>6} {p:>8.2f}x {m:>7.2f}x {100 * e:>+6.1f}%{flag}")
        if flag:
            bad.append((b, f"bs{b}/{col}"))
    if any(b == 1 for b, _ in bad):
        print(f"outside 10% at batch 1: {', '.join(c for b, c in bad if b == 1)}. Why: {why_bs1}")
    if any(b > 1 for b, _ in bad):
        print(f"outside 10% at batch > 1: {', '.join(c for b, c in bad if b > 1)}. Why: {BATCH_WHY}")
    return f"{len(rows) - len(bad)}/{len(rows)}"


BATCH_WHY = (
    "bench_sd's speedup at batch > 1 is a ratio of whole-rollout times, and its rows finish at different "
    "rounds: the SD time is set by the slowest rows (the long ones, and those the drafter predicts worst, "
    "whose accept is below the mean) and includes rounds run with finished rows still in the bucket (until "
    "half of it has finished), while accept / round cost is a mean over live row-rounds; the RL simulator "
    "(simulate_rl.py) models rows finishing at their own times, not per-row acceptance."
)


def parse_result(path: pathlib.Path) -> dict[str, float]:
    """The RESULT line of a bench_sd log as floats (non-numeric values dropped)."""
    line = [x for x in path.read_text().splitlines() if x.startswith("RESULT ")][-1]
    out = {}
    for item in line.split()[1:]:
        k, v = item.split("=", 1)
        try:
            out[k] = float(v)
        except ValueError:
            pass
    return out


def cpu_check(bench: pathlib.Path, costs_path: pathlib.Path) -> str:
    """bench_sd on this CPU: its accept per cell over the round cost step_costs measured at its shapes."""
    res = parse_result(bench)
    costs = json.loads(costs_path.read_text())
    secs = {(r["mode"], r["batch"]): r["seconds"] for r in costs["step_seconds"]}
    cells, names = {}, costs.get("columns", {})
    for k, v in res.items():
        m = re.fullmatch(r"speedup_bs(\d+)_(\w+)", k)
        if m and m[2] in names:
            b, col = int(m[1]), m[2]
            acc = res[f"accept_bs{b}_{col}"]
            cells[(b, col)] = dict(speedup=v, accept=acc, mode=names[col]["mode"], tv=names[col]["tv"])
    if "ngram_speedup_bs1" in res and "ngram" in names:
        acc, ng = res["ngram_accept_len_bs1"], names["ngram"]
        cells[(1, "ngram")] = dict(speedup=res["ngram_speedup_bs1"], accept=acc, mode=ng["mode"], tv=ng["tv"])
    rows = check_cells(cells, lambda b, c: secs[(c["mode"], b)] / secs[("plain", b)])
    why = (
        "the round costs come from step_costs' own chunk timings, a separate run on a shared, loaded CPU "
        "(+-15% between runs here), against bench_sd's medians of 3 pairs"
    )
    return print_check(f"CPU validation ({bench}; costs {costs_path})", rows, why)


def this_gpu(gpu: dict[str, Any]) -> dict[str, Any]:
    """On a GPU, the projection's ceilings measured here (bench_decode's copy bandwidth, a bf16 8192^3
    matmul), so it projects for the GPU it runs on; elsewhere the GPU run's."""
    import jax

    if jax.default_backend() not in ("gpu", "cuda", "rocm"):
        return gpu
    import time

    import jax.numpy as jnp

    from experiments.bench.bench_decode import measure_bandwidth

    bw = measure_bandwidth() * 1e9
    x = jnp.ones((8192, 8192), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return dict(gpu, device=jax.devices()[0].device_kind, bw=(bw, bw), flops=2 * 8192**3 / best)


def accept_sources(gpu: dict[str, Any]) -> dict[str, Accept]:
    """TV -> accept length per source (see the module docstring)."""
    curve = tv_curve({c["tv"]: c["accept"] for (b, _), c in gpu["cells"].items() if b == 1})
    ours = 1.0 + float(sum(gpu["per_position"]))  # the sampled per-position acceptance, depth d
    d = gpu["depth"]
    return {
        "ours": lambda tv: scaled_accept(ours, d + 1, curve, tv),
        "paper": lambda tv: scaled_accept(PAPER_ACCEPT["adaptive"], PAPER_ACCEPT_TV, curve, tv),
        "paper_base": lambda tv: scaled_accept(PAPER_ACCEPT["base-aligned"], PAPER_ACCEPT_TV, curve, tv),
    }


def table4(roof: Roofline, accept: Accept, cache: int) -> dict[tuple[int, int], float]:
    """(batch, TV) -> projected speedup accept(TV) x plain step / round."""
    return {
        (b, tv): accept(tv) * roof.plain(b, cache) / roof.round(b, tv, cache) for b in BATCHES for tv in TVS
    }


def table2(gpu: dict[str, Any], sources: dict[str, Accept], cache: int) -> dict[str, float]:
    """Batch 1: plain and SD tokens/s (best TV per source) over the measured bandwidth range, with fixed
    per-kernel costs hidden (the projection) and added (the pessimistic bound)."""
    res = {}
    for label, fixed in (("hidden", False), ("added", True)):
        roofs = [Roofline(QWEN2_5_7B, bw, gpu["flops"]) for bw in gpu["bw"]]
        if fixed:
            roofs = [with_fixed_costs(r, gpu) for r in roofs]
        plain = [1.0 / r.plain(1, cache) for r in roofs]
        print(
            f"\nTable 2 (batch 1), fixed per-kernel costs {label}: plain {plain[0]:.0f}-{plain[1]:.0f} tok/s "
            f"(paper {PAPER_T2['plain_tok_s']}, SD {PAPER_T2['sd_tok_s']}, {PAPER_T2['speedup']}x)"
        )
        print(f"{'source':>11} {'TV':>3} {'accept':>6} {'round':>6} {'SD tok/s':>11} {'speedup':>7}")
        hi = roofs[1]
        for name, acc in sources.items():
            best = max(TVS, key=lambda tv: acc(tv) / hi.round(1, tv, cache))
            rc = hi.round(1, best, cache) / hi.plain(1, cache)
            sp = acc(best) / rc
            sd = f"{plain[0] * sp:.0f}-{plain[1] * sp:.0f}"
            print(f"{name:>11} {best:>3} {acc(best):>6.2f} {rc:>6.2f} {sd:>11} {sp:>6.2f}x")
            res[f"t2_speedup_{name}" + ("_fixed" if fixed else "")] = sp
        if not fixed:
            res["t2_plain_tok_s"] = plain[1]
    return res


def print_projection(gpu: dict[str, Any], cache: int) -> tuple[dict[str, float], dict]:
    """Table 2 and Table 4 for Qwen2.5-7B on the GPU run's device, both acceptance sources; RESULT keys."""
    sources = accept_sources(gpu)
    print(
        f"\nPROJECTION (not measured): Qwen2.5-7B bf16 on one {gpu['device']}, roofline at the measured "
        f"{gpu['bw'][0] / 1e12:.2f}-{gpu['bw'][1] / 1e12:.2f} TB/s and {gpu['flops'] / 1e12:.0f} TFLOP/s, "
        f"cache bucket {cache} (our engine reads the whole bucket), full-vocabulary EAGLE-1 drafter head; "
        "accept: ours = the SmolLM2 drafter's per-position curve, paper = Table 6, both scaled over TV by "
        "bench_sd's measured curve"
    )
    res = table2(gpu, sources, cache)
    hi = Roofline(QWEN2_5_7B, gpu["bw"][1], gpu["flops"])
    tables = {}
    for name in ("ours", "paper"):
        t = table4(hi, sources[name], cache)
        tables[name] = t
        print(f"\nTable 4, accept from {name} (PROJECTION, hidden fixed costs): speedup (accept)")
        print(f"{'batch':>5} " + " ".join(f"{f'tv{tv}':>13}" for tv in TVS))
        for b in BATCHES:
            cells = [f"{t[b, tv]:.2f}x ({sources[name](tv):.2f})" for tv in TVS]
            print(f"{b:>5} " + " ".join(f"{c:>13}" for c in cells))
    paper = ", ".join(f"bs{b}/tv{tv} {v:.2f}x" for (b, tv), v in PAPER_T4.items())
    print(f"paper Table 4 (Qwen2.5-32B TP4, H100, measured): {paper}")
    for b, tv in PAPER_T4:
        res[f"t4_bs{b}_tv{tv}_paper"] = tables["paper"][b, tv]
        res[f"t4_bs{b}_tv{tv}_ours"] = tables["ours"][b, tv]
    return res, tables


def accept_bias(gpu: dict[str, Any]) -> str:
    """What the acceptance sources still are (for the measured projections' bias line)."""
    return (
        "accept: ours = the warmed SmolLM2-135M EAGLE drafter's sampled per-position acceptance on the "
        f"{gpu['device']} (the --gpu-run's; a 135M target's drafter, not a 7B's), paper = Table 6 (during "
        "RL), both placed over TV by bench_sd's SmolLM2 curve"
    )


def measured_t2(costs: Any, sources: dict[str, Accept], cache: int, measured: bool) -> dict[str, float]:
    """Table 2 (batch 1) at one cache bucket from the measured costs (`measured`: rounds measured at that
    cache): plain tok/s and per source the best TV's speedup (accept / the round in plain steps); RESULT
    keys, suffixed by the cache."""
    plain = 1.0 / costs.plain(1, cache)
    res: dict[str, float] = {f"measured_t2_plain_tok_s_c{cache}": plain}
    note = "" if measured else "; no round measured at this cache: see BIAS"
    print(
        f"\nTable 2 (batch 1, cache {cache}): plain {plain:.0f} tok/s (paper {PAPER_T2['plain_tok_s']}{note})"
    )
    print(f"{'source':>11} {'TV':>3} {'accept':>6} {'round':>6} {'SD tok/s':>9} {'speedup':>7}")
    for name, acc in sources.items():
        best = max(TVS, key=lambda tv: acc(tv) / costs.round(1, tv, cache))
        rc = costs.round_steps(1, best, cache)
        sp = acc(best) / rc
        print(f"{name:>11} {best:>3} {acc(best):>6.2f} {rc:>6.2f} {plain * sp:>9.0f} {sp:>6.2f}x")
        res[f"measured_t2_speedup_{name}_c{cache}"] = sp
    return res


def print_measured(gpu: dict[str, Any], path: str, cache: int) -> tuple[dict[str, float], dict]:
    """Tables 2 and 4 for Qwen2.5-7B with the costs a GPU call measured at 7B shape (`measured_costs`), the
    acceptance sources as in the roofline projection; Table 2 also at every other cache bucket the call
    measured; the bias line. RESULT keys prefixed `measured_` (at `cache` without a cache suffix)."""
    from experiments.models import measured_costs as mc

    m = mc.load(path)
    costs = mc.measured_costs(m)
    print("\nPROJECTION FROM MEASURED COSTS (Qwen2.5-7B shapes, random weights on the device):")
    print("\n".join(mc.describe(m, costs)))
    print(mc.bias(m, costs, list(BATCHES), accept_bias(gpu)))
    sources = accept_sources(gpu)
    res: dict[str, float] = {}
    for c in sorted({cache, *m["round_cache"], *(c for _, c in m["plain"])}):
        t2 = measured_t2(costs, sources, c, c in m["round_cache"])
        res |= {k.removesuffix(f"_c{cache}"): v for k, v in t2.items()}
    tables = {}
    for name in ("ours", "paper"):
        t = table4(costs, sources[name], cache)
        tables[f"measured_{name}"] = t
        print(f"\nTable 4 from measured costs, cache {cache}, accept {name}: speedup (round in plain steps)")
        print(f"{'batch':>5} " + " ".join(f"{f'tv{tv}':>13}" for tv in TVS))
        for b in BATCHES:
            cells = [f"{t[b, tv]:.2f}x ({costs.round_steps(b, tv, cache):.2f})" for tv in TVS]
            print(f"{b:>5} " + " ".join(f"{c:>13}" for c in cells))
        for b, tv in PAPER_T4:
            res[f"measured_t4_bs{b}_tv{tv}_{name}"] = t[b, tv]
    return res, tables


def plot_tables(tables: dict[str, dict[tuple[int, int], float]], path: pathlib.Path) -> None:
    """The projected Table 4 heatmaps, one per acceptance source, the paper's cells marked."""
    fig, axes = h.pyplot().subplots(1, len(tables), figsize=(5.5 * len(tables), 4))
    for ax, (name, t) in zip(np.atleast_1d(axes), tables.items(), strict=True):
        grid = np.array([[t[b, tv] for tv in TVS] for b in BATCHES])
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=max(2.0, grid.max()))
        for i, b in enumerate(BATCHES):
            for j, tv in enumerate(TVS):
                paper = f"\n(paper {PAPER_T4[b, tv]:.2f})" if (b, tv) in PAPER_T4 else ""
                ax.text(j, i, f"{grid[i, j]:.2f}x{paper}", ha="center", va="center", fontsize=7)
        ax.set(xticks=range(len(TVS)), xticklabels=TVS, yticks=range(len(BATCHES)), yticklabels=BATCHES)
        ax.set(
            xlabel="tokens to verify", ylabel="batch", title=f"PROJECTED Qwen2.5-7B / H100, accept: {name}"
        )
        fig.colorbar(im, ax=ax, shrink=0.8)
    h.save_plot(fig, path)


def main(argv: Sequence[str] | None = None) -> None:
    """Validate on the GPU run (and the CPU run if given), then project Tables 2 and 4 for Qwen2.5-7B."""
    ap = h.parser(__doc__, quick=None, out=h.ROOT / "workdirs" / "project_sd")
    ap.add_argument("--gpu-run", default=str(GPU_RUN), help="a GPU suite output folder (call3_summary.json)")
    ap.add_argument(
        "--cpu-bench", default=None, help="a bench_sd.py log (with its RESULT line) from this CPU"
    )
    ap.add_argument("--cpu-costs", default=None, help="step_costs.py --bench-shapes JSON for that run")
    ap.add_argument("--cache", type=int, default=4096, help="cache bucket of the projected steps")
    ap.add_argument(
        "--measured",
        default=None,
        help="a GPU call's 7B costs (summary.json of the suite's call 1; several, comma-separated, merge)",
    )
    args = ap.parse_args(argv)
    gpu = load_gpu_run(pathlib.Path(args.gpu_run))
    res: dict[str, Any] = {}
    rows = check_cells(gpu["cells"], lambda b, c: c["round"])
    res["gpu_cells_within_10pct"] = print_check(
        f"GPU validation ({gpu['device']}, SmolLM2-135M, bench_sd's accept / its round cost vs its measured "
        "speedup; batch 1: nearly an identity)",
        rows,
        "bench_sd's own numbers disagree with each other (timing noise)",
    )
    if args.cpu_bench and args.cpu_costs:
        res["cpu_cells_within_10pct"] = cpu_check(pathlib.Path(args.cpu_bench), pathlib.Path(args.cpu_costs))
    else:
        print("\nCPU validation skipped: pass --cpu-bench LOG --cpu-costs JSON (see the module docstring)")
    proj, tables = print_projection(this_gpu(gpu), args.cache)
    res = {**proj, **res}
    if args.measured:
        measured, mtables = print_measured(gpu, args.measured, args.cache)
        res, tables = {**measured, **res}, {**tables, **mtables}
    out = h.out_dir(args)
    plot_tables(tables, out / "table4_projection.png")
    print(f"\nplot: {out / 'table4_projection.png'}")
    h.result(res, args)


if __name__ == "__main__":
    main()
