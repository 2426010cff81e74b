"""The GPU suite's measurement phases that run the project's experiment scripts on the real model: speculative
rollouts identical to plain ones (sd_identity.py), a verify round's breakdown (bench_verify_cost.py),
compile time first run vs rerun (compile_time.py), the SD table (bench_sd.py) and the GRPO end to end
(e2e_speedup.py). Each reads the script's RESULT line (every key, generically) and its --json file where it
writes one; a script another engineer has not landed yet, or without the flag a phase needs, is skipped with
that reason. A dry run checks the scripts' flags without running them (they need the 98 MB model and
minutes; tests/experiments/test_experiments.py smoke-tests them on CPU).
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import time
from typing import TYPE_CHECKING

from gpu.parse import (
    PhaseResult,
    as_number,
    parse_result,
    parse_round_breakdown,
    parse_sd_rows,
    script_cmd,
    script_flags,
    tail,
)

if TYPE_CHECKING:
    from gpu.runner import Suite

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments"
# bench_sd cells on a GPU, most important first: (batch, tokens_to_verify values, timed pairs)
SD_PLAN = [(1, "4,8,16,32,64", 2), (4, "8,16,32", 1), (16, "8,32", 1), (64, "8", 1)]
SD_FLAGS = ("--drafter", "--batches", "--tv", "--new", "--reps", "--ngram")
IDENTITY_FLAGS = (
    "--dtype",
    "--temperature",
    "--prompts",
    "--samples",
    "--max-new",
    "--drafter-path",
    "--json",
)
# float32 first: its identity at XLA's default GPU precision is the fixed defect to re-measure (issue #38:
# 100% expected), with most of the phase (H200 2026-11-26: not even its plain rollout in 49 s; bfloat16's
# took 19.1 s); bfloat16 (what GPU RL stacks roll out in) gets what float32 leaves
IDENTITY_DTYPES = ("float32", "bfloat16")
IDENTITY_FIRST_SHARE = 0.85  # of the phase for float32 (it leaves the rest when it finishes sooner)
# a dtype with less left is skipped: the GGUF's load and the plain rollout's compiles (bfloat16 on the H200,
# 2026-11-26: its plain rollout printed after ~35 s), then the rerun and a strategy
IDENTITY_MIN_S = 45.0
# sd_identity.py's per-strategy line ("   chain  3_1_4  1.000  0  nan  1.23 12  first divergences [...]"):
# what a run cut before its RESULT line still measured
IDENTITY_ROW = re.compile(
    r"^\s*(chain|tree|ngram)\s+(\S+)\s+([\d.]+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\d+)\s+first divergences",
    re.M,
)
DRY = "dry run: the script needs the 98 MB GGUF and minutes; its flags are checked against its argparse"


def _skip(phase: str, note: str) -> PhaseResult:
    return PhaseResult(phase, "skipped", error=note, details={"note": note})


def phase_identity(suite: Suite, timeout: float) -> PhaseResult:
    """sd_identity.py per dtype (float32 first, IDENTITY_FIRST_SHARE of the phase; bfloat16 what it leaves),
    at XLA's default GPU matmul precision (nothing set: what the engine's programs choose themselves): 16
    prompts x 4 samples x 128 tokens at T 0.9, plain vs SD with the same keys (EAGLE chain, tree, n-gram):
    the fraction of sequences identical token for token, first divergences, and a plain rerun as the
    control. The EAGLE drafter is this lease's warmed one when the drafter phase has made one, else an
    untrained one. Each dtype's result is printed and written (the state's results, --out) as it ends; a run
    cut before its RESULT line keeps the strategies it printed. The script's flags are checked in a dry run
    only (on a GPU the check is one more Python start with JAX: ~20 s on the H200, 2026-11-26)."""
    script = EXP / "checks" / "sd_identity.py"
    if suite.dry:
        missing = [f for f in IDENTITY_FLAGS if f not in script_flags(script, suite.child_env("flags", {}))]
        if missing:
            return PhaseResult("identity", "failed", error=f"{script.name} no longer takes {missing}")
        return PhaseResult("identity", "ok", details={"note": DRY, "flags_checked": list(IDENTITY_FLAGS)})
    trained = (suite.drafter_dir / "drafter").is_dir()
    drafter = ["--drafter-path", str(suite.drafter_dir)] if trained else []
    res = PhaseResult("identity", details={"drafter": str(suite.drafter_dir) if trained else "untrained"})
    bad: list[str] = []
    for i, dt in enumerate(IDENTITY_DTYPES):
        if suite.phase_left() < IDENTITY_MIN_S:
            bad.append(f"{dt} skipped: {suite.phase_left():.0f}s left")
            continue
        js = suite.state / f"identity_{dt}.json"
        js.unlink(missing_ok=True)
        cmd = [*script_cmd(script), "--dtype", dt, "--json", str(js), *drafter]
        share = suite.phase_left() * (IDENTITY_FIRST_SHARE if i < len(IDENTITY_DTYPES) - 1 else 1.0)
        proc = suite.run(f"identity_{dt}", cmd, share, {})
        res.details[dt] = json.loads(js.read_text()) if js.exists() else identity_rows(proc.output)
        for k, v in (parse_result(proc.output) or res.details[dt].get("results", {})).items():
            if k != "dtype":
                res.metrics[f"{dt}_{k}"] = as_number(v)
        status = "ok" if proc.rc == 0 else "timeout" if proc.timed_out else "failed"
        if status != "ok":
            bad.append(f"{dt} {status}: {tail(proc.output, 300)}")
        res.error = " | ".join(bad)
        res.status = identity_status(res, bad)
        _save_interim(suite, res)
        got = {k: v for k, v in res.metrics.items() if k.startswith(dt) and "identical_frac" in k}
        print(f"##### identity {dt}: {status} in {proc.seconds:.0f}s; {got}", flush=True)
    res.error = " | ".join(bad)
    res.status = identity_status(res, bad)
    return res


def identity_status(res: PhaseResult, bad: list[str]) -> str:
    """ok, partial (a dtype cut, failed or skipped but something measured), or failed (nothing measured)."""
    if not bad:
        return "ok"
    return "partial" if any(res.details.get(dt) for dt in IDENTITY_DTYPES) else "failed"


def identity_rows(output: str) -> dict:
    """The strategies a cut sd_identity.py run printed (its table rows; the --json file comes at the end):
    {strategy: {mode, identical_frac, diverged, accept_len, seconds}, "results": {identical_frac_<s>, ...},
    "cut": True}, or {} when it printed none."""
    d: dict = {}
    results: dict = {}
    for name, mode, frac, div, _med, acc, secs in IDENTITY_ROW.findall(output):
        row = {"mode": mode, "identical_frac": float(frac), "diverged": int(div), "seconds": float(secs)}
        d[name] = {**row, "accept_len": as_number(acc)}
        results |= {f"identical_frac_{name}": float(frac), f"diverged_{name}": int(div)}
    plain = re.search(r"^plain: ([\d.]+)s", output, re.M)
    if plain:
        results["plain_s"] = float(plain.group(1))
    return {**d, "results": results, "cut": True} if d or results else {}


def _save_interim(suite: Suite, res: PhaseResult) -> None:
    """The phase's result so far, into the state's results (a later --resume sees it) and --out (a call cut
    by the device tool still returns it); the suite rewrites both when the phase ends."""
    text = json.dumps({**res.record(suite.call, suite.dry), "interim": True}, indent=2, default=str)
    (suite.state / "results" / f"{res.phase}.json").write_text(text)
    (suite.out / f"{res.phase}.json").write_text(text)


VERIFY_STRATEGIES = "3_1_4,8_2_16,8_3_64"  # bench_sd's mapping for TV 4, 16, 64 (each strategy: 5 programs)


def _copy_png(src: pathlib.Path, dest: pathlib.Path) -> None:
    if src.is_file():
        shutil.copy(src, dest)


def phase_verify_cost(suite: Suite, timeout: float) -> PhaseResult:
    """bench_verify_cost.py --quick --breakdown: a speculative round's device time by phase (draft, verify,
    accept, commit) beside the whole round and a plain step, at TV 4, 16 and 64, with this lease's drafter
    (else an untrained one: the phases' cost hardly depends on what it drafts). Every RESULT key is kept;
    `round_*` keys become the breakdown table. Runs only once the script has --breakdown."""
    script = EXP / "bench" / "bench_verify_cost.py"
    flags = script_flags(script, suite.child_env("flags", {})) if script.exists() else set()
    if "--breakdown" not in flags:
        return _skip("verify_cost", f"{script.name} has no --breakdown flag (yet): no round breakdown to run")
    if suite.dry:
        return PhaseResult("verify_cost", "ok", details={"note": DRY, "flags": sorted(flags)})
    out = suite.state / "verify_breakdown"
    args = ["--quick", "--breakdown"]
    args += ["--strategies", VERIFY_STRATEGIES] if "--strategies" in flags else []
    args += ["--out", str(out)] if "--out" in flags else []
    if (suite.drafter_dir / "drafter").is_dir() and "--drafter" in flags:
        args += ["--drafter", str(suite.drafter_dir)]
    elif "--random-drafter" in flags:
        args.append("--random-drafter")
    proc = suite.run("verify_cost", [*script_cmd(script), *args], timeout, {})
    res = PhaseResult("verify_cost", metrics={k: as_number(v) for k, v in parse_result(proc.output).items()})
    res.details = {"command": " ".join(args), "rounds": parse_round_breakdown(res.metrics)}
    _copy_png(out / "verify_breakdown.png", suite.out / "verify_breakdown.png")
    if proc.rc != 0:
        res.status, res.error = ("timeout" if proc.timed_out else "failed"), tail(proc.output)
    return res


def phase_compile(suite: Suite, timeout: float) -> PhaseResult:
    """compile_time.py --quick, once the script exists: configs/tlt.py:quick's first RL step compiled from an
    empty cache, then rerun on that cache, each in its own process (RESULT compile_first_s, compile_rerun_s
    and the rest, all kept). The script keeps its own cache under --out; the lease's cache (other phases'
    programs) is unset for it, so its first run cannot be a cache hit."""
    script = EXP / "bench" / "compile_time.py"
    if not script.exists():
        return _skip("compile", f"{script.name} does not exist (yet)")
    flags = script_flags(script, suite.child_env("flags", {}))
    if "--quick" not in flags:
        return PhaseResult("compile", "failed", error=f"{script.name} has no --quick flag")
    if suite.dry:
        return PhaseResult("compile", "ok", details={"note": DRY, "flags": sorted(flags)})
    out = suite.state / f"compile_time_{int(time.time())}"  # empty: the first run compiles everything
    args = ["--quick"] + (["--out", str(out)] if "--out" in flags else [])
    proc = suite.run("compile", [*script_cmd(script), *args], timeout, {"JAX_COMPILATION_CACHE_DIR": None})
    res = PhaseResult("compile", metrics={k: as_number(v) for k, v in parse_result(proc.output).items()})
    res.details = {"command": " ".join(args), "out": str(out)}
    _copy_png(out / "compile_time.png", suite.out / "compile_time.png")
    if proc.rc != 0:
        res.status, res.error = ("timeout" if proc.timed_out else "failed"), tail(proc.output)
        first = first_run_compile_s(out / "run1" / "metrics.jsonl")
        if first is not None and "compile_first_s" not in res.metrics:  # the rerun was cut: keep run 1
            res.status, res.metrics["compile_first_s"] = "partial", first
        low = compile_so_far_s(proc.output)
        if "compile_first_s" not in res.metrics and low:  # run 1 cut: its compile seconds so far
            res.metrics["compile_first_s_at_least"] = low
    return res


COMPILED_SO_FAR = re.compile(r"^step 1/\d+ (\w+) .*compiled \d+ programs? \((\d+) s\) in this phase", re.M)


def compile_so_far_s(output: str) -> float | None:
    """A lower bound of the first step's compile seconds from the learner's progress lines ("step 1/1
    rollout 1:21 | ... | compiled 13 programs (80 s) in this phase"): each phase's last figure, summed."""
    last: dict[str, float] = {}
    for phase, secs in COMPILED_SO_FAR.findall(output):
        last[phase] = float(secs)
    return sum(last.values()) if last else None


def first_run_compile_s(metrics: pathlib.Path) -> float | None:
    """compile_time.py's first run's compile seconds from its workdir's metrics (the learner's summed
    `compile/total_s` per step), for a phase cut during the rerun; None if the first run did not log it."""
    if not metrics.is_file():
        return None
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip().startswith("{")]
    vals = [r["compile/total_s"] for r in rows if isinstance(r.get("compile/total_s"), (int, float))]
    return float(sum(vals)) if vals else None


