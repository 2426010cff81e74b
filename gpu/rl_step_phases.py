"""The GPU suite's whole-RL-step phase and its GPU test phase (issue #45).

rl_step_7b  (call 1) `python -m tlt_jax.main --config configs/qwen2_5_7b_gpu_step.py:layers=N` -- the program
            a cluster user launches, with the 7B config's sections (stacked scanned update with remat,
            continuous batching under a running-rows cap, the spot trainer, BEG-MAB over plain and the
            EAGLE trees, a held-out evaluation) at Qwen2.5-7B's layer shapes with N layers of random bf16
            weights and the token task of tlt_jax/tasks/synthetic.py (a geometric long tail of lengths, a
            reward on token ids) -- run by gpu/rl_step_run.py, which watches it: the seconds to the end of
            step 1 from a cold persistent cache (the compile seconds in them), each part of steps 2..N
            (metrics.jsonl's time/*), the device's peak memory per learner phase beside the memory plans
            of the same config (gpu/rl_step_plan.py, XLA:GPU), the rollout's tail (lengths, SD rounds,
            accept length, the bandit's choices, spot steps) and the exit status;
gpu_tests   (call 2) the GPU-relevant test files on the image's jax with the kernels compiled: the two tests
            `make test` skips for want of a GPU (cuDNN attention against the reference, the compiled
            Triton kernel's mode) and the kernels' files, 8 xdist workers.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

from gpu.call_plan import RL_STEP_LAYERS, RL_STEP_STEPS
from gpu.markdown_tables import cell, table, verdict
from gpu.parse import PhaseResult, parse_junit, parse_pytest_verbose, tail

if TYPE_CHECKING:
    from gpu.runner import Suite

PY = sys.executable
CONFIG = "configs/qwen2_5_7b_gpu_step.py"
GIB = 2**30
SHM = pathlib.Path(
    "/dev/shm"
)  # the run's workdir when it has room: its final checkpoint is ~24 GB at 4 layers
SHM_NEED_GB = 40
# the plan's parts (GPU, dry run): a dry run takes the resident state only (the programs' compiles would
# double its CPU time; tests/experiments/test_gpu_suite.py compiles them)
PLAN_PARTS = ("update,rollout", "resident")
# the tests `make test` skips for want of a GPU, then the files they are in and the Triton module checks
SKIPPED_ON_CPU = (
    "tests/kernels/test_flash_attention.py::test_cudnn_equals_reference_on_gpu",
    "tests/kernels/test_tree_attention.py::test_compiled_mode_has_a_gpu",
)
GPU_TEST_FILES = (
    "tests/kernels/test_flash_attention.py",
    "tests/kernels/test_tree_attention.py",
    "tests/kernels/test_triton_module.py",
)
STEP_KEYS = ("time/step", "compile/total_s", "compile/programs", "length/p50", "length/p90", "length/max")
STEP_KEYS += ("spec/verify_rounds", "spec/accept_len", "rollout/sd_share", "spot/steps", "reward/mean")
STEP_KEYS += ("reward/std", "eval/reward", "eval/seconds")


def _workdir(suite: Suite) -> pathlib.Path:
    """A fresh workdir: /dev/shm when it has room for the final checkpoint (GPU runs), else the state's."""
    free = shutil.disk_usage(SHM).free / 1e9 if SHM.is_dir() else 0.0
    base = SHM if not suite.dry and free >= SHM_NEED_GB else suite.state
    wd = base / "tlt_rl_step_7b"
    shutil.rmtree(wd, ignore_errors=True)
    return wd


def read_steps(metrics: pathlib.Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl's rows by step (step 0: the evaluation before training)."""
    if not metrics.is_file():
        return {}
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip().startswith("{")]
    return {int(r["step"]): r for r in rows}


