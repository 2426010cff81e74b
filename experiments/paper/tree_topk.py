"""The tree's top-k (paper Table 1): accepted tokens per round and decode speed of EAGLE trees as top-k grows.

    python -m experiments.paper.tree_topk --quick                               # tiny random target (smoke)
    python -m experiments.paper.tree_topk --drafter workdirs/drafter_tlt        # SmolLM2 + a warmed drafter
    python -m experiments.paper.tree_topk --drafter DIR --depth 4,6,8 --verify 32 --topk 1,2,4,6,8

One engine (the warmed drafter of --drafter: EAGLE-1 or EAGLE-3, whichever its checkpoint holds) decodes the
same greedy prompts (configs/tlt.py's task, batch 1, as the paper's Table 1) once per strategy
`depth_k_verify` for each depth of --depth and k of --topk, plus plain decoding. Per (depth, k): the mean
accepted tokens per verify round and tokens/s against plain's (each strategy's programs compiled by a first
untimed call; plain timed again right after each strategy, and the ratio taken within the pair, so a
shared machine's drift hits both alike). Greedy SD equals plain decoding token for token, which the script
checks.

Published (Table 1, Qwen-32B, depth 12 / verify 64): acceptance 8.29 - 8.67 over top-k 4..16, speedup 3.47 -
3.65x, best k 6 - 10. On this CPU a verify round's cost grows with the tree (docs/benchmarks.md), so the best
k for speed can be smaller than the best for acceptance: both are reported.

Final line: `RESULT best_topk=<k by tokens/s> best_depth=<its depth> best_topk_accept=<k by acceptance>
best_depth_accept=<its depth> accept_d<depth>_k<k>=.. speedup_d<depth>_k<k>=..`; a PNG of both against k, a
line per depth.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from experiments.lib import harness as h

Cells = dict[tuple[int, int], tuple[float, float]]  # (depth, top-k) -> (accepted per round, speed vs plain)


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
    """`mode` decoding the prompts greedily, timed after an untimed call that compiles its programs."""
    from tlt_jax.rollout.hooks import FixedMode
    from tlt_jax.rollout.sampling import SamplingParams

    run = lambda: engine.generate(  # noqa: E731
        prompts, n=1, key=__import__("jax").random.key(0), sampling=SamplingParams(0.0), hooks=FixedMode(mode)
    )
    run()  # compiles this strategy's programs
    t0 = time.perf_counter()
    out = run()
    return out, time.perf_counter() - t0


def sweep(engine: Any, prompts: list, plain: Any, depth: int, args: Any) -> Cells:
    """(depth, k) -> (accepted per round, speed vs plain) for each top-k a depth-`depth` tree can fill."""
    ks = [k for k in h.ints(args.topk) if 1 + k * depth >= args.verify or k == 1]
    if left := sorted(set(h.ints(args.topk)) - set(ks)):  # every tree but the chain verifies `verify` tokens
        print(
            f"depth {depth}: top-k {left} left out: a tree with 1 + k x {depth} < {args.verify} nodes cannot "
            f"fill the {args.verify} tokens every tree here verifies"
        )
    cells: Cells = {}
    for k in ks:
        mode = engine.add_mode("eagle", f"{depth}_{k}_{min(args.verify, 1 + k * depth)}")
        res, secs = _timed(engine, prompts, mode)
        if not (res.tokens == plain.tokens).all():
            raise SystemExit(f"depth {depth}, top-k {k}: greedy SD differs from plain decoding")
        # paired: plain under the same load as `mode`, its programs compiled first (registering the first
        # EAGLE mode changes plain's programs too: they then carry the drafter)
        _, plain_s = _timed(engine, prompts, "plain")
        acc, speed = float(res.stats.mean_accept_length), plain_s / secs  # same tokens (greedy identity)
        cells[depth, k] = (acc, speed)
        tps = float(np.sum(plain.lengths)) / plain_s
        print(f"depth {depth}, top-k {k}: accepted {acc:.3f} per round, {speed:.2f}x plain ({tps:.1f} tok/s)")
    return cells


def main() -> None:
    ap = h.parser(__doc__, quick="a tiny random target and drafter (smoke: acceptance is meaningless)")
    h.add_model_args(ap)
    ap.add_argument("--drafter", default="workdirs/drafter_tlt", help="a warm-up workdir (or its drafter/)")
    ap.add_argument("--topk", default="1,2,4,6,8", help="the top-k values")
    ap.add_argument("--depth", default=None, help="draft depths, comma-separated (default 4,6,8; 2,3 quick)")
    ap.add_argument("--verify", type=int, default=None, help="tokens to verify (default 16; 8 quick)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=None, help="new tokens per prompt (default 128; 24 quick)")
    args = ap.parse_args()
    out = h.out_dir(args, "tree_topk")
    depths = h.ints(args.depth or ("2,3" if args.quick else "4,6,8"))
    args.verify = args.verify or (8 if args.quick else 16)
    max_new = args.max_new or (24 if args.quick else 128)
    target, drafter, vocab, prompts, eos = _setup(args)
    from tlt_jax.rollout.engine import RolloutEngine
    from tlt_jax.rollout.interface import EngineConfig

    ecfg = EngineConfig(max_new_tokens=max_new, max_cache_len=512 if not args.quick else 64, chunk_steps=8)
    engine = RolloutEngine(target, ecfg, eos_ids=eos, drafter=drafter, draft_vocab=vocab)
    plain, plain_s = _timed(engine, prompts, "plain")
    plain_tps = float(np.sum(plain.lengths)) / plain_s
    print(f"plain: {plain_tps:.1f} tok/s")
    cells: Cells = {}
    for depth in depths:
        cells |= sweep(engine, prompts, plain, depth, args)
    plot(cells, out / "tree_topk.png")
    by_speed = max(cells, key=lambda c: cells[c][1])
    by_accept = max(cells, key=lambda c: cells[c][0])
    values: dict[str, Any] = {
        "best_topk": by_speed[1],
        "best_depth": by_speed[0],
        "best_topk_accept": by_accept[1],
        "best_depth_accept": by_accept[0],
    }
    values.update({f"accept_d{d}_k{k}": a for (d, k), (a, _) in cells.items()})
    values.update({f"speedup_d{d}_k{k}": s for (d, k), (_, s) in cells.items()})
    print(f"plot: {out / 'tree_topk.png'}")
    h.result(values, args)


def plot(cells: Cells, path: Any) -> None:
    """Accepted tokens and speed against top-k, one line per depth."""
    fig, (a1, a2) = h.pyplot().subplots(1, 2, figsize=(10, 4))
    for d in sorted({d for d, _ in cells}):
        ks = sorted(k for dd, k in cells if dd == d)
        a1.plot(ks, [cells[d, k][0] for k in ks], marker="o", label=f"depth {d}")
        a2.plot(ks, [cells[d, k][1] for k in ks], marker="s", label=f"depth {d}")
    a1.set_xlabel("tree top-k")
    a1.set_ylabel("accepted tokens per round")
    a1.set_title("paper Table 1: 8.29-8.67 accepted, best k 6-10")
    a2.set_xlabel("tree top-k")
    a2.set_ylabel("x plain decoding")
    a2.axhline(1.0, color="gray", lw=0.8)
    a2.set_title("paper: 3.47-3.65x (Qwen-32B, depth 12, verify 64)")
    a1.legend()
    a2.legend()
    h.save_plot(fig, path)


if __name__ == "__main__":
    main()
