"""Where a speculative round's time goes: draft, verify forward, accept and sample, commit (issue #23, 5).

`bench_verify_cost.py --breakdown` runs this. For each EAGLE strategy (bench_sd's TV mapping, or
`--strategies`), the round's four phases run as their own jitted programs on the same inputs, beside the
whole round (the body of the engine's speculative chunk, `decode.spec_round`) and one plain decode step
(`decode.plain_step`, no drafter), all at the same cache state:

  draft    `decode.draft_round`: the EAGLE drafter's depth forwards, top-k expansion, the tree selection;
  verify   `tree_verify.verify_forward`: the target over the TV tree nodes with the tree mask (the LM head
           at the nodes `decode.logit_nodes` asks for);
  accept   `tree_verify.accept_and_sample`: target distributions, plain decoding's draws (coupled), the walk,
           the stop node's draw, the recorded log-probs, EOS/budget truncation;
  commit   `tree_verify.commit`: record the tokens, gather the accepted path in the target cache, extend the
           drafter cache (its forward over the committed pairs).

Each program runs `inner` times inside one `fori_loop` (the engine's chunks are device loops too), its cache
buffers fed from one iteration to the next (so updates stay in place and nothing is hoisted out of the loop)
and its inputs passed through an optimization barrier; calls are interleaved over all programs and
configurations for `reps` rounds, medians reported. Every phase is also counted in its compiled HLO (this
backend's): kernels launched per run (fusions, custom calls and other non-trivial ops, loop bodies times
their trip counts), while loops entered and their sequential trips, sorts / TopK. On a GPU at batch 1 each
launch costs microseconds whatever its size, so a count that grows with TV is what to look for even where
this CPU's time does not show it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import pathlib
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.models.kv_cache import KVCache
from tlt_jax.rollout import decode, tree_verify
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.types import DecodeState

PHASES = ("draft", "verify", "accept", "commit")
PROGRAMS = (*PHASES, "round")

# ---- HLO counts ---------------------------------------------------------------------------------------

_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier"}
_FREE |= {"partition-id", "replica-id", "add-dependency", "domain"}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")


@dataclasses.dataclass
class Op:
    opcode: str
    attrs: str  # the instruction's text after its operands (metadata removed)
    source: str = ""  # its metadata's op_name (where in the JAX program it comes from)

    def ref(self, name: str) -> str | None:
        m = re.search(rf"\b{name}=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None

    @property
    def trips(self) -> int | None:
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', self.attrs)
        return int(m.group(1)) if m else None

    @property
    def branches(self) -> list[str]:
        m = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
        if m:
            return [b.strip().lstrip("%") for b in m.group(1).split(",")]
        return [c for c in (self.ref("true_computation"), self.ref("false_computation")) if c]


def _skip_type(rest: str) -> str:
    """An instruction's text after ` = ` without its result type (a tuple type's parentheses balanced)."""
    if not rest.startswith("("):
        return rest.split(" ", 1)[1] if " " in rest else ""
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[i + 1 :]
    return ""


def parse_hlo(text: str) -> tuple[dict[str, list[Op]], str]:
    """Optimized HLO text (`compiled.as_text()`) -> ({computation: its ops}, the entry computation)."""
    comps: dict[str, list[Op]] = {}
    entry, cur = "", None
    for line in text.splitlines():
        if not line.startswith(" "):
            m = _HEADER.match(line)
            cur = m.group(1) if m else None
            if cur is not None:
                comps[cur] = []
                entry = cur if line.startswith("ENTRY") else entry
            continue
        if cur is None or " = " not in line:
            continue
        source = re.search(r'op_name="([^"]*)"', line)
        rest = re.sub(r"metadata=\{[^}]*\}", "", line.split(" = ", 1)[1])
        rest = _skip_type(rest)
        m = _OPCODE.match(rest)
        if m:
            comps[cur].append(Op(m.group(1), rest[m.end() :], source.group(1) if source else ""))
    return comps, entry


@dataclasses.dataclass
class Counts:
    """Per run of a program: kernels launched, while loops entered, their sequential trips, sorts (sort ops
    and TopK calls), counting the costlier branch of each conditional (`optional`: the kernels only that
    branch launches); `static`: launchable ops in its text (each body once); `unknown`: loops whose trip
    count XLA could not tell (counted once); `where`: trips per loop, by the JAX source of the loop."""

    kernels: float = 0.0
    loops: float = 0.0
    trips: float = 0.0
    sorts: float = 0.0
    optional: float = 0.0
    static: int = 0
    unknown: int = 0
    where: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, other: Counts, times: float = 1.0) -> None:
        for f in ("kernels", "loops", "trips", "sorts", "optional"):
            setattr(self, f, getattr(self, f) + times * getattr(other, f))
        self.static += other.static
        self.unknown += other.unknown
        for k, v in other.where.items():
            self.where[k] = self.where.get(k, 0.0) + times * v


def _loop_name(source: str) -> str:
    """A short name of a loop's JAX source: its op_name without jit/vmap wrappers, last three parts."""
    prev = None
    while prev != source:
        prev, source = source, re.sub(r"\b(?:jit|vmap|pjit)\(([^()]*)\)", r"\1", source)
    parts = [p for p in source.split("/") if p]
    return "/".join(parts[-3:]) or "?"


