"""A 7B cost model fed with what a GPU call measured (issues #38, #45): `project_sd.py --measured` and
`simulate_rl.py --measured` read it instead of a roofline with zero fixed costs.

Input: the JSON of the GPU suite's call 1 (`summary.json`, its `regime_7b.json` phase copy, or the worker's
own file from `gpu/regime_7b.py`), e.g. `docs/gpu_runs/<date>-<device>/summary.json`, or several of one lease,
comma-separated (their cells merged, the later file's winning): Qwen2.5-7B shapes with
random bf16 weights on the device, plain decode steps at (batch, cache bucket) and speculative rounds at
(batch, TV, cache bucket), each round with the plain step of its batch and cache measured beside it, every
fixed per-kernel cost included, plus the device's copy bandwidth and bf16 matmul rate.

The model: `roofline.Roofline` at the measured bandwidth and matmul rate (its drafter head the rounds' draft
vocabulary), each plain step multiplied by measured / roofline, each round by (its measured cost in plain
steps of its own call x the model's plain step at its batch and cache) / roofline: exact at every measured
cell, a round's cost in plain steps the one measured in its call (not mixed with another call's plain step);
between and beyond them the ratios are interpolated (log2 batch, log2 cache for steps; TV, log2 batch,
log2 cache for rounds; held flat past the ends), so the roofline supplies only the shape between measured
points. With rounds at one cache only, the ratio to the roofline is held at every cache: a round does not
follow the plain step's measured slowdown at long caches (`bias` says so, with the figure). `describe()` says
which inputs are measured and which are assumed, `bias()` what is left biased, in one line.
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


def _step_accept(data: dict[str, Any]) -> float | None:
    """The whole-step phase's accept length (rl_step_7b: a random drafter on random weights), if any."""
    for src in (
        (data.get("phases") or {}).get("rl_step_7b"),
        (data.get("lease_results") or {}).get("rl_step_7b"),
    ):
        acc = ((src or {}).get("metrics") or {}).get("rl_spec_accept_len")
        if isinstance(acc, (int, float)):
            return float(acc)
    return None


def _read(path: pathlib.Path) -> dict[str, Any]:
    """One file's cells: decode rows, each round row's own plain step, rounds (seconds and in plain steps of
    their call), drafter step, env, meta."""
    data = json.loads(path.read_text())
    d = _regime_details(data)
    rounds = d.get("round", [])
    if any("cache" not in r for r in rounds):
        raise ValueError(f"{path}: a round row without its cache bucket (gpu/regime_7b.py writes one)")
    cell = lambda r: (int(r["batch"]), int(r["tv"]), int(r["cache"]))  # noqa: E731
    return {
        "env": _env(data, d),
        "meta": d.get("meta") or {},
        "decode": {(int(r["batch"]), int(r["cache"])): r["step_ms"] / 1e3 for r in d.get("decode", [])},
        "round_plain": {(int(r["batch"]), int(r["cache"])): r["plain_step_ms"] / 1e3 for r in rounds},
        "rounds": {cell(r): r["round_ms"] / 1e3 for r in rounds},
        "round_steps": {cell(r): r["round_ms"] / r["plain_step_ms"] for r in rounds},
        "drafter_step_s": next((r["step_ms"] / 1e3 for r in d.get("drafter", [])), None),
        "step_accept": _step_accept(data),
        "dry": bool(data.get("dry_run")),
    }


