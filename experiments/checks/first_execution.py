"""Is a chunk whose program was just compiled a fair bandit reward? First execution vs reruns of one chunk.

The engine compiles a chunk's program before starting the chunk's clock (`ProgramCache.prepare`), so no
chunk's seconds contain a compilation, and the adaptive policy rewards every chunk, first visits included.
What remains is the first execution of a fresh program (allocations, cold instruction and data caches). This
script measures it: a fresh engine decodes the same rollout (same prompts, same key, so the same chunks and
shapes) three times per mode; pass 1 compiles each program before running it, passes 2 and 3 compile
nothing. Per chunk that compiled in pass 1: first / min(pass 2, pass 3). The noise reference is the same
ratio for chunks that compiled nothing in pass 1 (their programs were met earlier in the pass).

    python -m experiments.checks.first_execution --quick  # 4 prompts x 2, <= 160 tokens, modes plain, 3_1_4
    python -m experiments.checks.first_execution          # 8 prompts x 2, <= 256 tokens, 4 modes
Final line: `RESULT first_exec_ratio_median=.. first_exec_ratio_max=.. rerun_ratio_median=..
rerun_ratio_max=.. compiled_chunks=.. chunks=..`.
"""

from __future__ import annotations

import jax
import numpy as np

from experiments.lib import harness as h
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FixedMode
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.tasks.datasets import make_task


def main() -> None:
    ap = h.parser(__doc__, quick="4 prompts x 2, <= 160 tokens, modes plain,3_1_4", out=None)
    ap.add_argument("--modes", default=None, help="plain, EAGLE strategies, ngram_<strategy> (comma list)")
    h.add_drafter_args(ap, h.ROOT / "workdirs" / "drafter_tlt")
    h.add_model_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=None, help="default 8 (quick 4), 2 samples each")
    ap.add_argument("--max-new", type=int, default=None, help="default 256 (quick 160)")
    args = ap.parse_args()
    prompts_n = args.prompts or (4 if args.quick else 8)
    new = args.max_new or (160 if args.quick else 256)
    modes = (args.modes or ("plain,3_1_4" if args.quick else "plain,2_1_3,3_1_4,ngram_4_1_5")).split(",")

    tlt = h.load_config(h.TLT_CONFIG)
    loaded, model = h.load_target(args.gguf)
    drafter, dname, vocab, _ = h.load_drafter_or_exit(args, model)
    task = make_task(tlt.task)
    _, prompts = h.task_prompts(task, loaded.tokenizer, 2000, prompts_n)
    ro = tlt.rollout
    sp, key = SamplingParams(temperature=float(ro.temperature)), jax.random.key(args.seed)
    print(f"{h.device_line()}; drafter {dname}; {prompts_n} prompts x 2, <= {new} tokens; modes {modes}")
    first, rerun = [], []
    for name in modes:  # a fresh engine per mode: every program is compiled in its pass 1
        eng = RolloutEngine(
            model,
            h.rl_engine_config(ro, new),
            eos_ids=list(loaded.tokenizer.eos_token_ids),
            drafter=drafter,
            draft_vocab=vocab,
        )
        mode = h.add_arm(eng, name)
        hook = FixedMode(mode)
        passes = [
            eng.generate(prompts, n=2, key=key, sampling=sp, max_new_tokens=new, hooks=hook).stats.chunks
            for _ in range(3)
        ]
        assert [c.steps for c in passes[0]] == [c.steps for c in passes[1]], "the passes must decode alike"
        for i, (a, b, c) in enumerate(zip(*passes, strict=True)):
            assert not (b.compiled or c.compiled), "passes 2 and 3 must compile nothing"
            ratio = a.seconds / min(b.seconds, c.seconds)
            (first if a.compiled else rerun).append(ratio)
            print(
                f"{mode:>12} chunk {i:>2}: batch {a.batch_bucket:>2} cache {a.cache_bucket:>3} "
                f"{'compiled' if a.compiled else '        '} {a.seconds:.3f} s vs {b.seconds:.3f} / "
                f"{c.seconds:.3f} s -> {ratio:.2f}"
            )
    stat = lambda f, x: float(f(x)) if x else float("nan")  # noqa: E731  (no chunk of that kind: nan)
    res = dict(
        first_exec_ratio_median=stat(np.median, first),
        first_exec_ratio_max=stat(np.max, first),
        rerun_ratio_median=stat(np.median, rerun),
        rerun_ratio_max=stat(np.max, rerun),
    )
    h.result(res | {"compiled_chunks": len(first), "chunks": len(first) + len(rerun)}, args)


if __name__ == "__main__":
    main()
