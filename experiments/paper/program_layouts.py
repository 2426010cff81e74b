"""How many speculative chunk programs a strategy set compiles, and their memory (cf. TLT Table 5).

The paper captures one CUDA graph per (strategy, batch size) in the naive layout (30.4 GB) and shares the
target graphs between strategies with the same tokens_to_verify in the bucketed one (10.7 GB). The JAX
counterpart is the engine's compiled chunk programs (`rollout.programs.ProgramCache`): one per (batch bucket,
cache bucket, program group). Three layouts of the same engine, for a fixed set of batch buckets and ONE
cache bucket:
  * single: one strategy registered (`--single`): what a fixed-strategy engine needs;
  * naive:  every strategy of `--strategies` registered, `EngineConfig(share_programs=False)`: one program per
            strategy and bucket;
  * shared: the same strategies, `share_programs=True` (the default): strategies with the same
            tokens_to_verify (and acceptance rule) run in ONE program per bucket, the strategy a runtime
            operand (`lax.switch` over the drafters).
Sharing only merges strategies with equal tokens_to_verify: with the default set (TVs 3, 4, 8, 5, 6, 16, all
distinct) shared == naive, which is the honest answer for that set; `--strategies 3_1_4,ngram_3_1_4,7_1_8,
3_2_8,ngram_7_1_8,8_2_16,4_3_16` (three TV groups) shows the merge.

How it compiles: each layout's engine prefills a batch once; for every batch bucket the state's first rows are
copied, marked done and grown to the cache bucket, and `engine.decode_chunk` runs on it once per mode, so the
program keys, shapes and donation are exactly the engine's own; with every row done the chunk's
`lax.while_loop` runs zero rounds, so only compilation costs time. Plain chunk programs (the same in every
layout) are not compiled. The drafter's weights do not change a program (shapes do): a random drafter with a
`--draft-vocab`-token head (the warm-up's 8192 by default) is used, so no warmed drafter is needed.
`experiments/models/memory_plans.py` compiles the same layouts (and the paper's "bucketed" one: per batch
bucket only the tokens_to_verify group BEG-MAB plays there) for the paper's Qwen2.5-7B/32B configs from
abstract shapes, with the functions below and `tlt_jax/memory_plan.py` (`layout_engine`, `layout_programs`,
`layout_totals`, `print_programs`, `plot`).
Footprint = `ProgramInfo.footprint_bytes`: XLA's temporaries + outputs not aliased to donated inputs +
generated code (weights and the donated state are arguments, shared by all programs and not counted), the
JAX analogue of the memory a CUDA-graph capture pins. On XLA:CPU the temporaries are the buffers of the
verify forward; on a GPU they are the analogue of the graph pools.

    python -m experiments.paper.program_layouts --tiny            # tiny random model (seconds; smoke test)
    python -m experiments.paper.program_layouts --quick           # SmolLM2, batch buckets 1,2
    python -m experiments.paper.program_layouts                   # SmolLM2, batch buckets 1,2,4,8
Final line: `RESULT programs_single=.. programs_naive=.. programs_shared=.. mib_single=.. mib_naive=..
mib_shared=.. compile_s_single=.. compile_s_naive=.. compile_s_shared=..`; a bar chart in --out.
"""

from __future__ import annotations

import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.lib import harness as h
from experiments.lib.program_layouts import LAYOUTS, layout_programs, layout_totals
from tlt_jax.memory_plan import layout_engine
from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.ngram import NgramBank
from tlt_jax.rollout.programs import ProgramInfo
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.types import DecodeState

DEFAULT_STRATEGIES = "2_1_3,3_1_4,7_1_8,ngram_4_1_5,3_2_6,8_2_16"
PAPER = "paper Table 5 (Qwen, H100): per-strategy CUDA graphs 30.4 GB -> bucketed 10.7 GB (2.84x less)"


