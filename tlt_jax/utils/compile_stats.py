"""Where compilation time goes: JAX's own compile events, summed per program kind.

For every program it compiles (a `jit` call, an AOT `lower().compile()`, a Pallas kernel inside them) JAX
reports through `jax.monitoring` the seconds of tracing to a jaxpr, lowering to StableHLO and the backend
compilation (XLA's passes, GPU autotuning included, or the read from the persistent compilation cache), and
whether the persistent cache supplied the binary. `CompileLog` listens once per process and sums them per
*kind*: the innermost `scope(kind)` open on this thread when the event fires (the learner opens "update",
"rollout", "drafter", ...; the rollout's `ProgramCache` opens "rollout/<program kind>"), else "other".
`delta` of two snapshots is one step's compilation, which the learner logs as `compile/*` metrics. With
$TLT_JAX_COMPILE_LOG set, the process writes there at exit a JSON list of its XLA compilations per (kind,
program name): what `experiments/bench/compile_time.py` reads to say which programs the seconds went to.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import Iterator

import jax

_PHASES = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "backend",
}
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
DEFAULT_CACHE_DIR = "~/.cache/tlt_jax/xla"  # shared by every run on this machine (README: "Compilation")
CACHE_ENV = "TLT_JAX_COMPILATION_CACHE"
LOG_ENV = "TLT_JAX_COMPILE_LOG"


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Running totals: seconds per (kind, phase), backend compilations and persistent-cache hits per kind."""

    seconds: dict[tuple[str, str], float]
    programs: dict[str, int]
    cache_hits: dict[str, int]

    def delta(self, since: Snapshot) -> Snapshot:
        def sub(a: dict, b: dict) -> dict:
            return {k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0)}

        return Snapshot(
            sub(self.seconds, since.seconds),
            sub(self.programs, since.programs),
            sub(self.cache_hits, since.cache_hits),
        )

    def total(self, phase: str | None = None) -> float:
        return sum(v for (_, p), v in self.seconds.items() if phase is None or p == phase)

    def metrics(self, prefix: str = "compile") -> dict[str, float]:
        """Flat metrics: totals per phase, and seconds / programs / cache hits per kind."""
        out = {f"{prefix}/{p}_s": self.total(p) for p in ("trace", "lower", "backend")}
        out[f"{prefix}/total_s"] = self.total()
        out[f"{prefix}/programs"] = float(sum(self.programs.values()))
        out[f"{prefix}/cache_hits"] = float(sum(self.cache_hits.values()))
        by_kind: dict[str, float] = collections.defaultdict(float)
        for (kind, _), v in self.seconds.items():
            by_kind[kind] += v
        for kind, v in sorted(by_kind.items()):
            out[f"{prefix}/{kind}_s"] = v
            out[f"{prefix}/{kind}_programs"] = float(self.programs.get(kind, 0))
        return out


class CompileLog:
    """The process's compile-time accountant (use `compile_log()`: one listener per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
        self._programs: dict[str, int] = collections.defaultdict(int)
        self._hits: dict[str, int] = collections.defaultdict(int)
        self._by_name: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _kind(self) -> str:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else "other"

    def _on_duration(self, event: str, duration: float, **kw: object) -> None:
        phase = _PHASES.get(event)
        if phase is None:
            return
        kind = self._kind()
        with self._lock:
            self._seconds[(kind, phase)] += duration
            if phase == "backend":
                self._programs[kind] += 1
                entry = self._by_name[(kind, str(kw.get("fun_name", "?")))]
                entry[0] += duration
                entry[1] += 1

    def _on_event(self, event: str, **_: object) -> None:
        if event == _CACHE_HIT:
            with self._lock:
                self._hits[self._kind()] += 1

    @contextlib.contextmanager
    def scope(self, kind: str) -> Iterator[None]:
        """Attribute the compilations inside this block (on this thread) to `kind`."""
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(kind)
        try:
            yield
        finally:
            stack.pop()

    def programs_by_name(self) -> list[dict[str, object]]:
        """XLA compilations (or cache reads) per (kind, program name), the most seconds first."""
        with self._lock:
            items = list(self._by_name.items())
        rows = [{"kind": k, "name": n, "backend_s": v[0], "count": v[1]} for (k, n), v in items]
        return sorted(rows, key=lambda r: -float(r["backend_s"]))

    def write(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.programs_by_name(), f, indent=1)

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(dict(self._seconds), dict(self._programs), dict(self._hits))


_LOG: CompileLog | None = None


def compile_log() -> CompileLog:
    """The process-wide `CompileLog` (installed on first use)."""
    global _LOG
    if _LOG is None:
        _LOG = CompileLog()
        if os.environ.get(LOG_ENV):
            atexit.register(_LOG.write, os.environ[LOG_ENV])
    return _LOG


def scope(kind: str) -> contextlib.AbstractContextManager[None]:
    """`compile_log().scope(kind)`."""
    return compile_log().scope(kind)


def resolve_cache_dir(setting: str) -> str:
    """config.compilation_cache_dir -> the folder to use ("" = off). "auto": $TLT_JAX_COMPILATION_CACHE, else
    a cache the process was already given (JAX_COMPILATION_CACHE_DIR, a test's), else DEFAULT_CACHE_DIR."""
    if setting != "auto":
        return os.path.abspath(os.path.expanduser(setting)) if setting else ""
    chosen = os.environ.get(CACHE_ENV) or jax.config.jax_compilation_cache_dir or DEFAULT_CACHE_DIR
    return os.path.abspath(os.path.expanduser(chosen))


def enable_persistent_cache(folder: str) -> None:
    """Every compiled program (however quick to compile) is written to, and read from, `folder`: a rerun
    of the same config compiles nothing. Must run before the first compilation of the process."""
    os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
