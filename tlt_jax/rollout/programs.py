"""The compile cache of the rollout engine: every device program, keyed by what its shapes depend on.

Programs are compiled ahead of time (`jit(...).lower(*args).compile()`) on their first use, so each one's
memory (`memory_analysis()`: arguments, outputs, temporaries, code) and compile time are known and reported:
the JAX counterpart of the paper's CUDA-graph accounting (Table 5). Keys name the program's kind and shape
parameters: decode chunks by (batch bucket, cache bucket, tokens_to_verify) for the target, plus the strategy
for the speculative body; prefill by prompt/batch buckets; compaction and resize by their buckets.

`ProgramCache.run(key, fn, args)` returns the outputs and whether this call compiled; `prepare` returns the
compiled program first, so a caller can time the call alone (a chunk's seconds, a bandit's reward, never
contain a compilation). After warm-up nothing compiles: tests count XLA compilations.

Numerics are part of a program: `matmul_precision` (a `jax.default_matmul_precision` name, e.g. "highest")
is in force while each program is traced, so every dot it contains carries that precision in its HLO
whatever the process default is. Float32 rollouts need it: XLA on a GPU computes float32 dots at TF32-class
precision by default, and a T-token verify pass then rounds unlike a 1-token decode step often enough for
coupled verification to stop reproducing plain decoding.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax

from tlt_jax.utils import compile_stats


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


def memory_fields(compiled: Any) -> dict[str, int]:
    """XLA's accounting of a compiled program in bytes (zeros where the backend reports none)."""
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


def pow2_at_least(x: int, floor: int = 1) -> int:
    """The power-of-two bucket (>= floor) that holds x: batch, cache and prompt buckets."""
    return max(floor, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


MATMUL_PRECISIONS = ("auto", "highest", "high", "default")


def program_precision(name: str, model_dtype: str) -> str | None:
    """A MATMUL_PRECISIONS name -> the `jax.default_matmul_precision` the programs are traced under (None:
    the process default). "auto": "highest" for float32 models (exact float32 whatever the process default,
    so coupled verification reproduces plain decoding on GPUs too), the process default for bfloat16."""
    if name == "auto":
        return "highest" if model_dtype == "float32" else None
    return None if name == "default" else name


def _name(key: tuple) -> str:
    """A readable name of a program key (its kind and shape parameters, without the signature)."""
    return "/".join(str(k) for k in key[:-1])


class ProgramCache:
    """Ahead-of-time compiled programs by key; counts, compile time and memory per program."""

    def __init__(self, matmul_precision: str | None = None, keep_text: bool = False) -> None:
        """matmul_precision: in force while tracing every program (None: the process default).
        keep_text: keep each program's lowered StableHLO text (`texts()`), for tests that read it."""
        self.matmul_precision = matmul_precision
        self.keep_text = keep_text
        self._programs: dict[Hashable, Any] = {}
        self._info: dict[Hashable, ProgramInfo] = {}
        self._texts: dict[Hashable, str] = {}

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
            with compile_stats.scope(f"rollout/{key[0]}"):
                lowered = self.lower(fn, args, donate)
                if self.keep_text:
                    self._texts[key] = lowered.as_text()
                compiled = lowered.compile()
            self._programs[key] = compiled
            self._info[key] = ProgramInfo(
                key=key, compile_seconds=time.perf_counter() - t0, **memory_fields(compiled)
            )
        return self._programs[key]

    def lower(self, fn: Callable, args: tuple, donate: tuple[int, ...] = ()) -> jax.stages.Lowered:
        """`fn` traced and lowered for `args` under this cache's matmul precision (not compiled, not kept)."""
        if self.matmul_precision is None:
            return jax.jit(fn, donate_argnums=donate).lower(*args)
        with jax.default_matmul_precision(self.matmul_precision):
            return jax.jit(fn, donate_argnums=donate).lower(*args)

    def texts(self) -> dict[str, str]:
        """{program name: lowered StableHLO text} of every program compiled since `keep_text` was set."""
        return {_name(k): t for k, t in self._texts.items()}

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
