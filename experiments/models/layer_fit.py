"""The memory plans' per-layer extrapolation and GPU estimate (issue #24), shared by `memory_plans.py` (the
paper configs' programs) and `rollout_plan.py` (the paper's rollout at its running-rows cap), which both
compile each program at two small depths and extrapolate linearly to the model's.

Imports point one way: memory_plans -> rollout_plan -> layer_fit (and memory_plans -> layer_fit).
"""

from __future__ import annotations

import dataclasses

from experiments.lib import harness as h
from tlt_jax.rollout.programs import ProgramInfo

CONFIGS = {"7b": h.CONFIGS / "qwen2_5_7b.py", "32b": h.CONFIGS / "qwen2_5_32b.py"}
FIELDS = ("argument_bytes", "output_bytes", "temp_bytes", "code_bytes", "alias_bytes")


@dataclasses.dataclass(frozen=True)
class Spec:
    """One program to plan: its key, phase ("rollout", "update", "update_apply", "drafter"), the program
    whose per-layer slope it takes (itself, a batch bucket's first speculative chunk, or () for none: the
    drafter's step does not depend on the target's depth) and the layouts it belongs to."""

    key: tuple
    phase: str
    rep: tuple
    layouts: tuple[str, ...] = ()
    mode: str = "plain"


def extrapolate(
    specs: list[Spec], m1: dict, m2: dict, l1: int, l2: int, layers: int
) -> dict[tuple, ProgramInfo]:
    """Each program at `layers` layers: its bytes at l1 plus its slope program's change per layer."""
    out = {}
    for s in specs:
        a = m1[s.key]
        r1, r2 = (m1[s.rep], m2[s.rep]) if s.rep else (a, a)
        vals = {
            f: getattr(a, f) + (getattr(r2, f) - getattr(r1, f)) * (layers - l1) / (l2 - l1) for f in FIELDS
        }
        ints = {f: max(round(v), 0) for f, v in vals.items()}
        out[s.key] = ProgramInfo(key=s.key, compile_seconds=a.compile_seconds, **ints)
    return out


def fit_errors(specs: list[Spec], m: dict, layers: tuple[int, int, int]) -> list[tuple]:
    """The (l1, l2) fit checked at depth l3 on every slope program: (error / the program's measured need,
    error / the field's measured value (at least 1 MiB), key, field) per program and field (arguments,
    outputs, temporaries), worst first."""
    l1, l2, l3 = layers
    pred = extrapolate([s for s in specs if s.rep == s.key], m[l1], m[l2], l1, l2, l3)
    out = []
    for k, p in pred.items():
        got = m[l3][k]
        need = got.argument_bytes + got.footprint_bytes
        for f in ("argument_bytes", "output_bytes", "temp_bytes"):
            err = abs(getattr(p, f) - getattr(got, f))
            out.append((err / max(need, 2**20), err / max(getattr(got, f), 2**20), k, f))
    return sorted(out, key=lambda e: e[:2], reverse=True)


def fit_error(specs: list[Spec], m: dict, layers: tuple[int, int, int]) -> float:
    """The largest relative error of a field at the check depth (see `fit_errors`)."""
    return max(e[1] for e in fit_errors(specs, m, layers))


def estimate(bf16: ProgramInfo, f32: ProgramInfo) -> dict[str, ProgramInfo]:
    """The GPU estimate's ends: the bfloat16 program's arguments/outputs/code with temporaries "high" (the
    smaller of the two compiles') and "low" (half the float32 compile's)."""
    high = min(bf16.temp_bytes, f32.temp_bytes)
    return {
        "high": dataclasses.replace(bf16, temp_bytes=high),
        "low": dataclasses.replace(bf16, temp_bytes=min(high, f32.temp_bytes // 2)),
    }
