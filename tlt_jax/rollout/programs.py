"""The compile cache of the rollout engine: every device program, keyed by what its shapes depend on.

Programs are compiled ahead of time (`jit(...).lower(*args).compile()`) on their first use, so each one's
memory (`memory_analysis()`: arguments, outputs, temporaries, code) and compile time are known and reported:
the JAX counterpart of the paper's CUDA-graph accounting (Table 5). Keys name the program's kind and shape
parameters: decode chunks by (batch bucket, cache bucket, tokens_to_verify) for the target, plus the strategy
for the speculative body; prefill by prompt/batch buckets; compaction and resize by their buckets.

`ProgramCache.run(key, fn, args)` returns the outputs and whether this call compiled; `prepare` returns the
compiled program first, so a caller can time the call alone (a chunk's seconds, a bandit's reward, never
contain a compilation). After warm-up nothing compiles: tests count XLA compilations.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class ProgramInfo:
    """One compiled program: its key, compile seconds and XLA's memory accounting (bytes)."""

    key: tuple
    compile_seconds: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    code_bytes: int
    alias_bytes: int

    @property
    def kind(self) -> str:
        return str(self.key[0])

    @property
    def footprint_bytes(self) -> int:
        """Memory the program needs beyond its donated inputs: temporaries + outputs not aliased to inputs
        + generated code (what a CUDA-graph capture pins, in the paper's accounting)."""
        return self.temp_bytes + max(self.output_bytes - self.alias_bytes, 0) + self.code_bytes


def signature(args: Any) -> tuple:
    """The tree structure and (shape, dtype) of every leaf: what a compiled program is specialised to."""
    leaves, tree = jax.tree.flatten(args)
    return (tree, tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x)))) for x in leaves))


def _memory(compiled: Any) -> dict[str, int]:
    try:
        m = compiled.memory_analysis()
    except Exception:  # some backends do not report it
        m = None
    get = lambda name: int(getattr(m, name, 0) or 0)  # noqa: E731
    return {
        "argument_bytes": get("argument_size_in_bytes"),
        "output_bytes": get("output_size_in_bytes"),
        "temp_bytes": get("temp_size_in_bytes"),
        "code_bytes": get("generated_code_size_in_bytes"),
        "alias_bytes": get("alias_size_in_bytes"),
    }


class ProgramCache:
    """Ahead-of-time compiled programs by key; counts, compile time and memory per program."""

    def __init__(self) -> None:
        self._programs: dict[Hashable, Any] = {}
        self._info: dict[Hashable, ProgramInfo] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._programs

    def __len__(self) -> int:
        return len(self._programs)

    @property
    def compile_count(self) -> int:
        return len(self._programs)

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling so far (each program once)."""
        return sum(i.compile_seconds for i in self._info.values())

    def compile(self, key: tuple, fn: Callable, args: tuple, donate: tuple[int, ...] = ()) -> Any:
        """The compiled program for `key` and `args`' shapes (compiling `fn` for them if new). `key` names
        the program for the reports; the arguments' tree and avals are part of its identity, so two calls
        can never share a program compiled for other shapes."""
        key = (*key, signature(args))
        if key not in self._programs:
            t0 = time.perf_counter()
            compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
            self._programs[key] = compiled
            self._info[key] = ProgramInfo(
                key=key, compile_seconds=time.perf_counter() - t0, **_memory(compiled)
            )
        return self._programs[key]

    def prepare(
        self, key: tuple, fn: Callable, args: tuple, donate: tuple[int, ...] = ()
    ) -> tuple[Callable, bool]:
        """(the compiled program for `key` and `args`, whether this call compiled it): compile first, then
        time only the call, so a timing (a bandit's reward) never contains a compilation."""
        fresh = (*key, signature(args)) not in self._programs
        return self.compile(key, fn, args, donate), fresh

    def run(self, key: tuple, fn: Callable, args: tuple, donate: tuple[int, ...] = ()) -> tuple[Any, bool]:
        """Call the program for `key` on `args`; returns (outputs, whether this call compiled it)."""
        program, fresh = self.prepare(key, fn, args, donate)
        return program(*args), fresh

    def infos(self, kind: str | None = None) -> list[ProgramInfo]:
        return [i for i in self._info.values() if kind is None or i.kind == kind]

    def summary(self) -> dict[str, float]:
        """Program counts, footprint (MiB) and compile seconds, overall and per kind."""
        out: dict[str, float] = {}
        kinds = sorted({i.kind for i in self._info.values()})
        for kind in [None, *kinds]:
            sel = self.infos(kind)
            tag = "all" if kind is None else kind
            out[f"programs/{tag}/count"] = float(len(sel))
            out[f"programs/{tag}/footprint_mib"] = sum(i.footprint_bytes for i in sel) / 2**20
            out[f"programs/{tag}/compile_s"] = sum(i.compile_seconds for i in sel)
        return out
