"""What gpu/regime_7b.py's parts share: the results file written after every measurement, the clock with
per-part deadlines, the device's memory limit (simulated in a dry run) and peak, the dry run's tiny sizes."""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Any

GIB = 2**30
# of a worker's time after the model's init, per part, in priority order: each part's deadline keeps the later
# parts' shares (what one part leaves goes to the next). On the H200 (2026-11-26) a cold decode program took
# 7-9 s to compile (the plan's 4 decode cells: ~40 s), a cold round program 11-13 s (b1 at TV 16/4/48 and two
# caches: 6 programs, ~75 s; b8 as many more), the drafter's step 21 s; the split (8 programs per TV) gets
# what is left
SHARES = {"decode": 0.35, "round": 0.63, "drafter": 0.01, "split": 0.01, "update": 1.0}
# a program's compile seconds before any has compiled in this process (H200 2026-11-26, cold: the 7B chunk
# programs 7.4 s (plain b1), 11.0 s (3_1_4), 13.2 s (8_2_16))
PRIOR_COMPILE_S = 13.0
TINY = dict(  # a dry run's Qwen2 (the 7B preset's code paths at unit-test sizes)
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
FIT_FRACTION = 0.95  # of the device's memory limit a cell's weights + KV may take before it is skipped
SIMULATED_LIMIT: list[int] = []  # a dry run's device limit (bytes), set once the tiny model exists


class Recorder:
    """The worker's JSON, rewritten (atomically) after every measurement; a clock with per-part deadlines."""

    def __init__(self, path: pathlib.Path, budget_s: float, meta: dict[str, Any]) -> None:
        self.path, self.t0, self.budget_s = path, time.perf_counter(), budget_s
        self.data: dict[str, Any] = {"meta": meta, "compile": [], "skipped": [], "errors": []}
        self.part_deadline = self.t0 + budget_s
        self.estimating: list[float] = []  # compile seconds of the programs the estimate follows
        self.parts_budget: float | None = None  # what the parts share (fixed when the first one starts)
        self.parts_total = 1.0
        self.save()

    def left(self) -> float:
        return self.t0 + self.budget_s - time.perf_counter()

    def part_left(self) -> float:
        return min(self.part_deadline, self.t0 + self.budget_s) - time.perf_counter()

    @property
    def compile_guess(self) -> float:
        """The next program's compile seconds: the largest of this process's programs measured so far that
        the estimate follows (chunk and update programs; not the weights' init, the drafter's step or a
        split's group of 8), PRIOR_COMPILE_S before the first."""
        return max(self.estimating) if self.estimating else PRIOR_COMPILE_S

    def start_part(self, part: str, remaining: list[str]) -> None:
        """This part's deadline: the end of the budget less the shares of the parts after it, of what the
        parts had when the first one started (after the model's init), so what a part leaves goes to the
        next one and no part eats the later parts' shares."""
        if self.parts_budget is None:
            self.parts_budget = max(self.left(), 0.0)
            self.parts_total = sum(SHARES[p] for p in remaining)
        later = sum(SHARES[p] for p in remaining[1:])
        self.part_deadline = self.t0 + self.budget_s - self.parts_budget * later / self.parts_total
        print(f"## part {part}: {self.part_left():.0f}s of {self.left():.0f}s left", flush=True)

    def add(self, key: str, row: dict[str, Any]) -> None:
        self.data.setdefault(key, []).append(row)
        self.save()

    def compiled(self, program: str, seconds: float, estimate: bool = True) -> None:
        """A program's first-call compile seconds; with `estimate`, the guess for the next cell's compile
        follows it (`compile_guess`)."""
        if estimate:
            self.estimating.append(seconds)
        self.add("compile", {"program": program, "seconds": round(seconds, 3)})

    def skip(self, what: str, why: str, kind: str = "budget") -> None:
        """A cell not run: for lack of time ("budget": the phase is partial) or because it cannot fit the
        device ("memory": expected, e.g. 128 rows of 32K tokens on one GPU)."""
        print(f"   skip {what}: {why}", flush=True)
        self.add("skipped", {"what": what, "why": why, "kind": kind})

    def affordable(self, what: str, need_s: float) -> bool:
        """Whether `need_s` seconds are left in this part; else the cell is skipped with the reason."""
        if self.part_left() >= need_s:
            return True
        guess, left = self.compile_guess, max(self.part_left(), 0)
        self.skip(what, f"time budget: needs ~{need_s:.0f}s (compiles + runs; a program ~{guess:.0f}s), "
                  f"{left:.0f}s left in the part")  # fmt: skip
        return False

    def save(self) -> None:
        self.data["meta"]["wall_s"] = round(time.perf_counter() - self.t0, 1)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


# ---- the model, engine and synthetic states -------------------------------------------------------------


def device_limit() -> int | None:
    """Bytes the allocator may use on device 0 (None where the backend does not say, e.g. a CPU); a dry
    run's simulated limit when one is set."""
    import jax

    if SIMULATED_LIMIT:
        return SIMULATED_LIMIT[0]
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def bytes_in_use() -> int | None:
    """Bytes the allocator holds on device 0 now (None where the backend does not say)."""
    import jax

    return (jax.devices()[0].memory_stats() or {}).get("bytes_in_use")


def peak_bytes() -> int | None:
    """The most bytes the allocator has held on device 0 since the process started (None: not reported)."""
    import jax

    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def tree_bytes(tree: Any) -> int:
    import jax
    import numpy as np

    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def gib(n: float) -> str:
    """Bytes as GiB, or MiB below one GiB (a dry run's sizes)."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"
