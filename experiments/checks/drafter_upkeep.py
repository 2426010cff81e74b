"""What a drafter costs while SD is off: plain decoding in an engine ready to speculate vs one that cannot.

An engine that can switch to speculation mid-rollout pays for it during plain chunks in two ways:
  * EAGLE keeps its drafter's KV cache in step (`rollout/decode.py: plain_step` runs the drafter's layer on
    each emitted token, without its LM head) and prefills it with the prompts, so the first SD round can
    draft at once;
  * every speculative mode reserves its lookahead in the cache, so a row's cache-length bucket (attention
    reads the whole bucket) is chosen for length + lookahead and grows earlier (`--fixed-cache` turns the
    buckets off to see the first cost alone).
This is the cost of the SD arms outside their SD phase (`e2e_speedup`'s `plain-ph` column). Three engines
decode plain for the whole rollout with the same prompts and keys (identical tokens), with the RL config's
engine sizes (configs/tlt.py: cache buckets 128..512, chunks of 16 steps): no drafter; the warmed EAGLE
drafter registered (3_1_4); the n-gram drafter registered (4_1_5). Passes interleave, `--reps` times after
one untimed warm-up each; ratios are medians of the per-pass ratios to the no-drafter engine.

    python -m experiments.checks.drafter_upkeep --quick      # batches 8, 32; 128 new tokens
    python -m experiments.checks.drafter_upkeep --batches 1,4,16,32 --new 256

Final line: `RESULT eagle_decode_ratio_bs{B}=.. eagle_prefill_ratio_bs{B}=.. ngram_decode_ratio_bs{B}=..`
(ready engine's plain tokens/s over the no-drafter engine's, decode chunks only; prefill seconds ready over
no-drafter).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from experiments.lib import harness as h
from experiments.lib.sd_pairs import TASK_KWARGS, Totals, one_pass
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.tasks.datasets import ReasoningGymTask


def prefill_seconds(engine, groups: list[list[list[int]]], new: int, temp: float, seed: int) -> float:  # noqa: ANN001
    """Prefill seconds of one plain rollout of every group (the engine's RolloutStats phase)."""
    total = 0.0
    for i, prompts in enumerate(groups):
        out = engine.generate(
            prompts, n=1, key=jax.random.key(seed + i), sampling=SamplingParams(temperature=temp),
            max_new_tokens=new,
        )  # fmt: skip
        total += out.stats.phase_seconds.get("prefill", 0.0)
    return total


def main() -> None:
    ap = h.parser(__doc__, quick="batches 8 and 32, 128 new tokens, 3 passes each", out=None)
    h.add_drafter_args(ap, "workdirs/drafter_tlt")
    h.add_model_args(ap)
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,4,16,32)")
    ap.add_argument("--new", type=int, default=None, help="max new tokens per response (default 256)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved timed passes per batch size")
    ap.add_argument("--fixed-cache", action="store_true", help="one cache bucket (512): no bucket effect")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    batches = [int(b) for b in (args.batches or ("8,32" if args.quick else "1,4,16,32")).split(",")]
    new = args.new or (128 if args.quick else 256)

    loaded, model = h.load_target(args.gguf)
    tok = loaded.tokenizer
    drafter, dname, draft_vocab, _ = h.load_drafter_or_exit(args, model)
    task = ReasoningGymTask("chain_sum", size=5000, seed=0, dataset_kwargs=TASK_KWARGS["chain_sum"])
    _, prompts = h.task_prompts(task, tok, 2000, max(batches))
    rollout = h.load_config().rollout
    ecfg = h.rl_engine_config(rollout, new)
    if args.fixed_cache:
        ecfg = dataclasses.replace(ecfg, min_cache_bucket=ecfg.max_cache_len)
    eos = list(tok.eos_token_ids)
    bare, eagle = h.engine_pair(model, ecfg, eos, drafter, draft_vocab)
    eagle.add_mode("eagle", "3_1_4")  # registered, never played: its plain chunks keep the drafter in step
    ngram = RolloutEngine(model, ecfg, eos_ids=eos)
    ngram.add_mode("ngram", "4_1_5")
    engines = {"bare": bare, "eagle": eagle, "ngram": ngram}
    print(f"{h.device_line()}; SmolLM2-135M fp32; drafter {dname}; {new} new tokens; {ecfg}")
    print(f"{'batch':>5} {'tok/s bare':>11} {'eagle':>7} {'ngram':>7} {'eagle prefill':>14}")
    result: dict[str, float] = {}
    for b in batches:
        groups = [prompts[:b]]
        for engine in engines.values():  # warm-up: compiles every program of the trajectory
            one_pass(engine, groups, None, new, args.temperature, args.seed)
        runs: dict[str, list[Totals]] = {k: [] for k in engines}
        pre: list[float] = []
        for _ in range(args.reps):
            for name, engine in engines.items():
                runs[name].append(one_pass(engine, groups, None, new, args.temperature, args.seed))
            s = [prefill_seconds(e, groups, new, args.temperature, args.seed) for e in (bare, eagle)]
            pre.append(s[1] / max(s[0], 1e-9))
        pairs = {k: zip(runs["bare"], runs[k], strict=True) for k in ("eagle", "ngram")}
        ratio = {k: float(np.median([r.tok_s / max(p.tok_s, 1e-9) for p, r in v])) for k, v in pairs.items()}
        bare_tok = float(np.median([p.tok_s for p in runs["bare"]]))
        prefill = float(np.median(pre))
        print(f"{b:>5} {bare_tok:>11.1f} {ratio['eagle']:>6.3f}x {ratio['ngram']:>6.3f}x {prefill:>13.3f}x")
        result |= {f"eagle_decode_ratio_bs{b}": ratio["eagle"], f"ngram_decode_ratio_bs{b}": ratio["ngram"]}
        result[f"eagle_prefill_ratio_bs{b}"] = prefill
    result["wall_s"] = time.perf_counter() - t0
    h.result(result, args)


if __name__ == "__main__":
    main()
