"""The phases of experiments/gpu_suite.py: what each runs, and how its output becomes numbers.

Every phase is a function `(suite, timeout_s) -> PhaseResult` that runs the project's own scripts and tests in
subprocesses (the suite kills a subprocess's whole process group at its timeout) and reads their outputs:
RESULT lines, `--json` files, JUnit XML, the drafter warm-up's workdir. A phase never raises for a failing
script: the failure, its last output lines and what still finished are the result. `--dry-run` runs the same
functions on tiny shapes (interpret mode on CPU); `DRY` documents where a dry run does less.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import re
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING, Any

import gpu_bundle

if TYPE_CHECKING:
    from gpu_suite import Suite

ROOT = pathlib.Path(__file__).resolve().parents[1]
PY = sys.executable
GPU_TESTS = {
    "kernel_tests": ["tests/kernels/test_tree_attention.py"],
    # engine and speculative equality on tiny models; the CPU FFI kernel's variants cannot run on a GPU
    "rollout_tests": [
        "tests/rollout/test_engine_sd.py",
        "tests/rollout/test_engine.py",
        "-k",
        "not cpu_kernel",
    ],
}
DRY_TESTS = {
    "kernel_tests": [
        "tests/kernels/test_tree_attention.py",
        "-k",
        "verify-T8-S64 or lowers_to_triton or tuned",
    ],
    "rollout_tests": [
        "tests/rollout/test_acceptance.py::test_greedy_matches_brute_force_and_one_hot_tree_accept"
    ],
}
# bench_sd cells on a GPU, most important first: (batch, tokens_to_verify values, timed pairs)
SD_PLAN = [(1, "4,8,16,32,64", 2), (4, "8,16,32", 1), (16, "8,32", 1), (64, "8", 1)]
SD_FLAGS = ("--drafter", "--batches", "--tv", "--new", "--reps", "--ngram")
DRY = {
    "sd": "dry run: bench_sd needs the 98 MB GGUF and minutes; its flags are checked against the script",
    "e2e": "dry run: flags checked against the script, not run",
}


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


# ------------------------------------------------------------------------------------------------ parsers
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


def script_flags(path: pathlib.Path) -> set[str]:
    """The `--flags` a script's argparse declares (read from its source: no import, no JAX start-up)."""
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", path.read_text()))


def latest_step(ckpt_dir: pathlib.Path) -> int:
    """The newest complete orbax step under `ckpt_dir` (numeric directory names; temporaries ignored)."""
    steps = [int(p.name) for p in ckpt_dir.glob("*") if p.is_dir() and p.name.isdigit()]
    return max(steps, default=0)


def _tail(text: str, n: int = 1500) -> str:
    """The end of a script's output, from a line start: the traceback's last lines say what broke."""
    tail = text[-n:]
    return tail[tail.find("\n") + 1 :] if len(text) > n and "\n" in tail else tail


def _pytest(suite: Suite, phase: str, timeout: float, env: dict[str, str]) -> PhaseResult:
    """Run a pytest selection; counts from its JUnit file (or its -v lines if it was killed)."""
    xml = suite.state / f"{phase}.xml"
    xml.unlink(missing_ok=True)
    sel = DRY_TESTS[phase] if suite.dry else GPU_TESTS[phase]
    extra = ["-n", "4"] if phase == "rollout_tests" and not suite.dry and suite.has_xdist else []
    cmd = [PY, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}", *extra, *sel]
    proc = suite.run(phase, cmd, timeout, env)
    res = parse_junit(xml) if xml.exists() else parse_pytest_verbose(proc.output)
    out = PhaseResult(phase, details={**res, "command": " ".join(cmd[2:]), "env": env})
    out.metrics = {k: res[k] for k in ("passed", "failed", "errors", "skipped")}
    if proc.timed_out:
        out.status = "timeout"
    elif proc.rc != 0 or res["failed"] or res["errors"] or not res["passed"]:
        out.status, out.error = "failed", _tail(proc.output, 800)
    return out


