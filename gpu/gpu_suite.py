"""The GPU suite: on a lent GPU (one H100/H200, no network, 10 min per command), one command per device call
runs the checks and benchmarks the paper's numbers need, each phase in subprocesses under its own time
budget, and leaves JSON + PNG results under --out ($OUT on the device machine) and `RESULT` lines last.

Phases (docs/gpu.md says what each measures and the targets they are judged by):
  env             versions, device, memory bandwidth (device copy) and bf16 matmul rate, Pallas backends
  regime_7b       gpu/regime_7b.py: Qwen2.5-7B shapes, random bf16 weights on the device: plain decode at
                  batch 1..128 x cache 4K/32K vs the paper and the roofline, a speculative round in plain
                  steps (TV 4..64, batch 1..32) split draft/verify/accept, the drafter's step, compile times
  kernel_tests    tests/kernels/test_tree_attention.py with the kernel compiled by Triton (not interpreted)
  tree_attention  experiments/bench/bench_tree_attention.py --tune: block sizes (split-K included) tuned,
                  kernel vs jnp reference
  rollout_tests   the engine's speculative == plain / cache tests (tests/rollout) on the GPU
  model           the SmolLM2 GGUF reassembled from the stashed bundle parts (sha256 checked)
  decode          experiments/bench/bench_decode.py, bfloat16 then float32, vs HF's dynamic-cache, fast paths
  identity        experiments/checks/sd_identity.py: SD rollouts identical to plain ones (bfloat16, float32)
  compile         experiments/bench/compile_time.py --quick: compile time, first run vs rerun (if it exists)
  update_7b       gpu/regime_7b.py update: the 7B-width update micro-step at 8K / 32K tokens per row, as
                  many layers as fit, peak memory vs the plan
  verify_cost     experiments/bench/bench_verify_cost.py --quick --breakdown: a verify round's phases (if
                  supported)
  drafter         the drafter warm-up (configs/drafter_warmup.py:gpu), cut at a checkpoint if out of time
  sd              experiments/bench/bench_sd.py with that drafter: batch x tokens_to_verify (Table 4's shape)
  e2e             experiments/paper/e2e_speedup.py --quick, when the script exists

A task is lent a GPU for 15 minutes of device time in all (start, transfers and idle time included), so the
plan is two calls (gpu_regime.PLAN: <= 12 minutes with the machine's start, printed at every call); the 98
MB model cannot travel in one call (64 MiB), so each call carries one part of `make gpu-bundle`'s
.gpu_bundle, which the suite copies into its state folder on arrival:
  --call 1  (305 s)  env, regime_7b, update_7b, tree_attention  carry .gpu_bundle/a (wheels, model part 1)
  --call 2  (265 s)  env, model, identity, compile              carry .gpu_bundle/b (model part 2)
  --call 3, --call 4 (570 / 540 s): the other phases, for a session with a longer lease
State that later calls use (the bundle parts, the model, wheels, tuned block sizes, the drafter, the XLA and
inductor caches, every phase's result) lives outside the repository (gpu_state.py: --state-dir, else
$TLT_GPU_STATE, else /root/keep/gpu_suite); `--resume` runs the phases that have not finished yet.

    python3 -m gpu.gpu_suite --call 1 --out $OUT              # on the device machine
    python3 -m gpu.gpu_suite --resume --call plan --out $OUT  # what the plan's calls have not finished
    python -m gpu.gpu_suite --dry-run                          # CPU: tiny shapes, interpret mode
    python -m gpu.gpu_suite --dry-run --phases regime_7b,update_7b   # the plan's new phases (make test)
    python -m gpu.gpu_suite --phases decode,sd --budget-s 300  # any subset

Exit status 0 when no phase failed or timed out (partial and skipped phases are reported, not failures).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from gpu import gpu_bundle, gpu_regime, gpu_report, gpu_state
from gpu import gpu_phases as ph

ROOT = pathlib.Path(__file__).resolve().parents[1]
PHASES = tuple(ph.PHASE_FUNCS)
CALLS = {  # calls 1 and 2: the 15-minute plan (gpu_regime.PLAN); 3 and 4: the rest, for a longer lease
    **{call: tuple(p[0] for p in phases) for call, phases in gpu_regime.PLAN.items()},
    "3": ("env", "kernel_tests", "rollout_tests", "model", "decode"),
    "4": ("env", "model", "verify_cost", "drafter", "sd", "e2e"),
    "all": PHASES,
}
CALLS["plan"] = tuple(dict.fromkeys(CALLS["1"] + CALLS["2"]))  # `--resume --call plan`: the plan's phases
# Seconds on a GPU: (most a phase may take, least worth starting; also what is kept for each later phase).
# Measured on an H100 (2026-11-24): env 10, kernel_tests 25, tree_attention 116, decode (dynamic HF only)
# 137 + >103, drafter ~290 in all, sd 326 for batch 1 and 4, a GRPO step 1 of configs/tlt.py:quick 313
# (compile's first run); rollout_tests did not finish in 240 with 4 workers (the chi-square test alone ran
# > 240 s: it is deselected on a GPU, and 8 workers share the rest).
LIMITS = {
    "env": (60, 15),
    "kernel_tests": (90, 30),
    "tree_attention": (180, 45),
    "rollout_tests": (150, 60),
    "model": (30, 5),
    "decode": (300, 90),
    "identity": (240, 90),
    "compile": (420, 60),
    "verify_cost": (150, 30),
    "drafter": (420, 60),
    "sd": (300, 90),
    "e2e": (300, 90),
}
# the 7B phases outside the plan's calls (resumes, --call all): the plan's caps (call 1, H200 2026-11-26)
LIMITS.update(
    {p: (cap, least) for p, cap, least, *_ in gpu_regime.PLAN["1"] if p in ("regime_7b", "update_7b")}
)
# default --budget-s; calls 1 and 2 (and their phases' caps) from the plan
CALL_BUDGETS = {**gpu_regime.CALL_BUDGET_S, "3": 570.0, "4": 540.0, "plan": 285.0, "all": 570.0}
PLAN_LIMITS = {c: {p[0]: (p[1], p[2]) for p in phases} for c, phases in gpu_regime.PLAN.items()}
DRY_CAP_S = 300.0  # per phase in a dry run: generous, so a slow CI machine is not a failure
REPORT_RESERVE_S = 15.0  # kept for plots and the summary at the end of a call
NEEDS_MODEL = ("decode", "identity", "compile", "verify_cost", "drafter", "sd", "e2e")
# phases that run with the tuned block sizes, if any (every one that runs the model through the engine)
TUNED_FOR = ("decode", "identity", "verify_cost", "compile", "drafter", "sd", "e2e")
DONE = ("ok", "failed")  # a phase with such a result is not rerun by --resume (a failure needs a fix first)
LOG_CAP_BYTES = 12 << 20


@dataclasses.dataclass
class Proc:
    """A finished (or killed) subprocess: exit code, whether the timeout killed it, merged output."""

    rc: int | None
    timed_out: bool
    seconds: float
    output: str


class Suite:
    """The run's settings, clock and subprocess runner; the phase functions (gpu_phases.py) use it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.dry: bool = args.dry_run
        self.out = pathlib.Path(args.out or os.environ.get("OUT") or ROOT / "gpu_suite_out").resolve()
        self.state, self.state_why = gpu_state.choose_state_dir(args.state_dir, self.dry, self.out)
        self.bundle = pathlib.Path(args.bundle).resolve()  # what this call carried (gone at the next call)
        self.stash = self.state / "bundle"  # where the carried parts are kept for the lease
        self.allow_cpu: bool = args.allow_cpu
        self.extend_drafter: bool = args.extend_drafter
        self.drafter_config: str = args.drafter_config
        self.call: str = args.call
        self.limits = {**LIMITS, **PLAN_LIMITS.get(args.call, {})}  # a plan call's own caps
        self.regime_parts: str = getattr(args, "regime_parts", "")
        self.caps = {k: float(v) for k, v in (kv.split("=") for kv in args.limits.split(",") if kv)}
        self.t0 = time.perf_counter()
        self.budget_s: float = args.budget_s or CALL_BUDGETS[args.call]
        self.deadline = self.t0 + self.budget_s
        self.phase_deadline = self.deadline
        self.on_gpu = False
        self.has_xdist = importlib.util.find_spec("xdist") is not None
        cfg = args.drafter_config or ("tiny" if self.dry else "gpu")
        self.drafter_dir = self.state / ("drafter" if cfg == "gpu" else f"drafter_{cfg}")  # one per config
        self.site = pathlib.Path(args.site) if args.site else self.state / "site"
        self.extra_path: list[str] = []
        for d in (self.out, self.state, self.state / "results"):
            d.mkdir(parents=True, exist_ok=True)
        stale = {"summary.json", "report.md", "suite.log", "compile_time.png", "verify_breakdown.png"}
        stale |= {f"{p}.{e}" for p in PHASES for e in ("json", "png")}
        for name in stale:  # an earlier run's files in a reused --out must not pass for this run's
            (self.out / name).unlink(missing_ok=True)
        self.log = open(self.out / "suite.log", "w", encoding="utf-8", errors="replace")  # noqa: SIM115
        self.log_bytes = 0
        self.phase = ""

    # ---- clock
    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def phase_left(self) -> float:
        return self.phase_deadline - time.perf_counter()

    def timeout_for(self, name: str, later: tuple[str, ...]) -> float:
        """The phase's own cap, less what the later phases need at least; 0 when not worth starting."""
        cap = self.caps.get(name, DRY_CAP_S if self.dry else self.limits[name][0])
        left = self.left() - REPORT_RESERVE_S
        least = min(cap, 1.0 if self.dry else self.limits[name][1])  # a --limits cap below it is honoured
        t = min(cap, left - sum(0.0 if self.dry else self.limits[p][1] for p in later))
        if t < least:  # earlier phases come first: take what is left rather than skip
            t = min(cap, left)
        return t if t >= least else 0.0

    # ---- subprocesses
    def child_env(self, label: str, extra: dict[str, str | None]) -> dict[str, str]:
        test_session = (
            "XLA_FLAGS",
            "PYTEST_CURRENT_TEST",
            "PYTEST_XDIST_WORKER",
            "PYTEST_XDIST_WORKER_COUNT",
        )
        env = {k: v for k, v in os.environ.items() if k not in test_session}  # a user's shell
        paths = [str(ROOT), *self.extra_path, env.get("PYTHONPATH", "")]
        env.update(
            PYTHONPATH=os.pathsep.join(p for p in paths if p),
            PYTHONUNBUFFERED="1",
            WANDB_MODE="disabled",
            XLA_PYTHON_CLIENT_PREALLOCATE="false",  # JAX and torch share the GPU in bench_decode
            TOKENIZERS_PARALLELISM="false",
        )
        if not self.dry:  # compiled programs survive into later calls of the lease (and resumed phases)
            env["JAX_COMPILATION_CACHE_DIR"] = str(self.state / "jax_cache")
            env["TORCHINDUCTOR_CACHE_DIR"] = str(self.state / "torch_cache")  # HF's compiled decode step
        tuned = self.state / "tuned_block_sizes.json"
        if tuned.exists() and any(label.startswith(p) for p in TUNED_FOR):
            env["TLT_TREE_ATTENTION_BLOCK_SIZES"] = str(tuned)
        for key, value in extra.items():  # None: unset
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def _write_log(self, text: str) -> None:
        if self.log_bytes < LOG_CAP_BYTES:
            self.log.write(text)
            self.log_bytes += len(text)
            if self.log_bytes >= LOG_CAP_BYTES:
                self.log.write("\n... suite.log truncated at its size cap\n")
            self.log.flush()

    def run(self, label: str, cmd: list[str], timeout: float, env: dict[str, str | None]) -> Proc:
        """Run `cmd` in the repository root in its own process group; kill the group at `timeout` (clamped
        to the phase's deadline). Output is echoed (prefixed), logged to suite.log and returned."""
        timeout = max(1.0, min(timeout, self.phase_left()))
        full_env = self.child_env(label, env)
        head = f"\n===== [{label}] timeout {timeout:.0f}s: {' '.join(cmd)}\n"
        print(head.strip(), flush=True)
        self._write_log(head)
        t = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
            errors="replace",
            bufsize=1,
        )
        chunks: list[str] = []

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                chunks.append(line)
                self._write_log(line)
                shown = line.rstrip("\n").split("\r")[-1]  # progress bars: the last state only
                if shown.strip():
                    print(f"  [{label}] {shown[:240]}", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self._kill(proc)
        reader.join(timeout=10)
        secs = time.perf_counter() - t
        tail = f"===== [{label}] rc={proc.returncode} timed_out={timed_out} {secs:.0f}s\n"
        print(tail.strip(), flush=True)
        self._write_log(tail)
        return Proc(None if timed_out else proc.returncode, timed_out, secs, "".join(chunks))

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """SIGTERM to the process group this suite started (pytest workers, compilers), then SIGKILL."""
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    # ---- phases
    def run_phase(self, name: str, timeout: float) -> ph.PhaseResult:
        self.phase, self.phase_deadline = name, time.perf_counter() + timeout
        t = time.perf_counter()
        try:
            res = ph.PHASE_FUNCS[name](self, timeout)
        except Exception as e:  # a bug in a phase must not stop the others
            res = ph.PhaseResult(
                name, "failed", error=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
            )
        res.seconds = time.perf_counter() - t
        res.details.setdefault("timeout_s", round(timeout))
        self.phase_deadline = self.deadline
        return res


def install_wheels(suite: Suite) -> dict[str, Any]:
    """On a GPU machine: the stashed bundle's wheels into --site (once per manifest), added to the children's
    path."""
    if suite.dry or not (suite.stash / "a" / "wheels").is_dir():
        return {"installed": False, "reason": "dry run" if suite.dry else f"no {suite.stash}/a/wheels yet"}
    try:
        missing = gpu_bundle.install_wheels(suite.stash, suite.site)
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


def pending(state: pathlib.Path) -> tuple[str, ...]:
    """The phases, in order, that no call of this lease has finished (ok or failed): never run, skipped,
    partial or cut by their timeout. What `--resume` runs."""
    done = {k for k, r in gpu_report.load_results(state).items() if r.get("status") in DONE}
    return tuple(p for p in PHASES if p not in done)


def select_phases(args: argparse.Namespace, suite: Suite) -> tuple[str, ...]:
    """--phases, else the phases of --call's that --resume finds unfinished, else --call's; env always runs
    first."""
    if args.phases:
        phases = tuple(args.phases.split(","))
    elif args.resume:
        phases = tuple(p for p in pending(suite.state) if p in CALLS[args.call])
    else:
        phases = CALLS[args.call]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        sys.exit(f"unknown phases {unknown}: choose from {PHASES}")
    return phases if "env" in phases else ("env", *phases)


def prepare(suite: Suite) -> dict[str, Any]:
    """Before the phases (GPU runs): stash the bundle parts this call carried, then install the wheels."""
    where = (
        "inside the repository: lost at the next device call!" if gpu_state.inside_repo(suite.state) else ""
    )
    print(f"# state {suite.state} ({suite.state_why}) {where}; carried bundle {suite.bundle}", flush=True)
    stashed = {} if suite.dry else gpu_state.stash_bundle(suite.bundle, suite.stash)
    wheels = install_wheels(suite)
    print(f"# bundle parts: {stashed or 'dry run'}; wheels: {wheels}", flush=True)
    return {"wheels": wheels, "bundle_parts": stashed, "state": str(suite.state)}


def run_phases(suite: Suite, phases: tuple[str, ...], call: str) -> list[ph.PhaseResult]:
    """Each phase in turn under its timeout, its result recorded in the state folder as it ends; a failed
    env (no GPU) or model phase skips what depends on it."""
    results: list[ph.PhaseResult] = []
    blocked: dict[str, str] = {}
    for i, name in enumerate(phases):
        if name in blocked:
            res = ph.PhaseResult(name, "skipped", error=blocked[name])
        elif (timeout := suite.timeout_for(name, phases[i + 1 :])) <= 0:
            res = ph.PhaseResult(name, "skipped", error=f"time budget: {suite.left():.0f}s left")
        else:
            print(f"\n##### phase {name} (up to {timeout:.0f}s)", flush=True)
            res = suite.run_phase(name, timeout)
        results.append(res)
        why = res.error.strip().splitlines()[-1][:300] if res.error.strip() else ""
        print(f"##### phase {name}: {res.status} in {res.seconds:.0f}s {why}", flush=True)
        path = suite.state / "results" / f"{name}.json"
        if res.status != "skipped" or not path.exists():  # a skip must not hide an earlier call's result
            path.write_text(json.dumps(res.record(call, suite.dry), indent=2, default=str))
        if name == "env":  # only a definite "no GPU" stops the rest; a broken probe does not
            suite.on_gpu = bool(res.details.get("on_gpu"))
            if res.details.get("no_gpu"):
                blocked.update({p: f"env: {res.error[:200]}" for p in phases if p != "env"})
        if name == "model" and res.status != "ok":
            blocked.update({p: f"no model: {res.error[:300]}" for p in NEEDS_MODEL if p in phases[i + 1 :]})
    return results


def run_suite(args: argparse.Namespace) -> int:
    suite = Suite(args)
    phases = select_phases(args, suite)
    call = "resume" if args.resume and not args.phases else args.call
    mode = "dry run (tiny shapes; interpret mode on CPU)" if suite.dry else f"call {call}"
    print(f"# gpu_suite: {mode}; phases {','.join(phases)}; budget {suite.budget_s:.0f}s; out {suite.out}")
    print("\n".join(gpu_regime.plan_lines()), flush=True)
    meta: dict[str, Any] = {"call": call, "dry_run": suite.dry, "budget_s": suite.budget_s, **prepare(suite)}
    results = run_phases(suite, phases, call)
    meta["wall_s"] = time.perf_counter() - suite.t0
    try:
        summary = gpu_report.write_outputs(suite.out, suite.state, results, meta)
    except Exception as e:  # the RESULT lines below must still come out
        print(f"# writing summary/report/plots failed: {type(e).__name__}: {e}", flush=True)
        summary = {"targets": {}}
    suite.log.close()
    if suite.dry:  # the plan again, with what each phase took here
        print("\n".join(gpu_regime.plan_lines({r.phase: r.seconds for r in results})), flush=True)
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
        help=f"kept between calls (default ${gpu_state.STATE_ENV}, else "
        f"{gpu_state.DEFAULT_STATE}, else {gpu_state.FALLBACK_STATE}; dry run: under --out)",
    )
    ap.add_argument("--budget-s", type=float, default=0.0, help="wall-clock budget (0: per call, 420-570 s)")
    ap.add_argument("--limits", default="", help="per-phase caps in seconds, e.g. drafter=300,sd=400")
    ap.add_argument("--bundle", default=str(gpu_bundle.BUNDLE), help="where this call's carried parts are")
    ap.add_argument("--site", default="", help="where the bundle's wheels go (default <state>/site)")
    ap.add_argument("--allow-cpu", action="store_true", help="run the full phases without a GPU (debugging)")
    ap.add_argument(
        "--regime-parts", default="", help=f"regime_7b's parts (default {gpu_regime.REGIME_PARTS})"
    )
    ap.add_argument("--extend-drafter", action="store_true", help="train a finished drafter on (train.steps)")
    ap.add_argument(
        "--drafter-config", default="", help="configs/drafter_warmup.py arg (default gpu; tiny dry)"
    )
    sys.exit(run_suite(ap.parse_args()))


if __name__ == "__main__":
    main()