def rows_of(state: DecodeState, b: int, cache: int, engine: RolloutEngine) -> DecodeState:
    """A fresh copy of the state's first b rows, every row done (the chunk then runs zero rounds), with the
    cache grown to `cache` slots (a copy: decode_chunk donates its state)."""
    sub = jax.tree.map(lambda x: jnp.array(x[:b], copy=True), state)
    sub = sub.replace(done=jnp.ones_like(sub.done))
    return engine.resize_cache(sub, cache) if sub.cache.capacity != cache else sub


def compile_layout(
    engine: RolloutEngine, batches: list[int], cache: int, prompt: list[int], max_new: int
) -> list[ProgramInfo]:
    """Compile the speculative chunk program of every (registered mode, batch bucket) at one cache bucket;
    returns the chunk programs' infos (plain chunk programs are never compiled here)."""
    sp = SamplingParams(temperature=0.9)
    top = max(batches)
    n = min(4, top)
    state, _ = engine.prefill(
        [prompt] * (top // n), n=n, key=jax.random.key(0), sampling=sp, max_new_tokens=max_new
    )
    bank = None
    if engine.needs()[1]:
        bank = jax.device_put(NgramBank.empty(top, n, max_new), engine.replicated)
    layout = "naive" if not engine.config.share_programs else "shared"
    for b, mode in layout_programs(engine, layout, batches):
        sub = rows_of(state, b, cache, engine)
        sub, record, bank, _ = engine.decode_chunk(sub, mode, sp, bank, exit_live=-1)
        assert record.steps == 0, record  # every row is done: nothing ran
    return [i for i in engine.programs.infos("chunk") if i.key[4]]  # key[4]: the program's modes (plain: ())


def main() -> None:
    ap = h.parser(
        __doc__,
        quick="batch buckets 1,2 (default --batches 1,2,4,8)",
        out=h.ROOT / "workdirs" / "program_layouts",
    )
    ap.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2 (smoke test)")
    ap.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated; ngram_<s> = n-gram")
    ap.add_argument("--single", default="3_1_4", help="the strategy of the single-strategy layout")
    ap.add_argument("--batches", default=None, help="comma-separated batch buckets (powers of two)")
    ap.add_argument(
        "--cache", type=int, default=512, help="the cache bucket (configs/tlt.py's max_cache_len)"
    )
    ap.add_argument(
        "--max-new", type=int, default=384, help="response budget (sets the state's token buffers)"
    )
    ap.add_argument("--draft-vocab", type=int, default=8192, help="drafter head rows (0: the full head)")
    h.add_model_args(ap)
    args = ap.parse_args()
    t_start = time.perf_counter()
    batches = [int(b) for b in (args.batches or ("1,2" if args.quick else "1,2,4,8")).split(",")]
    if any(b & (b - 1) for b in batches):
        sys.exit(f"--batches must be powers of two (batch buckets), got {batches}")
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.tiny:
        cfg = tiny_config("llama", vocab_size=264)
        model, mname = Transformer(cfg, nnx.Rngs(0)), "tiny random Llama"
        max_new, cache = min(args.max_new, 32), min(args.cache, 64)
    else:
        loaded, model = h.load_target(args.gguf)
        cfg, mname = loaded.config, "SmolLM2-135M fp32"
        max_new, cache = args.max_new, args.cache
    drafter = Drafter(cfg, nnx.Rngs(1))
    dv = min(args.draft_vocab, cfg.vocab_size)
    vocab = np.arange(dv) if dv > 0 else None
    prompt = [1 + (7 * i) % (cfg.vocab_size - 1) for i in range(24)]
    print(
        f"{h.device_line()}; {mname}; "
        f"batch buckets {batches}; cache bucket {cache}; draft head {dv or 'full'} rows; strategies {names}; "
        f"single {args.single}"
    )

    infos: dict[str, list[ProgramInfo]] = {}
    ecfg = EngineConfig(max_new_tokens=max_new, max_cache_len=cache, min_cache_bucket=min(64, cache))
    for layout in LAYOUTS:
        engine = layout_engine(layout, model, ecfg, names, args.single, drafter, vocab)
        if layout == "shared":
            groups = sorted({engine.mode_group(m) for m in engine.modes})
            print("program groups (same tokens_to_verify): " + "; ".join("+".join(g) for g in groups))
        t0 = time.perf_counter()
        infos[layout] = compile_layout(engine, batches, cache, prompt, max_new)
        print(
            f"{layout}: {len(infos[layout])} chunk programs compiled in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )

    totals = layout_totals(infos)
    mib = {k: t["bytes"] / 2**20 for k, t in totals.items()}
    secs = {k: t["compile_s"] for k, t in totals.items()}
    print_programs(infos)
    print(f"\n{'layout':>8} {'programs':>8} {'MiB':>9} {'compile s':>9}")
    for layout in LAYOUTS:
        print(f"{layout:>8} {len(infos[layout]):>8} {mib[layout]:>9.1f} {secs[layout]:>9.1f}")
    ratio = mib["naive"] / max(mib["shared"], 1e-9)
    print(f"naive / shared footprint: {ratio:.2f}x; {PAPER}")
    out = h.out_dir(args)
    png = plot(infos, mib, secs, out / "program_layouts.png", f"{mname}, buckets {batches}, cache {cache}")
    print(f"plot: {png}; wall {time.perf_counter() - t_start:.0f} s")
    res = {f"programs_{k}": len(v) for k, v in infos.items()}
    res |= {f"mib_{k}": round(v, 3) for k, v in mib.items()} | {
        f"compile_s_{k}": round(v, 1) for k, v in secs.items()
    }
    h.result(res, args, fmt="")


def print_programs(infos: dict[str, list[ProgramInfo]], unit: str = "MiB") -> None:
    """One line per chunk program: layout, batch bucket, tokens_to_verify, modes, footprint and its parts."""
    div = {"MiB": 2**20, "GiB": 2**30}[unit]
    print(
        f"\nper program (batch bucket, tokens_to_verify, modes): footprint {unit} (= temp + outputs + code), "
        "compile seconds"
    )
    for layout, items in infos.items():
        for i in sorted(items, key=lambda i: (i.key[1], i.key[3])):
            parts = (i.temp_bytes, max(i.output_bytes - i.alias_bytes, 0), i.code_bytes)
            print(
                f"  {layout:>8} b={i.key[1]:<3} tv={i.key[3]:<3} {'+'.join(i.key[4]):<34} "
                f"{i.footprint_bytes / div:8.2f} {unit} (temp {parts[0] / div:.2f}, "
                f"out {parts[1] / div:.2f}, code {parts[2] / div:.2f})  {i.compile_seconds:6.1f} s"
            )


def plot(
    infos: dict[str, list[ProgramInfo]],
    mib: dict[str, float],
    secs: dict[str, float],
    path: pathlib.Path,
    title: str,
    unit: str = "MiB",
) -> pathlib.Path:
    """Three bar panels per layout (those in `infos`): chunk programs, footprint, compile seconds."""
    plt = h.pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    colors = ["#888888", "#d62728", "#2ca02c", "#1f77b4"]
    layouts = list(infos)
    for ax, (label, vals) in zip(
        axes,
        (
            ("chunk programs", {k: len(v) for k, v in infos.items()}),
            (f"footprint ({unit})", mib),
            ("compile seconds", secs),
        ),
        strict=True,
    ):
        bars = ax.bar(layouts, [vals[k] for k in layouts], color=colors[: len(layouts)])
        ax.bar_label(bars, fmt="%.3g")
        ax.set_title(label)
    fig.suptitle(f"speculative chunk programs per layout ({title})", fontsize=10)
    return h.save_plot(fig, path, dpi=110)


if __name__ == "__main__":
    main()
