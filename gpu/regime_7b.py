"""The paper's regime on one GPU: Qwen2.5-7B shapes with random bf16 weights born on the device (issue #38).

Run by the GPU suite's `regime_7b` and `update_7b` phases (call 1; no model file, only the bundle's wheels),
each in one subprocess that writes its JSON after every measurement, so a run cut at its time limit still
leaves what it measured. The model's init comes first (outside the shares), then the parts, in priority
order, each with a share of what `--budget-s` has left then (what one part leaves goes to the next; a cell
that cannot finish in what is left is skipped with the reason):

  decode   plain decode chunks (the engine's own program, `RolloutEngine.decode_chunk`, an engine without a
           drafter as bench_sd's baseline) at batch 1 (4K, then 32K cache), then 8, 32, 128 at 4K, then at
           32K: seconds per step, tok/s, the roofline from the bandwidth measured by the env phase (the
           weights a step reads + the KV of every row's attended tokens, over that bandwidth); cells whose
           KV cache cannot fit the device are skipped with the arithmetic;
  round    one speculative round (EAGLE, bench_sd's TV -> strategy mapping, TV 16 (a goal at batch 1), 4,
           64, 48) at batch 1, 8, 32, cache 4K: the engine's speculative chunk, seconds per round and in plain
           steps of the same batch and cache, drafting over the warm-up's 8,192-id draft vocabulary as a
           warmed drafter does (the random drafter's acceptance is irrelevant: the round's work is fixed);
  drafter  (regime_train.py) one optimizer step of the EAGLE drafter at 7B width
           (`drafter.trainer.train_step`, config.spot's packed batch of configs/qwen2_5_7b.py);
  split    the round split into draft / verify / accept / commit (`experiments/bench/verify_breakdown.py`:
           each phase its own looped program, 8 programs per TV), batch 1 first, while time lasts;
  update   (update_7b, regime_train.py) the policy update's accumulation over one micro-batch (`memory_plan`'s
           program: the trainer's layers scanned, remat, chunked MLP and logits as configs/qwen2_5_7b.py) at
           --update-len tokens per row, with as many layers as the plan says fit the device, peak memory
           (`memory_stats`) against the plan's figure (XLA's accounting of the same program).

Every program's first-call compile seconds are recorded. The states are synthetic: a decode state of zeros
whose cache lengths are set to the cache bucket less the chunk's growth (timing and memory do not depend on
the values). `--dry-run` (or a CPU): a tiny Qwen2 of the same code paths, small batches and caches.

    python -m gpu.regime_7b decode,round,drafter,split --json OUT.json --budget-s 200 --bandwidth-gb-s 2400
    python -m gpu.regime_7b update --json OUT.json --budget-s 100 --update-len 8192
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpu.regime_common import (
    FIT_FRACTION,
    SHARES,
    SIMULATED_LIMIT,
    TINY,
    Recorder,
    device_limit,
    gib,
    tree_bytes,
)
from gpu.regime_train import part_drafter, part_update

if TYPE_CHECKING:
    from tlt_jax.models.config import ModelConfig
    from tlt_jax.rollout.engine import RolloutEngine
    from tlt_jax.rollout.types import DecodeState

PAPER_PLAIN_TOK_S = 164.65  # the paper's Table 2: Qwen2.5-7B, batch 1, one H100, no SD
GRID = {  # (GPU, dry run); issue #45: decode at batch 1 and 8, rounds at TV 4/16/48, each at 4K and 32K
    "decode_batches": ((1, 8), (1, 2)),
    "decode_caches": ((4096, 32768), (256, 512)),
    "round_batches": ((1, 8), (1,)),
    "round_tvs": ((16, 4, 48), (4,)),  # TV 16 first: its batch-1 round is a goal (<= 1.3 steps)
    "round_caches": ((4096, 32768), (256,)),
}


def model_config(dry: bool) -> ModelConfig:
    """Qwen2.5-7B's shapes in bf16 (a dry run: the same architecture at TINY sizes)."""
    from tlt_jax.models import presets

    return presets.arch_config("qwen2_5_7b", **(TINY if dry else {}))


def draft_vocab_size(cfg: ModelConfig) -> int:
    """The drafter head's size in the speculative engine: the warm-up's default `draft_vocab_size`."""
    from tlt_jax.drafter.warmup_config import WarmupRunSection

    return min(WarmupRunSection().draft_vocab_size, cfg.vocab_size)


