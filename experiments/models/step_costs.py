"""What one decode step, verify round, prefill and chunk of host work cost on THIS machine: the inputs of
`experiments/models/simulate_rl.py`, measured with the engine's own programs.

For the RL config of each end-to-end arm (`configs/tlt.py:quick` with drafter none / ngram / eagle, as
`e2e_speedup.py` builds them):
  1. grid: `RolloutEngine.decode_chunk` (the rollout's own chunk programs) on a prefilled state of B rows,
     its cache resized to each cache bucket, EOS ignored so every step runs every row; seconds per step of
     plain decoding (the baseline's engine) and per verify round of the arm's speculative mode, for every
     (batch bucket, cache bucket) the rollout can meet. Configurations are interleaved round-robin over
     `--reps` rounds and the median kept, so a drift of the machine's speed hits all alike;
  2. rollouts: `--rollouts` real rollouts of the arm's engine and hooks (its threshold switch) on held-out
     prompts of the task (stream positions past the training run's): prefill seconds, host seconds per
     chunk and per rollout (what is neither prefill nor device chunks), and the speculative mode's accept
     length per batch bucket (tokens per row per verify round where the arm actually runs SD).
Compilation is excluded (an untimed first call per shape; the persistent compilation cache is on).

The JSON (`--out`, default workdirs/step_costs.json) is keyed so that other machines' or models' costs drop
in: `step_seconds` rows {mode, tv, batch, cache, seconds} (tv = 1 for plain), `arms.<arm>` {prefill,
chunk_overhead, rollout_overhead, threshold, modes.<mode> {accept, accept_by_batch, rounds}}, `engine`
(chunk_steps, buckets) and `meta` (machine, load average, model, when).

    python -m experiments.models.step_costs                  # arms none,ngram (+ eagle with a warmed drafter)
    python -m experiments.models.step_costs --arms none --reps 3 --rollouts 1 --out costs.json
Final line: `RESULT plain_b1_s=.. plain_b16_s=.. <mode>_round_b1_s=.. accept_<mode>=.. prefill_s=..`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import statistics
import time
from typing import Any

import jax
import numpy as np

from experiments.lib import harness as h
from tlt_jax import config_lib, config_schema
from tlt_jax.models.build import build_model_and_tokenizer
from tlt_jax.rl.speculation import resolve_drafter
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.ngram import NgramBank
from tlt_jax.rollout.programs import pow2_at_least
from tlt_jax.tasks import make_task
from tlt_jax.utils import compile_stats

ARM_ARGS = {  # as experiments/paper/e2e_speedup.py
    "none": "drafter=none,spot=off,bandit=off",
    "ngram": "drafter=ngram,spot=off,bandit=off",
    "eagle": "drafter=eagle,spot=off,bandit=off",
}
HELD_OUT = 4000  # task stream position of the rollouts' prompts (a quick training run reads from 0)


class Arm:
    """One arm's engines: `timing` ignores EOS (chunks run every step), `real` is the RL config's."""

    def __init__(self, name: str, config: Any, model: Any, tokenizer: Any):
        self.name, self.config = name, config
        drafter = resolve_drafter(config_schema.section(config, "drafter"), model.cfg)
        if name != "none" and drafter.kind != name:
            raise SystemExit(f"arm {name}: no {name} drafter ({drafter.note})")
        mesh = config_lib.build_mesh(config)
        kw = dict(mesh=mesh, tokenizer=tokenizer, drafter=drafter.drafter, draft_vocab=drafter.draft_vocab)
        ec = config_lib.engine_config_from(config, drafter.kind)
        self.timing = RolloutEngine(model, ec, eos_ids=[], **kw)
        self.real = RolloutEngine(model, ec, eos_ids=list(tokenizer.eos_token_ids), **kw)
        self.mode = self.real.spec_mode  # None for the baseline
        self.sampling = config_lib.sampling_from(config)


def time_chunk(
    eng: RolloutEngine,
    mode: str,
    batch: int,
    cache: int,
    prompt: list[int],
    sampling: Any,
    bank: tuple[int, int] | None,
    seed: int,
) -> float:
    """Seconds per step of one `mode` chunk of `batch` rows at cache bucket `cache`: a fresh prefill of
    `prompt` (the task's length, so the state has the rollout's shapes), EOS ignored (`eng` has none), no
    early exit; `bank` = (sequences, group size) of the rollout's n-gram bank; nan when the call compiled."""
    per_step = 1 if mode == "plain" else eng.modes[mode].tokens_per_step
    lookahead = 1 if mode == "plain" else eng.modes[mode].lookahead
    max_new = eng.config.max_new_tokens
    # the scheduler's rule: the chunk's growth, at most the rows' budget, plus the round's lookahead
    if len(prompt) + min(eng.config.chunk_steps * per_step, max_new) + lookahead > cache:
        raise ValueError(f"cache {cache} holds no {mode} chunk after a {len(prompt)}-token prompt")
    state, _ = eng.prefill(
        [prompt] * batch, n=1, key=jax.random.key(seed), sampling=sampling, max_new_tokens=max_new
    )
    if state.done.shape[0] != batch:
        raise ValueError(f"batch {batch} is not a bucket of this engine ({state.done.shape[0]})")
    if state.cache.capacity != cache:
        state = eng.resize_cache(state, cache)
    # dispatch is asynchronous: without this the prefill's (and resize's) device time lands in the chunk's
    # seconds (measured: +40-60% per step at batch 1 over 16 steps here)
    state = jax.block_until_ready(state)
    ngram = None
    if eng.needs()[1]:
        ngram = jax.device_put(NgramBank.empty(bank[0], bank[1], max_new), eng.replicated)
    _, rec, _, _ = eng.decode_chunk(state, mode, sampling, ngram, -1)
    return float("nan") if rec.compiled else rec.seconds / max(rec.steps, 1)


