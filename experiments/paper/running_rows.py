"""Continuous batching on CPU: the running-rows profile of a capped rollout and its throughput at the cap.

    python -m experiments.paper.running_rows            # 16 prompts x 4 = 64 rows, cap 16, repeats 3
    python -m experiments.paper.running_rows --quick    # 8 prompts x 4 = 32 rows, cap 8, 96 new tokens

SmolLM2 (configs/tlt.py's model, task, temperature and response cap) answers `--prompts` problems `--n` times
with plain decoding, twice with the same key: on an engine with `EngineConfig.max_running_rows = --cap`
(continuous batching: `--cap` rows decode, the rest queue and are prefilled into the slots of finished rows)
and on one without a cap (every row prefilled at once, the tail compacted). Issue #36 asks for both results:

1. The profile. One plot of running rows against elapsed decode seconds (chunk time; inserts and prefill are
   not on the x axis), both rollouts; the decode seconds at <= 32 / 8 / 2 running rows of each
   (`RolloutStats.seconds_at_running`), their wall seconds, and `tokens_identical`: every row's tokens and
   length equal between the two (each row samples from (key, row id, position) only, so the cap changes the
   schedule, never the tokens; a 0 here is a bug to report, not noise).
2. Throughput at the cap, paired. A = the capped rollout above, over its chunks at batch bucket `cap`: every
   chunk before its first compaction (the queued phase, while inserts refill freed slots, and the chunks
   after the queue ran dry until half the slots are free), with ALL its insert seconds added to their chunk
   seconds (every insert precedes one of them). B = an uncapped rollout of exactly `cap` rows (the first
   cap / n prompts x n, same key), over its chunks at batch bucket `cap` (before its first compaction): the
   same program, the same selection rule, no inserts; neither side counts its first prefill. (The chunks
   that ran while rows were queued cannot be told exactly from the stats, which record no per-chunk queue
   length: a chunk can start with every slot live just after the queue ran dry. Before the first compaction
   is a rule both sides share.) A B A B ... `--repeats` times, after one warm-up rollout of each
   (compilation excluded; the same key every time, so no insert shape compiles late).

   The rate is decode steps per second at batch bucket `cap` (inserts included for A): a step's cost does
   not depend on how many of its slots are live (static shapes), so this compares the engines' work on the
   same program. It equals tokens per second divided by mean running rows (plain decoding emits one token per
   live row per step): the per-row-step rate. Raw tokens per second is not comparable: A's slots idle from a
   row's finish to the next chunk's insert, B's idle until its tail compacts, and those differ by schedule,
   not by engine speed; it is printed, as `tok_s_ratio`, but not the headline. The KV cache bucket of a
   step also sets its cost: A's queued phase lasts longer than B's full batch, so its longest row (and
   cache bucket) can grow further; the per-cache-bucket breakdown is printed. The issue asks for
   `capped_over_uncapped` (median over the pairs of A's rate / B's) within 5% of 1. A's inserts are the
   prefill of the queued rows, work B did in its own (uncounted) prefill, so `decode_only_ratio` (A without
   its inserts) and `insert_share` (inserts / A's seconds) say how much of the gap is insert time, and
   `insert_ms_per_row` (A's inserts per queued row) beside `prefill_ms_per_row` (B's one prefill per row)
   whether an insert costs more than the prefill it replaces (a prefill runs each unique prompt once: B's
   n siblings share one, while siblings inserted at different times each prefill their prompt again).

Final line: `RESULT capped_le32_s=.. capped_le8_s=.. capped_le2_s=.. uncapped_le32_s=.. ... capped_wall_s=..
uncapped_wall_s=.. tokens_identical=1 capped_over_uncapped=.. ...` and `running_rows.png` under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from experiments.lib import harness as h
from tlt_jax.models.build import build_model_and_tokenizer
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.types import ChunkRecord, Rollout, RolloutStats
from tlt_jax.tasks import make_task

TAIL_ROWS = (32, 8, 2)


def parse_args() -> argparse.Namespace:
    """The common flags plus the rollout's size, the cap and the repeats; --quick shrinks them."""
    ap = h.parser(
        __doc__,
        quick="8 prompts x 4 = 32 rows, cap 8, 96 new tokens, 2 repeats (a few minutes on 2 cores)",
        out=h.ROOT / "workdirs" / "running_rows",
    )
    ap.add_argument("--config", default=str(h.TLT_CONFIG), help="model, task and sampling")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--cap", type=int, default=16, help="max_running_rows of the capped engine (power of 2)")
    ap.add_argument("--max-new", type=int, default=None, help="response cap (default: the config's)")
    ap.add_argument("--repeats", type=int, default=3, help="A B pairs of the throughput comparison")
    ap.add_argument("--offset", type=int, default=1000, help="task stream position of the first prompt")
    ap.add_argument("--seed", type=int, default=0, help="the rollouts' key")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.n, args.cap, args.repeats = 8, 4, 8, 2
        args.max_new = args.max_new or 96
    if args.cap % args.n or args.cap > args.prompts * args.n:
        ap.error(f"--cap {args.cap} must be a multiple of --n {args.n} and at most the rollout's rows")
    return args