def build_engines(
    cfg: ModelConfig, rec: Recorder, chunk_steps: int, max_new: int
) -> tuple[RolloutEngine, RolloutEngine]:
    """(plain engine, speculative engine) over one random `cfg` target, weights drawn on the device by one
    jitted program each (`models.random_init`: no host copy of 15 GB; both engines hold the same arrays).
    The plain one has no drafter, as bench_sd's baseline: with EAGLE modes registered, an engine's plain
    chunks also keep the drafter's cache up to date. The speculative one drafts over a reduced head of the
    warm-up's `draft_vocab_size` ids, as an engine with a warmed drafter does (at 7B the full 152K head is
    1.09 GB read per draft step; which ids does not change a round's work)."""
    import numpy as np

    from tlt_jax.models.random_init import random_drafter, random_model
    from tlt_jax.rollout.engine import RolloutEngine
    from tlt_jax.rollout.interface import EngineConfig

    t = time.perf_counter()
    model = random_model(cfg, seed=0)
    drafter = random_drafter(cfg, seed=1)
    # not a cell's program: the per-cell estimate must not follow it (35 s cold on the H200, 1.8 s warm)
    rec.compiled("init_random_weights (target + drafter)", time.perf_counter() - t, estimate=False)
    ecfg = EngineConfig(max_new_tokens=max_new, max_cache_len=1 << 20, chunk_steps=chunk_steps)
    plain = RolloutEngine(model, ecfg, eos_ids=[])
    vocab = np.linspace(0, cfg.vocab_size - 1, draft_vocab_size(cfg)).astype(np.int64)
    return plain, RolloutEngine(model, ecfg, eos_ids=[], drafter=drafter, draft_vocab=vocab)


def step_weight_bytes(engine: RolloutEngine) -> int:
    """Weight bytes one decode step reads: every parameter but the embedding table (a few rows are
    gathered), unless the LM head is tied to it."""
    total = tree_bytes(engine.params)
    embed = tree_bytes(engine.params["embed"])
    return total if engine.model_config.tie_embeddings else total - embed


_MAKERS: dict[tuple, Callable[[], DecodeState]] = {}  # (engine, rows, cache, length) -> compiled maker


def zero_state(engine: RolloutEngine, rows: int, cache: int, length: int) -> DecodeState:
    """A decode state of `rows` rows at cache bucket `cache` (the engine's layout, `memory_plan`'s abstract
    prefill output), materialised as zeros on the device, every row's cache length `length` (the drafter
    cache one less: its invariant), budget `max_new_tokens`, nothing done. The program that makes it is
    traced and compiled once per shape (a timed cell makes a fresh state for every call: a memset)."""
    key = (id(engine), rows, cache, length)
    if key not in _MAKERS:
        _MAKERS[key] = _state_maker(engine, rows, cache, length)
    return _MAKERS[key]()


def _state_maker(engine: RolloutEngine, rows: int, cache: int, length: int) -> Callable[[], DecodeState]:
    """`zero_state`'s compiled program (no arguments: every buffer is born on the device)."""
    import jax
    import jax.numpy as jnp

    from tlt_jax import memory_plan as mpp
    from tlt_jax.rollout.sampling import SamplingParams

    am = mpp.AbstractModels(
        engine.model_config,
        engine.graphdef,
        engine.params,
        engine.drafter_graphdef,
        engine.drafter_params,
    )
    abstract = mpp.abstract_state(engine, am, SamplingParams(temperature=0.9), rows, cache, 16)
    budget = engine.config.max_new_tokens

    def make() -> DecodeState:
        st = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
        full = lambda v: jnp.full((rows,), v, jnp.int32)  # noqa: E731
        st = st.replace(cache=st.cache.replace(lengths=full(length)), max_new=full(budget))
        if st.aux is not None and st.aux.drafter_cache is not None:
            dc = st.aux.drafter_cache.replace(lengths=full(length - 1))
            st = st.replace(aux=st.aux.replace(drafter_cache=dc))
        return st

    return jax.jit(make, out_shardings=jax.tree.map(lambda s: s.sharding, abstract))


def chunk_margin(engine: RolloutEngine, modes: list[str]) -> int:
    """Cache slots a chunk (and the timed repeats on the same state) may grow into: chunk_steps rounds of
    at most depth + 1 tokens each, plus the last round's lookahead."""
    per, ahead = 1, 1
    for m in modes:
        if m != "plain":
            per = max(per, engine.modes[m].tokens_per_step)
            ahead = max(ahead, engine.modes[m].lookahead)
    return engine.config.chunk_steps * per + ahead + 1