def _count(comps: dict[str, list[Op]], name: str) -> Counts:
    out = Counts()
    for op in comps.get(name, []):
        if op.opcode == "while":
            trips = op.trips
            out.unknown += trips is None
            trips = 1 if trips is None else trips
            body, cond = _count(comps, op.ref("body") or ""), _count(comps, op.ref("condition") or "")
            out.add(body, trips)
            out.add(cond, trips + 1)
            out.loops += 1
            out.trips += trips
            out.where[_loop_name(op.source)] = out.where.get(_loop_name(op.source), 0.0) + trips
        elif op.opcode == "conditional":
            branches = [_count(comps, b) for b in op.branches]
            worst = max(branches, key=lambda c: c.kernels, default=Counts())
            out.add(worst)
            out.kernels += 1
            out.optional += worst.kernels - min((b.kernels for b in branches), default=0.0)
            out.static += 1 + sum(b.static for b in branches) - worst.static
        elif op.opcode == "call":
            out.add(_count(comps, op.ref("to_apply") or ""))
        elif op.opcode not in _FREE:
            out.kernels += 1
            out.static += 1
            is_topk = op.opcode == "custom-call" and "topk" in op.attrs.lower()
            out.sorts += op.opcode == "sort" or is_topk
    return out


def hlo_counts(text: str, inner: int = 1) -> Counts:
    """Counts per iteration of a program whose entry runs its work in a `fori_loop` of `inner` trips (the
    timing harness): that loop's body, else the whole program divided by `inner`."""
    comps, entry = parse_hlo(text)
    for op in comps.get(entry, []):
        if op.opcode == "while" and op.trips == inner:
            out = _count(comps, op.ref("body") or "")
            out.add(_count(comps, op.ref("condition") or ""))
            return out
    whole = _count(comps, entry)
    scaled = Counts(static=whole.static, unknown=whole.unknown)
    scaled.add(dataclasses.replace(whole, static=0, unknown=0), 1.0 / inner)
    return scaled


# ---- programs -----------------------------------------------------------------------------------------


def _buffers(dst: KVCache, src: KVCache) -> KVCache:
    """`src`'s K/V buffers with `dst`'s lengths: feed a written cache back without committing anything."""
    return src.replace(lengths=dst.lengths)


def _without_caches(st: DecodeState) -> DecodeState:
    st = st.replace(cache=None)
    if st.aux is not None and st.aux.drafter_cache is not None:
        st = st.replace(aux=st.aux.replace(drafter_cache=None))
    return st


def _feed_state(st: DecodeState, new: DecodeState) -> tuple[DecodeState, DecodeState]:
    """(the input state with `new`'s cache buffers, `new` without them): a round or step repeated on the
    same rows (same lengths, same keys), its caches updated in place."""
    st = st.replace(cache=_buffers(st.cache, new.cache))
    if st.aux is not None and st.aux.drafter_cache is not None and new.aux.drafter_cache is not None:
        dc = _buffers(st.aux.drafter_cache, new.aux.drafter_cache)
        st = st.replace(aux=st.aux.replace(drafter_cache=dc))
    return st, _without_caches(new)