def interleaved(
    configs: list[tuple[RolloutEngine, str, int, int]], prompt: list[int], sampling: Any, bank: Any, reps: int
) -> list[dict[str, Any]]:
    """Median seconds per step over `reps` round-robin rounds of every (engine, mode, batch, cache) that
    fits (an untimed first call compiles each); rows {mode, tv, batch, cache, seconds, reps}."""
    fits = []
    for cfg in configs:
        try:
            time_chunk(*cfg, prompt, sampling, bank, 0)
            fits.append(cfg)
        except ValueError as e:
            print(f"  skip {cfg[1]} b{cfg[2]} c{cfg[3]}: {e}")
    samples: dict[tuple, list[float]] = {k: [] for k in fits}
    for r in range(reps):
        for k in fits:
            s = time_chunk(*k, prompt, sampling, bank, r + 1)
            if s == s:
                samples[k].append(s)
    rows = []
    for (eng, mode, b, c), xs in samples.items():
        tv = 1 if mode == "plain" else eng.modes[mode].strategy.tokens_to_verify
        rows.append(dict(mode=mode, tv=tv, batch=b, cache=c, seconds=statistics.median(xs), reps=len(xs)))
        print(f"  {mode:>12} b{b:<3} cache {c:<5} {1e3 * rows[-1]['seconds']:8.2f} ms/step  ({len(xs)} reps)")
    return rows


def task_prompts(config: Any, tokenizer: Any, start: int, count: int) -> list[list[int]]:
    """`count` chat-encoded prompts of the config's task from stream position `start`."""
    task = make_task(config.task)
    problems, _ = task.batch(start, count)
    return [tokenizer.encode_chat(task.messages(p)) for p in problems]