# ------------------------------------------------------------------------------------------------- phases
def phase_env(suite: Suite, timeout: float) -> PhaseResult:
    """Versions, device, memory bandwidth and bf16 matmul rate, Pallas backends, the bundle's wheels."""
    path = suite.state / "env.json"
    path.unlink(missing_ok=True)
    cmd = [PY, str(ROOT / "experiments" / "gpu_suite.py"), "--worker", "env", "--worker-out", str(path)]
    proc = suite.run("env", cmd + (["--dry-run"] if suite.dry else []), timeout, {})
    if not path.exists():
        return PhaseResult("env", "failed", error=_tail(proc.output))
    info = json.loads(path.read_text())
    keys = (
        "backend",
        "device",
        "jax",
        "bandwidth_gb_s",
        "bf16_matmul_tflops",
        "pallas_triton",
        "wheels_missing",
    )
    res = PhaseResult("env", metrics={k: info.get(k) for k in keys}, details=info)
    res.metrics["probe_errors"] = len(info.get("probe_errors", {}))
    if proc.timed_out:  # the essentials are written first: what the machine is is still known
        res.status, res.error = "partial", "the env probe timed out after its first measurements"
    if not suite.dry and not info.get("on_gpu") and not suite.allow_cpu:
        res.status, res.error = "failed", f"no GPU: JAX's backend is {info.get('backend')!r}"
        res.details["no_gpu"] = True  # the suite skips the other phases
    return res


def phase_kernel_tests(suite: Suite, timeout: float) -> PhaseResult:
    """tests/kernels/test_tree_attention.py: the kernel compiled by Triton on a GPU (interpreted if dry)."""
    env = {"TLT_PALLAS_INTERPRET": "0"} if suite.on_gpu else {}  # on a GPU: compiled, or the tests fail
    res = _pytest(suite, "kernel_tests", timeout, env)
    res.metrics["compiled"] = int(suite.on_gpu)
    return res


def phase_rollout_tests(suite: Suite, timeout: float) -> PhaseResult:
    """The engine's greedy speculative == plain, cache and lossless tests on the GPU (full fp32 matmuls:
    XLA's default TF32 would break the tests' 1e-5 logprob checks for reasons unrelated to correctness)."""
    return _pytest(suite, "rollout_tests", timeout, {"JAX_DEFAULT_MATMUL_PRECISION": "highest"})


def phase_tree_attention(suite: Suite, timeout: float) -> PhaseResult:
    """bench_tree_attention.py --tune: kernel vs reference at verify shapes, block sizes tuned first."""
    js, tuned = suite.state / "tree_attention.json", suite.state / "tuned_block_sizes.json"
    js.unlink(missing_ok=True)
    if suite.dry:
        args = "--quick --models tiny --seq 64 --tokens 16 --tune-max-evals 2 --tune-shapes 1".split()
    else:  # the tuning adds decode shapes (T=1)
        args = "--tokens 8,16,32,48,64 --batches 1,8,32 --seq 1024".split()
    cmd = [PY, str(ROOT / "experiments" / "bench_tree_attention.py"), *args, "--tune"]
    cmd += ["--json", str(js), "--tuned-out", str(tuned), "--budget-s", f"{max(10.0, timeout - 40):.0f}"]
    proc = suite.run("tree_attention", cmd, timeout, {})
    if not js.exists():
        return PhaseResult(
            "tree_attention", "timeout" if proc.timed_out else "failed", error=_tail(proc.output)
        )
    data = json.loads(js.read_text())
    keys = (
        "lowering",
        "dtype",
        "geomean_ratio",
        "worst_ratio_t16_64",
        "faster_t16_64",
        "max_err",
        "kernel_errors",
    )
    res = PhaseResult("tree_attention", metrics={k: data.get(k) for k in keys}, details=data)
    if data.get("tuning"):
        res.metrics["tuned_speedup_vs_default"] = data["tuning"]["speedup_vs_default"]
        bs = data["block_sizes"]
        res.metrics["tuned_block_sizes"] = (
            f"q{bs['block_q']}_k{bs['block_k']}_splits{bs['kv_splits']}_warps{bs['num_warps'] or 'auto'}"
            f"_stages{bs['num_stages']}"
        )
        res.details["tuned_file"] = str(tuned) if tuned.exists() else None
    if proc.rc != 0 or data.get("kernel_errors"):
        res.status, res.error = ("timeout" if proc.timed_out else "failed"), _tail(proc.output, 800)
    elif data.get("skipped_for_budget"):
        res.status = "partial"
    return res