def time_chunks(
    engine: RolloutEngine, mode: str, rows: int, cache: int, reps: int, rec: Recorder
) -> dict[str, Any]:
    """Seconds per step (plain) or round of `mode`: the engine's chunk program on a fresh zero state per
    call (the first call compiles, recorded), median of `reps` calls."""
    import statistics

    from tlt_jax.rollout.sampling import SamplingParams

    sp = SamplingParams(temperature=0.9)
    length = cache - chunk_margin(engine, [mode])
    times, first = [], None
    for i in range(reps + 1):
        state = zero_state(engine, rows, cache, length)
        state, chunk, _, _ = engine.decode_chunk(state, mode, sp, None, -1)
        del state
        if chunk.compiled:
            rec.compiled(f"chunk_{mode}_b{rows}_c{cache}", chunk.compile_seconds)
        if i == 0:
            first = chunk
            continue
        times.append(chunk.seconds / max(chunk.steps, 1))
    gc.collect()
    return {"seconds": statistics.median(times), "steps": first.steps, "length": length, "reps": reps}


def fits(rec: Recorder, what: str, need: int) -> bool:
    """Whether `need` bytes fit FIT_FRACTION of the device's limit (unknown limit: yes); else skipped."""
    limit = device_limit()
    if limit is None or need <= FIT_FRACTION * limit:
        return True
    rec.skip(
        what, f"memory: needs {gib(need)} (weights + KV cache) > {FIT_FRACTION} x {gib(limit)}", "memory"
    )
    return False