def measure_grid(
    arms: dict[str, Arm], batches: list[int], caches: list[int], sd_batches: list[int], reps: int
) -> list[dict[str, Any]]:
    """Plain steps (the baseline's engine) at every (batch, cache) and each arm's speculative rounds at
    `sd_batches`, interleaved (`interleaved`), on a median-length prompt of the task."""
    base = arms.get("none") or next(iter(arms.values()))
    prompts = task_prompts(base.config, base.real.tokenizer, HELD_OUT, 8)
    prompt = sorted(prompts, key=len)[len(prompts) // 2]
    configs = [(base.timing, "plain", b, c) for b in batches for c in caches]
    for arm in arms.values():
        if arm.mode is not None:
            configs += [(arm.timing, arm.mode, b, c) for b in sd_batches for c in caches]
    n = int(base.config.rl.samples_per_prompt)
    bank = (int(base.config.rl.prompts_per_step) * n, n)  # the rollout's bank: every sequence, its groups
    return interleaved(configs, prompt, base.sampling, bank, reps)


def measure_rollouts(arm: Arm, count: int, seed: int) -> dict[str, Any]:
    """Prefill, host overhead and accept length from `count` real rollouts of the arm's RL shape."""
    cfg = arm.config
    per, n = int(cfg.rl.prompts_per_step), int(cfg.rl.samples_per_prompt)
    prefill, host, chunks, other = [], [], 0, []
    emitted: dict[int, list[int]] = {}
    i = 0
    while len(prefill) < count and i < 2 * count + 2:  # rollouts that compiled something are not timed
        prompts = task_prompts(cfg, arm.real.tokenizer, HELD_OUT + (i + 1) * per, per)
        c0 = arm.real.programs.compile_seconds
        rollout = arm.real.generate(prompts, n=n, key=jax.random.key(seed + i), sampling=arm.sampling)
        st, i = rollout.stats, i + 1
        if arm.real.programs.compile_seconds > c0:
            print(f"  {arm.name}: rollout {i} compiled programs (untimed)", flush=True)
            continue
        ph = st.phase_seconds
        prefill.append(ph.get("prefill", 0.0))
        host.append(ph.get("host", 0.0))
        chunks += len(st.chunks)
        device = sum(c.seconds for c in st.chunks)
        other.append(st.wall_seconds - ph.get("prefill", 0.0) - ph.get("host", 0.0) - device)
        for c in st.chunks:
            if c.mode != "plain":
                e = emitted.setdefault(c.batch_bucket, [0, 0])
                e[0] += c.accepted_tokens
                e[1] += c.verify_rounds
    runs = max(len(prefill), 1)
    out = {
        "prefill": float(np.median(prefill)) if prefill else float("nan"),
        "chunk_overhead": sum(host) / max(chunks, 1),
        "rollout_overhead": float(np.median(other)) if other else 0.0,
        "threshold": int(cfg.spec.threshold),
        "policy": "threshold" if cfg.bandit.algorithm == "off" else "best",
        "rollouts": runs,
        "modes": {},
    }
    if arm.mode is not None:
        acc, rounds = sum(e[0] for e in emitted.values()), sum(e[1] for e in emitted.values())
        out["modes"][arm.mode] = {
            "accept": acc / rounds if rounds else float("nan"),
            "accept_by_batch": {str(b): e[0] / e[1] for b, e in sorted(emitted.items()) if e[1]},
            "rounds": rounds,
        }
    return out


def bench_shapes(args: argparse.Namespace) -> dict[str, Any]:
    """Plain steps and verify rounds at bench_sd.py's shapes (its engine config, TV -> strategy mapping,
    prompts, n-gram strategy), for `project_sd.py`'s CPU validation: same JSON rows, plus `columns`
    (bench_sd's column -> mode and TV)."""
    from experiments.models.roofline import strategy_for
    from tlt_jax.drafter.draft_vocab import load_draft_vocab
    from tlt_jax.drafter.warmup import init_drafter, load_drafter
    from tlt_jax.models.loading import DEFAULT_GGUF_PATH
    from tlt_jax.rollout.interface import EngineConfig
    from tlt_jax.rollout.sampling import SamplingParams
    from tlt_jax.rollout.strategy import Strategy
    from tlt_jax.tasks.datasets import ReasoningGymTask

    loaded, model = h.load_target(DEFAULT_GGUF_PATH)
    tok = loaded.tokenizer
    batches = [int(b) for b in (args.batches or "1").split(",")]
    task = ReasoningGymTask("chain_sum", size=5000, seed=0, dataset_kwargs={})
    # bench_sd's prompts (its cache bucket)
    _, prompts = h.task_prompts(task, tok, 2000, max(args.prompts, max(batches)))
    prompt = sorted(prompts, key=len)[len(prompts) // 2]
    cols = {f"tv{tv}": Strategy(*strategy_for(tv), tv).name for tv in map(int, args.tv.split(","))}
    ahead = max([Strategy.parse(s).lookahead for s in cols.values()] + [Strategy.parse(args.ngram).lookahead])
    cache = 1 << math.ceil(math.log2(max(map(len, prompts)) + args.new + ahead + 1))
    ecfg = EngineConfig(max_new_tokens=args.new, max_cache_len=cache, min_cache_bucket=cache, chunk_steps=16)
    if args.drafter:
        drafter, vocab = load_drafter(args.drafter, model.cfg), load_draft_vocab(args.drafter)
    else:
        drafter, vocab = init_drafter(model, args.seed), None
    plain, sd = h.engine_pair(model, ecfg, [], drafter, vocab)
    ng = RolloutEngine(model, ecfg, eos_ids=[])
    columns = {
        c: dict(mode=sd.add_mode("eagle", s), tv=Strategy.parse(s).tokens_to_verify) for c, s in cols.items()
    }
    columns["ngram"] = dict(
        mode=ng.add_mode("ngram", args.ngram), tv=Strategy.parse(args.ngram).tokens_to_verify
    )
    configs = [(plain, "plain", b, cache) for b in batches]
    configs += [(sd, c["mode"], b, cache) for c in columns.values() if c["mode"] in sd.modes for b in batches]
    configs += [(ng, columns["ngram"]["mode"], 1, cache)]
    print(
        f"bench_sd shapes: cache {cache}, prompt {len(prompt)} tokens, <= {args.new} new, batches {batches}"
    )
    rows = interleaved(configs, prompt, SamplingParams(temperature=0.9), (1, 1), args.reps)  # n-gram: batch 1
    return dict(step_seconds=rows, columns=columns, engine=dict(cache=cache, new=args.new))


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = h.parser(
        __doc__,
        quick=None,
        out=h.ROOT / "workdirs" / "step_costs.json",
        out_help="the costs JSON (default workdirs/step_costs.json)",
    )
    ap.add_argument("--config", default=str(h.TLT_CONFIG))
    ap.add_argument("--config-arg", default="quick", help="appended to every arm's config args")
    ap.add_argument("--arms", default=None, help="default none,ngram (+ eagle when a warmed drafter exists)")
    ap.add_argument("--batches", default=None, help="plain batch buckets (default 1..rows per step)")
    ap.add_argument("--sd-batches", default=None, help="SD batch buckets (default up to 2x the threshold)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rollouts", type=int, default=2, help="timed real rollouts per arm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--bench-shapes",
        action="store_true",
        help="instead: bench_sd.py's shapes (--batches, --tv, --ngram, --new, --drafter; random drafter "
        "without one) for project_sd.py --cpu-costs",
    )
    ap.add_argument("--tv", default="3,4,8,16", help="--bench-shapes: bench_sd's TVs")
    ap.add_argument("--ngram", default="4_1_5", help="--bench-shapes: bench_sd's n-gram strategy")
    ap.add_argument("--new", type=int, default=64, help="--bench-shapes: bench_sd's --new")
    ap.add_argument("--drafter", default=None, help="--bench-shapes: a warm-up workdir (default random)")
    ap.add_argument("--prompts", type=int, default=4, help="--bench-shapes: bench_sd's --prompts")
    return ap.parse_args()


def rl_costs(args: argparse.Namespace, load0: tuple[float, ...]) -> tuple[dict[str, Any], dict[str, float]]:
    """The simulator's cost file for the e2e arms of `args.config` (see the module docstring), and the
    RESULT keys."""
    names = args.arms.split(",") if args.arms else ["none", "ngram"]
    configs = {a: h.load_config(args.config, f"{ARM_ARGS[a]},{args.config_arg}") for a in names}
    if args.arms is None:
        eagle = h.load_config(args.config, f"{ARM_ARGS['eagle']},{args.config_arg}")
        if pathlib.Path(eagle.drafter.path).is_dir():
            names.append("eagle")
            configs["eagle"] = eagle
    cfg = configs[names[0]]
    model, tok = build_model_and_tokenizer(cfg)
    arms = {a: Arm(a, configs[a], model, tok) for a in names}
    ro = cfg.rollout
    rows = int(cfg.rl.prompts_per_step) * int(cfg.rl.samples_per_prompt)
    cap = pow2_at_least(int(ro.max_cache_len))
    caches = [c for c in (1 << k for k in range(20)) if int(ro.min_cache_bucket) <= c <= cap]
    batches = [int(b) for b in args.batches.split(",")] if args.batches else _pow2_upto(rows)
    thr = max(int(c.spec.threshold) for c in configs.values())
    sd_batches = [int(b) for b in args.sd_batches.split(",")] if args.sd_batches else _pow2_upto(2 * thr)
    print(f"{h.device_line()}, load {load0}")
    print(f"grid: plain batches {batches}, SD batches {sd_batches}, caches {caches}, {args.reps} reps")
    grid = measure_grid(arms, batches, caches, sd_batches, args.reps)
    arm_costs = {}
    for a, arm in arms.items():
        arm_costs[a] = measure_rollouts(arm, args.rollouts, args.seed)
        print(f"  {a}: {json.dumps(arm_costs[a])}")
    out = {
        "meta": meta(load0, f"{args.config}:{args.config_arg}, model {cfg.model.path} ({cfg.model.dtype})"),
        "engine": {k: int(ro[k]) for k in ("chunk_steps", "min_cache_bucket", "max_cache_len")},
        "devices": int(cfg.mesh.data),
        "step_seconds": grid,
        "arms": arm_costs,
    }
    res = {f"plain_b{b}_s": _at(grid, "plain", b) for b in (batches[0], batches[-1])}
    for a, arm in arms.items():
        if arm.mode is not None:
            res[f"{arm.mode}_round_b1_s"] = _at(grid, arm.mode, sd_batches[0])
            res[f"accept_{arm.mode}"] = arm_costs[a]["modes"][arm.mode]["accept"]
    res["prefill_s"] = arm_costs[names[0]]["prefill"]
    return out, res


def main() -> None:
    """Measure, write the JSON, print the RESULT line."""
    args = parse_args()
    t0, load0 = time.perf_counter(), os.getloadavg()
    folder = compile_stats.resolve_cache_dir("auto")
    if folder:
        compile_stats.enable_persistent_cache(folder)
    if args.bench_shapes:
        out = bench_shapes(args)
        out["meta"] = meta(load0, "bench_sd shapes")
        res = {f"{r['mode']}_b{r['batch']}_ms": 1e3 * r["seconds"] for r in out["step_seconds"]}
    else:
        out, res = rl_costs(args, load0)
    path = write(args.out, out)
    res["wall_s"] = time.perf_counter() - t0
    print(f"wrote {path}; load average {os.getloadavg()}")
    h.result(res, args, fmt=".4g")


def meta(load0: tuple[float, ...], what: str) -> dict[str, Any]:
    """Where and when the costs were measured (the load average at the start and the end)."""
    return {
        "source": "measured (experiments/models/step_costs.py)",
        "what": what,
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "backend": jax.devices()[0].platform,
        "device": str(jax.devices()[0].device_kind),
        "load_average": [list(load0), list(os.getloadavg())],
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def write(out: str, data: dict[str, Any]) -> pathlib.Path:
    """`data` as JSON at `out` (folders created)."""
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


def _pow2_upto(n: int) -> list[int]:
    return [1 << k for k in range(int(np.log2(pow2_at_least(n))) + 1)]


def _at(grid: list[dict[str, Any]], mode: str, batch: int) -> float:
    """The step seconds of `mode` at `batch` and its smallest cache bucket."""
    rows = sorted((r for r in grid if r["mode"] == mode and r["batch"] == batch), key=lambda r: r["cache"])
    return rows[0]["seconds"] if rows else float("nan")


if __name__ == "__main__":
    main()