# ---- reading the stats -------------------------------------------------------------------------------------


def timeline(stats: RolloutStats) -> tuple[np.ndarray, np.ndarray]:
    """(elapsed decode seconds at the start of each step, running rows at that step), plus a final point at
    the end of decoding with 0 rows, for a step plot."""
    secs = np.concatenate([[0.0], np.cumsum(stats.seconds_per_step)])
    rows = np.concatenate([np.asarray(stats.running_per_step, float), [0.0]])
    return secs, rows


def at_cap(chunks: Sequence[ChunkRecord], cap: int) -> list[ChunkRecord]:
    """The leading chunks at batch bucket `cap`: a rollout's chunks before its first compaction (module
    docstring, 2). A capped rollout's inserts all precede one of them (compaction waits for the queue)."""
    out: list[ChunkRecord] = []
    for c in chunks:
        if c.batch_bucket != cap:
            break
        out.append(c)
    return out


def rate(chunks: Sequence[ChunkRecord], extra_seconds: float = 0.0) -> dict[str, float]:
    """Over `chunks` (`extra_seconds`, e.g. inserts, added to their time): decode steps per second, tokens per
    second, tokens / s / mean running rows (the per-row-step rate), and the step-weighted cache bucket."""
    steps = sum(c.steps for c in chunks)
    secs = sum(c.seconds for c in chunks) + extra_seconds
    tokens = sum(c.new_tokens for c in chunks)
    row_steps = sum(sum(c.running) for c in chunks)
    mean_rows = row_steps / max(steps, 1)
    return {
        "steps": float(steps),
        "seconds": secs,
        "steps_per_s": steps / max(secs, 1e-9),
        "tok_s": tokens / max(secs, 1e-9),
        "row_step_rate": tokens / max(secs, 1e-9) / max(mean_rows, 1e-9),
        "mean_rows": mean_rows,
        "cache": sum(c.cache_bucket * c.steps for c in chunks) / max(steps, 1),
    }


def capped_rate(out: Rollout, cap: int) -> dict[str, float]:
    """A: the capped rollout's rate over its chunks at bucket `cap`, insert seconds included (and without
    them: `decode_steps_per_s`)."""
    phase = at_cap(out.stats.chunks, cap)
    insert = out.stats.phase_seconds.get("insert", 0.0)
    res = rate(phase, insert)
    res["decode_steps_per_s"] = rate(phase)["steps_per_s"]
    res["insert_s"] = insert
    res["chunks"] = float(len(phase))
    return res


def uncapped_rate(out: Rollout, cap: int) -> dict[str, float]:
    """B: the uncapped rollout's rate over its chunks at bucket `cap` (it has `cap` rows: all before its
    first compaction)."""
    res = rate(at_cap(out.stats.chunks, cap))
    res["chunks"] = float(len(at_cap(out.stats.chunks, cap)))
    res["prefill_s"] = out.stats.phase_seconds.get("prefill", 0.0)
    return res


def per_cache_bucket(chunks: Sequence[ChunkRecord]) -> dict[int, tuple[int, float]]:
    """Cache bucket -> (decode steps, seconds per step) over `chunks`."""
    acc: dict[int, list[float]] = {}
    for c in chunks:
        a = acc.setdefault(c.cache_bucket, [0.0, 0.0])
        a[0] += c.steps
        a[1] += c.seconds
    return {k: (int(s), t / max(s, 1)) for k, (s, t) in sorted(acc.items())}


