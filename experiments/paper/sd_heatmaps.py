"""Speculative speedup heatmaps: batch x tokens_to_verify (TLT Table 4) and draft depth x tokens_to_verify at
batch 1 (TLT Fig 13), with the paper's numbers beside ours.

A sibling of `bench_sd.py`, measured the same way (`sd_pairs.py`: `measure_pairs`, per cell an untimed SD
warm-up pass that compiles every program the trajectory needs, then `--reps` interleaved (plain, SD) passes
over the same prompts and PRNG keys; speedup = the median of the per-pair ratios of decode tokens/s, so a
drift of the machine's speed cancels within a pair; prefill and host time excluded). Plain = an engine
without a drafter; SD = the EAGLE drafter, speculative from the first chunk. Accept length = tokens emitted
per row per verify round (accepted drafts + bonus), shown in brackets in each cell.
  * Table 4: rows batch size B (B distinct prompts, n = 1), columns tokens_to_verify TV with bench_sd's
    mapping (`strategy_for`: depth min(8, TV - 1), the smallest topk whose tree holds TV - 1 nodes).
  * Fig 13: batch 1, rows draft depth d, columns TV, strategy d_k_TV with the smallest such topk; cells with
    d > TV - 1 would repeat the d = TV - 1 cell and are left empty.
A cell measured for one table is reused by the other (same batch and strategy). The SD engine compiles one
program per strategy (`share_programs=False`: a shared program verifies to the deepest strategy of its
tokens_to_verify group, which would tax the shallow cells).

What to expect here: on this 2-core CPU a verify pass over T tokens costs more than a decode step as T grows
(docs/benchmarks.md), so short chains at batch 1-2 win and wide trees and big batches lose; the paper's H100
regime (TV 64 best at batch 1, TV 16 best at batch 32) needs compute to spare. Acceptance is bound by the
drafter's training. The prompts are the RL task's (configs/tlt.py, held-out stream positions), the drafter
its warm-up (`configs/drafter_warmup.py:tlt` -> workdirs/drafter_tlt).

    python -m experiments.paper.sd_heatmaps --quick                 # 5 cells, 4 prompts x 48 tokens (minutes)
    python -m experiments.paper.sd_heatmaps --quick --random-drafter  # smoke run without a warmed drafter
    python -m experiments.paper.sd_heatmaps                           # B 1..32 x TV 4..64, depths 2..12 x TV
Outputs `table4_heatmap.png` and `fig13_heatmap.png` in --out, and a final line
`RESULT best_t4=<strategy>@bs<B> best_t4_speedup=.. best_t4_accept=.. best_f13=<strategy> best_f13_speedup=..
best_f13_accept=.. t4_bs{B}_tv{TV}=.. f13_d{d}_tv{TV}=.. wall_s=..` (the t4_/f13_ keys: cell speedups).
"""

from __future__ import annotations

import math
import pathlib
import time

import jax
import numpy as np

from experiments.lib import harness as h
from experiments.lib.sd_pairs import TASK_KWARGS, Pairs, measure_pairs, one_pass, strategy_for
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.strategy import Strategy
from tlt_jax.tasks.datasets import ReasoningGymTask, make_task

PAPER_T4 = {  # Table 4, Qwen2.5-32B on H100: speedup at batch 1 and at batch 32 per tokens_to_verify
    16: (3.22, 2.48),
    64: (3.62, 1.70),
}
PAPER_TEXT = (
    "paper (Qwen2.5-32B, H100): Table 4 TV16 3.22x (bs1) -> 2.48x (bs32), TV64 3.62x -> 1.70x (big trees "
    "lose at large batch); Fig 13 best 3.66x at depth 12, verify 64, acceptance up to 9.78; Table 1 topk "
    "4..16: acceptance 8.29-8.67, speedup 3.47-3.65x (best k 6-10)"
)


def depth_strategy(depth: int, tv: int) -> str | None:
    """d_k_TV with the smallest topk whose EAGLE-2 tree holds TV - 1 draft nodes; None when d > TV - 1."""
    if depth > tv - 1:
        return None
    return strategy_for(tv, max_depth=depth)