def load(spec: str | pathlib.Path) -> dict[str, Any]:
    """{device, bw, flops, plain {(batch, cache): s}, rounds {(batch, tv, cache): s}, round_steps
    {(batch, tv, cache): round / the plain step measured beside it}, round_cache (sorted), drafter_step_s
    (None if not measured), step_accept (the whole-step phase's, None if absent), draft_vocab, model, dry,
    source}: the cells a GPU call measured. `spec` is one file or several, comma-separated (one lease's
    calls, e.g. a resumed call that measured the cells the first one skipped): cells merge, a later file's
    cell replacing an earlier one, a decode row's plain step winning over a round row's; the bandwidth and
    matmul rate are the first file's that has them. Raises ValueError when no file holds a 7B decode cell."""
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
    accept = [f["step_accept"] for f in files if f["step_accept"] is not None]
    rounds = {k: v for f in files for k, v in f["rounds"].items()}
    model = str(meta.get("model", "?"))
    return {
        "device": env.get("device") or meta.get("device"),
        "bw": float(bw) * 1e9,
        "flops": float(flops) * 1e12,
        "plain": plain,
        "rounds": rounds,
        "round_steps": {k: v for f in files for k, v in f["round_steps"].items()},
        "round_cache": sorted({c for _, _, c in rounds}),
        "drafter_step_s": drafter[-1] if drafter else None,
        "step_accept": accept[-1] if accept else None,
        "draft_vocab": meta.get("draft_vocab"),
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
    round_ratio: dict[tuple[int, int, int], float] = dataclasses.field(default_factory=dict)

    def _plain_scale(self, batch: int, cache: int) -> float:
        by_cache: dict[float, dict[float, float]] = {}
        for (b, c), r in self.plain_ratio.items():
            by_cache.setdefault(math.log2(c), {})[math.log2(b)] = r
        per_cache = {lc: _interp(math.log2(batch), pts) for lc, pts in by_cache.items()}
        return _interp(math.log2(cache), per_cache)

    def _round_scale(self, batch: int, tv: int, cache: int) -> float:
        """The rounds' measured / roofline ratio: over TV, then log2 batch, then log2 cache (flat beyond);
        no round measured: the plain steps' at the same batch and cache (assumed alike)."""
        if not self.round_ratio:
            return self._plain_scale(batch, cache)
        grid: dict[float, dict[float, dict[float, float]]] = {}
        for (b, t, c), r in self.round_ratio.items():
            grid.setdefault(math.log2(c), {}).setdefault(math.log2(b), {})[float(t)] = r
        per_cache = {
            lc: _interp(math.log2(batch), {lb: _interp(float(tv), pts) for lb, pts in by_b.items()})
            for lc, by_b in grid.items()
        }
        return _interp(math.log2(cache), per_cache)

    def plain(self, batch: int, cache: int, kv: int = 0) -> float:
        return Roofline.plain(self, batch, cache, kv) * self._plain_scale(batch, cache)

    def round(self, batch: int, tv: int, cache: int, kv: int = 0) -> float:
        return Roofline.round(self, batch, tv, cache, kv) * self._round_scale(batch, tv, cache)

    def round_steps(self, batch: int, tv: int, cache: int) -> float:
        """A round's cost in plain steps of the same batch and cache (what a speedup divides accept by)."""
        return self.round(batch, tv, cache) / self.plain(batch, cache)


def measured_costs(m: dict[str, Any], draft_vocab: int | None = None) -> MeasuredCosts:
    """The cost model of `load`'s cells: plain steps' ratios measured / roofline; each round's ratio its
    measured cost in plain steps (its own call's) x the model's plain step at its batch and cache, over the
    roofline round at its cache. The roofline's drafter head: `draft_vocab`, else the rounds' (meta)."""
    vocab = draft_vocab or m.get("draft_vocab")
    roof = Roofline(QWEN2_5_7B, m["bw"], m["flops"], vocab)
    plain = {k: s / roof.plain(*k) for k, s in m["plain"].items()}
    steps = MeasuredCosts(QWEN2_5_7B, m["bw"], m["flops"], vocab, plain_ratio=plain)
    rounds = {
        (b, t, c): r * steps.plain(b, c) / roof.round(b, t, c) for (b, t, c), r in m["round_steps"].items()
    }
    return dataclasses.replace(steps, device=str(m["device"]), round_ratio=rounds)


def describe(m: dict[str, Any], costs: MeasuredCosts) -> list[str]:
    """Which inputs are measured and which assumed, with the measured/roofline ratio of each cell."""
    dry = " (A DRY RUN'S TINY MODEL: not a measurement of anything)" if m["dry"] else ""
    cells = ", ".join(f"b{b}/c{c} x{r:.2f}" for (b, c), r in sorted(costs.plain_ratio.items()))
    rounds = ", ".join(
        f"b{b}/tv{t}/c{c} {m['round_steps'][b, t, c]:.2f} (x{r:.2f})"
        for (b, t, c), r in sorted(costs.round_ratio.items())
    )
    return [
        f"costs MEASURED on {m['device']} ({m['model']}; {m['source']}){dry}:",
        f"  bandwidth {m['bw'] / 1e12:.2f} TB/s, bf16 matmul {m['flops'] / 1e12:.0f} TFLOP/s (the env phase)",
        f"  plain steps, measured / roofline: {cells}",
        "  speculative rounds, in plain steps of their own call (as seconds at the steps above: / roofline): "
        + (rounds or "none measured"),
        "ASSUMED: between and beyond those cells the ratios are interpolated (steps: log2 batch, log2 cache; "
        "rounds: TV, log2 batch, log2 cache) and the roofline gives the shape; a prefill is the roofline's "
        "(compute-bound, not measured); accept lengths come from the acceptance sources below.",
    ]


def _one_cache_bias(m: dict[str, Any], costs: MeasuredCosts, plain_caches: list[int]) -> str:
    """The fallback of rounds at one cache, with a round's cost in plain steps there and where the plain
    steps were measured farthest from it (batch 1 or the smallest round batch, TV 16 or the smallest)."""
    c = m["round_cache"][0]
    far = max(plain_caches, key=lambda x: abs(math.log2(x / c)))
    b = min(b for b, _, _ in m["rounds"])
    tvs = sorted(t for bb, t, _ in m["rounds"] if bb == b)
    t = 16 if 16 in tvs else tvs[0]
    text = f"rounds at one cache ({c}): at other caches a round keeps its {c} ratio to the roofline"
    if far == c:
        return text + " (no plain step measured at another cache either)"
    return (
        f"{text} while plain steps keep their own (b{b}/TV{t}: {costs.round_steps(b, t, c):.2f} plain steps "
        f"at {c}, {costs.round_steps(b, t, far):.2f} assumed at {far}), biased towards SD at long caches"
    )


def bias(m: dict[str, Any], costs: MeasuredCosts, batches: list[int], accept: str) -> str:
    """One line: what still biases a projection from `m`'s costs at `batches` with acceptance `accept`."""
    out = ["A DRY RUN'S TINY MODEL, not a measurement"] if m["dry"] else []
    caches, plain_caches = m["round_cache"], sorted({c for _, c in m["plain"]})
    if not caches:
        out.append("no round measured: rounds scaled like plain steps at the same batch and cache")
    elif len(caches) == 1:
        out.append(_one_cache_bias(m, costs, plain_caches))
    else:
        out.append(f"rounds at {len(caches)} caches {caches}, interpolated in log2 cache, flat beyond")
    for what, have in (
        ("rounds", {b for b, _, _ in m["rounds"]}),
        ("plain steps", {b for b, _ in m["plain"]}),
    ):
        miss = [b for b in batches if b not in have]
        if have and miss:
            out.append(
                f"{what} not measured at batch {miss} (measured {sorted(have)}: interpolated, flat beyond)"
            )
    acc = m.get("step_accept")
    if acc is not None:
        out.append(f"the call's own accept length {acc:.2f} (a random drafter on random weights) not used")
    return "BIAS still in this projection: " + "; ".join([*out, accept])


def projection_costs(
    gpu: dict[str, Any], measured: str | None, spot_step: float | None, rows: int, accept: str
) -> tuple[Roofline, str, str, float]:
    """simulate_rl's projection inputs: (the cost model, what it is, where the spot drafter's step time
    comes from, that time). With `measured` (a GPU call's JSON) the measured steps, rounds and drafter step
    (printing `describe` and the `bias` line for batch buckets up to `rows`, acceptance `accept`); else the
    roofline of the 2026-11-24 run's ceilings, fixed costs assumed hidden."""
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
    print(bias(m, costs, [1 << k for k in range((rows - 1).bit_length() + 1)], accept))
    text = f"MEASURED 7B steps and rounds on {m['device']} ({measured}), paged KV"
    if spot_step:
        return costs, text, "given", spot_step
    if m["drafter_step_s"] is not None:
        return costs, text, "measured", m["drafter_step_s"]
    return costs, text, "assumed", SPOT_STEP_ASSUMED
