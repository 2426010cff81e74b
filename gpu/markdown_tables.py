"""Markdown cells and tables and pass / fail verdicts, shared by report.md's sections (report.py and
the phases' own sections: regime_phases.py, rl_step_phases.py)."""

from __future__ import annotations

import math
from typing import Any


def cell(v: Any) -> str:
    """A table cell: 3 significant digits for floats, "-" for None and NaN."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def table(head: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(cell(v) for v in row) + " |" for row in rows
    ]


def verdict(value: Any, ok: bool) -> str:
    """A goal's verdict: "na" when nothing was measured, else "pass" / "fail"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "na"
    return "pass" if ok else "fail"


def div(a: Any, b: Any) -> float | None:
    """a / b when both are numbers and b is finite and positive, else None."""
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isfinite(b) and b > 0
    return a / b if ok else None