def phase_rl_step_7b(suite: Suite, timeout: float) -> PhaseResult:
    """The whole RL step (module docstring); dry run: the same config's `tiny` arg, 1 layer, 1 step, XLA at
    O0 (the run is compile-bound on a CPU), the plan's resident state only."""
    layers, steps = (1, 1) if suite.dry else (RL_STEP_LAYERS, RL_STEP_STEPS)
    wd, js = _workdir(suite), suite.state / "rl_step_7b.json"
    js.unlink(missing_ok=True)
    cache = suite.state / f"rl_step_cache_{int(time.time())}"  # cold: the first step compiles everything
    arg = f"{CONFIG}:layers={layers},steps={steps}" + (",tiny" if suite.dry else "")
    cmd = [PY, "-m", "gpu.rl_step_run", "--json", str(js), "--plan", PLAN_PARTS[int(suite.dry)]]
    cmd += ["--deadline-s", f"{max(timeout - 15, 5):.0f}", "--", f"--config={arg}", f"--workdir={wd}"]
    cmd += [f"--config.compilation_cache_dir={cache}"]
    env = {"TLT_JAX_COMPILE_LOG": str(suite.state / "rl_step_compile_log.json")}
    proc = suite.run("rl_step_7b", cmd, timeout, env)
    watch = json.loads(js.read_text()) if js.exists() else {}
    steps_logged = read_steps(wd / "metrics.jsonl")
    keep = suite.state / "rl_step_7b"  # the small outputs outlive the workdir (its checkpoint is GBs)
    keep.mkdir(exist_ok=True)
    for name in ("metrics.jsonl", "samples.jsonl", "config.json"):
        if (wd / name).is_file():
            shutil.copy(wd / name, keep / name)
    shutil.rmtree(wd, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    details = rl_step_details(watch, steps_logged, layers, steps, suite.state / "rl_step_compile_log.json")
    res = PhaseResult("rl_step_7b", metrics=rl_step_metrics(details), details=details)
    trained = [s for s in steps_logged if s > 0]
    if proc.rc == 0 and len(trained) >= steps:
        res.status = (
            "partial" if watch.get("plan_error") or (watch.get("plan") or {}).get("skipped") else "ok"
        )
        res.error = watch.get("plan_error", "") or "; ".join((watch.get("plan") or {}).get("skipped", []))
    else:
        why = "cut by the phase's timeout" if proc.timed_out else f"exit {proc.rc}"
        res.status = "partial" if trained else ("timeout" if proc.timed_out else "failed")
        res.error = f"{why} after {len(trained)} of {steps} steps: {tail(proc.output, 800)}"
    return res


def rl_step_details(
    watch: dict[str, Any], rows: dict[int, dict[str, Any]], layers: int, steps: int, log: pathlib.Path
) -> dict[str, Any]:
    """What the report and the RESULT line read: per-step rows, the phase timeline and peaks, the plan, the
    seconds to the end of step 1, the programs that took the most compile time."""
    phases = watch.get("phases") or []
    step1 = (watch.get("steps") or {}).get("1", {}).get("logged_s")
    compiles = json.loads(log.read_text()) if log.is_file() else []
    compiles = sorted(compiles, key=lambda r: -float(r.get("backend_s") or 0))[:12]
    per_step = {s: {k: r.get(k) for k in STEP_KEYS} | _time_parts(r) for s, r in rows.items()}
    bandit = {k: v for s, r in rows.items() if s > 0 for k, v in r.items() if k.endswith("/chosen")}
    return {
        "layers": layers,
        "steps_planned": steps,
        "exit": watch.get("exit"),
        "step1_end_s": step1,
        "run_s": watch.get("run_s"),
        "steps": per_step,
        "bandit_chosen": sorted(bandit),
        "timeline": phases,
        "memory": watch.get("memory"),
        "plan": watch.get("plan"),
        "plan_error": watch.get("plan_error"),
        "top_compiles": compiles,
    }


def _time_parts(row: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in row.items() if k.startswith("time/") and isinstance(v, (int, float))}


def _peaks(d: dict[str, Any]) -> dict[str, int]:
    """The allocator's peak bytes at the end of each learner phase kind (rollout, update, ...), the largest
    over the steps; `all` the process's peak."""
    out: dict[str, int] = {}
    for p in d.get("timeline") or []:
        end = p.get("peak_at_end")
        if isinstance(end, int):
            out[p["phase"]] = max(out.get(p["phase"], 0), end)
    mem = d.get("memory") or {}
    if isinstance(mem.get("peak_bytes_in_use"), int):
        out["all"] = mem["peak_bytes_in_use"]
    return out


def rl_step_metrics(d: dict[str, Any]) -> dict[str, Any]:
    """RESULT keys: layers, seconds to the end of step 1 and its compile seconds, each time part's mean over
    steps 2.., the rollout's tail, the peak and the plan's need (GiB) and their ratio."""
    steps = {int(k): v for k, v in (d.get("steps") or {}).items()}
    later = [v for s, v in steps.items() if s >= 2]
    m: dict[str, Any] = {"rl_layers": d.get("layers"), "rl_steps": len([s for s in steps if s > 0])}
    m["rl_step1_end_s"] = d.get("step1_end_s")
    first = steps.get(1, {})
    m["rl_step1_s"], m["rl_step1_compile_s"] = first.get("time/step"), first.get("compile/total_s")
    for part in sorted({k for v in later for k in v if k.startswith("time/")}):
        vals = [v[part] for v in later if isinstance(v.get(part), (int, float))]
        m[f"rl_{part.replace('/', '_')}_s"] = statistics.mean(vals) if vals else None
    last = steps.get(max(steps), {}) if steps else {}
    for k in ("length/max", "length/p50", "spec/verify_rounds", "spec/accept_len", "spot/steps"):
        m[f"rl_{k.replace('/', '_')}"] = last.get(k)
    peaks, plan = _peaks(d), d.get("plan") or {}
    need = plan.get("need_max")
    m["rl_peak_gib"] = peaks["all"] / GIB if "all" in peaks else None
    m["rl_plan_need_gib"] = need / GIB if need else None
    m["rl_peak_over_plan"] = peaks["all"] / need if "all" in peaks and need else None
    return m


def rl_step_targets(results: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The whole step ran to its end (every planned step logged, exit 0): `rl_step`."""
    r = results.get("rl_step_7b") or {}
    d = r.get("details") or {}
    done = d.get("exit")
    ok = done == 0 and (r.get("metrics") or {}).get("rl_steps", 0) >= (d.get("steps_planned") or 1)
    return {"rl_step": verdict(done, ok)}


def rl_step_md(r: dict[str, Any]) -> list[str]:
    """report.md's whole-step section: per step its parts and tail, then peaks beside the plan's needs."""
    d = r.get("details") or {}
    if not d.get("steps"):
        return []
    m = r.get("metrics") or {}
    lines = [
        f"Whole RL step (`python -m tlt_jax.main --config {CONFIG}:layers={d.get('layers')}`; exit "
        f"{d.get('exit')}): step 1 ended {cell(m.get('rl_step1_end_s'))} s after the start, cold cache",
        "",
    ]
    parts = sorted({k for v in d["steps"].values() for k in v if k.startswith("time/")})
    head = ["step", *[p.removeprefix("time/") for p in parts], "compile s", "programs", "len p50/max"]
    rows = []
    for s, v in sorted(d["steps"].items(), key=lambda kv: int(kv[0])):
        rows.append([s, *[v.get(p) for p in parts], v.get("compile/total_s"), v.get("compile/programs")])
        rows[-1].append(f"{cell(v.get('length/p50'))}/{cell(v.get('length/max'))}")
    lines += table(head, rows) + [""]
    plan = d.get("plan") or {}
    peaks = _peaks(d)
    prow = [[k, v / GIB] for k, v in sorted(peaks.items())]
    lines += ["Peak memory (allocator, GiB) at the end of each learner phase", ""]
    lines += table(["phase", "peak GiB"], prow) + [""]
    progs = [[p["kind"], p["program"], p["need"] / GIB, p["compile_s"]] for p in plan.get("programs", [])]
    if progs:
        lines += [f"Memory plan of the same config ({plan.get('backend')}): need per device, GiB", ""]
        lines += table(["kind", "program", "need GiB", "compile s"], progs) + [""]
    return lines


def phase_gpu_tests(suite: Suite, timeout: float) -> PhaseResult:
    """The GPU-relevant test files with the kernels compiled (TLT_PALLAS_INTERPRET=0 on a GPU); the two
    tests `make test` skips must pass here. Dry run: those two only (they skip on a CPU)."""
    xml = suite.state / "gpu_tests.xml"
    xml.unlink(missing_ok=True)
    sel = list(SKIPPED_ON_CPU) if suite.dry else list(GPU_TEST_FILES)
    extra = ["-n", "8", "--dist", "worksteal"] if suite.has_xdist and not suite.dry else []
    cmd = [PY, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}", *extra, *sel]
    env = {"TLT_PALLAS_INTERPRET": "0"} if suite.on_gpu else {}
    proc = suite.run("gpu_tests", cmd, timeout, env)
    res_counts = parse_junit(xml) if xml.exists() else parse_pytest_verbose(proc.output)
    named = named_outcomes(xml, SKIPPED_ON_CPU) if xml.exists() else {}
    out = PhaseResult("gpu_tests", details={**res_counts, "named": named, "command": " ".join(cmd[2:])})
    out.metrics = {k: res_counts[k] for k in ("passed", "failed", "errors", "skipped")}
    out.metrics["skipped_on_cpu_passed"] = sum(v == "passed" for v in named.values())
    want = "skipped" if not suite.on_gpu else "passed"
    if proc.timed_out:
        out.status = "timeout" if not res_counts["passed"] else "partial"
    elif proc.rc not in (0, 5) or res_counts["failed"] or res_counts["errors"]:
        out.status, out.error = "failed", tail(proc.output, 800)
    elif any(v != want for v in named.values()) or len(named) < len(SKIPPED_ON_CPU):
        out.status, out.error = "failed", f"the tests make test skips: {named} (want {want})"
    return out


def named_outcomes(xml: pathlib.Path, names: tuple[str, ...]) -> dict[str, str]:
    """passed / failed / error / skipped of each test id in `names` as the JUnit file recorded it."""
    import xml.etree.ElementTree as ET

    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        path = (case.get("classname") or "").replace(".", "/") + ".py"
        test = f"{path}::{case.get('name')}"
        if test in names:
            tags = {c.tag for c in case}
            out[test] = next((t for t in ("failure", "error", "skipped") if t in tags), "passed")
            out[test] = out[test].replace("failure", "failed")
    return out


def gpu_tests_md(r: dict[str, Any]) -> list[str]:
    d = r.get("details") or {}
    if "named" not in d:
        return []
    named = ", ".join(f"{k.split('::')[1]} {v}" for k, v in d["named"].items()) or "not reached"
    counts = ", ".join(f"{k} {d.get(k)}" for k in ("passed", "failed", "errors", "skipped"))
    return [f"GPU tests ({d.get('command')}): {counts}; the two make test skips: {named}", ""]
