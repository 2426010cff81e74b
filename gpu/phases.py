"""The phases of gpu/suite.py: what each runs, and how its output becomes numbers.

Every phase is a function `(suite, timeout_s) -> PhaseResult` that runs the project's own scripts and tests in
subprocesses (the suite kills a subprocess's whole process group at its timeout) and reads their outputs:
RESULT lines, `--json` files, JUnit XML, the drafter warm-up's workdir. A phase never raises for a failing
script: the failure, its last output lines and what still finished are the result. `--dry-run` runs the same
functions on tiny shapes (interpret mode on CPU); `DRY` documents where a dry run does less.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import random
import shutil
import sys
from typing import TYPE_CHECKING, Any

from gpu import bundle, measure, regime_phases, rl_step_phases, state
from gpu.parse import (
    PhaseResult,
    as_number,
    latest_step,
    parse_junit,
    parse_pytest_verbose,
    parse_result,
    script_cmd,
    tail,
)

if TYPE_CHECKING:
    from gpu.runner import Suite

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments"
PY = sys.executable
GPU_TESTS = {
    "kernel_tests": ["tests/kernels/test_tree_attention.py"],
    # engine and speculative equality on tiny models; the CPU FFI kernel's variants cannot run on a GPU, and
    # the chi-square test (10 x 32,768 samples) ran > 240 s on an H100: the CPU suite covers its math
    "rollout_tests": [
        "tests/rollout/test_engine_sd.py",
        "tests/rollout/test_engine.py",
        "-k",
        "not cpu_kernel and not lossless",
    ],
}
ROLLOUT_WORKERS = 8  # xdist workers on the GPU machine (16 cores: the tests compile more than they run)
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
DECODE_FP32_MIN_S = 60.0  # kept for the float32 decode run after bfloat16's


def _pytest(suite: Suite, phase: str, timeout: float, env: dict[str, str | None]) -> PhaseResult:
    """Run a pytest selection; counts from its JUnit file (or its -v lines if it was killed). The rollout
    tests run on xdist workers that steal queued tests from each other, each test under a timeout (when
    pytest-timeout is there) so one slow test fails alone instead of taking the phase's JUnit file with it."""
    xml = suite.state / f"{phase}.xml"
    xml.unlink(missing_ok=True)
    sel = DRY_TESTS[phase] if suite.dry else GPU_TESTS[phase]
    extra = []
    if phase == "rollout_tests" and not suite.dry and suite.has_xdist:
        extra = ["-n", str(ROLLOUT_WORKERS), "--dist", "worksteal"]
    if phase == "rollout_tests" and not suite.dry and importlib.util.find_spec("pytest_timeout"):
        extra.append(f"--timeout={max(30, int(0.6 * timeout))}")
    cmd = [PY, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}", *extra, *sel]
    proc = suite.run(phase, cmd, timeout, env)
    res = parse_junit(xml) if xml.exists() else parse_pytest_verbose(proc.output)
    out = PhaseResult(phase, details={**res, "command": " ".join(cmd[2:]), "env": env})
    out.metrics = {k: res[k] for k in ("passed", "failed", "errors", "skipped")}
    if proc.timed_out:
        out.status = "timeout"
    elif proc.rc != 0 or res["failed"] or res["errors"] or not res["passed"]:
        out.status, out.error = "failed", tail(proc.output, 800)
    return out


# ------------------------------------------------------------------------------------------------- phases
def phase_env(suite: Suite, timeout: float) -> PhaseResult:
    """Versions, device, memory bandwidth and bf16 matmul rate, Pallas backends, the bundle's wheels."""
    path = suite.state / "env.json"
    path.unlink(missing_ok=True)
    cmd = [PY, "-m", "gpu.env", str(path)]
    proc = suite.run("env", cmd + (["--dry-run"] if suite.dry else []), timeout, {})
    if not path.exists():
        return PhaseResult("env", "failed", error=tail(proc.output))
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
    differ = (info.get("stack") or {}).get("differ")
    res.metrics["stack_differ"] = "; ".join(differ) if differ else ("none" if differ == [] else None)
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
    """The engine's greedy speculative == plain, cache and coupled-sampling tests on the GPU (but the
    chi-square one, GPU_TESTS), full fp32 matmuls (XLA's default TF32 would break the tests' 1e-5 logprob
    checks for reasons unrelated to correctness); tests that need several devices skip with the reason."""
    return _pytest(suite, "rollout_tests", timeout, {"JAX_DEFAULT_MATMUL_PRECISION": "highest"})


