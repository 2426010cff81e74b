"""The history drafter on revisited prompts: accepted tokens per round by epoch, host cost, the tail's speed.

    python -m experiments.models.history_drafter --quick   # 2 prompts x 4, 3 epochs, 128 new tokens
    python -m experiments.models.history_drafter           # 4 prompts x 4, 4 epochs, 256 new tokens

RL revisits every prompt once an epoch. SmolLM2 (configs/tlt.py's model, chain_sum task, temperature 0.9)
answers the same `--prompts` problems `--n` times in each of `--epochs` epochs (a fresh sampling key per
epoch; the policy is frozen, so this is the best case for a drafter that remembers: an RL policy moves a
little between epochs). Four arms per epoch, every one with the epoch's key: plain, and SD at one strategy
(`--strategy`, a chain by default) with the n-gram drafter (prompt + the row's own text + siblings), the
history drafter (tlt_jax/rollout/history.py: the prompt, the group's finished siblings and every earlier
epoch's responses) and the EAGLE drafter (the warmed one in `--drafter` if present, else an untrained one:
the line says which). Coupled verification makes every arm emit the same tokens as plain (checked:
`tokens_identical`), so the arms differ only in how many tokens a round accepts and what a round costs. SD
turns on at `--threshold` running rows, as in the RL config (the tail). The history drafter has its own
engine, fed by its own rollouts only (epoch 1: nothing but the prompt and finished siblings).

Per arm and epoch: accepted tokens per verify round (row-rounds), the round's wall time (a chunk's seconds
over its rounds: the host's drafting included for history, whose rounds are one device call each) and the
history drafter's host drafting time per round; the tail's speed (tokens per second of the chunks that start
at <= threshold running rows, compiled chunks left out) against plain's. Then the PROJECTION to Qwen2.5-7B
on the H100 of the repository's GPU run (experiments/models/project_sd.py's roofline at the measured
bandwidth and bf16 peak; cache bucket `--cache`): speedup = accept x plain step / round, a round = the target
pass over TV tokens (+ the EAGLE drafter's passes; + the measured host drafting for history, as it is serial
with the device here), at the tail's mean running rows.

Final line: `RESULT history_e1=.. history_e2=.. ... ngram_e1=.. eagle_e1=.. (accepted tokens per round by
epoch) history_host_ms=.. (per round) history_tail_x=.. ngram_tail_x=.. eagle_tail_x=.. (tail speed / plain)
proj7b_history=.. proj7b_ngram=.. proj7b_eagle=.. <arm>_rows_equal_plain=..` (the share of rows whose
tokens equal plain's); `history_drafter.png` in --out.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from experiments.lib import harness as h

ARMS = ("plain", "ngram", "history", "eagle")


def _engines(args: Any, model: Any, loaded: Any, cfg: Any) -> tuple[dict[str, Any], dict[str, str], str]:
    """(engine per arm, mode per arm, the EAGLE drafter's description): one engine for plain, n-gram and
    EAGLE, one for history (its store sees only its own rollouts)."""
    from tlt_jax.drafter.warmup import init_drafter
    from tlt_jax.rl.speculation import has_drafter
    from tlt_jax.rollout.engine import RolloutEngine

    ecfg = h.rl_engine_config(cfg.rollout, args.max_new)
    eos = list(loaded.tokenizer.eos_token_ids)
    if has_drafter(args.drafter):
        drafter, _, vocab, _ = h.load_drafter_or_exit(args, model)
        dname = f"warmed ({args.drafter})"
    else:
        drafter, vocab, dname = init_drafter(model, 0), None, "UNTRAINED (no warmed drafter at --drafter)"
    main = RolloutEngine(model, ecfg, eos_ids=eos, drafter=drafter, draft_vocab=vocab)
    hist = RolloutEngine(model, ecfg, eos_ids=eos)
    modes = {
        "plain": "plain",
        "ngram": main.add_mode("ngram", args.strategy),
        "history": hist.add_mode("history", args.strategy),
        "eagle": main.add_mode("eagle", args.strategy),
    }
    return {"plain": main, "ngram": main, "history": hist, "eagle": main}, modes, dname


def _arm_stats(out: Any, threshold: int) -> dict[str, float]:
    """Accepted tokens per round, seconds per round, tail tokens and seconds of one rollout."""
    sd = [c for c in out.stats.chunks if c.mode != "plain"]
    rounds = sum(c.verify_rounds for c in sd)
    steps = sum(c.steps for c in sd if not c.compiled)
    tail = [c for c in out.stats.chunks if c.running_start <= threshold and not c.compiled]
    return {
        "accepted": float(sum(c.accepted_tokens for c in sd)),
        "rounds": float(rounds),
        "round_s": sum(c.seconds for c in sd if not c.compiled),
        "round_steps": float(steps),
        "tail_tokens": float(sum(c.new_tokens for c in tail)),
        "tail_s": sum(c.seconds for c in tail),
        "tail_rows": float(sum(c.running_start * c.steps for c in sd)) / max(sum(c.steps for c in sd), 1),
    }


def run_epochs(args: Any) -> tuple[dict[str, list[dict[str, float]]], dict[str, Any]]:
    """Every arm in every epoch; returns per-arm per-epoch stats and run facts."""
    import jax

    from tlt_jax.rollout.hooks import FixedMode, ThresholdPolicy
    from tlt_jax.rollout.sampling import SamplingParams
    from tlt_jax.tasks import make_task

    cfg = h.load_config(h.TLT_CONFIG)
    loaded, model = h.load_target(args.gguf, "float32")
    task = make_task(cfg.task.to_dict())
    _, prompts = h.task_prompts(task, loaded.tokenizer, 0, args.prompts)
    engines, modes, dname = _engines(args, model, loaded, cfg)
    sp = SamplingParams(temperature=cfg.rollout.temperature)
    stats: dict[str, list[dict[str, float]]] = {a: [] for a in ARMS}
    same_rows, hist_host = {a: [] for a in ARMS[1:]}, []
    for e in range(args.epochs):
        key = jax.random.fold_in(jax.random.key(args.seed), e)
        outs = {}
        for arm in ARMS:
            hook = FixedMode("plain") if arm == "plain" else ThresholdPolicy(modes[arm], args.threshold, 0)
            outs[arm] = engines[arm].generate(prompts, n=args.n, key=key, sampling=sp, hooks=hook)
            stats[arm].append(_arm_stats(outs[arm], args.threshold))
        st = engines["history"].history.take_stats()
        hist_host.append(st.draft_seconds / max(stats["history"][-1]["round_steps"], 1))
        for arm in ARMS[1:]:  # coupled: every row equal to plain's (a float32 verify pass and a decode step
            # may round a logit apart; tests/rollout/test_engine_sd.py allows 1e-3 of rows at 4,096 samples)
            same_rows[arm].append(float((outs[arm].tokens == outs["plain"].tokens).all(axis=1).mean()))
        line = " ".join(
            f"{a} {s[-1]['accepted'] / max(s[-1]['rounds'], 1):.2f}" for a, s in stats.items() if a != "plain"
        )
        lens = outs["plain"].lengths
        print(
            f"epoch {e + 1}: accepted tokens per round: {line}; history: "
            f"{st.match_tokens / max(st.rounds, 1):.1f} matched tokens, "
            f"{hist_host[-1] * 1e3:.2f} ms host drafting per round, store "
            f"{engines['history'].history.metrics()['history/host_mib']:.2f} MiB; lengths p50 "
            f"{np.median(lens):.0f} max {lens.max()}",
            flush=True,
        )
    facts = {"drafter": dname, "same_rows": same_rows, "host_s": hist_host, "tokens": float(lens.sum())}
    return stats, facts


def project_7b(
    stats: dict[str, list[dict[str, float]]], facts: dict[str, Any], args: Any
) -> dict[str, float]:
    """The PROJECTION: Qwen2.5-7B on the GPU run's H100, per arm, at the tail's mean running rows."""
    from experiments.models.project_sd import GPU_RUN, load_gpu_run
    from experiments.models.roofline import QWEN2_5_7B, Roofline
    from tlt_jax.rollout.strategy import Strategy

    gpu = load_gpu_run(GPU_RUN)
    roof = Roofline(QWEN2_5_7B, gpu["bw"][1], gpu["flops"])
    s = Strategy.parse(args.strategy)
    tv, cache = s.tokens_to_verify, args.cache
    out = {}
    for arm in ARMS[1:]:
        last = stats[arm][-1]  # the last epoch: the history drafter at its fullest
        accept = last["accepted"] / max(last["rounds"], 1)
        b = max(1, round(last["tail_rows"]))
        round_s = roof.forward(b, tv, cache)
        if arm == "eagle":  # the drafter's passes (model-free drafters have none)
            round_s += roof.draft(b, s.max_depth, s.topk)
        if arm == "history":
            round_s += facts["host_s"][-1]
        out[f"proj7b_{arm}"] = accept * roof.plain(b, cache) / round_s
        print(
            f"PROJECTION {arm:>8}: batch {b}, accept {accept:.2f}, 7B round {round_s * 1e3:.2f} ms vs plain "
            f"step {roof.plain(b, cache) * 1e3:.2f} ms -> {out[f'proj7b_{arm}']:.2f}x"
        )
    return out


def plot(stats: dict[str, list[dict[str, float]]], tail_x: dict[str, float], path: Any) -> None:
    plt = h.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for arm in ARMS[1:]:
        ys = [s["accepted"] / max(s["rounds"], 1) for s in stats[arm]]
        a.plot(range(1, len(ys) + 1), ys, marker="o", label=arm)
    a.set_xlabel("epoch (same prompts, fresh samples)")
    a.set_ylabel("accepted tokens per round")
    a.set_title("acceptance by epoch")
    a.legend()
    arms = list(tail_x)
    b.bar(arms, [tail_x[x] for x in arms])
    b.axhline(1.0, color="k", lw=0.8)
    b.set_ylabel("tail tokens/s vs plain")
    b.set_title("rollout speed at the tail's running rows (CPU)")
    h.save_plot(fig, path)


def main() -> None:
    ap = h.parser(__doc__, quick="2 prompts x 4, 3 epochs, 128 new tokens", out=None)
    h.add_model_args(ap)
    h.add_drafter_args(ap, h.ROOT / "workdirs" / "drafter_tlt")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--max-new", type=int, default=None)
    ap.add_argument("--strategy", default="3_1_4")
    ap.add_argument("--threshold", type=int, default=4, help="SD at <= this many running rows (the tail)")
    ap.add_argument("--cache", type=int, default=16384, help="the 7B projection's cache bucket")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.prompts = args.prompts or (2 if args.quick else 4)
    args.epochs = args.epochs or (3 if args.quick else 4)
    args.max_new = args.max_new or (128 if args.quick else 256)
    out = h.out_dir(args, "history_drafter")
    print(h.device_line(), f"load average {os.getloadavg()[0]:.2f}", flush=True)
    t0 = time.perf_counter()
    stats, facts = run_epochs(args)
    print(f"EAGLE drafter: {facts['drafter']}; {args.prompts} prompts x {args.n}, {args.epochs} epochs")
    res: dict[str, Any] = {}
    for arm in ARMS[1:]:
        for e, s in enumerate(stats[arm]):
            res[f"{arm}_e{e + 1}"] = s["accepted"] / max(s["rounds"], 1)
    res["history_host_ms"] = 1e3 * float(np.mean(facts["host_s"]))
    for arm in ARMS[1:]:
        r = sum(s["round_s"] for s in stats[arm]) / max(sum(s["round_steps"] for s in stats[arm]), 1)
        res[f"{arm}_round_ms"] = 1e3 * r
    speed = {
        a: sum(s["tail_tokens"] for s in st) / max(sum(s["tail_s"] for s in st), 1e-9)
        for a, st in stats.items()
    }
    tail_x = {a: speed[a] / speed["plain"] for a in ARMS[1:]}
    for a, x in tail_x.items():
        res[f"{a}_tail_x"] = x
    res.update(project_7b(stats, facts, args))
    plot(stats, tail_x, out / "history_drafter.png")
    for arm, fr in facts["same_rows"].items():
        res[f"{arm}_rows_equal_plain"] = float(np.mean(fr))
    print(
        f"load average {os.getloadavg()[0]:.2f}; {time.perf_counter() - t0:.0f} s; "
        f"plot {out / 'history_drafter.png'}"
    )
    h.result(res, args, fmt=".3f", formats={"history_host_ms": ".3f"})


if __name__ == "__main__":
    main()