def heatmap(
    cells: dict[tuple[int, int], tuple[float, float]],
    rows: list[int],
    cols: list[int],
    row_label: str,
    title: str,
    path: pathlib.Path,
) -> None:
    """Annotated speedup heatmap ("1.23x (2.45)" = speedup (accept length)); empty cells grey."""
    from matplotlib.colors import TwoSlopeNorm

    plt = h.pyplot()

    grid = np.full((len(rows), len(cols)), np.nan)
    for (r, c), (speed, _) in cells.items():
        grid[rows.index(r), cols.index(c)] = speed
    finite = grid[np.isfinite(grid)]
    lo, hi = min(finite.min(initial=1.0), 0.99), max(finite.max(initial=1.0), 1.01)
    fig, ax = plt.subplots(figsize=(max(7.5, 1.3 * len(cols) + 2.5), 0.75 * len(rows) + 2.4))
    cmap = plt.get_cmap("RdYlGn").copy()
    cmap.set_bad("#dddddd")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=TwoSlopeNorm(1.0, lo, hi), aspect="auto")
    for (r, c), (speed, acc) in cells.items():
        ax.text(
            cols.index(c), rows.index(r), f"{speed:.2f}x\n({acc:.2f})", ha="center", va="center", fontsize=9
        )
    for i, j in zip(*np.nonzero(np.isnan(grid)), strict=True):  # e.g. depth > TV - 1: nothing to draft
        ax.text(j, i, "-", ha="center", va="center", color="#777777")
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel("tokens_to_verify")
    ax.set_ylabel(row_label)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="speedup over plain (1 = break-even)")
    h.save_plot(fig, path, dpi=110)


