"""The tree's top-k (paper Table 1): accepted tokens per round and decode speed of EAGLE trees as top-k grows.

    python -m experiments.paper.tree_topk --quick                               # tiny random target (smoke)
    python -m experiments.paper.tree_topk --drafter workdirs/drafter_tlt        # SmolLM2 + a warmed drafter
    python -m experiments.paper.tree_topk --drafter DIR --depth 6 --verify 32 --topk 1,2,4,6,8

One engine (the warmed drafter of --drafter: EAGLE-1 or EAGLE-3, whichever its checkpoint holds) decodes the
same greedy prompts (configs/tlt.py's task, batch 1, as the paper's Table 1) once per strategy
`depth_k_verify` for each k of --topk, plus plain decoding. Per k: the mean accepted tokens per verify round
and tokens/s against plain's (each strategy's programs compiled by a first untimed call). Greedy SD equals
plain decoding token for token, which the script checks.

Published (Table 1, Qwen-32B, depth 12 / verify 64): acceptance 8.29 - 8.67 over top-k 4..16, speedup 3.47 -
3.65x, best k 6 - 10. On this CPU a verify round's cost grows with the tree (docs/benchmarks.md), so the best
k for speed can be smaller than the best for acceptance: both are reported.

Final line: `RESULT best_topk=<k by tokens/s> best_topk_accept=<k by acceptance> accept_k<k>=..
speedup_k<k>=..`; a PNG of both against k.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from experiments.lib import harness as h


def _setup(args: Any) -> tuple[Any, Any, Any, list[list[int]], list[int]]:
    """(target, drafter, draft vocabulary, prompts, eos ids)."""
    if args.quick:
        from flax import nnx

        from tlt_jax.drafter.warmup import init_drafter
        from tlt_jax.models.config import tiny_config
        from tlt_jax.models.llama import Transformer

        target = Transformer(tiny_config(vocab_size=64), nnx.Rngs(0))
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 64, size=8).tolist() for _ in range(args.prompts)]
        return target, init_drafter(target, 0), None, prompts, []
    from tlt_jax.tasks import make_task

    loaded, target = h.load_target(args.gguf, "float32")
    args.seed, args.random_drafter, args.draft_vocab = 0, False, "auto"
    drafter, _, vocab, note = h.load_drafter_or_exit(args, target)
    print(f"drafter {args.drafter} ({getattr(drafter, 'arch', 'eagle')}, {note})")
    task = make_task(h.load_config().task)
    _, prompts = h.task_prompts(task, loaded.tokenizer, 10_000, args.prompts)
    return target, drafter, vocab, prompts, list(loaded.tokenizer.eos_token_ids)


def _timed(engine: Any, prompts: list[list[int]], mode: str) -> tuple[Any, float]:
    from tlt_jax.rollout.hooks import FixedMode
    from tlt_jax.rollout.sampling import SamplingParams

    run = lambda: engine.generate(  # noqa: E731
        prompts, n=1, key=__import__("jax").random.key(0), sampling=SamplingParams(0.0), hooks=FixedMode(mode)
    )
    run()  # compiles this strategy's programs
    t0 = time.perf_counter()
    out = run()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = h.parser(__doc__, quick="a tiny random target and drafter (smoke: acceptance is meaningless)")
    h.add_model_args(ap)
    ap.add_argument("--drafter", default="workdirs/drafter_tlt", help="a warm-up workdir (or its drafter/)")
    ap.add_argument("--topk", default="1,2,4,6,8", help="the top-k values")
    ap.add_argument("--depth", type=int, default=None, help="draft depth (default 6; 3 quick)")
    ap.add_argument("--verify", type=int, default=None, help="tokens to verify (default 16; 8 quick)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=None, help="new tokens per prompt (default 128; 24 quick)")
    args = ap.parse_args()
    out = h.out_dir(args, "tree_topk")
    depth = args.depth or (3 if args.quick else 6)
    verify = args.verify or (8 if args.quick else 16)
    max_new = args.max_new or (24 if args.quick else 128)
    target, drafter, vocab, prompts, eos = _setup(args)
    from tlt_jax.rollout.engine import RolloutEngine
    from tlt_jax.rollout.interface import EngineConfig

    ecfg = EngineConfig(max_new_tokens=max_new, max_cache_len=512 if not args.quick else 64, chunk_steps=8)
    engine = RolloutEngine(target, ecfg, eos_ids=eos, drafter=drafter, draft_vocab=vocab)
    plain, plain_s = _timed(engine, prompts, "plain")
    plain_tps = float(np.sum(plain.lengths)) / plain_s
    ks = [k for k in h.ints(args.topk) if 1 + k * depth >= verify or k == 1]
    if left := sorted(set(h.ints(args.topk)) - set(ks)):  # every tree but the chain verifies `verify` tokens
        print(
            f"top-k {left} left out: a depth-{depth} tree with 1 + k x {depth} < {verify} nodes cannot fill "
            f"the {verify} tokens every tree here verifies"
        )
    accept, speed = {}, {}
    for k in ks:
        mode = engine.add_mode("eagle", f"{depth}_{k}_{min(verify, 1 + k * depth)}")
        res, secs = _timed(engine, prompts, mode)
        if not (res.tokens == plain.tokens).all():
            raise SystemExit(f"top-k {k}: greedy SD differs from plain decoding")
        accept[k] = float(res.stats.mean_accept_length)
        speed[k] = float(np.sum(res.lengths)) / secs / plain_tps
        print(f"top-k {k}: accepted {accept[k]:.3f} per round, {speed[k]:.2f}x plain ({plain_tps:.1f} tok/s)")
    plot(ks, accept, speed, out / "tree_topk.png")
    values: dict[str, Any] = {
        "best_topk": max(ks, key=lambda k: speed[k]),
        "best_topk_accept": max(ks, key=lambda k: accept[k]),
    }
    values.update({f"accept_k{k}": accept[k] for k in ks})
    values.update({f"speedup_k{k}": speed[k] for k in ks})
    print(f"plot: {out / 'tree_topk.png'}")
    h.result(values, args)


def plot(ks: list[int], accept: dict[int, float], speed: dict[int, float], path: Any) -> None:
    fig, ax = h.pyplot().subplots(figsize=(6, 4))
    ax.plot(ks, [accept[k] for k in ks], marker="o", label="accepted tokens / round")
    ax2 = ax.twinx()
    ax2.plot(ks, [speed[k] for k in ks], marker="s", color="tab:orange", label="speed vs plain")
    ax.set_xlabel("tree top-k")
    ax.set_ylabel("accepted tokens per round")
    ax2.set_ylabel("x plain decoding")
    ax.set_title("paper Table 1: 8.29-8.67 accepted, best k 6-10")
    h.save_plot(fig, path)


if __name__ == "__main__":
    main()
