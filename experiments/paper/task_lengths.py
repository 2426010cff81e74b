"""Response-length distribution of a task under the policy: the long tail TLT exploits, measured.

    python -m experiments.paper.task_lengths                          # configs/tlt.py's task, 16 x 4, cap 384
    python -m experiments.paper.task_lengths --task gsm_symbolic --prompts 16 --n 4 --max-new 384

SmolLM2 answers `--prompts` problems `--n` times (T = 0.9, the config's prompts and cap) with plain decoding;
prints the length percentiles, the share that hits the cap, the reward / accuracy / `Answer:`-format rates,
and the share of decode time spent at <= 32 / 8 / 2 running rows (from the engine's per-step timeline: the
time speculative decoding can act on). One warm-up rollout first, so compilation is not counted. Final line:
`RESULT p50=.. p90=.. cap_frac=.. share_le2=.. share_le8=.. share_le32=.. reward=.. accuracy=..`, and a
histogram PNG.
"""

from __future__ import annotations

import jax
import numpy as np

from experiments.lib import harness as h
from tlt_jax.models.build import build_model_and_tokenizer
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.tasks import make_task


def main() -> None:
    ap = h.parser(__doc__, quick=None, out=h.ROOT / "workdirs" / "task_lengths")
    ap.add_argument("--config", default=str(h.TLT_CONFIG), help="model, task and sampling")
    ap.add_argument("--task", default=None, help="a reasoning-gym dataset instead of the config's task")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=None, help="response cap (default: the config's)")
    ap.add_argument("--temperature", type=float, default=None, help="default: the config's")
    ap.add_argument("--offset", type=int, default=1000, help="task stream position of the first prompt")
    args = ap.parse_args()
    cfg = h.load_config(args.config)
    task_cfg = cfg.task.to_dict()
    if args.task:
        task_cfg = dict(
            kind="reasoning_gym", name=args.task, size=5000, seed=0, answer_mode="answer_or_last_number"
        )
    max_new = args.max_new or int(cfg.rollout.max_new_tokens)
    model, tok = build_model_and_tokenizer(cfg)
    task = make_task(task_cfg)
    problems, prompts = h.task_prompts(task, tok, args.offset, args.prompts)
    engine = RolloutEngine(
        model,
        EngineConfig(
            max_new_tokens=max_new, max_cache_len=max(map(len, prompts)) + max_new + 16, chunk_steps=16
        ),
        eos_ids=list(tok.eos_token_ids),
        tokenizer=tok,
    )
    sp = SamplingParams(args.temperature or float(cfg.rollout.temperature))
    engine.generate(prompts, n=args.n, key=jax.random.key(99), sampling=sp)  # warm-up: compiles
    out = engine.generate(prompts, n=args.n, key=jax.random.key(0), sampling=sp)
    lengths = out.lengths
    scores = [
        task.score(problems[int(out.prompt_index[i])], tok.decode(out.response(i)))
        for i in range(len(lengths))
    ]
    stats = out.stats
    decode = max(stats.decode_seconds, 1e-9)
    res = {
        "p50": float(np.percentile(lengths, 50)),
        "p90": float(np.percentile(lengths, 90)),
        "mean": float(lengths.mean()),
        "max": float(lengths.max()),
        "cap_frac": float(np.mean(lengths >= max_new)),
        **{f"share_le{k}": stats.seconds_at_running(k) / decode for k in (2, 8, 32)},
        "reward": float(np.mean([s.reward for s in scores])),
        "accuracy": float(np.mean([s.correct for s in scores])),
        "format": float(np.mean([s.format_ok for s in scores])),
        "decode_s": stats.decode_seconds,
        "rows": float(len(lengths)),
    }
    name = task_cfg.get("name", task_cfg["kind"])
    print(f"{name}: {args.prompts} prompts x {args.n}, cap {max_new}, T={sp.temperature}")
    print(
        "lengths  p10/p50/p90/max: " + "/".join(f"{np.percentile(lengths, q):.0f}" for q in (10, 50, 90, 100))
    )
    print(
        f"hit the cap {100 * res['cap_frac']:.0f}%; reward {res['reward']:.3f}, "
        f"accuracy {100 * res['accuracy']:.0f}%, Answer: format {100 * res['format']:.0f}%"
    )
    print(
        "decode time at <= 32 / 8 / 2 running rows: "
        + " / ".join(f"{100 * res[f'share_le{k}']:.0f}%" for k in (32, 8, 2))
    )
    fig, ax = h.pyplot().subplots(figsize=(6, 3.5))
    ax.hist(lengths, bins=32)
    ax.set(xlabel="response tokens", ylabel="sequences", title=f"{name}: response lengths (cap {max_new})")
    print(f"plot: {h.save_plot(fig, h.out_dir(args) / f'lengths_{name}.png')}")
    h.result(res, args)


if __name__ == "__main__":
    main()