def main() -> None:
    ap = h.parser(
        __doc__,
        quick="B 1,2 x TV 4,8; depths 3,7; 4 prompts x 48 tokens",
        out=h.ROOT / "workdirs" / "sd_heatmaps",
    )
    h.add_drafter_args(ap, h.ROOT / "workdirs" / "drafter_tlt")
    h.add_model_args(ap)
    ap.add_argument(
        "--task", default="tlt", choices=["tlt", *sorted(TASK_KWARGS)], help="tlt: configs/tlt.py"
    )
    ap.add_argument("--task-offset", type=int, default=2000, help="first stream position (held out)")
    ap.add_argument("--batches", default=None, help="Table 4 rows (default 1,2,4,8,16,32; quick 1,2)")
    ap.add_argument("--tv", default=None, help="columns of both tables (default 4,8,16,32,64; quick 4,8)")
    ap.add_argument("--depths", default=None, help="Fig 13 rows (default 2,3,4,6,8,12; quick 3,7)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per cell (>= batch; default 4)")
    ap.add_argument("--new", type=int, default=None, help="max new tokens (default 128; quick 48)")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--reps", type=int, default=None, help="timed (plain, SD) pairs per cell (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t_start = time.perf_counter()
    ints = h.ints
    batches = ints(args.batches or ("1,2" if args.quick else "1,2,4,8,16,32"))
    tvs = ints(args.tv or ("4,8" if args.quick else "4,8,16,32,64"))
    depths = ints(args.depths or ("3,7" if args.quick else "2,3,4,6,8,12"))
    new = args.new or (48 if args.quick else 128)
    reps = args.reps or 2
    n_prompts = max(args.prompts or 4, max(batches))

    loaded, model = h.load_target(args.gguf)
    tok = loaded.tokenizer
    drafter, dname, draft_vocab, vocab_note = h.load_drafter_or_exit(args, model)
    if args.task == "tlt":
        task = make_task(h.load_config(h.TLT_CONFIG).task)
    else:
        task = ReasoningGymTask(args.task, size=5000, seed=0, dataset_kwargs=TASK_KWARGS[args.task])
    _, prompts = h.task_prompts(task, tok, args.task_offset, n_prompts)

    t4 = {(b, tv): strategy_for(tv) for b in batches for tv in tvs}
    f13 = {(d, tv): s for d in depths for tv in tvs if (s := depth_strategy(d, tv)) is not None}
    strategies = sorted({*t4.values(), *f13.values()}, key=lambda s: Strategy.parse(s).tokens_to_verify)
    ahead = max(Strategy.parse(s).lookahead for s in strategies)
    cache = 1 << math.ceil(math.log2(max(map(len, prompts)) + new + ahead + 1))
    ecfg = EngineConfig(
        max_new_tokens=new, max_cache_len=cache, min_cache_bucket=cache, chunk_steps=16, share_programs=False
    )
    eos = list(tok.eos_token_ids)
    plain_engine, sd_engine = h.engine_pair(model, ecfg, eos, drafter, draft_vocab)
    modes = {s: sd_engine.add_mode("eagle", s) for s in strategies}
    print(
        f"{h.device_line()}; SmolLM2-135M fp32; "
        f"drafter {dname} ({vocab_note}); task {args.task} ({n_prompts} prompts); T={args.temperature}; "
        f"<= {new} new tokens; cache {cache}; {reps} timed pairs per cell"
    )
    print(f"Table 4 cells {len(t4)}, Fig 13 cells {len(f13)}; strategies {strategies}")

    def groups_for(b: int) -> list[list[list[int]]]:
        return [prompts[i * b : (i + 1) * b] for i in range(max(1, n_prompts // b))]

    measured: dict[tuple[int, str], Pairs] = {}
    warm: set[int] = set()
    print(
        f"\n{'batch':>5} {'strategy':>9} {'plain tok/s':>11} {'SD tok/s':>9} {'speedup':>8} {'accept':>6} "
        f"{'s':>5}"
    )
    needed = sorted({*((b, s) for (b, _), s in t4.items()), *((1, s) for s in f13.values())})
    for b, s in needed:
        groups = groups_for(b)
        if b not in warm:  # untimed: compiles the plain programs of this batch
            one_pass(plain_engine, groups, None, new, args.temperature, args.seed)
            warm.add(b)
        t0 = time.perf_counter()
        pairs = measure_pairs(
            plain_engine, sd_engine, groups, modes[s], new, args.temperature, args.seed, reps
        )
        measured[b, s] = pairs
        compiles = sum(t.compiles for t in pairs.plain + pairs.sd)
        warn = f"  ({compiles} compiles while timed!)" if compiles else ""
        print(
            f"{b:>5} {s:>9} {pairs.plain_tok_s:>11.1f} {pairs.sd_tok_s:>9.1f} {pairs.speedup:>7.2f}x "
            f"{accept(pairs):>6.2f} {time.perf_counter() - t0:>5.0f}{warn}",
            flush=True,
        )

    cells4 = {(b, tv): (measured[b, s].speedup, accept(measured[b, s])) for (b, tv), s in t4.items()}
    cells13 = {(d, tv): (measured[1, s].speedup, accept(measured[1, s])) for (d, tv), s in f13.items()}
    print(
        "\nTable 4: speedup (accept length), rows batch, columns tokens_to_verify (strategies: bench_sd's "
        "mapping)"
    )
    print(
        f"{'batch':>5} "
        + " ".join(f"{f'TV{tv} ' + strategy_for(tv):>16}" for tv in tvs)
        + "   paper TV16 / TV64"
    )
    for b in batches:
        line = " ".join(f"{f'{cells4[b, tv][0]:.2f}x ({cells4[b, tv][1]:.2f})':>16}" for tv in tvs)
        ref = (
            {1: PAPER_T4[16][0], 32: PAPER_T4[16][1]}.get(b),
            {1: PAPER_T4[64][0], 32: PAPER_T4[64][1]}.get(b),
        )
        paper = f"{ref[0]:.2f}x / {ref[1]:.2f}x" if ref[0] else "-"
        print(f"{b:>5} {line}   {paper}")
    print("\nFig 13 (batch 1): speedup (accept length), rows draft depth, columns tokens_to_verify")
    print(f"{'depth':>5} " + " ".join(f"{f'TV{tv}':>22}" for tv in tvs))
    for d in depths:
        items = []
        for tv in tvs:
            c = cells13.get((d, tv))
            items.append(f"{f'{c[0]:.2f}x ({c[1]:.2f}) {f13[d, tv]}' if c else '-':>22}")
        print(f"{d:>5} " + " ".join(items))
    print(PAPER_TEXT)

    out = h.out_dir(args)
    note = (
        "random drafter: acceptance meaningless"
        if args.random_drafter
        else f"drafter {pathlib.Path(dname).name}"
    )
    heatmap(
        cells4,
        batches,
        tvs,
        "batch size",
        f"Table 4, ours (SmolLM2-135M, {jax.devices()[0].platform}, {note}): speedup over plain (accept "
        "length)\npaper Qwen-32B H100: TV16 3.22x -> 2.48x, TV64 3.62x -> 1.70x from batch 1 to 32",
        out / "table4_heatmap.png",
    )
    heatmap(
        cells13,
        depths,
        tvs,
        "draft depth",
        f"Fig 13, ours (SmolLM2-135M, batch 1, {note}): speedup over plain (accept length)\n"
        "paper: best 3.66x at depth 12 x verify 64, acceptance up to 9.78",
        out / "fig13_heatmap.png",
    )
    print(
        f"plots: {out / 'table4_heatmap.png'}, {out / 'fig13_heatmap.png'}; "
        f"wall {time.perf_counter() - t_start:.0f} s"
    )

    b4 = max(cells4, key=lambda k: cells4[k][0])
    b13 = max(cells13, key=lambda k: cells13[k][0])
    res: dict[str, object] = {
        "best_t4": f"{t4[b4]}@bs{b4[0]}",
        "best_t4_speedup": cells4[b4][0],
        "best_t4_accept": cells4[b4][1],
        "best_f13": f13[b13],
        "best_f13_speedup": cells13[b13][0],
        "best_f13_accept": cells13[b13][1],
    }
    res |= {f"t4_bs{b}_tv{tv}": v[0] for (b, tv), v in cells4.items()}
    res |= {f"f13_d{d}_tv{tv}": v[0] for (d, tv), v in cells13.items()}
    res["wall_s"] = time.perf_counter() - t_start
    h.result(res, args)


def accept(pairs: Pairs) -> float:
    """Accept length of a cell: tokens per verify round over its timed SD passes."""
    return sum(t.accepted for t in pairs.sd) / max(sum(t.rounds for t in pairs.sd), 1)


if __name__ == "__main__":
    main()