def rollout_fn(
    engine: RolloutEngine, prompts: list[list[int]], n: int, key: jax.Array, sp: SamplingParams
) -> Any:
    """A function that runs the rollout on `engine` and says if it compiled any program (prefill, insert or
    chunk: the engine's program cache grew), which a timed rollout after its warm-up should not."""

    def run(label: str = "") -> Rollout:
        before = engine.programs.compile_count
        out = engine.generate(prompts, n=n, key=key, sampling=sp)
        if label and engine.programs.compile_count > before:
            print(f"  warning: {label} compiled {engine.programs.compile_count - before} program(s)")
        return out

    return run


def same_tokens(a: Rollout, b: Rollout) -> tuple[bool, int]:
    """(every row's length and tokens equal, rows that differ)."""
    if a.tokens.shape[0] != b.tokens.shape[0]:
        return False, max(a.tokens.shape[0], b.tokens.shape[0])
    diff = sum(
        int(a.lengths[i] != b.lengths[i] or a.response(i) != b.response(i)) for i in range(len(a.lengths))
    )
    return diff == 0, diff


# ---- the runs ----------------------------------------------------------------------------------------------


def build(
    args: argparse.Namespace,
) -> tuple[list[list[int]], int, SamplingParams, RolloutEngine, RolloutEngine]:
    """(the prompts, the response cap, sampling, the uncapped engine, the capped one): one model, two engines
    whose configs differ only in `max_running_rows`."""
    cfg = h.load_config(args.config)
    max_new = args.max_new or int(cfg.rollout.max_new_tokens)
    model, tok = build_model_and_tokenizer(cfg)
    _, prompts = h.task_prompts(make_task(cfg.task.to_dict()), tok, args.offset, args.prompts)
    ecfg = EngineConfig(
        max_new_tokens=max_new, max_cache_len=max(map(len, prompts)) + max_new + 16, chunk_steps=16
    )
    eos = list(tok.eos_token_ids)
    free = RolloutEngine(model, ecfg, eos_ids=eos, tokenizer=tok)
    capped = RolloutEngine(
        model, dataclasses.replace(ecfg, max_running_rows=args.cap), eos_ids=eos, tokenizer=tok
    )
    print(capped.admission_line)
    return prompts, max_new, SamplingParams(float(cfg.rollout.temperature)), free, capped


def paired(
    args: argparse.Namespace, run_a: Any, run_b: Any
) -> tuple[list[float], list[dict[str, float]], list[dict[str, float]], tuple[Rollout, Rollout]]:
    """A B A B ... `args.repeats` times: (A's rate / B's per pair, A's rates, B's rates, the first pair)."""
    ratios: list[float] = []
    rates_a: list[dict[str, float]] = []
    rates_b: list[dict[str, float]] = []
    first: tuple[Rollout, Rollout] | None = None
    for r in range(args.repeats):
        out_a, out_b = run_a(f"pair {r + 1} A"), run_b(f"pair {r + 1} B")
        first = first or (out_a, out_b)
        a, b = capped_rate(out_a, args.cap), uncapped_rate(out_b, args.cap)
        rates_a.append(a)
        rates_b.append(b)
        ratios.append(a["steps_per_s"] / b["steps_per_s"])
        print(
            f"  pair {r + 1}: A {a['steps_per_s']:.2f} steps/s ({a['chunks']:.0f} chunks, "
            f"{a['steps']:.0f} steps, insert {a['insert_s']:.2f} s, cache {a['cache']:.0f}), "
            f"B {b['steps_per_s']:.2f} steps/s "
            f"({b['steps']:.0f} steps, cache {b['cache']:.0f}): A/B {ratios[-1]:.3f}"
        )
    assert first is not None
    return ratios, rates_a, rates_b, first


