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

    python experiments/case_study.py --quick                   # 8 x 4 requests, <= 384 tokens
    python experiments/case_study.py --quick --random-drafter  # smoke run without a warmed drafter
    python experiments/case_study.py                           # 32 x 4 requests, <= 384 tokens
Final line: `RESULT keys=K adaptive_vs_plain=.. adaptive_vs_best_fixed=.. adaptive_vs_plain_min=.. ..
adaptive_vs_ema=.. best_fixed=<name> ...` (X_vs_Y: Y's drift-corrected rollout time / X's, geometric mean
over keys; _min/_max: over keys; same_tokens=1 if every rollout equals plain's, flips=N sequences that
differed by a rounding flip).
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from bench_sd import load_drafter_or_exit  # noqa: E402

from tlt_jax import config_lib  # noqa: E402
from tlt_jax.models.llama import from_hf_tensors  # noqa: E402
from tlt_jax.models.loading import DEFAULT_GGUF_PATH, load_gguf  # noqa: E402
from tlt_jax.rollout.adaptive import AdaptivePolicy, build_policy  # noqa: E402
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine  # noqa: E402
from tlt_jax.rollout.hooks import FixedMode, RolloutHooks, ThresholdPolicy  # noqa: E402
from tlt_jax.rollout.sampling import SamplingParams, target_probs  # noqa: E402
from tlt_jax.rollout.types import Rollout  # noqa: E402
from tlt_jax.tasks.datasets import make_task  # noqa: E402

PAPER = "paper Fig 14 (Qwen-7B, H100): 128 requests, SD on below 32 running rows, 2.44x rollout speedup"