def looped(fn: Callable, feed: Callable, inner: int, name: str = "run") -> Callable:
    """jit((consts, args) -> (args', rest)): `inner` runs of `fn(consts, *args)`; `feed(args, out)` gives the
    next run's args (written buffers fed back) and the rest of the output, carried so nothing is dead code.
    The args pass an optimization barrier with the previous rest, so no run can be hoisted or merged. The
    args are donated: chain the calls (`args = f(consts, args)[0]`)."""

    def run(consts: Any, args: tuple) -> tuple:
        shapes = jax.eval_shape(lambda a: feed(a, fn(consts, *a))[1], args)
        rest0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def body(_: jax.Array, carry: tuple) -> tuple:
            a, rest = jax.lax.optimization_barrier(carry)
            return feed(a, fn(consts, *a))

        return jax.lax.fori_loop(0, inner, body, (args, rest0))

    run.__name__ = name  # the program's name in a profile trace
    return jax.jit(run, donate_argnums=1)


def _models(prog: decode.ChunkProgram, consts: dict) -> decode.RoundModels:
    drafter = nnx.merge(prog.drafter, consts["dparams"]) if prog.drafter is not None else None
    target = nnx.merge(prog.target, consts["params"])
    return decode.RoundModels(target, drafter, consts["vocab"], consts["head"])


def phase_programs(prog: decode.ChunkProgram, eos: jax.Array) -> dict[str, tuple[Callable, Callable]]:
    """{program: (fn(consts, *args), feed)} for the four phases and the whole round of `prog`'s mode."""
    depth, sp, mode = prog.max_depth, prog.sampling, prog.modes[0]
    n_logits = decode.logit_nodes(prog)

    def draft(c: dict, st: DecodeState) -> Any:
        return decode.draft_round(prog, _models(prog, c), st, None)

    def feed_draft(a: tuple, out: Any) -> tuple:
        (st,) = a
        dc = _buffers(st.aux.drafter_cache, out[1])
        return (st.replace(aux=st.aux.replace(drafter_cache=dc)),), out[0]

    def verify(c: dict, st: DecodeState, tree: Any) -> Any:
        m = _models(prog, c)
        nodes = None if n_logits is None else tree_verify.decision_nodes(tree.parents, n_logits)
        kw = {"max_depth": depth, "attn_impl": prog.attn_impl, "nodes_bm": nodes}
        return tree_verify.verify_forward(m.target, st, tree, **kw), nodes

    def feed_verify(a: tuple, out: Any) -> tuple:
        st, tree = a
        fwd, nodes = out
        return (st.replace(cache=_buffers(st.cache, fwd.cache)), tree), (fwd.logits, fwd.hidden, nodes)

    def accept(c: dict, st: DecodeState, tree: Any, logits: jax.Array, hidden: jax.Array, nodes: Any) -> Any:
        kw = {"acceptance": mode.acceptance, "accept_rule": mode.accept_rule, "nodes_bm": nodes}
        m = _models(prog, c)
        return tree_verify.accept_and_sample(
            m.target, st, tree, logits, hidden, sp, eos, max_depth=depth, **kw
        )

    def commit(c: dict, st: DecodeState, hidden: jax.Array, cache: KVCache, verdict: Any, dc: Any) -> Any:
        m = _models(prog, c)
        kw = {"max_depth": depth, "attn_impl": prog.attn_impl, "drafter_cache": dc}
        return tree_verify.commit(m.target, m.drafter, st, hidden, cache, verdict, eos, **kw)

    def feed_commit(a: tuple, out: Any) -> tuple:
        st, hidden, cache, verdict, dc = a
        new, stats = out
        cache = _buffers(cache, new.cache)
        if dc is not None:
            dc = _buffers(dc, new.aux.drafter_cache)
        return (st, hidden, cache, verdict, dc), (_without_caches(new), stats)

    def round_(c: dict, st: DecodeState) -> Any:
        return decode.spec_round(prog, _models(prog, c), st, None, eos)

    def feed_round(a: tuple, out: Any) -> tuple:
        st, rest = _feed_state(a[0], out[0])
        return (st,), (rest, out[1])

    return {
        "draft": (draft, feed_draft),
        "verify": (verify, feed_verify),
        "accept": (accept, lambda a, out: (a, out)),
        "commit": (commit, feed_commit),
        "round": (round_, feed_round),
    }