def plot(capped: Rollout, free: Rollout, args: argparse.Namespace, path: Any) -> Any:
    """Running rows vs elapsed decode seconds, both rollouts; a line at the capped first compaction."""
    fig, ax = h.pyplot().subplots(figsize=(7, 3.8))
    for out, label in ((free, "uncapped"), (capped, f"max_running_rows={args.cap}")):
        x, y = timeline(out.stats)
        ax.step(x, y, where="post", label=f"{label} (wall {out.stats.wall_seconds:.1f} s)")
    phase = at_cap(capped.stats.chunks, args.cap)
    ax.axvline(sum(c.seconds for c in phase), color="gray", ls=":", lw=1, label="capped: first compaction")
    rows = args.prompts * args.n
    ax.set(
        xlabel="elapsed decode seconds",
        ylabel="running rows",
        title=f"{args.prompts} prompts x {args.n} = {rows} rows: uncapped vs cap {args.cap}",
    )
    ax.legend()
    return h.save_plot(fig, path)


def main() -> None:
    args = parse_args()
    print(h.device_line())
    prompts, max_new, sp, free, capped = build(args)
    key = jax.random.key(args.seed)
    few = prompts[: args.cap // args.n]
    rows = len(prompts) * args.n
    print(f"{len(prompts)} prompts x {args.n} = {rows} rows, response cap {max_new}, T={sp.temperature}")
    run_a = rollout_fn(capped, prompts, args.n, key, sp)
    run_b = rollout_fn(free, few, args.n, key, sp)
    run_free = rollout_fn(free, prompts, args.n, key, sp)
    for run in (run_a, run_b, run_free):
        run()  # warm-up: compiles every program of the timed rollouts (same key, same shapes)
    out_free = run_free("uncapped")
    print(f"throughput at the cap: A = capped {rows} rows, B = uncapped {args.cap} rows, paired")
    ratios, rates_a, rates_b, (out_cap, out_b) = paired(args, run_a, run_b)
    identical, diff = same_tokens(out_cap, out_free)
    print(f"capped vs uncapped tokens: {'identical' if identical else f'{diff} of {rows} rows differ'}")
    for name, chunks in (
        ("A", at_cap(out_cap.stats.chunks, args.cap)),
        ("B", at_cap(out_b.stats.chunks, args.cap)),
    ):
        table = ", ".join(
            f"{k}: {s} steps, {1e3 * t:.1f} ms" for k, (s, t) in per_cache_bucket(chunks).items()
        )
        print(f"  {name}, first pair, decode time per step by cache bucket: {table}")
    res: dict[str, Any] = {}
    for name, out in (("capped", out_cap), ("uncapped", out_free)):
        res.update({f"{name}_le{k}_s": out.stats.seconds_at_running(k) for k in TAIL_ROWS})
        res[f"{name}_decode_s"] = out.stats.decode_seconds
        res[f"{name}_wall_s"] = out.stats.wall_seconds
    res["capped_insert_s"] = out_cap.stats.phase_seconds.get("insert", 0.0)
    res["tokens_identical"] = int(identical)
    res["capped_over_uncapped"] = statistics.median(ratios)
    res["ratio_min"], res["ratio_max"] = min(ratios), max(ratios)
    res["decode_only_ratio"] = statistics.median(
        a["decode_steps_per_s"] / b["steps_per_s"] for a, b in zip(rates_a, rates_b, strict=True)
    )
    res["insert_share"] = statistics.median(a["insert_s"] / a["seconds"] for a in rates_a)
    res["insert_ms_per_row"] = 1e3 * statistics.median(a["insert_s"] for a in rates_a) / (rows - args.cap)
    res["prefill_ms_per_row"] = 1e3 * statistics.median(b["prefill_s"] for b in rates_b) / args.cap
    res["tok_s_ratio"] = statistics.median(
        a["tok_s"] / b["tok_s"] for a, b in zip(rates_a, rates_b, strict=True)
    )
    res["cache_a"] = statistics.median(a["cache"] for a in rates_a)
    res["cache_b"] = statistics.median(b["cache"] for b in rates_b)
    res["rows"], res["cap"], res["pairs"] = rows, args.cap, args.repeats
    print(f"plot: {plot(out_cap, out_free, args, h.out_dir(args, 'running_rows') / 'running_rows.png')}")
    h.result(res, args, formats={"cache_a": ".0f", "cache_b": ".0f"})


if __name__ == "__main__":
    main()
