"""Speculative-decoding rollouts vs plain decoding: acceptance length and decode speedup (cf. TLT Table 4).

SmolLM2-135M (GGUF) samples responses to reasoning-gym prompts (chain_sum by default, or gsm_symbolic; the
default step-by-step system prompt and instruction, through the chat template, as the drafter warm-up uses)
at temperature 0.9. For every batch size B and tokens_to_verify TV, the same prompts and the same PRNG keys
run in interleaved pairs, plain then SD, `--reps` times (3 with --quick) after one untimed warm-up run each
(so compilation is excluded); speedup and round cost are the medians of the per-pair ratios, so a drift of
the machine's speed during the run (+-15% on this VM) cancels within a pair:
  * plain: an engine without a drafter (pure plain decoding, no drafter-cache upkeep);
  * SD:    an engine with the warmed EAGLE drafter, speculative for the whole rollout
           (ThresholdSelector(threshold=B, min_steps_below=0): SD from the first chunk).
Tokens/s = emitted tokens / device time of the decode chunks (RolloutStats chunk records; prefill and host
time excluded). Accept length = tokens emitted per row per verify round (accepted drafts + bonus).
Speedup = SD tok/s / plain tok/s. Outputs differ token by token (sampling is lossless in distribution, not
per token), so both sides are normalised by their own token counts. Batch B = B distinct prompts (n=1);
with fewer prompts than `--prompts`, ceil(prompts / B) engine calls are made and summed.

Strategy for a TV (documented mapping): depth = min(8, TV - 1) and topk = the smallest k whose EAGLE-2 tree
(k + (depth - 1) * k^2 candidates) can hold TV - 1 draft nodes:
    TV=3 -> 2_1_3, 4 -> 3_1_4, 8 -> 7_1_8 (chains), 16 -> 8_2_16, 32 -> 8_3_32, 48 -> 8_3_48, 64 -> 8_3_64.
On this CPU the short chains win at batch 1 (a verify pass over T tokens costs more than a decode step as T
grows: docs/benchmarks.md); the GPU regime of the paper favours the wide trees.
The model-free n-gram drafter (default 4_1_5) runs at batch 1 against the same plain baseline.

    python -m experiments.bench.bench_sd --quick               # batch 1, TV 3/4/8/16 + n-gram, 8 prompts x 64
    python -m experiments.bench.bench_sd --quick --random-drafter  # smoke test without a warmed drafter
    python -m experiments.bench.bench_sd                           # batches 1..32 x TV 3..64
Final line: `RESULT accept_len_bs1=... sd_speedup_bs1=... ngram_speedup_bs1=... speedup_bs{B}_tv{TV}=...`.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from experiments.lib import harness as h
from experiments.lib.sd_pairs import TASK_KWARGS, measure_pairs, one_pass, strategy_for
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.strategy import Strategy
from tlt_jax.tasks.datasets import ReasoningGymTask


def main() -> None:
    ap = h.parser(__doc__, quick="batch 1, TV 3/4/8/16, short generations (< 10 min)", out=None)
    h.add_drafter_args(ap, "workdirs/drafter_warmup")
    h.add_model_args(ap)
    ap.add_argument("--task", default="chain_sum", choices=sorted(TASK_KWARGS))
    ap.add_argument(
        "--task-offset",
        type=int,
        default=2000,
        help="stream position of the first prompt (past the warm-up's training/eval prompts)",
    )
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes")
    ap.add_argument("--tv", default=None, help="comma-separated tokens_to_verify values")
    ap.add_argument(
        "--strategies",
        default=None,
        help="comma-separated strategies depth_topk_tv (e.g. 3_1_4,3_1_4:rej,5_2_8), replacing the TV "
        "mapping; verification is coupled to plain sampling (the default: identical samples), NAME:rej "
        "samples a chain's drafts and verifies by rejection sampling (exact in distribution only), "
        "NAME:fp32 keeps the drafter's weights in float32 (default: SpecConfig.drafter_weight_dtype='auto', "
        "bfloat16 with the CPU kernel)",
    )
    ap.add_argument("--prompts", type=int, default=None, help="prompts per configuration (>= batch)")
    ap.add_argument("--new", type=int, default=None, help="max new tokens per response")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--ngram", default="4_1_5", help="n-gram drafter strategy at batch 1 ('' to skip)")
    ap.add_argument(
        "--reps",
        type=int,
        default=None,
        help="interleaved (plain, SD) timed pairs per configuration; the median ratio is reported "
        "(default 3 with --quick, else 1)",
    )
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --new tokens")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t_start = time.perf_counter()
    batches = [int(b) for b in (args.batches or ("1" if args.quick else "1,2,4,8,16,32")).split(",")]
    tvs = [int(t) for t in (args.tv or ("3,4,8,16" if args.quick else "3,4,8,16,32,48,64")).split(",")]
    new = args.new or (64 if args.quick else 128)
    n_prompts = max(args.prompts or (8 if args.quick else 4), max(batches))

    loaded, model = h.load_target(args.gguf)
    tok = loaded.tokenizer
    drafter, dname, draft_vocab, vocab_note = h.load_drafter_or_exit(args, model)

    task = ReasoningGymTask(args.task, size=5000, seed=0, dataset_kwargs=TASK_KWARGS[args.task])
    _, prompts = h.task_prompts(task, tok, args.task_offset, n_prompts)
    # column -> (strategy, variant); variant "rej": a chain with sampled drafts and rejection sampling;
    # "fp32": the drafter's weights in float32 (a second SD engine), to compare with the default side by side
    if args.strategies:  # explicit strategies: columns are named after them
        strategies = {}
        for item in args.strategies.split(","):
            name, _, variant = item.partition(":")
            if variant not in ("", "rej", "fp32"):
                raise SystemExit(
                    f"--strategies: unknown variant {variant!r} in {item!r} (use NAME, NAME:rej or NAME:fp32)"
                )
            name = Strategy.parse(name).name
            strategies[f"s{name}" + (f"_{variant}" if variant else "")] = (name, variant)
    else:
        strategies = {f"tv{tv}": (strategy_for(tv), "") for tv in tvs}
    max_ahead = max(
        [Strategy.parse(s).lookahead for s, _ in strategies.values()]
        + ([Strategy.parse(args.ngram).lookahead] if args.ngram else [])
    )
    cache = 1 << math.ceil(math.log2(max(len(p) for p in prompts) + new + max_ahead + 1))
    # One cache bucket for the whole run (fewer programs to compile; identical for plain and SD).
    ecfg = EngineConfig(max_new_tokens=new, max_cache_len=cache, min_cache_bucket=cache, chunk_steps=16)
    eos = [] if args.ignore_eos else list(tok.eos_token_ids)
    plain_engine, sd_engine = h.engine_pair(model, ecfg, eos, drafter, draft_vocab)
    engines = {col: sd_engine for col in strategies}
    modes = {}
    for col, (s, v) in strategies.items():
        if v == "rej":
            modes[col] = sd_engine.add_mode("eagle", s, acceptance="rejection", label=v)
        elif v == "fp32":
            f32_spec = dataclasses.replace(ecfg.spec, drafter_weight_dtype="float32")
            f32 = dataclasses.replace(ecfg, spec=f32_spec)
            engines[col] = RolloutEngine(model, f32, eos_ids=eos, drafter=drafter, draft_vocab=draft_vocab)
            modes[col] = engines[col].add_mode("eagle", s)
        else:
            modes[col] = sd_engine.add_mode("eagle", s)
    wdt = sd_engine.drafter_weight_dtype or "float32"

    print(
        f"{h.device_line()}; SmolLM2-135M fp32; "
        f"drafter {dname} ({vocab_note}, {wdt} weights); task {args.task} ({n_prompts} prompts, "
        f"{min(map(len, prompts))}.."
        f"{max(map(len, prompts))} tokens); temperature {args.temperature}; <= {new} new tokens; "
        f"cache {cache}; eos {'ignored' if args.ignore_eos else 'stops'}"
    )
    print(
        "strategies (depth_topk_tv; coupled verification unless ':rej' = sampled drafts + rejection): "
        + ", ".join(f"{col}: {s}{':' + v if v else ''}" for col, (s, v) in strategies.items())
    )

    def groups_for(b: int) -> list[list[list[int]]]:
        k = max(1, n_prompts // b)
        return [prompts[i * b : (i + 1) * b] for i in range(k)]

    results: dict[str, float] = {}
    cells: dict[tuple[int, str], tuple[float, float]] = {}
    print(
        f"\n{'batch':>5} {'column':>8} {'strategy':>11} {'plain tok/s':>11} {'SD tok/s':>9} {'speedup':>7} "
        f"{'accept':>6} {'round/step':>10} {'tokens':>7} {'s':>5}"
    )
    reps = args.reps or (3 if args.quick else 1)
    print(
        "(round/step: device time of one verify round, drafting included, in plain decode steps; speedup and"
        f" round/step: medians over {reps} interleaved plain/SD pairs)"
    )
    for b in batches:
        groups = groups_for(b)
        one_pass(plain_engine, groups, None, new, args.temperature, args.seed)  # untimed: compiles
        rows = [(col, modes[col], engines[col]) for col in strategies]
        if b == 1 and args.ngram:
            ng_engine = RolloutEngine(model, ecfg, eos_ids=eos)
            rows.append((None, ng_engine.add_mode("ngram", args.ngram), ng_engine))
        plain_rates = []
        for col, mode, eng in rows:
            t0 = time.perf_counter()
            pairs = measure_pairs(plain_engine, eng, groups, mode, new, args.temperature, args.seed, reps)
            speed, round_cost, sd = pairs.speedup, pairs.round_cost, pairs.sd[0]
            plain_rates.extend(p.tok_s for p in pairs.plain)
            if col is None:
                results["ngram_speedup_bs1"], results["ngram_accept_len_bs1"] = speed, sd.accept_len
                results["ngram_round_cost_bs1"] = round_cost
            else:
                cells[(b, col)] = (speed, sd.accept_len)
                results[f"speedup_bs{b}_{col}"], results[f"accept_bs{b}_{col}"] = speed, sd.accept_len
                results[f"round_cost_bs{b}_{col}"] = round_cost
            compiles = sum(t.compiles for t in pairs.plain + pairs.sd)
            warn = f"  ({compiles} compiles while timed!)" if compiles else ""
            print(
                f"{b:>5} {col or '-':>8} {mode:>11} {pairs.plain_tok_s:>11.1f} {pairs.sd_tok_s:>9.1f} "
                f"{speed:>6.2f}x {sd.accept_len:>6.2f} {round_cost:>10.2f} {sd.tokens:>7} "
                f"{time.perf_counter() - t0:>5.0f}{warn}",
                flush=True,
            )
        results[f"plain_tok_s_bs{b}"] = float(np.median(plain_rates))

    print("\nTable 4 shape: speedup (accept length); rows batch size, columns tokens_to_verify / strategy")
    print(f"{'batch':>5} " + " ".join(f"{col:>14}" for col in strategies))
    for b in batches:
        print(
            f"{b:>5} "
            + " ".join(f"{f'{cells[b, col][0]:.2f}x ({cells[b, col][1]:.2f})':>14}" for col in strategies)
        )
    if args.ngram and 1 in batches:
        print(
            f"n-gram {args.ngram} at batch 1: {results['ngram_speedup_bs1']:.2f}x "
            f"(accept {results['ngram_accept_len_bs1']:.2f})"
        )

    if 1 in batches:  # headline: the best TV at batch 1
        best = max(strategies, key=lambda col: cells[1, col][0])
        head = {
            "accept_len_bs1": cells[1, best][1],
            "sd_speedup_bs1": cells[1, best][0],
            "ngram_speedup_bs1": results.get("ngram_speedup_bs1", float("nan")),
            "best_bs1": ":".join(x for x in strategies[best] if x),
        }
        results = {**head, **results}
    results["wall_s"] = time.perf_counter() - t_start
    print(f"wall {results['wall_s']:.0f} s")
    h.result(results, args)


if __name__ == "__main__":
    main()