def phase_tree_attention(suite: Suite, timeout: float) -> PhaseResult:
    """bench_tree_attention.py --tune: kernel vs reference at verify shapes, block sizes tuned first."""
    js, tuned = suite.state / "tree_attention.json", suite.state / "tuned_block_sizes.json"
    js.unlink(missing_ok=True)
    if suite.dry:
        args = "--quick --models tiny --seq 64 --tokens 16 --tune-max-evals 2 --tune-shapes 1".split()
    else:  # the tuning adds decode shapes (T=1)
        args = "--tokens 8,16,32,48,64 --batches 1,8,32 --seq 1024".split()
    cmd = [*script_cmd(EXP / "bench" / "bench_tree_attention.py"), *args, "--tune"]
    cmd += ["--json", str(js), "--tuned-out", str(tuned), "--budget-s", f"{max(10.0, timeout - 40):.0f}"]
    proc = suite.run("tree_attention", cmd, timeout, {})
    if not js.exists():
        return PhaseResult(
            "tree_attention", "timeout" if proc.timed_out else "failed", error=tail(proc.output)
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
        res.status, res.error = ("timeout" if proc.timed_out else "failed"), tail(proc.output, 800)
    elif data.get("skipped_for_budget"):
        res.status = "partial"
    return res


def phase_model(suite: Suite, timeout: float) -> PhaseResult:
    """Reassemble the SmolLM2 GGUF from the stashed bundle parts into the state folder (sha256 checked; once
    per lease) and link the repository's model path to it. Dry run: the same code on a synthetic 1 MiB
    model over three simulated calls: part a arrives (refused: model incomplete), part b arrives (assembled
    from the stash, linked), nothing arrives (a no-op)."""
    del timeout
    if not suite.dry:
        try:
            info = state.assemble_and_link(suite.stash, suite.state, bundle.MODEL_PATH)
        except bundle.BundleError as e:
            return PhaseResult("model", "failed", error=str(e))
        return PhaseResult("model", metrics={"assembled": int(info["assembled"])}, details=info)
    tmp = suite.state / "dry_bundle"
    src = tmp / "model.gguf"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_bytes(random.Random(0).randbytes(1 << 20))
    bundle.write_parts(src, tmp / "built", wheel_bytes=1 << 18)
    stash, state_dir, repo_path = tmp / "state" / "bundle", tmp / "state", tmp / "repo" / "model.gguf"
    calls, refused = [], ""
    for part in ("a", "b", ""):  # what each simulated call carries
        carried = tmp / f"carried_{part or 'none'}"
        if part:
            shutil.copytree(tmp / "built" / part, carried / part, dirs_exist_ok=True)
        notes = state.stash_bundle(carried, stash)
        try:
            info = state.assemble_and_link(stash, state_dir, repo_path)
            calls.append({"carried": part, "parts": notes, "assembled": info["assembled"]})
        except bundle.BundleError as e:
            refused = str(e)
            calls.append({"carried": part, "parts": notes, "refused": refused[:200]})
    ok = "model incomplete" in refused and [c.get("assembled") for c in calls] == [None, True, False]
    ok = ok and repo_path.is_symlink() and repo_path.read_bytes() == src.read_bytes()
    details = {"calls": calls, "refusal": refused}
    try:  # the real bundle, if this checkout built one: does each call fit the limit?
        details["bundle_check"] = bundle.check(suite.bundle) if (suite.bundle / "a").is_dir() else None
    except bundle.BundleError as e:
        details["bundle_check"] = str(e)
    return PhaseResult("model", "ok" if ok else "failed", metrics={"assembled": 1}, details=details)


DECODE_ARGS = {  # on a GPU: bfloat16 (what RL stacks decode in) at every batch, float32 at batch 1
    "bfloat16": "--batches 1,4,16,64",
    "float32": "--batches 1",
}


def _ratio(ours: Any, theirs: Any) -> float | None:
    ok = isinstance(theirs, float) and theirs == theirs and theirs > 0
    return ours / theirs if ok else None


def phase_decode(suite: Suite, timeout: float) -> PhaseResult:
    """bench_decode.py per dtype (bfloat16 first; float32 gets what it leaves, at least 60 s) against HF
    transformers on the same device, both of HF's paths: `generate` with its dynamic cache and the fast path
    (static cache + torch.compile; skipped on a CPU, with the reason). A dtype whose run fails (not a
    timeout) is retried once with the jnp attention (reported as such)."""
    dtypes = ["float32"] if suite.dry else ["bfloat16", "float32"]
    has_hf = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
    res = PhaseResult("decode")
    bad = []
    for i, dt in enumerate(dtypes):
        js = suite.state / f"decode_{dt}.json"
        base = "--tiny --batches 1 --new 8 --prompt-len 24" if suite.dry else DECODE_ARGS[dt]
        reserve = DECODE_FP32_MIN_S if i < len(dtypes) - 1 else 0.0
        if suite.phase_left() < 45:
            bad.append(f"{dt} skipped: {suite.phase_left():.0f}s left")
            continue
        for impl in ("auto", "reference"):
            js.unlink(missing_ok=True)
            cmd = [*script_cmd(EXP / "bench" / "bench_decode.py"), *base.split()]
            cmd += ["--dtype", dt, "--attn-impl", impl, "--json", str(js)] + ([] if has_hf else ["--no-hf"])
            proc = suite.run(f"decode_{dt}", cmd, max(30.0, suite.phase_left() - reserve), {})
            if proc.rc == 0 or proc.timed_out or suite.phase_left() < 60:
                break
        data = json.loads(js.read_text()) if js.exists() else {"rows": []}
        data["attn_impl"] = impl
        data["status"] = "ok" if proc.rc == 0 else "timeout" if proc.timed_out else "failed"
        res.details[dt] = data
        for r in data["rows"]:  # the finished batches of a run cut short count too
            b = r["batch"]
            res.metrics[f"{dt}_ours_tok_s_bs{b}"] = r["ours_tok_s"]
            res.metrics[f"{dt}_ratio_vs_hf_bs{b}"] = _ratio(r["ours_tok_s"], r["hf_tok_s"])
            res.metrics[f"{dt}_ratio_vs_hf_fast_bs{b}"] = _ratio(r["ours_tok_s"], r.get("hf_fast_tok_s"))
        for k, v in parse_result(proc.output).items():
            res.metrics.setdefault(f"{dt}_{k}", as_number(v))
        if proc.rc != 0:
            data["output_tail"] = tail(proc.output, 1500)
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
        cmd += [
            "--config.drafter_eval.before=False",
            "--config.train.steps=2",
            "--config.train.checkpoint_every=2",
        ]
    reserve = 0.0 if suite.dry else min(120.0, 0.3 * timeout)  # to finalise a run cut short
    proc = suite.run("drafter", cmd, max(30.0, timeout - reserve), {})
    if proc.rc == 0:
        return _drafter_result(wd, "ok")
    if not proc.timed_out:
        return _drafter_result(wd, "failed", error=tail(proc.output))
    step = latest_step(wd / "train_state")
    if step == 0:
        return _drafter_result(
            wd, "timeout", note="stopped before training: the next call continues the data"
        )
    fin = suite.run("drafter_finalise", [*cmd, f"--config.train.steps={step}"], suite.phase_left(), {})
    note = f"training cut at its step-{step} checkpoint by the time budget, then evaluated and saved"
    return _drafter_result(
        wd, "partial" if fin.rc == 0 else "failed", note=note, error=tail(fin.output) if fin.rc else ""
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


PHASE_FUNCS = {
    "env": phase_env,
    "rl_step_7b": rl_step_phases.phase_rl_step_7b,
    "regime_7b": regime_phases.phase_regime_7b,
    "update_7b": regime_phases.phase_update_7b,
    "gpu_tests": rl_step_phases.phase_gpu_tests,
    "kernel_tests": phase_kernel_tests,
    "tree_attention": phase_tree_attention,
    "rollout_tests": phase_rollout_tests,
    "model": phase_model,
    "decode": phase_decode,
    "identity": measure.phase_identity,
    "compile": measure.phase_compile,
    "verify_cost": measure.phase_verify_cost,
    "drafter": phase_drafter,
    "sd": measure.phase_sd,
    "e2e": measure.phase_e2e,
}
