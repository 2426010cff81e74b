"""The long-tail case study (TLT Fig 14: 128 requests, SD on below 32 running rows, 2.44x rollout speedup).

One rollout of N requests (`--requests`, default 128 = 32 prompts x 4 samples of the RL task in
configs/tlt.py, T = 0.9, <= 384 new tokens; held-out prompts) decoded by every policy of the engine, for each
of `--keys` measured sampling keys (3, quick 2):
  (a) plain:        an engine without a drafter (no speculation, no drafter-cache upkeep: a strong baseline);
  (b) <arm>@thr<T>: each fixed strategy of `--arms` (EAGLE chains 2_1_3, 3_1_4, 7_1_8, n-gram 4_1_5) behind
                    the paper's switch (`ThresholdPolicy`: plain until <= T rows have run for
                    `--min-steps-below` steps; paper 32 and 10, CPU default 2 and 0: SD pays only at batch
                    1-2 here); the best of them in hindsight is `best_fixed`;
  (c) sglang:       mainline SGLang's rule (per-bucket EMA of accepted drafts, hysteresis on a depth ladder:
                    plain, then the EAGLE arms shallow to deep);
  (d) adaptive:     BEG-MAB with plain as an arm, every arm eligible in every bucket, buckets 1|2|4|8|rest.
(c) and (d) learn across rollouts: `--learn` rollouts with other keys train the selector (default 6: the
state of a selector the learner has carried through 6 RL steps; `--learn 2` measures the cold start: 5 arms
x 5 buckets of plain and SD probes, at 9-32 rows at a third to a half of plain's speed); its state is
restored before every pass with a measured key, so it never learns from the measured rollouts.

Keys. The same prompts sampled with another key have another tail (which rows ramble, whether they run to
the cap, how well the last rows draft), and whether SD pays at the tail's end changes with it: one key would
decide "best fixed in hindsight" by chance. Each key is timed on its own (its plain runs are its drift
reference); ratios are geometric means over keys, with each key's in the table and the spread in RESULT
(`_min` / `_max`). `best_fixed` is ONE fixed strategy for all keys, the best in hindsight.
`--fresh` (default on, off with --quick) also times a selector that learned nothing.

Timing. A pass with the measured key that compiled any program (`engine.compile_count` moved: chunks,
prefill, compaction, cache growth) is untimed and repeated, so compilation never lands in a timing (column
"untimed"; a timed pass still compiling after 4 tries is flagged). This shared VM's speed drifts (2x between
plain runs minutes apart under others' load), so a timed plain rollout runs before every `--plain-every`
configurations (default 1: pairs, as bench_sd) and at the end, and each rollout's time is divided by plain's
interpolated to its moment: speedups are ratios of these drift-corrected times (raw seconds printed too).
"cpu vs" is the same ratio in process CPU seconds, which others' load moves less (a cross-check only).
`--reps` > 1 repeats the timed rollouts round-robin (medians).

Table: rollout seconds (prefill + host + decode), decode seconds (chunks), speedup vs plain, accept length
(tokens per row per verify round), SD share (of decode time), chunks. With coupled verification (default)
every configuration samples plain decoding's tokens (each row's PRNG stream decides each token), so all do
the same work: the script checks it, with the engine's caveat that a verify pass and a decode step round
differently, so a draw whose uniform lies within rounding of a CDF boundary can flip. Each differing
sequence is diagnosed (its uniform's distance to the other token's interval under a teacher-forced forward:
~1e-6 is such a flip; a real divergence fails the script). Oracle bound: plain's decode time per batch
bucket cut by the best SD speedup any timed run's SD chunks reached there. PNG: running rows over decode
time (plain, best fixed, sglang, adaptive), where SD was on, the arm each selector chose per chunk. On this
CPU SD pays only at 1-2 running rows, and the tail may never get there: rows that run to the token cap
finish together, so the running count stops at their number.

    python -m experiments.paper.case_study --quick                   # 8 x 4 requests, <= 384 tokens
    python -m experiments.paper.case_study --quick --random-drafter  # smoke run without a warmed drafter
    python -m experiments.paper.case_study                           # 32 x 4 requests, <= 384 tokens
Final line: `RESULT keys=K adaptive_vs_plain=.. adaptive_vs_best_fixed=.. adaptive_vs_plain_min=.. ..
adaptive_vs_ema=.. best_fixed=<name> ...` (X_vs_Y: Y's drift-corrected rollout time / X's, geometric mean
over keys; _min/_max: over keys; same_tokens=1 if every rollout equals plain's, flips=N sequences that
differed by a rounding flip).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.lib import harness as h
from experiments.paper.case_study_runs import Config, report, sd_share
from tlt_jax.rollout.adaptive import AdaptivePolicy, build_policy
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FixedMode, ThresholdPolicy
from tlt_jax.rollout.sampling import SamplingParams, target_probs
from tlt_jax.rollout.selector_config import BanditSection
from tlt_jax.rollout.types import Rollout
from tlt_jax.tasks.datasets import make_task


def selector(
    algo: str, engine: RolloutEngine, arms: list[str], buckets: tuple[int, ...], seed: int
) -> AdaptivePolicy:
    """A selector hook over plain + `arms` (every arm eligible in every bucket) built by `build_policy`."""
    tlt_bandit = h.load_config(h.TLT_CONFIG).bandit
    ladder: tuple[str, ...] = ()
    if algo == "sglang":  # plain, then the EAGLE arms shallow to deep (SGLang ladders one drafter's depth)
        eagle = [a for a in arms if not a.startswith("ngram_")] or arms
        by_depth: dict[int, str] = {}
        for a in eagle:
            by_depth.setdefault(engine.modes[a].tokens_per_step, a)
        ladder = ("plain", *(by_depth[k] for k in sorted(by_depth)))
    section = BanditSection(
        algorithm=algo,
        arms=("plain", *arms),
        bucket_bounds=buckets,
        all_arms=True,
        epsilon=float(tlt_bandit.epsilon),
        window=int(tlt_bandit.window),
        sglang_ladder=ladder,
    )
    return build_policy(section, engine, seed=seed)


@functools.cache
def _forward(graphdef: Any) -> Callable:
    """A jitted teacher-forced forward: (params, [1, S] tokens, index) -> the logits at that index."""

    def f(params: Any, toks: jax.Array, idx: jax.Array) -> jax.Array:
        pos = jnp.arange(toks.shape[1], dtype=jnp.int32)[None]
        out = nnx.merge(graphdef, params)(toks, pos, None, logits_index_bk=idx[None, None])
        return out.logits[0, 0]

    return jax.jit(f)


def flip_distance(
    engine: RolloutEngine, prompt: list[int], plain: np.ndarray, other: np.ndarray, seq_key: Any, sp: Any
) -> tuple[int, float]:
    """(j, d): the first position where `other` differs from plain's tokens, and the distance (probability
    mass) between the uniform plain decoding drew for token j (the sequence's key folded with j: the engine's
    row keys) and the CDF interval of the token `other` emitted there, under a teacher-forced forward of
    prompt + plain[:j] (a third rounding of the same logits). ~1e-6: a rounding flip; O(0.1): a divergence."""
    j = int(np.argmax(plain != other))
    ctx = list(prompt) + plain[:j].tolist()
    toks = np.zeros((1, engine.config.max_cache_len), np.int32)
    toks[0, : len(ctx)] = ctx
    logits = _forward(engine.graphdef)(engine.params, jnp.asarray(toks), jnp.int32(len(ctx) - 1))
    cdf = np.concatenate([[0.0], np.cumsum(np.asarray(target_probs(logits[None], sp)[0], np.float64))])
    x = float(jax.random.uniform(jax.random.fold_in(seq_key, j), (1,))[0]) * cdf[-1]
    t = int(other[j])
    return j, max(cdf[t] - x, x - cdf[t + 1], 0.0)


def parse_args() -> argparse.Namespace:
    ap = h.parser(
        __doc__, quick="8 prompts x 4, <= 384 tokens, 2 measured keys", out=h.ROOT / "workdirs" / "case_study"
    )
    add = ap.add_argument
    add("--requests", type=int, default=None, help="rows = prompts x --samples (default 128)")
    add("--samples", type=int, default=4, help="samples per prompt (GRPO group size)")
    add("--max-new", type=int, default=None, help="default configs/tlt.py's 384")
    add("--arms", default="2_1_3,3_1_4,7_1_8,ngram_4_1_5", help="strategies; ngram_<s> = n-gram drafter")
    add("--threshold", type=int, default=2, help="SD switch: <= this many running rows (paper 32)")
    add("--min-steps-below", type=int, default=0, help="... for this many steps (paper 10)")
    add("--buckets", default="1,2,4,8", help="selector bucket bounds (+ the rest)")
    add("--learn", type=int, default=None, help="selector learning rollouts (6; 2: cold start)")
    add(
        "--keys", type=int, default=None, help="measured keys seed, seed+1, .. (3; quick 2): the tail differs"
    )
    add("--reps", type=int, default=1, help="timed rollouts per configuration and key (median)")
    add("--plain-every", type=int, default=1, help="a timed plain rollout before every K others")
    add("--fresh", action=argparse.BooleanOptionalAction, default=None, help="time a fresh BEG-MAB too")
    h.add_drafter_args(ap, h.ROOT / "workdirs" / "drafter_tlt")
    h.add_model_args(ap)
    add("--task-offset", type=int, default=2000, help="first stream position (held out)")
    add("--seed", type=int, default=0)
    add("--allow-mismatch", action="store_true", help="report, not fail, on a real divergence")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    tlt = h.load_config(h.TLT_CONFIG)
    ro, n = tlt.rollout, args.samples
    # quick: fewer rows at the RL config's cap, so the tail still reaches 1-2 rows (64 x <= 256 tokens did
    # not: 8 rows ran to the cap and finished together, so the SD switch at 2 rows never fired)
    num_prompts = max(1, (args.requests or (32 if args.quick else 128)) // n)
    new = args.max_new or ro.max_new_tokens
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    buckets = tuple(int(b) for b in args.buckets.split(","))
    fresh = (not args.quick) if args.fresh is None else args.fresh
    learn = args.learn if args.learn is not None else 6
    num_keys = args.keys if args.keys is not None else (2 if args.quick else 3)

    loaded, model = h.load_target(args.gguf)
    drafter, dname, draft_vocab, vocab_note = h.load_drafter_or_exit(args, model)
    task = make_task(tlt.task)
    _, prompts = h.task_prompts(task, loaded.tokenizer, args.task_offset, num_prompts)
    ecfg = h.rl_engine_config(ro, new)  # configs/tlt.py's engine
    eos, sp = list(loaded.tokenizer.eos_token_ids), SamplingParams(temperature=float(ro.temperature))
    plain_engine, sd_engine = h.engine_pair(model, ecfg, eos, drafter, draft_vocab)
    modes = [h.add_arm(sd_engine, a) for a in arms]
    print(
        f"{h.device_line()}; SmolLM2-135M fp32; "
        f"drafter {dname} ({vocab_note}); {num_prompts} prompts x {n} = {num_prompts * n} requests, prompts "
        f"{min(map(len, prompts))}..{max(map(len, prompts))} tokens, T={sp.temperature}, <= {new} new "
        f"tokens; threshold {args.threshold} (min {args.min_steps_below} steps); buckets {buckets}+rest; "
        f"{learn} learning rollouts; {args.reps} timed rollout(s) per configuration"
    )

    configs = {"plain": Config("plain", plain_engine, lambda: FixedMode("plain"))}
    for m in modes:
        hook = lambda m=m: ThresholdPolicy(m, args.threshold, args.min_steps_below)  # noqa: E731
        configs[f"{m}@thr{args.threshold}"] = Config(f"{m}@thr{args.threshold}", sd_engine, hook)
    algos = {"sglang": ("sglang", learn), "adaptive": ("beg_mab", learn)} | (
        {"adaptive_fresh": ("beg_mab", 0)} if fresh else {}
    )
    # the selectors learn first (untimed; they compile most programs)
    for name, (algo, rounds) in algos.items():
        c = configs[name] = Config(name, sd_engine, lambda: None)
        c.policy = selector(algo, sd_engine, modes, buckets, args.seed)
        for i in range(rounds):
            k = jax.random.key(args.seed + 1000 + i)
            r = sd_engine.generate(prompts, n=n, key=k, sampling=sp, max_new_tokens=new, hooks=c.policy)
            print(
                f"  learn {name} {i + 1}/{rounds}: {r.stats.wall_seconds:.1f} s, SD share {sd_share(r):.2f}",
                flush=True,
            )
        c.snapshot = c.policy.policy.state_dict()

    def timed(c: Config, j: int, key: Any, marks: list) -> None:
        """Passes with measured key j until one compiles nothing (that one is timed)."""
        for _ in range(4):
            before, cpu = c.engine.compile_count, time.process_time()
            r = c.engine.generate(prompts, n=n, key=key, sampling=sp, max_new_tokens=new, hooks=c.hook())
            compiled, cpu = c.engine.compile_count - before, time.process_time() - cpu
            if not compiled:
                break
            c.untimed += 1
            print(f"  untimed {c.name}: {r.stats.wall_seconds:.1f} s ({compiled} programs compiled)")
        c.runs.append(r)
        c.key_of.append(j)
        c.compiled_in_timed += compiled  # nonzero only if 4 passes kept compiling: flagged
        marks.append((c, time.perf_counter() - r.stats.wall_seconds / 2, r, cpu))
        print(f"timed {c.name} (key {j}): {r.stats.wall_seconds:.2f} s", flush=True)

    others = [c for c in configs.values() if c.name != "plain"]
    measured = [jax.random.key(args.seed + j) for j in range(num_keys)]
    flips = diverged = 0
    for j, key in enumerate(measured):
        # every timed run of this key: (configuration, its mid time, the rollout, its CPU seconds)
        marks: list[tuple[Config, float, Rollout, float]] = []
        for _ in range(args.reps):  # round-robin, plain before every --plain-every others and at the end
            for i, c in enumerate(others):
                if i % args.plain_every == 0:
                    timed(configs["plain"], j, key, marks)
                timed(c, j, key, marks)
        timed(configs["plain"], j, key, marks)
        ref = [(t, r.stats.wall_seconds, cpu) for c, t, r, cpu in marks if c.name == "plain"]
        ref_t, ref_s, ref_cpu = zip(*ref, strict=True)
        for c, t, r, cpu in marks:  # the drift: plain's time (same key) interpolated around this run
            c.norm.append(r.stats.wall_seconds / float(np.interp(t, ref_t, ref_s)))
            c.norm_cpu.append(cpu / float(np.interp(t, ref_t, ref_cpu)))
        print(
            f"key {j}: timed plain runs {', '.join(f'{w:.1f}' for w in ref_s)} s "
            f"(max/min {max(ref_s) / min(ref_s):.2f})"
        )
        f, d = check_tokens(configs, j, key, prompts, n, plain_engine, sp)
        flips, diverged = flips + f, diverged + d
    title = f"{num_prompts * n} requests, drafter {dname}"
    report(args, configs, dict(new=new, flips=flips, diverged=diverged, title=title, t_start=t_start))


def check_tokens(
    configs: dict[str, Config], j: int, key: Any, prompts: list, n: int, plain_engine: RolloutEngine, sp: Any
) -> tuple[int, int]:
    """Coupled verification: every rollout of measured key j equals plain's, up to rounding flips. Returns
    (sequences that differ by a rounding flip, sequences that diverge for real)."""
    plain = configs["plain"].median_run(j)
    flips = diverged = 0
    seq_keys = jax.random.split(key, len(plain.lengths))
    for c in configs.values():
        for r in c.of_key(c.runs, j):
            for i in np.nonzero((r.tokens != plain.tokens).any(axis=1) | (r.lengths != plain.lengths))[0]:
                row = (prompts[i // n], plain.tokens[i], r.tokens[i], seq_keys[i], sp)
                same = not (r.tokens[i] != plain.tokens[i]).any()  # lengths differ only: no flip
                pos, d = (-1, 1.0) if same else flip_distance(plain_engine, *row)
                flips, diverged = flips + (d < 1e-4), diverged + (d >= 1e-4)
                verdict = "a rounding flip" if d < 1e-4 else "A REAL DIVERGENCE"
                print(
                    f"  {c.name} (key {j}): sequence {i} differs from token {pos} on; its uniform is {d:.1e} "
                    f"from the drawn token's interval: {verdict}"
                )
    return flips, diverged


if __name__ == "__main__":
    main()