def phase_model(suite: Suite, timeout: float) -> PhaseResult:
    """Reassemble the SmolLM2 GGUF from the bundle's two parts and check its sha256 (dry run: the same code
    on a synthetic 1 MiB file, including the refusal when a part is missing)."""
    del timeout
    if not suite.dry:
        try:
            info = gpu_bundle.assemble_model(suite.bundle, gpu_bundle.MODEL_PATH)
        except gpu_bundle.BundleError as e:
            return PhaseResult("model", "failed", error=str(e))
        return PhaseResult("model", metrics={"assembled": int(info["assembled"])}, details=info)
    import random

    tmp = suite.state / "dry_bundle"
    src = tmp / "model.gguf"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_bytes(random.Random(0).randbytes(1 << 20))
    gpu_bundle.write_parts(src, tmp, wheel_bytes=1 << 18)
    dest = tmp / "assembled" / "model.gguf"
    info = gpu_bundle.assemble_model(tmp, dest)
    ok = dest.read_bytes() == src.read_bytes() and not gpu_bundle.assemble_model(tmp, dest)["assembled"]
    dest.unlink()
    (tmp / "b" / "model.part2").unlink()
    try:
        gpu_bundle.assemble_model(tmp, dest)
        refused = ""
    except gpu_bundle.BundleError as e:
        refused = str(e)
    details = {**info, "refusal": refused}
    try:  # the real bundle, if this checkout built one: does each call fit the limit?
        details["bundle_check"] = gpu_bundle.check(suite.bundle) if (suite.bundle / "a").is_dir() else None
    except gpu_bundle.BundleError as e:
        details["bundle_check"] = str(e)
    status = "ok" if ok and "model incomplete" in refused else "failed"
    return PhaseResult("model", status, metrics={"assembled": int(info["assembled"])}, details=details)


def phase_decode(suite: Suite, timeout: float) -> PhaseResult:
    """bench_decode.py per dtype (bfloat16 first) against HF transformers on the same device; a dtype whose
    run fails (not a timeout) is retried once with the jnp attention (reported as such)."""
    dtypes = ["float32"] if suite.dry else ["bfloat16", "float32"]
    has_hf = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
    base = "--tiny --batches 1 --new 8 --prompt-len 24" if suite.dry else "--batches 1,4,16,64"
    res = PhaseResult("decode")
    bad = []
    for i, dt in enumerate(dtypes):
        js = suite.state / f"decode_{dt}.json"
        for impl in ("auto", "reference"):
            js.unlink(missing_ok=True)
            share = suite.phase_left() * (0.6 if i < len(dtypes) - 1 else 1.0)  # bfloat16 first, and more
            cmd = [PY, str(ROOT / "experiments" / "bench_decode.py"), *base.split()]
            cmd += ["--dtype", dt, "--attn-impl", impl, "--json", str(js)] + ([] if has_hf else ["--no-hf"])
            proc = suite.run(f"decode_{dt}", cmd, share, {})
            if proc.rc == 0 or proc.timed_out or suite.phase_left() < 60:
                break
        data = json.loads(js.read_text()) if js.exists() else {"rows": []}
        data["attn_impl"] = impl
        data["status"] = "ok" if proc.rc == 0 else "timeout" if proc.timed_out else "failed"
        res.details[dt] = data
        for r in data["rows"]:  # the finished batches of a run cut short count too
            b = r["batch"]
            res.metrics[f"{dt}_ours_tok_s_bs{b}"] = r["ours_tok_s"]
            res.metrics[f"{dt}_ratio_vs_hf_bs{b}"] = (
                r["ours_tok_s"] / r["hf_tok_s"] if r["hf_tok_s"] else None
            )
        for k, v in parse_result(proc.output).items():
            res.metrics[f"{dt}_{k}"] = as_number(v)
        if proc.rc != 0:
            data["output_tail"] = _tail(proc.output, 1500)
            bad.append(f"{dt} {data['status']} after {len(data['rows'])} batches (attention {impl})")
    if bad:
        any_rows = any(d["rows"] for d in res.details.values())
        res.status, res.error = ("partial" if any_rows else "failed"), " | ".join(bad)
    return res


