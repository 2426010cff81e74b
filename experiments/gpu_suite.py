"""The GPU suite: on a lent GPU (one H100/H200, no network, 10 min per command), one command per device call
runs the checks and benchmarks the paper's numbers need, each phase in subprocesses under its own time
budget, and leaves JSON + PNG results under --out ($OUT on the device machine) and `RESULT` lines last.

Phases (docs/gpu.md says what each measures and the targets they are judged by):
  env             versions, device, memory bandwidth (device copy) and bf16 matmul rate, Pallas backends
  kernel_tests    tests/kernels/test_tree_attention.py with the kernel compiled by Triton (not interpreted)
  tree_attention  experiments/bench_tree_attention.py --tune: block sizes tuned, kernel vs jnp reference
  rollout_tests   the engine's speculative == plain / cache / lossless tests (tests/rollout) on the GPU
  model           the SmolLM2 GGUF reassembled from the bundle's two parts (sha256 checked)
  decode          experiments/bench_decode.py, bfloat16 and float32, batch 1..64, vs HF transformers
  drafter         the drafter warm-up (configs/drafter_warmup.py:gpu), cut at a checkpoint if out of time
  sd              experiments/bench_sd.py with that drafter: batch x tokens_to_verify (Table 4's shape)
  e2e             experiments/e2e_speedup.py --quick, when the script exists

The 98 MB model cannot travel in one call (64 MiB), so the work is split into calls that each carry one part
of `make gpu-bundle`'s .gpu_bundle (parts stay on the machine for the lease; --call picks the phases):
  --call 1  (420 s)  env, kernel_tests, tree_attention, rollout_tests  carry .gpu_bundle/a (wheels, part 1)
  --call 2  (540 s)  env, model, decode, drafter                       carry .gpu_bundle/b (part 2)
  --call 3  (480 s)  env, model, drafter (if unfinished), sd, e2e      carry nothing new
(the budgets add up to ~24 min: with the machine's start, three calls fit a session's 30 minutes).
State that later calls use (tuned block sizes, the drafter, the XLA compilation cache, every phase's result)
lives in --state-dir (default workdirs/gpu_suite, ignored, so it stays on the machine between calls).

    python3 experiments/gpu_suite.py --call 1 --out $OUT              # on the device machine
    python experiments/gpu_suite.py --dry-run                          # CPU: tiny shapes, interpret mode
    python experiments/gpu_suite.py --phases decode,sd --budget-s 300  # any subset

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

import gpu_bundle
import gpu_phases as ph
import gpu_report

ROOT = pathlib.Path(__file__).resolve().parents[1]
PHASES = tuple(ph.PHASE_FUNCS)
CALLS = {
    "1": ("env", "kernel_tests", "tree_attention", "rollout_tests"),
    "2": ("env", "model", "decode", "drafter"),
    "3": ("env", "model", "drafter", "sd", "e2e"),
    "all": PHASES,
}
# Seconds on a GPU: (most a phase may take, least worth starting; also what is kept for each later phase).
LIMITS = {
    "env": (90, 20),
    "kernel_tests": (150, 30),
    "tree_attention": (210, 45),
    "rollout_tests": (240, 45),
    "model": (60, 5),
    "decode": (240, 60),
    "drafter": (600, 60),
    "sd": (420, 120),
    "e2e": (240, 90),
}
CALL_BUDGETS = {"1": 420.0, "2": 540.0, "3": 480.0, "all": 540.0}  # default --budget-s per call
DRY_CAP_S = 300.0  # per phase in a dry run: generous, so a slow CI machine is not a failure
REPORT_RESERVE_S = 15.0  # kept for plots and the summary at the end of a call
NEEDS_MODEL = ("decode", "drafter", "sd", "e2e")
TUNED_FOR = ("decode", "drafter", "sd", "e2e")  # phases that run with the tuned block sizes, if any
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
        self.state = pathlib.Path(
            args.state_dir or (self.out / "state" if self.dry else ROOT / "workdirs/gpu_suite")
        )
        self.state = self.state.resolve()
        self.bundle = pathlib.Path(args.bundle).resolve()
        self.allow_cpu: bool = args.allow_cpu
        self.extend_drafter: bool = args.extend_drafter
        self.drafter_config: str = args.drafter_config
        self.call: str = args.call
        self.caps = {k: float(v) for k, v in (kv.split("=") for kv in args.limits.split(",") if kv)}
        self.t0 = time.perf_counter()
        self.budget_s: float = args.budget_s or CALL_BUDGETS[args.call]
        self.deadline = self.t0 + self.budget_s
        self.phase_deadline = self.deadline
        self.on_gpu = False
        self.has_xdist = importlib.util.find_spec("xdist") is not None
        cfg = args.drafter_config or ("tiny" if self.dry else "gpu")
        self.drafter_dir = self.state / ("drafter" if cfg == "gpu" else f"drafter_{cfg}")  # one per config
        self.site = pathlib.Path(args.site)
        self.extra_path: list[str] = []
        for d in (self.out, self.state, self.state / "results"):
            d.mkdir(parents=True, exist_ok=True)
        stale = {"summary.json", "report.md", "suite.log"} | {
            f"{p}.{e}" for p in PHASES for e in ("json", "png")
        }
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
        cap = self.caps.get(name, DRY_CAP_S if self.dry else LIMITS[name][0])
        left = self.left() - REPORT_RESERVE_S
        least = min(cap, 1.0 if self.dry else LIMITS[name][1])  # a --limits cap below the minimum is honoured
        t = min(cap, left - sum(0.0 if self.dry else LIMITS[p][1] for p in later))
        if t < least:  # earlier phases come first: take what is left rather than skip
            t = min(cap, left)
        return t if t >= least else 0.0

    # ---- subprocesses
    def child_env(self, label: str, extra: dict[str, str]) -> dict[str, str]:
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
        if (
            not self.dry
        ):  # compiled programs survive into later calls of the lease (resumed warm-ups reuse them)
            env["JAX_COMPILATION_CACHE_DIR"] = str(self.state / "jax_cache")
        tuned = self.state / "tuned_block_sizes.json"
        if tuned.exists() and any(label.startswith(p) for p in TUNED_FOR):
            env["TLT_TREE_ATTENTION_BLOCK_SIZES"] = str(tuned)
        env.update(extra)
        return env

    def _write_log(self, text: str) -> None:
        if self.log_bytes < LOG_CAP_BYTES:
            self.log.write(text)
            self.log_bytes += len(text)
            if self.log_bytes >= LOG_CAP_BYTES:
                self.log.write("\n... suite.log truncated at its size cap\n")
            self.log.flush()

    def run(self, label: str, cmd: list[str], timeout: float, env: dict[str, str]) -> Proc:
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
    """On a GPU machine: the bundle's wheels into --site (once per manifest), added to the children's path."""
    if suite.dry or not (suite.bundle / "a" / "wheels").is_dir():
        return {"installed": False, "reason": "dry run" if suite.dry else f"no {suite.bundle}/a/wheels here"}
    try:
        missing = gpu_bundle.install_wheels(suite.bundle, suite.site)
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


def run_suite(args: argparse.Namespace) -> int:
    suite = Suite(args)
    phases = tuple(args.phases.split(",")) if args.phases else CALLS[args.call]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        sys.exit(f"unknown phases {unknown}: choose from {PHASES}")
    if "env" not in phases:
        phases = ("env", *phases)
    mode = "dry run (tiny shapes; interpret mode on CPU)" if suite.dry else f"call {args.call}"
    print(f"# gpu_suite: {mode}; phases {','.join(phases)}; budget {suite.budget_s:.0f}s; out {suite.out}")
    print(f"# state {suite.state}; bundle {suite.bundle}", flush=True)
    wheels = install_wheels(suite)
    print(f"# wheels: {wheels}", flush=True)
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
        record = {**dataclasses.asdict(res), "call": args.call, "dry_run": suite.dry, "time": time.ctime()}
        path = suite.state / "results" / f"{name}.json"
        if res.status != "skipped" or not path.exists():  # a skip must not hide an earlier call's result
            path.write_text(json.dumps(record, indent=2, default=str))
        if name == "env":  # only a definite "no GPU" stops the rest; a broken probe does not
            suite.on_gpu = bool(res.details.get("on_gpu"))
            if res.details.get("no_gpu"):
                blocked.update({p: f"env: {res.error[:200]}" for p in phases if p != "env"})
        if name == "model" and res.status != "ok":
            blocked.update({p: f"no model: {res.error[:300]}" for p in NEEDS_MODEL if p in phases[i + 1 :]})
    meta = {"call": args.call, "dry_run": suite.dry, "budget_s": suite.budget_s, "wheels": wheels}
    meta["wall_s"] = time.perf_counter() - suite.t0
    try:
        summary = gpu_report.write_outputs(suite.out, suite.state, results, meta)
    except Exception as e:  # the RESULT lines below must still come out
        print(f"# writing summary/report/plots failed: {type(e).__name__}: {e}", flush=True)
        summary = {"targets": {}}
    suite.log.close()
    for res in results:
        fields = " ".join(f"{k}={fmt(v)}" for k, v in res.metrics.items())
        print(f"RESULT gpu_suite.{res.phase} status={res.status} seconds={res.seconds:.0f} {fields}".rstrip())
    counts = {
        s: sum(r.status == s for r in results) for s in ("ok", "partial", "skipped", "failed", "timeout")
    }
    device = next((r.metrics.get("device") for r in results if r.phase == "env"), None)
    tail = " ".join(f"target_{k}={v}" for k, v in summary["targets"].items())
    print(
        f"RESULT gpu_suite call={args.call} dry_run={int(suite.dry)} device={fmt(device)} "
        + " ".join(f"{k}={v}" for k, v in counts.items())
        + f" {tail} wall_s={meta['wall_s']:.0f} out={suite.out}"
    )
    return 1 if counts["failed"] or counts["timeout"] else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--call", default="all", choices=sorted(CALLS), help="which device call's phases")
    ap.add_argument("--phases", default="", help="comma-separated phases (overrides --call; env always runs)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, interpret mode on CPU (seconds)")
    ap.add_argument("--out", default="", help="results folder (default $OUT, else gpu_suite_out/)")
    ap.add_argument("--state-dir", default="", help="kept between calls (default workdirs/gpu_suite)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="wall-clock budget (0: per call, 420-540 s)")
    ap.add_argument("--limits", default="", help="per-phase caps in seconds, e.g. drafter=300,sd=400")
    ap.add_argument("--bundle", default=str(gpu_bundle.BUNDLE), help="the `make gpu-bundle` folder")
    ap.add_argument("--site", default="/tmp/tlt_gpu_site", help="where the bundle's wheels are installed")
    ap.add_argument("--allow-cpu", action="store_true", help="run the full phases without a GPU (debugging)")
    ap.add_argument("--extend-drafter", action="store_true", help="train a finished drafter on (train.steps)")
    ap.add_argument(
        "--drafter-config", default="", help="configs/drafter_warmup.py arg (default gpu; tiny dry)"
    )
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "env":
        worker_env(pathlib.Path(args.worker_out), args.dry_run)
        return
    sys.exit(run_suite(args))


# ------------------------------------------------------------------------------------------------ workers
def worker_env(out: pathlib.Path, dry: bool) -> None:
    """(In a subprocess) what the machine is: versions, device, memory bandwidth, bf16 matmul rate, which
    Pallas GPU backends import, the bundle's imports. Each probe is guarded: one that fails is recorded as
    its error and the others still run (only the backend decides whether the GPU phases go ahead)."""
    import importlib
    import importlib.metadata as md
    import shutil
    import subprocess
    import time

    import jax
    import jax.numpy as jnp

    info: dict[str, Any] = {"python": sys.version.split()[0], "versions": {}, "probe_errors": {}}
    dists = "jax jaxlib jax-cuda13-plugin flax optax orbax-checkpoint chex numpy torch transformers triton"
    for dist in (dists + " tokenizers ml-collections gguf reasoning-gym").split():
        try:
            info["versions"][dist] = md.version(dist)
        except md.PackageNotFoundError:
            info["versions"][dist] = None
    dev = jax.devices()[0]
    info.update(backend=jax.default_backend(), device=dev.device_kind, device_count=jax.device_count())
    info.update(on_gpu=info["backend"] in ("gpu", "cuda", "rocm"), jax=jax.__version__)
    out.write_text(json.dumps(info, indent=2, default=str))  # the essentials first
    small = dry or not info["on_gpu"]  # a CPU (dry run, --allow-cpu) gets the small sizes

    def probe(name: str, fn: Any) -> None:
        try:
            info[name] = fn()
        except Exception as e:  # noted, and the next probe runs
            info["probe_errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"

    def best_ms(f: Any, *a: Any) -> float:
        f(*a).block_until_ready()
        times = []
        for _ in range(10):
            t = time.perf_counter()
            f(*a).block_until_ready()
            times.append(time.perf_counter() - t)
        return 1e3 * min(times)

    def bandwidth() -> float:  # GB/s of a device copy (x + 1: read + write), 1 GiB (16 MiB dry)
        x = jnp.ones(((1 << 22) if small else (1 << 28),), jnp.float32) * 1.5
        return 2 * x.nbytes / best_ms(jax.jit(lambda a: a + 1.0), x) / 1e6

    def matmul() -> float:  # bf16 TFLOP/s of an m^3 product on random data
        m, key = (256 if small else 8192), jax.random.key(0)
        a = jax.random.normal(key, (m, m), jnp.bfloat16)
        b = jax.random.normal(jax.random.fold_in(key, 1), (m, m), jnp.bfloat16)
        return 2 * m**3 / best_ms(jax.jit(jnp.matmul), a, b) / 1e9

    def smi() -> str:
        q = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu"
        cmd = ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()

    def project() -> dict[str, Any]:  # imports with no CPU kernel library built (the GPU case)
        sys.path.insert(0, str(ROOT))
        from tlt_jax.kernels import cpu_ffi, tree_attention  # noqa: F401
        from tlt_jax.rollout import engine  # noqa: F401

        return {"imports": "ok", "cpu_ffi_library_built": cpu_ffi.library_path().exists()}

    def failed_imports(mods: tuple[str, ...]) -> str:
        bad = []
        for mod in mods:
            try:
                importlib.import_module(mod)
            except Exception as e:
                bad.append(f"{mod} ({type(e).__name__}: {str(e)[:120]})")
        return "; ".join(bad) or "none"

    probe("memory_limit", lambda: {k: v for k, v in (dev.memory_stats() or {}).items() if "limit" in k})
    if shutil.which("nvidia-smi"):
        probe("nvidia_smi", smi)
    for mod in ("triton", "mosaic_gpu"):
        name = f"jax.experimental.pallas.{mod}"
        probe(f"pallas_{mod}", lambda name=name: "imports" if failed_imports((name,)) == "none" else "fails")
    probe("project", project)
    probe("bandwidth_gb_s", bandwidth)
    probe("bf16_matmul_tflops", matmul)
    probe("wheels_missing", lambda: failed_imports((*gpu_bundle.IMPORTS, "flax.nnx")))
    out.write_text(json.dumps(info, indent=2, default=str))


if __name__ == "__main__":
    main()
