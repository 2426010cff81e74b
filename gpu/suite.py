"""The GPU suite: on a lent GPU (one H100/H200, no network, 10 min per command), one command per device call
runs the checks and benchmarks the paper's numbers need, each phase in subprocesses under its own time
budget, and leaves JSON + PNG results under --out ($OUT on the device machine) and `RESULT` lines last.

Phases (docs/gpu.md says what each measures and the targets they are judged by):
  env             versions, the stack against requirements/jax-gpu.txt (gpu/stack.py), device, memory
                  bandwidth (device copy) and bf16 matmul rate, Pallas backends
  rl_step_7b      rl_step_phases.py: `python -m tlt_jax.main` with configs/qwen2_5_7b_gpu_step.py (Qwen2.5-7B
                  layer shapes, random bf16 weights, the token task): time to step 1 from a cold cache, the
                  steps' parts, peak memory per learner phase vs the memory plans of the same config
  regime_7b       gpu/regime_7b.py: Qwen2.5-7B shapes, random bf16 weights on the device: plain decode at
                  batch 1 and 8 x cache 4K/32K vs the paper and the roofline, a speculative round in plain
                  steps (TV 16/4/48 at 4K and 32K, batch 1 then 8), compile times (+ drafter step, split)
  update_7b       gpu/regime_7b.py update: the 7B-width update micro-step at 8K / 32K tokens per row, as
                  many layers as fit, peak memory vs XLA:GPU's and XLA:CPU's plans, cuDNN attention
  gpu_tests       the tests make test skips for want of a GPU and the kernels' test files, compiled
  kernel_tests    tests/kernels/test_tree_attention.py with the kernel compiled by Triton (not interpreted)
  tree_attention  experiments/bench/bench_tree_attention.py --tune: block sizes (split-K included) tuned,
                  kernel vs jnp reference
  rollout_tests   the engine's speculative == plain / cache tests (tests/rollout) on the GPU
  model           the SmolLM2 GGUF reassembled from the stashed bundle parts (sha256 checked)
  decode          experiments/bench/bench_decode.py, bfloat16 then float32, vs HF's dynamic-cache, fast paths
  identity        experiments/checks/sd_identity.py: SD rollouts identical to plain ones (bfloat16, float32)
  compile         experiments/bench/compile_time.py --quick: compile time, first run vs rerun (if it exists)
  verify_cost     experiments/bench/bench_verify_cost.py --quick --breakdown: a verify round's phases (if
                  supported)
  drafter         the drafter warm-up (configs/drafter_warmup.py:gpu), cut at a checkpoint if out of time
  sd              experiments/bench/bench_sd.py with that drafter: batch x tokens_to_verify (Table 4's shape)
  e2e             experiments/paper/e2e_speedup.py --quick, when the script exists

A task is lent a GPU for 15 minutes of device time in all (start, transfers and idle time included), so the
plan is two calls (call_plan.PLAN: <= 13 minutes with the machine's start, printed at every call); the 98
MB model cannot travel in one call (64 MiB), so each call carries one part of `make gpu-bundle`'s
.gpu_bundle, which the suite copies into its state folder on arrival:
  --call 1  (320 s)  env, rl_step_7b, regime_7b                               carry .gpu_bundle/a (wheels)
  --call 2  (320 s)  env, model, gpu_tests, identity, update_7b, compile      carry .gpu_bundle/b (model)
  --call 3, --call 4 (570 / 540 s): the other phases, for a session with a longer lease
State that later calls use (the bundle parts, the model, wheels, tuned block sizes, the drafter, the XLA and
inductor caches, every phase's result) lives outside the repository (state.py: --state-dir, else
$TLT_GPU_STATE, else /root/keep/gpu_suite); `--resume` runs the phases that have not finished yet.

    python3 -m gpu.suite --call 1 --out $OUT              # on the device machine
    python3 -m gpu.suite --resume --call plan --out $OUT  # what the plan's calls have not finished
    python -m gpu.suite --dry-run                          # CPU: tiny shapes, interpret mode
    python -m gpu.suite --dry-run --phases rl_step_7b,regime_7b,update_7b   # the 7B phases (make test)
    python -m gpu.suite --phases decode,sd --budget-s 300  # any subset

Exit status 0 when no phase failed or timed out (partial and skipped phases are reported, not failures).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import traceback
from typing import Any

from gpu import bundle, phases, report, state
from gpu.call_plan import CALL_BUDGETS, CALLS, LIMITS, PHASES, REPORT_RESERVE_S, plan_lines
from gpu.runner import Suite

__all__ = ["CALL_BUDGETS", "CALLS", "LIMITS", "PHASES", "REPORT_RESERVE_S", "Suite", "main"]
NEEDS_MODEL = ("decode", "identity", "compile", "verify_cost", "drafter", "sd", "e2e")
DONE = ("ok", "failed")  # a phase with such a result is not rerun by --resume (a failure needs a fix first)


def run_phase(suite: Suite, name: str, timeout: float) -> phases.PhaseResult:
    """One phase under `timeout` (the suite's phase deadline set for it); a bug in a phase is its failure,
    never the call's."""
    suite.phase, suite.phase_deadline = name, time.perf_counter() + timeout
    t = time.perf_counter()
    try:
        res = phases.PHASE_FUNCS[name](suite, timeout)
    except Exception as e:  # a bug in a phase must not stop the others
        res = phases.PhaseResult(
            name, "failed", error=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
        )
    res.seconds = time.perf_counter() - t
    res.details.setdefault("timeout_s", round(timeout))
    suite.phase_deadline = suite.deadline
    return res


def install_wheels(suite: Suite) -> dict[str, Any]:
    """On a GPU machine: the stashed bundle's wheels into --site (once per manifest), added to the children's
    path."""
    if suite.dry or not (suite.stash / "a" / "wheels").is_dir():
        return {"installed": False, "reason": "dry run" if suite.dry else f"no {suite.stash}/a/wheels yet"}
    try:
        missing = bundle.install_wheels(suite.stash, suite.site)
    except Exception as e:  # the phases then report what they cannot import
        return {"installed": False, "reason": f"{type(e).__name__}: {e}"[:2000]}
    suite.extra_path.append(str(suite.site))
    return {"installed": True, "site": str(suite.site), "still_missing": missing}


def fmt(value: Any) -> str:
    """A RESULT value: numbers in 4 significant digits, text without spaces."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return "na"
    return "_".join(str(value).split())[:80]


def pending(state_dir: pathlib.Path) -> tuple[str, ...]:
    """The phases, in order, that no call of this lease has finished (ok or failed): never run, skipped,
    partial or cut by their timeout. What `--resume` runs."""
    done = {k for k, r in report.load_results(state_dir).items() if r.get("status") in DONE}
    return tuple(p for p in PHASES if p not in done)


def select_phases(args: argparse.Namespace, suite: Suite) -> tuple[str, ...]:
    """--phases, else the phases of --call's that --resume finds unfinished, else --call's; env always runs
    first."""
    if args.phases:
        names = tuple(args.phases.split(","))
    elif args.resume:
        names = tuple(p for p in pending(suite.state) if p in CALLS[args.call])
    else:
        names = CALLS[args.call]
    unknown = [p for p in names if p not in PHASES]
    if unknown:
        sys.exit(f"unknown phases {unknown}: choose from {PHASES}")
    return names if "env" in names else ("env", *names)


def prepare(suite: Suite) -> dict[str, Any]:
    """Before the phases (GPU runs): stash the bundle parts this call carried, then install the wheels."""
    where = "inside the repository: lost at the next device call!" if state.inside_repo(suite.state) else ""
    print(f"# state {suite.state} ({suite.state_why}) {where}; carried bundle {suite.bundle}", flush=True)
    stashed = {} if suite.dry else state.stash_bundle(suite.bundle, suite.stash)
    wheels = install_wheels(suite)
    print(f"# bundle parts: {stashed or 'dry run'}; wheels: {wheels}", flush=True)
    return {"wheels": wheels, "bundle_parts": stashed, "state": str(suite.state)}


def run_phases(suite: Suite, names: tuple[str, ...], call: str) -> list[phases.PhaseResult]:
    """Each phase in turn under its timeout, its result recorded in the state folder as it ends; a failed
    env (no GPU) or model phase skips what depends on it."""
    results: list[phases.PhaseResult] = []
    blocked: dict[str, str] = {}
    for i, name in enumerate(names):
        if name in blocked:
            res = phases.PhaseResult(name, "skipped", error=blocked[name])
        elif (timeout := suite.timeout_for(name, names[i + 1 :])) <= 0:
            res = phases.PhaseResult(name, "skipped", error=f"time budget: {suite.left():.0f}s left")
        else:
            print(f"\n##### phase {name} (up to {timeout:.0f}s)", flush=True)
            res = run_phase(suite, name, timeout)
        results.append(res)
        why = res.error.strip().splitlines()[-1][:300] if res.error.strip() else ""
        print(f"##### phase {name}: {res.status} in {res.seconds:.0f}s {why}", flush=True)
        path = suite.state / "results" / f"{name}.json"
        if res.status != "skipped" or not path.exists():  # a skip must not hide an earlier call's result
            path.write_text(json.dumps(res.record(call, suite.dry), indent=2, default=str))
        if name == "env":  # only a definite "no GPU" stops the rest; a broken probe does not
            suite.on_gpu = bool(res.details.get("on_gpu"))
            if res.details.get("no_gpu"):
                blocked.update({p: f"env: {res.error[:200]}" for p in names if p != "env"})
        if name == "model" and res.status != "ok":
            blocked.update({p: f"no model: {res.error[:300]}" for p in NEEDS_MODEL if p in names[i + 1 :]})
    return results


def run_suite(args: argparse.Namespace) -> int:
    suite = Suite(args)
    names = select_phases(args, suite)
    call = "resume" if args.resume and not args.phases else args.call
    mode = "dry run (tiny shapes; interpret mode on CPU)" if suite.dry else f"call {call}"
    print(f"# gpu.suite: {mode}; phases {','.join(names)}; budget {suite.budget_s:.0f}s; out {suite.out}")
    print("\n".join(plan_lines()), flush=True)
    meta: dict[str, Any] = {"call": call, "dry_run": suite.dry, "budget_s": suite.budget_s, **prepare(suite)}
    results = run_phases(suite, names, call)
    meta["wall_s"] = time.perf_counter() - suite.t0
    try:
        summary = report.write_outputs(suite.out, suite.state, results, meta)
    except Exception as e:  # the RESULT lines below must still come out
        print(f"# writing summary/report/plots failed: {type(e).__name__}: {e}", flush=True)
        summary = {"targets": {}}
    suite.log.close()
    if suite.dry:  # the plan again, with what each phase took here
        print("\n".join(plan_lines({r.phase: r.seconds for r in results})), flush=True)
    for res in results:
        fields = " ".join(f"{k}={fmt(v)}" for k, v in res.metrics.items())
        print(f"RESULT gpu_suite.{res.phase} status={res.status} seconds={res.seconds:.0f} {fields}".rstrip())
    counts = {
        s: sum(r.status == s for r in results) for s in ("ok", "partial", "skipped", "failed", "timeout")
    }
    device = next((r.metrics.get("device") for r in results if r.phase == "env"), None)
    tail = " ".join(f"target_{k}={v}" for k, v in summary["targets"].items())
    print(
        f"RESULT gpu_suite call={call} dry_run={int(suite.dry)} device={fmt(device)} "
        + " ".join(f"{k}={v}" for k, v in counts.items())
        + f" {tail} wall_s={meta['wall_s']:.0f} out={suite.out}"
    )
    return 1 if counts["failed"] or counts["timeout"] else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--call", default="all", choices=sorted(CALLS), help="which device call's phases")
    ap.add_argument("--phases", default="", help="comma-separated phases (overrides --call; env always runs)")
    ap.add_argument("--resume", action="store_true", help="the phases this lease has not finished yet")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, interpret mode on CPU (seconds)")
    ap.add_argument("--out", default="", help="results folder (default $OUT, else gpu_suite_out/)")
    ap.add_argument(
        "--state-dir",
        default="",
        help=f"kept between calls (default ${state.STATE_ENV}, else "
        f"{state.DEFAULT_STATE}, else {state.FALLBACK_STATE}; dry run: under --out)",
    )
    ap.add_argument("--budget-s", type=float, default=0.0, help="wall-clock budget (0: per call, 420-570 s)")
    ap.add_argument("--limits", default="", help="per-phase caps in seconds, e.g. drafter=300,sd=400")
    ap.add_argument("--bundle", default=str(bundle.BUNDLE), help="where this call's carried parts are")
    ap.add_argument("--site", default="", help="where the bundle's wheels go (default <state>/site)")
    ap.add_argument("--allow-cpu", action="store_true", help="run the full phases without a GPU (debugging)")
    ap.add_argument("--regime-parts", default="", help="regime_7b's parts (default decode,round)")
    ap.add_argument("--extend-drafter", action="store_true", help="train a finished drafter on (train.steps)")
    ap.add_argument(
        "--drafter-config", default="", help="configs/drafter_warmup.py arg (default gpu; tiny dry)"
    )
    sys.exit(run_suite(ap.parse_args()))


if __name__ == "__main__":
    main()