def phase_drafter(suite: Suite, timeout: float) -> PhaseResult:
    """The drafter warm-up (configs/drafter_warmup.py:gpu; :tiny in dry runs). It is resumable: a run cut by
    the timeout is finalised at its newest checkpoint (a rerun with train.steps = that step evaluates and
    saves the drafter), and a later call continues unfinished data generation."""
    wd = suite.drafter_dir
    result = wd / "drafter_eval.json"
    config = f"configs/drafter_warmup.py:{suite.drafter_config or ('tiny' if suite.dry else 'gpu')}"
    if result.exists() and json.loads(result.read_text()).get("complete") and not suite.extend_drafter:
        return _drafter_result(wd, "ok", note="a drafter from an earlier call of this lease (reused)")
    cmd = [PY, "-m", "tlt_jax.main", f"--config={config}", f"--workdir={wd}"]
    if suite.dry:  # seconds, not a minute: no untrained-drafter evaluation, two steps, one checkpoint
        cmd += ["--config.eval.before=False", "--config.train.steps=2", "--config.train.checkpoint_every=2"]
    reserve = 0.0 if suite.dry else min(120.0, 0.3 * timeout)  # to finalise a run cut short
    proc = suite.run("drafter", cmd, max(30.0, timeout - reserve), {})
    if proc.rc == 0:
        return _drafter_result(wd, "ok")
    if not proc.timed_out:
        return _drafter_result(wd, "failed", error=_tail(proc.output))
    step = latest_step(wd / "train_state")
    if step == 0:
        return _drafter_result(
            wd, "timeout", note="stopped before training: the next call continues the data"
        )
    fin = suite.run("drafter_finalise", [*cmd, f"--config.train.steps={step}"], suite.phase_left(), {})
    note = f"training cut at its step-{step} checkpoint by the time budget, then evaluated and saved"
    return _drafter_result(
        wd, "partial" if fin.rc == 0 else "failed", note=note, error=_tail(fin.output) if fin.rc else ""
    )


def _drafter_result(wd: pathlib.Path, status: str, note: str = "", error: str = "") -> PhaseResult:
    res = PhaseResult("drafter", status, error=error, details={"workdir": str(wd), "note": note})
    path = wd / "drafter_eval.json"
    if path.exists():
        ev = json.loads(path.read_text())
        after = ev.get("after") or {}
        res.metrics = {
            "accept_length": after.get("accept_length"),
            "sampled_accept_length": after.get("sampled_accept_length"),
            "train_steps": (ev.get("drafter_checkpoint") or {}).get("step"),
            "train_sequences": (ev.get("data") or {}).get("train_sequences"),
        }
        res.details["eval"] = {
            k: ev.get(k) for k in ("after", "train", "phase_seconds", "drafter_checkpoint")
        }
    curve = []
    if (wd / "metrics.jsonl").exists():
        for line in (wd / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line) if line.strip().startswith("{") else {}
            if "train/loss" in row:
                curve.append([row.get("step"), row["train/loss"], row.get("train/top1_acc")])
    res.details["loss_curve"] = curve
    return res