def phase_sd(suite: Suite, timeout: float) -> PhaseResult:
    """bench_sd.py with the warmed drafter: batch x tokens_to_verify (Table 4's shape), batch 1 first (the
    headline, 2 timed pairs), one process per batch so a slow or failing cell keeps the others. Without a
    drafter, batch 1 runs with an untrained one: only its n-gram column (model-free) means anything."""
    script = EXP / "bench" / "bench_sd.py"
    missing = [f for f in SD_FLAGS if f not in script_flags(script, suite.child_env("flags", {}))]
    if missing:
        return PhaseResult("sd", "failed", error=f"bench_sd.py no longer takes {missing}")
    if suite.dry:
        return PhaseResult("sd", "ok", details={"note": DRY, "flags_checked": list(SD_FLAGS)})
    res = PhaseResult("sd", details={"rows": [], "runs": []})
    trained = (suite.drafter_dir / "drafter").is_dir()
    drafter = ["--drafter", str(suite.drafter_dir)] if trained else ["--random-drafter"]
    if not trained:
        res.error = f"no drafter under {suite.drafter_dir}: EAGLE columns untrained, n-gram only | "
    for b, tvs, reps in SD_PLAN if trained else [(1, "4", 2)]:
        if suite.phase_left() < 60:
            res.details["runs"].append({"batch": b, "status": "skipped (budget)"})
            continue
        cmd = [*script_cmd(script), *drafter, *f"--batches {b} --tv {tvs} --new 128 --reps {reps}".split()]
        proc = suite.run(f"sd_bs{b}", cmd, suite.phase_left(), {})
        rows = parse_sd_rows(proc.output)
        res.details["rows"] += rows
        status = "ok" if proc.rc == 0 else "timeout" if proc.timed_out else "failed"
        res.details["runs"].append({"batch": b, "status": status, "cells": len(rows)})
        for k, v in parse_result(proc.output).items():
            res.metrics.setdefault(k, as_number(v))
        if status != "ok":
            res.error += f"batch {b}: {status}: {tail(proc.output, 300)} | "
    if not trained or {r["status"] for r in res.details["runs"]} != {"ok"}:
        res.status = "partial" if res.details["rows"] else "failed"
    return res


