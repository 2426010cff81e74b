"""The GPU suite's runner: one call's settings, its clock (the call's and the current phase's deadlines) and
the subprocess runner every phase uses (its own process group, killed at the phase's timeout, output echoed,
logged to suite.log and returned). Phases (phases.py, measure.py, regime_phases.py, rl_step_phases.py) take a
`Suite`; suite.py builds it from the command line and runs the phases in order.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import pathlib
import signal
import subprocess
import threading
import time

from gpu import state
from gpu.call_plan import (
    CALL_BUDGETS,
    DRY_CAP_S,
    LIMITS,
    PHASES,
    PLAN_LIMITS,
    REPORT_RESERVE_S,
)
from tlt_jax.utils.kill_runs import FAST_COMPILE_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOG_CAP_BYTES = 12 << 20
# phases that run with the tuned block sizes, if any (every one that runs the model through the engine)
TUNED_FOR = ("decode", "identity", "verify_cost", "compile", "drafter", "sd", "e2e")


@dataclasses.dataclass
class Proc:
    """A finished (or killed) subprocess: exit code, whether the timeout killed it, merged output."""

    rc: int | None
    timed_out: bool
    seconds: float
    output: str


class Suite:
    """The run's settings, clock and subprocess runner; the phase functions (phases.py) use it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.dry: bool = args.dry_run
        self.out = pathlib.Path(args.out or os.environ.get("OUT") or ROOT / "gpu_suite_out").resolve()
        self.state, self.state_why = state.choose_state_dir(args.state_dir, self.dry, self.out)
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
        else:  # a dry run on CPU checks the plan's plumbing, not its numbers: the cheapest compile
            env["XLA_FLAGS"] = FAST_COMPILE_FLAGS
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
