"""`python -m tlt_jax.main` run in this process, watched: the GPU suite's `rl_step_7b` worker
(rl_step_phases.py).

    python -m gpu.rl_step_run --json OUT.json [--plan update,rollout] [--deadline-s S] -- \\
        --config=configs/qwen2_5_7b_gpu_step.py:layers=4 --workdir=W [--config.x=y ...]

Everything after `--` is tlt_jax.main's command line, run by `runpy` as `python -m tlt_jax.main` runs it (the
same module, flags, config, learner and exit status): the program a user launches, not a copy of it. A
watcher thread samples it every 0.25 s from outside the learner: the learner's phase file (`W/.phase`, "<step>
<phase>"), the device's allocator (`memory_stats`: bytes in use, the process's peak) and metrics.jsonl's
lines; per (step, phase) it keeps when it began (seconds since this process started), the most bytes in use
sampled in it and the allocator's peak when it ended (the phase that raised the process's peak is the one
whose end peak exceeds its start peak); per step when its metrics line appeared. The JSON is rewritten every
2 s and at the end, so a run cut by the phase's timeout leaves what it saw.

After a run that exited 0, `--plan` compiles the memory plans of the same config with this process's backend
(XLA:GPU on a GPU): `memory_plan.update_plan` (the update's accumulation, log-prob pass and apply at the
run's response bucket, all its layers) and `rollout_memory_plan`'s programs at the run's running-rows cap,
each with what lives beside it (`memory_plan.resident`, the prompt cache, the running batch) -- the
per-device need the plans quote, beside the measured peak. Parts run while `--deadline-s` lasts.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import runpy
import sys
import threading
import time
import traceback
from typing import Any

T0 = time.perf_counter()
PHASE_FILE, METRICS_FILE = ".phase", "metrics.jsonl"


def _now() -> float:
    return round(time.perf_counter() - T0, 2)


class Watcher(threading.Thread):
    """Samples the learner's phase, the allocator and metrics.jsonl (module docstring) into `data`."""

    def __init__(self, workdir: pathlib.Path, out: pathlib.Path) -> None:
        super().__init__(daemon=True)
        self.workdir, self.out = workdir, out
        self.data: dict[str, Any] = {"phases": [], "steps": {}, "memory": {}, "exit": None}
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def _memory(self) -> dict[str, int] | None:
        if not (self.workdir / PHASE_FILE).exists():  # before the learner: leave JAX's start to it
            return None
        import jax

        stats = jax.local_devices()[0].memory_stats() or {}
        keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
        return {k: int(stats[k]) for k in keys if k in stats} or None

    def sample(self) -> None:
        try:
            text = (self.workdir / PHASE_FILE).read_text().split()
        except OSError:
            text = []
        mem = self._memory()
        with self.lock:
            phases = self.data["phases"]
            if len(text) == 2 and (
                not phases or [phases[-1]["step"], phases[-1]["phase"]] != [int(text[0]), text[1]]
            ):
                if phases and mem:
                    phases[-1]["peak_at_end"] = mem.get("peak_bytes_in_use")
                phases.append({"step": int(text[0]), "phase": text[1], "start_s": _now(), "max_in_use": 0})
                if mem:
                    phases[-1]["peak_at_start"] = mem.get("peak_bytes_in_use")
            if phases and mem:
                phases[-1]["max_in_use"] = max(phases[-1]["max_in_use"], mem.get("bytes_in_use", 0))
                phases[-1]["peak_at_end"] = mem.get("peak_bytes_in_use")
                self.data["memory"] = mem
            self._steps()

    def _steps(self) -> None:
        path = self.workdir / METRICS_FILE
        if not path.exists():
            return
        for line in path.read_text().splitlines():
            if line.strip().startswith("{"):
                step = str(json.loads(line)["step"])
                self.data["steps"].setdefault(step, {"logged_s": _now()})

    def save(self) -> None:
        with self.lock:
            self.data["wall_s"] = _now()
            text = json.dumps(self.data, indent=1, default=str)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.out)

    def run(self) -> None:
        last = 0.0
        while not self.stop.wait(0.25):
            try:
                self.sample()
                if time.perf_counter() - last > 2.0:
                    self.save()
                    last = time.perf_counter()
            except Exception as e:  # never take the run down; say what the watcher could not read
                self.data["watch_error"] = f"{type(e).__name__}: {e}"


def run_main(argv: list[str]) -> int:
    """`python -m tlt_jax.main <argv>` in this process; its exit status."""
    sys.argv = ["tlt_jax/main.py", *argv]
    try:
        runpy.run_module("tlt_jax.main", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main_args(argv: list[str]) -> tuple[str, str | None, pathlib.Path]:
    """(config file, its argument, workdir) of tlt_jax.main's command line."""
    config = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
    workdir = next(a.split("=", 1)[1] for a in argv if a.startswith("--workdir="))
    path, _, arg = config.partition(":")
    return path, arg or None, pathlib.Path(workdir)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m gpu.rl_step_run --json OUT [--plan P] -- <tlt_jax.main args>")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--plan", default="", help="after the run: rollout,update or resident (memory plans)")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="seconds from start the plans may use")
    args = ap.parse_args(argv[:cut])
    path, arg, workdir = main_args(argv[cut + 1 :])
    watch = Watcher(workdir, pathlib.Path(args.json))
    watch.start()
    rc = run_main(argv[cut + 1 :])
    watch.stop.set()
    watch.join(timeout=5)
    watch.sample()
    watch.data["exit"], watch.data["run_s"] = rc, _now()
    watch.save()
    if rc == 0 and args.plan:
        from gpu import rl_step_plan

        try:
            rl_step_plan.plans(path, arg, args.plan.split(","), args.deadline_s - _now(), watch)
        except Exception as e:  # the run's measurements stand; the plan's failure is reported with them
            watch.data["plan_error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    watch.save()
    print(f"rl_step_run: exit {rc}, {len(watch.data['steps'])} logged steps, wrote {args.json}", flush=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
