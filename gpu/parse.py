"""What the GPU suite's phases read: the PhaseResult they return, and parsers for the outputs of the project's
scripts and tests (RESULT lines, pytest JUnit XML and -v lines, bench_sd rows, argparse flags, orbax steps,
bench_verify_cost's per-phase round times). Pure functions of text and files: unit-tested without a GPU.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"  # the scripts the phases run, as modules


@dataclasses.dataclass
class PhaseResult:
    """One phase's outcome: status ok | partial | failed | timeout | skipped, scalar metrics for the RESULT
    line, and details (rows, errors, paths) for summary.json and the plots."""

    phase: str
    status: str = "ok"
    seconds: float = 0.0
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str = ""

    def record(self, call: str, dry_run: bool) -> dict[str, Any]:
        """The phase's entry in the state's `results/<phase>.json` (and `--out`): the fields, the call,
        whether it was a dry run, and when."""
        return {**dataclasses.asdict(self), "call": call, "dry_run": dry_run, "time": time.ctime()}


def parse_result(text: str) -> dict[str, str]:
    """The last `RESULT key=value ...` line of a script's output as a dict ({} if none)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    return dict(item.split("=", 1) for item in lines[-1].split()[1:] if "=" in item) if lines else {}


def as_number(value: Any) -> Any:
    """float(value) when it is a number, else value unchanged."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def parse_junit(path: pathlib.Path) -> dict[str, Any]:
    """Counts and the first failures of a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = [c for c in case if c.tag in ("failure", "error")]
        if bad:
            counts["failed" if bad[0].tag == "failure" else "errors"] += 1
            failures.append({"test": name, "message": (bad[0].get("message") or bad[0].text or "")[:400]})
        elif any(c.tag == "skipped" for c in case):
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures[:20]}


def parse_pytest_verbose(text: str) -> dict[str, Any]:
    """Counts from `pytest -v` lines (what a run killed before writing its JUnit file still printed)."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for m in re.finditer(
        r"(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED)|(PASSED|FAILED|ERROR|SKIPPED)\s+(\S+::\S+)", text
    ):
        test, word = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        key = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped"}[word]
        counts[key] += 1
        if key in ("failed", "errors"):
            failures.append({"test": test, "message": "(see suite.log)"})
    return {**counts, "failures": failures[:20]}


_SD_ROW = re.compile(
    r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+(\S+)\s+([\d.]+)\s+(\d+)\s+(\d+)", re.M
)


def parse_sd_rows(text: str) -> list[dict[str, Any]]:
    """bench_sd's per-cell rows (batch, column, strategy, plain/SD tok/s, speedup, accept, round cost)."""
    rows = []
    for m in _SD_ROW.finditer(text):
        b, col, mode, plain, sd, speed, accept, cost = m.groups()[:8]
        rows.append(
            {
                "batch": int(b),
                "column": col,
                "strategy": mode,
                "plain_tok_s": float(plain),
                "sd_tok_s": float(sd),
                "speedup": float(speed),
                "accept": as_number(accept),
                "round_cost": float(cost),
            }
        )
    return rows


def script_module(path: pathlib.Path) -> str | None:
    """`experiments.<group>.<name>` for a script of the experiments package (they run as modules), else
    None."""
    path = pathlib.Path(path)
    inside = path.suffix == ".py" and path.parent.parent.resolve() == EXPERIMENTS
    script = inside and path.parent.name != "lib" and path.stem != "__init__"
    return f"experiments.{path.parent.name}.{path.stem}" if script else None


def script_cmd(path: pathlib.Path) -> list[str]:
    """The command that runs a script (from the repository root, as the suite runs everything): `python -m
    experiments.<group>.<name>` for the experiments package's, else `python <path>` (a test's stand-in)."""
    module = script_module(path)
    return [sys.executable, "-m", module] if module else [sys.executable, str(path)]


def script_flags(path: pathlib.Path, env: dict[str, str] | None = None) -> set[str]:
    """The `--flags` a script accepts. An experiments module: the usage line of its `--help` (exact, the
    harness's common flags included; one Python start-up in the repository root, with `env`); any other
    file (a test's stand-in): the flags its argparse calls declare, read from its source."""
    module = script_module(path)
    if module is None:
        return set(re.findall(r"add_argument\(\s*[\"'](--[\w-]+)[\"']", pathlib.Path(path).read_text()))
    cmd = [sys.executable, "-m", module, "--help"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{module} --help failed: {tail(proc.stdout + proc.stderr, 1500)}")
    usage = proc.stdout.split("\n\n", 1)[0]  # argparse's usage block: every option, nothing else
    return set(re.findall(r"(?<![\w-])(--[\w-]+)", usage))


def latest_step(ckpt_dir: pathlib.Path) -> int:
    """The newest complete orbax step under `ckpt_dir` (numeric directory names; temporaries ignored)."""
    steps = [int(p.name) for p in ckpt_dir.glob("*") if p.is_dir() and p.name.isdigit()]
    return max(steps, default=0)


def tail(text: str, n: int = 1500) -> str:
    """The end of a script's output, from a line start: the traceback's last lines say what broke."""
    tail = text[-n:]
    return tail[tail.find("\n") + 1 :] if len(text) > n and "\n" in tail else tail


_ROUND_KEY = re.compile(r"^round_(tv\d+|s\d+_\d+_\d+)(?:_(\w+?))?_(ms|steps)$")


def parse_round_breakdown(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """bench_verify_cost.py --breakdown's rounds from its RESULT keys `round_{column}[_{phase}]_{unit}`
    (column tv{T} or s{strategy}; phases such as draft, verify, accept, commit; unit ms or steps, i.e. plain
    decode steps; no phase: the whole round): one row per column, {"column", "tv", "<phase>_<unit>": ...},
    sorted by tokens_to_verify. Other keys (kernel counts, ...) are not rows."""
    rows: dict[str, dict[str, Any]] = {}
    for key, value in metrics.items():
        m = _ROUND_KEY.match(key)
        if m:
            col, part, unit = m.group(1), m.group(2) or "round", m.group(3)
            tv = int(col[2:]) if col.startswith("tv") else int(col.rsplit("_", 1)[1])
            rows.setdefault(col, {"column": col, "tv": tv})[f"{part}_{unit}"] = as_number(value)
    return sorted(rows.values(), key=lambda r: (r["tv"], r["column"]))