def plain_program(prog: decode.ChunkProgram, eos: jax.Array) -> tuple[Callable, Callable]:
    """One plain decode step without drafter upkeep (bench_sd's plain engine has no drafter)."""

    def step(c: dict, st: DecodeState) -> DecodeState:
        target = nnx.merge(prog.target, c["params"])
        return decode.plain_step(target, None, st, eos, prog.sampling, prog.attn_impl)

    def feed(a: tuple, out: DecodeState) -> tuple:
        st, rest = _feed_state(a[0], out)
        return (st,), rest

    return step, feed


@dataclasses.dataclass
class Timed:
    """One looped program (its name in a trace), its chained arguments and its counts."""

    name: str
    fn: Callable
    consts: dict
    args: tuple
    counts: Counts

    def __call__(self) -> None:
        with jax.profiler.TraceAnnotation(self.name):
            self.args = jax.block_until_ready(self.fn(self.consts, self.args))[0]


def _precision(engine: RolloutEngine) -> Any:
    """The engine's program matmul precision (where its program cache has one), as a context."""
    p = getattr(engine.programs, "matmul_precision", None)
    return jax.default_matmul_precision(p) if p else contextlib.nullcontext()


def _compile(
    name: str, fn: Callable, feed: Callable, consts: dict, args: tuple, inner: int, dump: pathlib.Path | None
) -> Timed:
    f = looped(fn, feed, inner, name)
    args = jax.tree.map(jnp.copy, args)  # each program owns (and donates) its inputs
    compiled = f.lower(consts, args).compile()
    text = compiled.as_text()
    if dump is not None:  # a trace names kernels by HLO instruction: this text maps them to JAX source
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{name}.hlo.txt").write_text(text)
    return Timed(name, compiled, consts, args, hlo_counts(text, inner))


def build(
    engine: RolloutEngine,
    mode: str,
    state: DecodeState,
    sp: SamplingParams,
    inner: int,
    dump: pathlib.Path | None = None,
) -> dict[str, Timed]:
    """The timed programs of one speculative mode on `state` (each phase on the inputs the previous phases
    produce from it), and with mode "plain" the plain step; `dump`: a folder for their optimized HLO."""
    prog = engine.chunk_program(mode, sp)
    eos = engine.eos_ids
    consts = {"params": engine.params, "dparams": engine.drafter_params, "vocab": engine.draft_vocab}
    with _precision(engine):
        if mode == "plain":
            plain = plain_program(dataclasses.replace(prog, drafter=None), eos)
            return {"plain": _compile("plain_step", *plain, consts | {"head": None}, (state,), inner, dump)}
        head = jax.jit(lambda p, v: decode.draft_head_of(prog, nnx.merge(prog.target, p), v))
        consts["head"] = None if engine.draft_vocab is None else head(engine.params, engine.draft_vocab)
        progs = phase_programs(prog, eos)
        run1 = lambda name, *a: jax.jit(progs[name][0])(consts, *a)  # noqa: E731
        tree, dcache = run1("draft", state)
        out, nodes = run1("verify", state, tree)
        verdict = run1("accept", state, tree, out.logits, out.hidden, nodes)
        args = {
            "draft": (state,),
            "verify": (state, tree),
            "accept": (state, tree, out.logits, out.hidden, nodes),
            "commit": (state, out.hidden, out.cache, verdict, dcache),
            "round": (state,),
        }
        return {k: _compile(f"{mode}_{k}", *progs[k], consts, args[k], inner, dump) for k in PROGRAMS}


def interleaved(calls: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median seconds per call of each entry, timed round-robin (one untimed call each first)."""
    for f in calls.values():
        f()
    times: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(reps):
        for k, f in calls.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}
