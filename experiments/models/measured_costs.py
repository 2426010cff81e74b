"""A 7B cost model fed with what a GPU call measured (issue #38): `project_sd.py --measured` and
`simulate_rl.py --measured` read it instead of a roofline with zero fixed costs.

Input: the JSON of the GPU suite's call 1 (`summary.json`, its `regime_7b.json` phase copy, or the worker's
own file from `gpu/regime_7b.py`), e.g. `docs/gpu_runs/<date>-<device>/summary.json`, or several of one lease,
comma-separated (their cells merged, the later file's winning): Qwen2.5-7B shapes with
random bf16 weights on the device, plain decode steps at (batch, cache bucket) and speculative rounds at
(batch, TV), every fixed per-kernel cost included, plus the device's copy bandwidth and bf16 matmul rate.

The model: `roofline.Roofline` at the measured bandwidth and matmul rate, each plain step and round
multiplied by measured / roofline: exact at every measured cell; between and beyond them the ratio is
interpolated (log2 batch, log2 cache for steps; TV and log2 batch for rounds; held flat past the ends), so
the roofline supplies only the shape between measured points. `describe()` says which inputs are measured
and which are assumed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

import numpy as np

from experiments.models.roofline import QWEN2_5_7B, Roofline

SPOT_STEP_ASSUMED = 0.056  # seconds per spot-trainer step at 7B when no GPU call measured one (an assumption)


def _regime_details(data: dict[str, Any]) -> dict[str, Any]:
    """The worker's results inside any of the accepted files (summary.json, the phase copy, the worker's)."""
    phases = data.get("phases") or {}
    if "regime_7b" in phases:
        return phases["regime_7b"].get("details") or {}
    if data.get("phase") == "regime_7b":
        return data.get("details") or {}
    return data


def _env(data: dict[str, Any], details: dict[str, Any]) -> dict[str, Any]:
    """The env phase's metrics (bandwidth, matmul rate, device) where the file has them."""
    for src in ((data.get("phases") or {}).get("env"), (data.get("lease_results") or {}).get("env")):
        if src and src.get("metrics"):
            return src["metrics"]
    meta = details.get("meta") or {}
    return {k: meta.get(k) for k in ("bandwidth_gb_s", "bf16_matmul_tflops", "device")}


def _read(path: pathlib.Path) -> dict[str, Any]:
    """One file's cells: decode rows, each round row's own plain step, rounds, drafter step, env, meta."""
    data = json.loads(path.read_text())
    d = _regime_details(data)
    rounds = d.get("round", [])
    return {
        "env": _env(data, d),
        "meta": d.get("meta") or {},
        "decode": {(int(r["batch"]), int(r["cache"])): r["step_ms"] / 1e3 for r in d.get("decode", [])},
        "round_plain": {(int(r["batch"]), int(r["cache"])): r["plain_step_ms"] / 1e3 for r in rounds},
        "rounds": {(int(r["batch"]), int(r["tv"])): r["round_ms"] / 1e3 for r in rounds},
        "round_cache": {int(r["cache"]) for r in rounds},
        "drafter_step_s": next((r["step_ms"] / 1e3 for r in d.get("drafter", [])), None),
        "dry": bool(data.get("dry_run")),
    }


def load(spec: str | pathlib.Path) -> dict[str, Any]:
    """{device, bw, flops, plain {(batch, cache): s}, rounds {(batch, tv): s}, round_cache, drafter_step_s
    (None if not measured), model, dry, source}: the cells a GPU call measured. `spec` is one file or
    several, comma-separated (one lease's calls, e.g. a resumed call that measured the cells the first one
    skipped): cells merge, a later file's cell replacing an earlier one, a decode row's plain step winning
    over a round row's; the bandwidth and matmul rate are the first file's that has them. Raises ValueError
    when no file holds a 7B decode cell."""
    paths = [pathlib.Path(p) for p in str(spec).split(",") if p]
    files = [_read(p) for p in paths]
    plain: dict[tuple[int, int], float] = {}
    for f in files:
        plain.update(f["round_plain"])
    for f in files:
        plain.update(f["decode"])
    if not plain:
        raise ValueError(f"{spec}: no 7B decode cell (the GPU suite's regime_7b phase writes them)")
    env = next((f["env"] for f in files if isinstance(f["env"].get("bandwidth_gb_s"), (int, float))), {})
    bw, flops = env.get("bandwidth_gb_s"), env.get("bf16_matmul_tflops")
    if not isinstance(bw, (int, float)) or not isinstance(flops, (int, float)):
        raise ValueError(f"{spec}: no measured bandwidth / matmul rate (the env phase's)")
    meta = next((f["meta"] for f in files if f["meta"]), {})
    drafter = [f["drafter_step_s"] for f in files if f["drafter_step_s"] is not None]
    model = str(meta.get("model", "?"))
    return {
        "device": env.get("device") or meta.get("device"),
        "bw": float(bw) * 1e9,
        "flops": float(flops) * 1e12,
        "plain": plain,
        "rounds": {k: v for f in files for k, v in f["rounds"].items()},
        "round_cache": sorted(set().union(*(f["round_cache"] for f in files))),
        "drafter_step_s": drafter[-1] if drafter else None,
        "model": model,
        "dry": "dry run" in model or any(f["dry"] for f in files),
        "source": ", ".join(str(p) for p in paths),
    }