class Config:
    """One way to decode the rollout: an engine, a hook factory and (for selectors) a persistent policy."""

    def __init__(self, name: str, engine: RolloutEngine, hook: Callable[[], RolloutHooks | None]):
        self.name, self.engine, self.make_hook = name, engine, hook
        self.policy: AdaptivePolicy | None = None
        self.snapshot: dict[str, Any] | None = None
        self.runs: list[Rollout] = []
        self.key_of: list[int] = []  # per timed run: the index of its measured key
        self.norm: list[float] = []  # per timed run: rollout seconds / plain's (same key) at that time
        self.norm_cpu: list[float] = []  # the same for the process's CPU seconds (all threads)
        self.untimed = 0  # passes that compiled a program (not timed)
        self.compiled_in_timed = 0  # programs compiled during the timed passes (should stay 0)

    def hook(self) -> RolloutHooks | None:
        if self.policy is not None:
            self.policy.policy.load_state_dict(self.snapshot)  # the learned state, never the measured run's
            return self.policy
        return self.make_hook()

    def of_key(self, values: list, j: int) -> list:
        """The entries of a per-timed-run list (runs, norm, norm_cpu) that belong to measured key j."""
        return [v for v, k in zip(values, self.key_of, strict=True) if k == j]

    def rel_key(self, j: int, cpu: bool = False) -> float:
        """Median rollout time relative to plain decoding's with measured key j (drift-corrected; in process
        CPU seconds with `cpu`)."""
        return float(np.median(self.of_key(self.norm_cpu if cpu else self.norm, j)))

    @property
    def rel(self) -> float:
        """Rollout time relative to plain's (1 / speedup): the geometric mean over measured keys of each key's
        median (one key: its median)."""
        return geomean([self.rel_key(j) for j in sorted(set(self.key_of))])

    rel_cpu = property(lambda self: geomean([self.rel_key(j, cpu=True) for j in sorted(set(self.key_of))]))

    def median_run(self, j: int = 0) -> Rollout:
        """The run with measured key j at the median of that key's timings."""
        idx = [i for i, k in enumerate(self.key_of) if k == j]
        return self.runs[idx[int(np.argsort([self.norm[i] for i in idx])[len(idx) // 2])]]


def geomean(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values))))


def selector(
    algo: str, engine: RolloutEngine, arms: list[str], buckets: tuple[int, ...], seed: int
) -> AdaptivePolicy:
    """A selector hook over plain + `arms` (every arm eligible in every bucket) built by `build_policy`."""
    section = config_lib.base_config().bandit
    tlt_bandit = config_lib.load_config_file(ROOT / "configs" / "tlt.py").bandit
    ladder: tuple[str, ...] = ()
    if algo == "sglang":  # plain, then the EAGLE arms shallow to deep (SGLang ladders one drafter's depth)
        eagle = [a for a in arms if not a.startswith("ngram_")] or arms
        by_depth: dict[int, str] = {}
        for a in eagle:
            by_depth.setdefault(engine.modes[a].tokens_per_step, a)
        ladder = ("plain", *(by_depth[k] for k in sorted(by_depth)))
    section.update(
        dict(
            algorithm=algo,
            arms=("plain", *arms),
            bucket_bounds=buckets,
            all_arms=True,
            epsilon=float(tlt_bandit.epsilon),
            window=int(tlt_bandit.window),
            sglang_ladder=ladder,
        )
    )
    return build_policy(section, engine, seed=seed)


def sd_share(r: Rollout) -> float:
    return r.stats.sd_seconds / max(r.stats.decode_seconds, 1e-9)


def per_bucket(r: Rollout, spec: bool) -> dict[tuple[int, str], list[float]]:
    """(batch bucket, mode) -> [decode seconds, tokens] of the rollout's plain (spec False) or SD chunks."""
    out: dict[tuple[int, str], list[float]] = {}
    for c in r.stats.chunks:
        if (c.mode != "plain") == spec and c.seconds > 0:
            acc = out.setdefault((c.batch_bucket, c.mode), [0.0, 0.0])
            acc[0], acc[1] = acc[0] + c.seconds, acc[1] + c.new_tokens
    return out


def oracle_bound(plain: Rollout, runs: list[Rollout]) -> tuple[float, dict[int, tuple[float, str]]]:
    """(plain's rollout time / the time with each batch bucket's plain decode time cut by the best SD
    speedup any timed run's SD chunks reached in that bucket, {bucket: (that speedup, its mode)})."""
    base = {b: v for (b, _), v in per_bucket(plain, spec=False).items() if v[1] > 0}
    best: dict[int, tuple[float, str]] = {}
    for r in runs:
        for (b, mode), (s, t) in per_bucket(r, spec=True).items():
            if b in base and (t / s) / (base[b][1] / base[b][0]) > best.get(b, (0.0, ""))[0]:
                best[b] = ((t / s) / (base[b][1] / base[b][0]), mode)
    saved = sum(base[b][0] * (1 - 1 / max(x, 1.0)) for b, (x, _) in best.items())
    return plain.stats.wall_seconds / max(plain.stats.wall_seconds - saved, 1e-9), best


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


def timeline(r: Rollout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step edges in decode seconds [steps + 1], running rows [steps], SD on [steps]) per step or round."""
    edges = np.concatenate([[0.0], np.cumsum(r.stats.seconds_per_step)])
    return edges, np.asarray(r.stats.running_per_step), np.asarray(r.stats.sd_per_step, bool)


def plot(configs: dict[str, Config], best_fixed: str, path: pathlib.Path, title: str) -> None:
    """Running rows over decode time (SD on shaded) + the arm per chunk of the two selectors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [k for k in ("plain", best_fixed, "sglang", "adaptive") if k in configs]
    fig, axes = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True, gridspec_kw={"height_ratios": [2.2, 1, 1]})
    colors = dict(zip(shown, ["#555555", "#1f77b4", "#ff7f0e", "#2ca02c"], strict=False))
    for name in shown:
        r = configs[name].median_run()
        edges, running, sd = timeline(r)
        label = (
            f"{name} ({r.stats.wall_seconds:.1f} s raw; {1 / configs[name].rel:.2f}x plain, drift-corrected)"
        )
        line = np.maximum(np.append(running, running[-1:]), 1)
        axes[0].step(edges, line, where="post", color=colors[name], label=label, lw=1.4)
        for i in np.nonzero(sd)[0] if name in ("adaptive", best_fixed) else ():
            axes[0].axvspan(edges[i], edges[i + 1], color=colors[name], alpha=0.12, lw=0)
    axes[0].set_yscale("log", base=2)
    axes[0].set_ylabel("running rows (log2)")
    axes[0].legend(fontsize=8, loc="upper right")
    axes[0].set_title(f"{title}\nshaded: SD on (adaptive, {best_fixed})", fontsize=9)
    for ax, name in zip(axes[1:], ("adaptive", "sglang"), strict=True):
        if name not in configs:
            continue
        chunks = configs[name].median_run().stats.chunks
        starts = np.concatenate([[0.0], np.cumsum([c.seconds for c in chunks])])
        arms = sorted({c.mode for c in chunks}, key=lambda a: (a != "plain", a))
        for c, t0 in zip(chunks, starts, strict=False):
            ax.broken_barh([(t0, c.seconds)], (arms.index(c.mode) - 0.4, 0.8), color=colors[name])
        ax.set_yticks(range(len(arms)), arms)
        ax.set_ylabel(f"{name}: arm")
    axes[-1].set_xlabel(
        "decode seconds, raw (chunks only; prefill and host excluded; each run at its own drift)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--quick", action="store_true", help="8 prompts x 4, <= 384 tokens, 2 measured keys")
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
    add("--drafter", default=str(ROOT / "workdirs" / "drafter_tlt"), help="the EAGLE warm-up workdir")
    add("--random-drafter", action="store_true", help="untrained drafter (smoke test only)")
    add("--draft-vocab", default="auto", help="'auto' (the warm-up's), 'none' or a .npy file")
    add("--gguf", default=str(DEFAULT_GGUF_PATH))
    add("--task-offset", type=int, default=2000, help="first stream position (held out)")
    add("--seed", type=int, default=0)
    add("--allow-mismatch", action="store_true", help="report, not fail, on a real divergence")
    add("--out", default=str(ROOT / "workdirs" / "case_study"))
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    tlt = config_lib.load_config_file(ROOT / "configs" / "tlt.py")
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

    loaded = load_gguf(args.gguf)
    model = from_hf_tensors(loaded.config, loaded.tensors)
    drafter, dname, draft_vocab, vocab_note = load_drafter_or_exit(args, model)
    task = make_task(tlt.task)
    problems = task.batch(args.task_offset, num_prompts)[0]
    prompts = [loaded.tokenizer.encode_chat(task.messages(p)) for p in problems]
    sizes = ("max_cache_len", "chunk_steps", "min_cache_bucket", "prompt_bucket")  # configs/tlt.py's engine
    ecfg = EngineConfig(max_new_tokens=new, **{k: ro[k] for k in sizes})
    eos, sp = list(loaded.tokenizer.eos_token_ids), SamplingParams(temperature=float(ro.temperature))
    plain_engine = RolloutEngine(model, ecfg, eos_ids=eos)
    sd_engine = RolloutEngine(model, ecfg, eos_ids=eos, drafter=drafter, draft_vocab=draft_vocab)
    modes = [
        sd_engine.add_mode(*(("ngram", a[6:]) if a.startswith("ngram_") else ("eagle", a))) for a in arms
    ]
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores; SmolLM2-135M fp32; "
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