def resident_bytes(engine: RolloutEngine) -> int:
    """Bytes already on the device (both engines' weights, what earlier cells left): the allocator's count
    where the backend keeps one, else the engine's weights."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_in_use") or tree_bytes(engine.params))


def kv_bytes_per_token(cfg: ModelConfig, drafter_layers: int = 0) -> int:
    """K and V of every layer (plus the drafter's) for one token, in the model's dtype."""
    import numpy as np

    layers = cfg.num_layers + drafter_layers
    return layers * 2 * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize


def part_decode(engine: RolloutEngine, rec: Recorder, args: argparse.Namespace, g: int) -> None:
    """Plain decode at every (batch, cache) of the grid, batch 1 first; against the paper and the roofline."""
    cfg, wbytes = engine.model_config, step_weight_bytes(engine)
    kv_tok = kv_bytes_per_token(cfg)
    bw = args.bandwidth_gb_s * 1e9 if args.bandwidth_gb_s else None
    cells = [(b, c) for b in GRID["decode_batches"][g][:1] for c in GRID["decode_caches"][g]]
    cells += [(b, c) for c in GRID["decode_caches"][g] for b in GRID["decode_batches"][g][1:]]
    for b, c in cells:
        what = f"decode b{b} c{c}"
        if not fits(rec, what, resident_bytes(engine) + b * c * kv_tok):
            continue
        if not rec.affordable(what, rec.compile_guess + 5.0):
            continue
        try:
            r = time_chunks(engine, "plain", b, c, args.reps, rec)
        except Exception as e:  # an out-of-memory cell is recorded, the next one runs
            rec.add("errors", {"what": what, "error": f"{type(e).__name__}: {str(e)[:400]}"})
            gc.collect()
            continue
        step_bytes = wbytes + b * r["length"] * kv_tok
        roof = b * bw / step_bytes if bw else None
        tok_s = b / r["seconds"]
        row = {"batch": b, "cache": c, "length": r["length"], "step_ms": 1e3 * r["seconds"], "tok_s": tok_s}
        row.update(roofline_tok_s=roof, roofline_frac=tok_s / roof if roof else None, step_bytes=step_bytes)
        if b == 1:
            row["vs_paper"] = tok_s / PAPER_PLAIN_TOK_S
        print(f"   {what}: {row['step_ms']:.2f} ms/step, {tok_s:.1f} tok/s (roofline {roof})", flush=True)
        rec.add("decode", row)


def part_round(
    plain_engine: RolloutEngine,
    engine: RolloutEngine,
    rec: Recorder,
    args: argparse.Namespace,
    g: int,
    modes: dict[int, str],
) -> None:
    """One speculative round per (batch, TV, cache) in plain steps of the same batch and cache (the plain
    engine's step, measured here beside it; decode's programs are reused): per batch, each TV at every
    cache before the next TV, so a part cut short still has TV 16 at 4K and 32K."""
    kv_tok = kv_bytes_per_token(engine.model_config, drafter_layers=1)
    for b in GRID["round_batches"][g]:
        plain: dict[int, float] = {}
        for cache in GRID["round_caches"][g]:
            what = f"plain b{b} c{cache}"
            if fits(rec, what, resident_bytes(engine) + b * cache * kv_tok) and rec.affordable(
                what, rec.compile_guess + 5.0
            ):
                plain[cache] = time_chunks(plain_engine, "plain", b, cache, args.reps, rec)["seconds"]
        for tv, mode in modes.items():
            for cache, step in plain.items():
                what = f"round b{b} tv{tv} c{cache}"
                if not rec.affordable(what, rec.compile_guess + 5.0):
                    continue
                try:
                    r = time_chunks(engine, mode, b, cache, args.reps, rec)
                except Exception as e:
                    rec.add("errors", {"what": what, "error": f"{type(e).__name__}: {str(e)[:400]}"})
                    continue
                row = {"batch": b, "tv": tv, "strategy": mode, "cache": cache, "round_ms": 1e3 * r["seconds"]}
                row.update(plain_step_ms=1e3 * step, round_steps=r["seconds"] / step)
                print(
                    f"   {what}: {row['round_ms']:.2f} ms = {row['round_steps']:.2f} plain steps", flush=True
                )
                rec.add("round", row)


def part_split(
    engine: RolloutEngine, rec: Recorder, args: argparse.Namespace, g: int, modes: dict[int, str]
) -> None:
    """Each round split into draft / verify / accept / commit (verify_breakdown's looped programs), batch by
    batch while the part's time lasts: ms and plain steps per phase."""
    from experiments.bench import verify_breakdown as vb
    from tlt_jax.rollout.sampling import SamplingParams

    sp, inner = SamplingParams(temperature=0.9), 4
    cache = GRID["round_caches"][g][0]
    per_build = None  # seconds to compile one mode's phase programs (measured on the first)
    for b in GRID["round_batches"][g]:
        # the plain step's program, then at least one TV's (8 programs, most smaller than a chunk's)
        if not rec.affordable(f"split b{b}", rec.compile_guess + (per_build or 5 * rec.compile_guess) + 5.0):
            return
        state = zero_state(engine, b, cache, cache - chunk_margin(engine, list(modes.values())))
        timed = {"plain": vb.build(engine, "plain", state, sp, inner)["plain"]}
        for tv, mode in modes.items():
            what = f"split b{b} tv{tv}"
            if not rec.affordable(what, (per_build or 5 * rec.compile_guess) + 5.0):
                continue
            t = time.perf_counter()
            for prog, fn in vb.build(engine, mode, state, sp, inner).items():
                timed[f"{tv}/{prog}"] = fn
            per_build = time.perf_counter() - t
            rec.compiled(f"split_b{b}_tv{tv} (8 programs)", per_build, estimate=False)
        ms = {k: v / inner * 1e3 for k, v in vb.interleaved(timed, args.reps).items()}
        for tv in modes:
            if f"{tv}/round" not in ms:
                continue
            row: dict[str, Any] = {"batch": b, "tv": tv, "cache": cache, "plain_step_ms": ms["plain"]}
            for p in vb.PROGRAMS:
                row[f"{p}_ms"] = ms[f"{tv}/{p}"]
                row[f"{p}_steps"] = ms[f"{tv}/{p}"] / ms["plain"]
            print(f"   split b{b} tv{tv}: " + " ".join(f"{p} {row[f'{p}_steps']:.2f}" for p in vb.PROGRAMS))
            rec.add("split", row)
        del state, timed
        gc.collect()


MODEL_PARTS = ("decode", "round", "split")  # the parts that need the 7B engines


def setup(rec: Recorder, dry: bool) -> tuple[RolloutEngine, RolloutEngine, dict[int, str]]:
    """(plain engine, speculative engine, TV -> mode): the random model, its drafter and the round's modes;
    a dry run also sets the simulated device limit (the weights and the first decode cell only)."""
    g = 1 if dry else 0
    plain, engine = build_engines(model_config(dry), rec, 4 if dry else 16, 512 if dry else 2048)
    modes = {tv: engine.add_mode("eagle", strategy(tv)) for tv in GRID["round_tvs"][g]}
    if dry:  # a device that holds the weights and the first cell (drafter layer included) only: others skip
        b, c = GRID["decode_batches"][g][0], GRID["decode_caches"][g][0]
        need = tree_bytes(engine.params) + b * c * kv_bytes_per_token(engine.model_config, drafter_layers=1)
        SIMULATED_LIMIT[:] = [int(need / FIT_FRACTION) + 1]
        rec.data["meta"]["simulated_limit"] = SIMULATED_LIMIT[0]
    return plain, engine, modes


def run_parts(parts: list[str], rec: Recorder, args: argparse.Namespace, dry: bool) -> None:
    """The parts in order, each under its deadline; a part that fails is recorded and the next one runs.
    The model is made first, before any part's share is computed: its init (a cold compile of 35 s on the
    H200) is spent before the parts share what is left."""
    g = 1 if dry else 0
    plain = engine = None
    modes: dict[int, str] = {}
    no_model = ""
    if any(p in MODEL_PARTS for p in parts):
        try:
            plain, engine, modes = setup(rec, dry)
        except Exception as e:  # recorded; the model's parts are skipped, the others run
            no_model = f"{type(e).__name__}: {e}"[:600]
            rec.add("errors", {"what": "init", "error": no_model, "trace": traceback.format_exc()[-1500:]})
            print(f"   init failed: {no_model[:300]}", flush=True)
    for i, part in enumerate(parts):
        rec.start_part(part, parts[i:])
        try:
            if part in MODEL_PARTS and engine is None:
                rec.skip(part, f"no model: {no_model[:200]}", "error")
            elif part == "decode":
                part_decode(plain, rec, args, g)
            elif part == "round":
                part_round(plain, engine, rec, args, g, modes)
            elif part == "split":
                part_split(engine, rec, args, g, modes)
            elif part == "drafter":
                part_drafter(rec, args, dry)
            elif part == "update":
                part_update(rec, args, dry)
        except Exception as e:  # recorded; the next part still runs
            rec.add("errors", {"what": part, "error": f"{type(e).__name__}: {e}"[:600],
                               "trace": traceback.format_exc()[-1500:]})  # fmt: skip
            print(f"   part {part} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


def strategy(tv: int) -> str:
    """bench_sd's EAGLE strategy for `tv` tokens to verify (experiments/lib/sd_pairs.py)."""
    from experiments.lib.sd_pairs import strategy_for

    return strategy_for(tv)


def meta(dry: bool, args: argparse.Namespace) -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    cfg = model_config(dry)
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return {
        "model": "tiny qwen2 (dry run)" if dry else "Qwen2.5-7B shapes, random bf16 weights",
        "model_config": {k: getattr(cfg, k) for k in (*TINY, "dtype", "tie_embeddings")},
        "device": dev.device_kind,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "bytes_limit": device_limit(),
        "bandwidth_gb_s": args.bandwidth_gb_s or None,
        "bf16_matmul_tflops": args.matmul_tflops or None,
        "kv_bytes_per_token": kv_bytes_per_token(cfg),
        "paper_plain_tok_s": PAPER_PLAIN_TOK_S,
        "draft_vocab": draft_vocab_size(cfg),  # the rounds' drafter head
        "budget_s": args.budget_s,
        "jax_cache": cache,
        # a warm persistent cache makes "first-call compile" seconds cache loads: say how warm it was
        "jax_cache_files_at_start": len(list(pathlib.Path(cache).glob("*"))) if cache else None,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", help=f"comma-separated, in order: {','.join(SHARES)}")
    ap.add_argument("--json", default="", help="the results file (rewritten after every measurement)")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--bandwidth-gb-s", type=float, default=0.0, help="the env phase's (for the roofline)")
    ap.add_argument("--matmul-tflops", type=float, default=0.0, help="the env phase's bf16 rate (recorded)")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per cell (after the compiling one)")
    ap.add_argument("--update-len", type=int, default=8192, help="update: response tokens per row")
    ap.add_argument("--update-rows", type=int, default=2, help="update: rows (a GRPO group: >= 2)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (any backend)")
    args = ap.parse_args(argv)
    import jax

    if not args.json:
        raise SystemExit("--json is required (the results file)")

    dry = args.dry_run or jax.default_backend() == "cpu"
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in SHARES]
    if unknown:
        raise SystemExit(f"unknown parts {unknown}: choose from {list(SHARES)}")
    rec = Recorder(pathlib.Path(args.json), args.budget_s, meta(dry, args))
    run_parts(parts, rec, args, dry)
    rec.save()
    print(
        f"wrote {args.json}: "
        + ", ".join(f"{k} {len(v)}" for k, v in rec.data.items() if isinstance(v, list))
    )


if __name__ == "__main__":
    main()