def phase_sd(suite: Suite, timeout: float) -> PhaseResult:
    """bench_sd.py with the warmed drafter: batch x tokens_to_verify (Table 4's shape), batch 1 first (the
    headline, 2 timed pairs), one process per batch so a slow or failing cell keeps the others. Without a
    drafter, batch 1 runs with an untrained one: only its n-gram column (model-free) means anything."""
    script = ROOT / "experiments" / "bench_sd.py"
    missing = [f for f in SD_FLAGS if f not in script_flags(script)]
    if missing:
        return PhaseResult("sd", "failed", error=f"bench_sd.py no longer takes {missing}")
    if suite.dry:
        return PhaseResult("sd", "ok", details={"note": DRY["sd"], "flags_checked": list(SD_FLAGS)})
    res = PhaseResult("sd", details={"rows": [], "runs": []})
    trained = (suite.drafter_dir / "drafter").is_dir()
    drafter = ["--drafter", str(suite.drafter_dir)] if trained else ["--random-drafter"]
    if not trained:
        res.error = f"no drafter under {suite.drafter_dir}: EAGLE columns untrained, n-gram only | "
    for b, tvs, reps in SD_PLAN if trained else [(1, "4", 2)]:
        if suite.phase_left() < 60:
            res.details["runs"].append({"batch": b, "status": "skipped (budget)"})
            continue
        cmd = [PY, str(script), *drafter, *f"--batches {b} --tv {tvs} --new 128 --reps {reps}".split()]
        proc = suite.run(f"sd_bs{b}", cmd, suite.phase_left(), {})
        rows = parse_sd_rows(proc.output)
        res.details["rows"] += rows
        status = "ok" if proc.rc == 0 else "timeout" if proc.timed_out else "failed"
        res.details["runs"].append({"batch": b, "status": status, "cells": len(rows)})
        for k, v in parse_result(proc.output).items():
            res.metrics.setdefault(k, as_number(v))
        if status != "ok":
            res.error += f"batch {b}: {status}: {_tail(proc.output, 300)} | "
    if not trained or {r["status"] for r in res.details["runs"]} != {"ok"}:
        res.status = "partial" if res.details["rows"] else "failed"
    return res


def phase_e2e(suite: Suite, timeout: float) -> PhaseResult:
    """experiments/e2e_speedup.py --quick (GRPO steps, drafter none / ngram / eagle), if the script exists:
    2 steps per arm (step 1 compiles and is not timed), with this lease's drafter when it takes a path, into
    a fresh folder of the state dir; its PNG is copied to --out as e2e.png."""
    script = ROOT / "experiments" / "e2e_speedup.py"
    if not script.exists():
        return PhaseResult("e2e", "skipped", details={"note": f"{script.name} does not exist (yet)"})
    flags = script_flags(script)
    if "--quick" not in flags:
        return PhaseResult("e2e", "failed", error=f"{script.name} has no --quick flag")
    if suite.dry:
        return PhaseResult("e2e", "ok", details={"note": DRY["e2e"], "flags": sorted(flags)})
    out = suite.state / f"e2e_{int(time.time())}"  # the script refuses a non-empty folder
    args = ["--quick"] + (["--out", str(out)] if "--out" in flags else [])
    args += ["--steps", "2"] if "--steps" in flags else []
    flag = next((f for f in ("--drafter-path", "--drafter") if f in flags), None)
    if flag and (suite.drafter_dir / "drafter").is_dir():
        args += [flag, str(suite.drafter_dir)]
    proc = suite.run("e2e", [PY, str(script), *args], timeout, {})
    res = PhaseResult("e2e", metrics={k: as_number(v) for k, v in parse_result(proc.output).items()})
    res.details = {"command": " ".join(args), "out": str(out)}
    pngs = sorted(out.glob("*.png")) if out.is_dir() else []
    if pngs:
        shutil.copy(pngs[0], suite.out / "e2e.png")
    if proc.rc != 0:
        res.status, res.error = ("timeout" if proc.timed_out else "failed"), _tail(proc.output)
    return res


PHASE_FUNCS = {
    "env": phase_env,
    "kernel_tests": phase_kernel_tests,
    "tree_attention": phase_tree_attention,
    "rollout_tests": phase_rollout_tests,
    "model": phase_model,
    "decode": phase_decode,
    "drafter": phase_drafter,
    "sd": phase_sd,
    "e2e": phase_e2e,
}