def report(args: argparse.Namespace, configs: dict[str, Config], info: dict[str, Any]) -> None:
    """The table, the explanation lines, the PNG and the RESULT line. Ratios over several measured keys are
    geometric means of each key's; the table's seconds, accept, SD share and arms are key 0's median run."""
    new, flips, diverged, t_start = info["new"], info["flips"], info["diverged"], info["t_start"]
    keys = sorted(set(configs["plain"].key_of))
    fixed = {k: c for k, c in configs.items() if "@thr" in k}
    best_fixed = min(fixed, key=lambda k: fixed[k].rel)  # ONE strategy for every key, chosen in hindsight
    print(
        f"\n{'configuration':>18} {'rollout s':>9} {'decode s':>8} {'vs plain':>8} {'accept':>6} "
        f"{'cpu vs':>6} {'SD share':>8} {'chunks':>6} {'untimed':>7}  per key vs plain; arms chosen (chunks)"
    )
    for name, c in configs.items():
        r = c.median_run()
        used = sorted(Counter(ch.mode for ch in r.stats.chunks).items())
        arms = ", ".join(f"{a} {k}" for a, k in used) if c.policy is not None else ""
        flag = "  COMPILED WHILE TIMED" if c.compiled_in_timed else ""
        print(
            f"{name:>18} {r.stats.wall_seconds:>9.2f} {r.stats.decode_seconds:>8.2f} {1 / c.rel:>7.2f}x "
            f"{r.stats.mean_accept_length:>6.2f} {1 / c.rel_cpu:>5.2f}x {sd_share(r):>8.2f} "
            f"{len(r.stats.chunks):>6} {c.untimed:>7}  "
            f"{'/'.join(f'{1 / c.rel_key(j):.2f}' for j in keys)}; {arms}{flag}"
        )
    for name in ("sglang", "adaptive"):  # what each selector has learned: median reward, plays
        m = configs[name].policy.policy.summary()
        rewards = [k for k in m if k.endswith("/reward")]
        text = [
            f"{k.split('/')[1]} {k.split('/')[2]} {m[k]:.0f} ({m[k[:-6] + 'count']:.0f})" for k in rewards
        ]
        print(
            f"{name} per bucket b0.. (<= {args.buckets}, rest), arm: median tok/s (chunks): {', '.join(text)}"
        )
    for name, c in fixed.items():
        if sd_share(c.median_run()) == 0.0:
            print(
                f"{name}: never reached <= {args.threshold} running rows, so it decoded exactly as plain "
                "(same programs, same tokens): its ratio to plain is timing noise, not a speedup"
            )
    bounds = []
    for j in keys:  # the tail differs from key to key: lengths, where SD could pay, the bound
        plain = configs["plain"].median_run(j)
        runs = [r for c in configs.values() for r in c.of_key(c.runs, j)]
        bound, best_b = oracle_bound(plain, runs)
        bounds.append(bound)
        tail = plain.stats.seconds_at_running(args.threshold) / max(plain.stats.decode_seconds, 1e-9)
        lens = plain.lengths
        best = ", ".join(f"b{b} {x:.2f}x ({m})" for b, (x, m) in sorted(best_b.items())) or "SD never ran"
        key_best = min(fixed, key=lambda k: fixed[k].rel_key(j))
        print(
            f"key {j}: response lengths p50 {np.median(lens):.0f}, p90 {np.percentile(lens, 90):.0f}, max "
            f"{lens.max()}; {int(np.sum(lens >= new))} rows at the {new}-token cap; {tail:.0%} of plain's "
            f"decode time at <= {args.threshold} running rows; best SD speedup per batch bucket (SD chunks "
            f"vs plain): {best}; bound {bound:.2f}x; best fixed for this key {key_best} "
            f"{1 / fixed[key_best].rel_key(j):.2f}x; adaptive {1 / configs['adaptive'].rel_key(j):.2f}x"
        )
    print(
        f"same tokens as plain in every rollout: {'yes' if not flips + diverged else 'no'} (coupled "
        f"verification); {flips} sequences differ by a float-rounding flip, {diverged} diverge for real"
    )
    print(PAPER)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(
        configs,
        best_fixed,
        out / "case_study.png",
        f"{info['title']}, SmolLM2-135M ({jax.devices()[0].platform})",
    )
    print(f"plot: {out / 'case_study.png'}; wall {time.perf_counter() - t_start:.0f} s")
    if diverged and not args.allow_mismatch:
        sys.exit(
            "error: SD changed sampled tokens beyond rounding (coupled verification must not): see above"
        )
    rel = lambda k: configs[k].rel  # noqa: E731
    per_key = lambda a, b: [configs[b].rel_key(j) / configs[a].rel_key(j) for j in keys]  # noqa: E731
    res: dict[str, object] = {
        "keys": len(keys),
        "adaptive_vs_plain": rel("plain") / rel("adaptive"),
        "adaptive_vs_best_fixed": rel(best_fixed) / rel("adaptive"),
        "adaptive_vs_plain_min": min(per_key("adaptive", "plain")),
        "adaptive_vs_plain_max": max(per_key("adaptive", "plain")),
        "adaptive_vs_best_fixed_min": min(per_key("adaptive", best_fixed)),
        "adaptive_vs_best_fixed_max": max(per_key("adaptive", best_fixed)),
        "adaptive_vs_ema": rel("sglang") / rel("adaptive"),
        "adaptive_vs_plain_cpu": configs["plain"].rel_cpu / configs["adaptive"].rel_cpu,
        "best_fixed": best_fixed,
        "best_fixed_vs_plain": rel("plain") / rel(best_fixed),
        "sglang_vs_plain": rel("plain") / rel("sglang"),
        "oracle_bound": geomean(bounds),
        "best_fixed_accept": fixed[best_fixed].median_run().stats.mean_accept_length,
        "best_fixed_sd_share": sd_share(fixed[best_fixed].median_run()),
        "adaptive_sd_share": sd_share(configs["adaptive"].median_run()),
        "same_tokens": int(not flips + diverged),
        "flips": flips,
    }
    if "adaptive_fresh" in configs:
        res["fresh_vs_plain"] = rel("plain") / rel("adaptive_fresh")
    res |= {f"{k.split('@')[0]}_vs_plain": rel("plain") / rel(k) for k in fixed}
    res["wall_s"] = time.perf_counter() - t_start
    print(
        "RESULT " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items())
    )


if __name__ == "__main__":
    main()