def phase_e2e(suite: Suite, timeout: float) -> PhaseResult:
    """experiments/paper/e2e_speedup.py --quick (GRPO steps, drafter none / ngram / eagle), if the script
    exists: 2 steps per arm (step 1 compiles and is not timed), with this lease's drafter when it takes a
    path, into a fresh folder of the state dir; its PNG is copied to --out as e2e.png."""
    script = EXP / "paper" / "e2e_speedup.py"
    if not script.exists():
        return PhaseResult("e2e", "skipped", details={"note": f"{script.name} does not exist (yet)"})
    flags = script_flags(script, suite.child_env("flags", {}))
    if "--quick" not in flags:
        return PhaseResult("e2e", "failed", error=f"{script.name} has no --quick flag")
    if suite.dry:
        return PhaseResult("e2e", "ok", details={"note": DRY, "flags": sorted(flags)})
    out = suite.state / f"e2e_{int(time.time())}"  # the script refuses a non-empty folder
    args = ["--quick"] + (["--out", str(out)] if "--out" in flags else [])
    args += ["--steps", "2"] if "--steps" in flags else []
    flag = next((f for f in ("--drafter-path", "--drafter") if f in flags), None)
    if flag and (suite.drafter_dir / "drafter").is_dir():
        args += [flag, str(suite.drafter_dir)]
    proc = suite.run("e2e", [*script_cmd(script), *args], timeout, {})
    res = PhaseResult("e2e", metrics={k: as_number(v) for k, v in parse_result(proc.output).items()})
    res.details = {"command": " ".join(args), "out": str(out)}
    pngs = sorted(out.glob("*.png")) if out.is_dir() else []
    if pngs:
        shutil.copy(pngs[0], suite.out / "e2e.png")
    if proc.rc != 0:
        res.status, res.error = ("timeout" if proc.timed_out else "failed"), tail(proc.output)
    return res