def _interp(x: float, pts: dict[float, float]) -> float:
    xs = sorted(pts)
    return float(np.interp(x, xs, [pts[k] for k in xs]))


@dataclasses.dataclass(frozen=True)
class MeasuredCosts(Roofline):
    """`Roofline` scaled to a GPU call's measured 7B steps and rounds (see the module docstring)."""

    device: str = ""  # the GPU that measured the cells
    plain_ratio: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    round_ratio: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)

    def _plain_scale(self, batch: int, cache: int) -> float:
        by_cache: dict[float, dict[float, float]] = {}
        for (b, c), r in self.plain_ratio.items():
            by_cache.setdefault(math.log2(c), {})[math.log2(b)] = r
        per_cache = {lc: _interp(math.log2(batch), pts) for lc, pts in by_cache.items()}
        return _interp(math.log2(cache), per_cache)

    def _round_scale(self, batch: int, tv: int) -> float:
        if not self.round_ratio:  # no round measured: the steps' scale (assumed alike)
            return self._plain_scale(batch, 4096)
        by_batch: dict[float, dict[float, float]] = {}
        for (b, t), r in self.round_ratio.items():
            by_batch.setdefault(math.log2(b), {})[float(t)] = r
        per_batch = {lb: _interp(float(tv), pts) for lb, pts in by_batch.items()}
        return _interp(math.log2(batch), per_batch)

    def plain(self, batch: int, cache: int, kv: int = 0) -> float:
        return Roofline.plain(self, batch, cache, kv) * self._plain_scale(batch, cache)

    def round(self, batch: int, tv: int, cache: int, kv: int = 0) -> float:
        return Roofline.round(self, batch, tv, cache, kv) * self._round_scale(batch, tv)


def measured_costs(m: dict[str, Any], draft_vocab: int | None = None) -> MeasuredCosts:
    """The cost model of `load`'s cells: ratios measured / roofline at each cell (rounds at their cache)."""
    roof = Roofline(QWEN2_5_7B, m["bw"], m["flops"], draft_vocab)
    plain = {k: s / roof.plain(*k) for k, s in m["plain"].items()}
    cache = m["round_cache"][0] if m["round_cache"] else 4096
    rounds = {(b, tv): s / roof.round(b, tv, cache) for (b, tv), s in m["rounds"].items()}
    return MeasuredCosts(
        QWEN2_5_7B,
        m["bw"],
        m["flops"],
        draft_vocab,
        device=str(m["device"]),
        plain_ratio=plain,
        round_ratio=rounds,
    )


def describe(m: dict[str, Any], costs: MeasuredCosts) -> list[str]:
    """Which inputs are measured and which assumed, with the measured/roofline ratio of each cell."""
    dry = " (A DRY RUN'S TINY MODEL: not a measurement of anything)" if m["dry"] else ""
    cells = ", ".join(f"b{b}/c{c} x{r:.2f}" for (b, c), r in sorted(costs.plain_ratio.items()))
    rounds = ", ".join(f"b{b}/tv{t} x{r:.2f}" for (b, t), r in sorted(costs.round_ratio.items()))
    return [
        f"costs MEASURED on {m['device']} ({m['model']}; {m['source']}){dry}:",
        f"  bandwidth {m['bw'] / 1e12:.2f} TB/s, bf16 matmul {m['flops'] / 1e12:.0f} TFLOP/s (the env phase)",
        f"  plain steps, measured / roofline: {cells}",
        f"  speculative rounds (cache {m['round_cache']}), measured / roofline: {rounds or 'none measured'}",
        "ASSUMED: between and beyond those cells the ratio is interpolated (log2 batch, log2 cache, TV) and "
        "the roofline gives the shape; rounds at other caches scale like the round cache's; a prefill is the "
        "roofline's (compute-bound, not measured); accept lengths come from the acceptance sources below.",
    ]


def projection_costs(
    gpu: dict[str, Any], measured: str | None, spot_step: float | None
) -> tuple[Roofline, str, str, float]:
    """simulate_rl's projection inputs: (the cost model, what it is, where the spot drafter's step time
    comes from, that time). With `measured` (a GPU call's JSON) the measured steps, rounds and drafter step
    (printing `describe`); else the roofline of the 2026-11-24 run's ceilings, fixed costs assumed hidden."""
    if not measured:
        roof = Roofline(QWEN2_5_7B, gpu["bw"][1], gpu["flops"])
        text = (
            f"project_sd's roofline at {gpu['bw'][1] / 1e12:.2f} TB/s / {gpu['flops'] / 1e12:.0f} TFLOP/s "
            "with paged KV (fixed per-kernel costs assumed hidden)"
        )
        return roof, text, "given" if spot_step else "assumed", spot_step or SPOT_STEP_ASSUMED
    m = load(measured)
    costs = measured_costs(m)
    print("\n".join(describe(m, costs)))
    text = f"MEASURED 7B steps and rounds on {m['device']} ({measured}), paged KV"
    if spot_step:
        return costs, text, "given", spot_step
    if m["drafter_step_s"] is not None:
        return costs, text, "measured", m["drafter_step_s"]
    return costs, text, "assumed", SPOT_STEP_ASSUMED
