"""Chunk-program layouts of the rollout engine (paper Table 5's accounting), shared by the paper's
`program_layouts.py` (compiled on this CPU) and `models/memory_plans.py` (planned at 7B shapes): which
speculative chunk programs each layout keeps, and their totals."""

from __future__ import annotations

from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.programs import ProgramInfo
from tlt_jax.rollout.selector_config import PAPER_BUCKET_BOUNDS, PAPER_BUCKET_TARGETS, beg_eligibility

LAYOUTS = ("single", "naive", "shared")
# + the paper's bucketed layout: shared programs, and per batch bucket only the tokens_to_verify group that
# BEG-MAB's grouping (bs 1 -> 48, 2-4 -> 32, 5-20 -> 16, >= 21 -> 8) plays at its running rows
ALL_LAYOUTS = (*LAYOUTS, "bucketed")


def beg_eligible(engine: RolloutEngine, mode: str, local_batch: int) -> bool:
    """Whether BEG-MAB's paper grouping plays `mode` in a batch bucket of `local_batch` rows per data shard
    (running rows in (local_batch / 2, local_batch], the rows compaction leaves in that bucket)."""
    modes = sorted(engine.modes)
    mask = beg_eligibility(
        tuple(engine.modes[m].strategy.tokens_to_verify for m in modes), PAPER_BUCKET_TARGETS
    )
    rows = range(local_batch // 2 + 1, local_batch + 1)
    buckets = {next(i for i, bound in enumerate(PAPER_BUCKET_BOUNDS) if r <= bound) for r in rows}
    return any(mask[i][modes.index(mode)] for i in buckets)


def layout_programs(engine: RolloutEngine, layout: str, batches: list[int]) -> list[tuple[int, str]]:
    """(batch bucket, a mode that runs it) for every speculative chunk program of the layout: one per
    (bucket, program group); "bucketed" keeps only the groups `beg_eligible` at each bucket (`batches` are
    rows per data shard)."""
    out = []
    for b in batches:
        seen: set[tuple[str, ...]] = set()
        for mode in sorted(engine.modes):
            group = engine.mode_group(mode)
            if group in seen or (layout == "bucketed" and not beg_eligible(engine, mode, b)):
                continue
            seen.add(group)
            out.append((b, mode))
    return out


def layout_totals(infos: dict[str, list[ProgramInfo]]) -> dict[str, dict[str, float]]:
    """Per layout: programs, summed footprint bytes (the paper's accounting: every CUDA graph pins its own
    memory), the largest program's footprint (XLA frees temporaries between programs) and compile seconds."""
    return {
        k: {
            "programs": len(v),
            "bytes": sum(i.footprint_bytes for i in v),
            "peak_bytes": max((i.footprint_bytes for i in v), default=0),
            "compile_s": sum(i.compile_seconds for i in v),
        }
        for k, v in infos.items()
    }
