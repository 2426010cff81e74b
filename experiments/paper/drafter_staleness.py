"""Drafter staleness (paper Table 6 / Fig 8 shape): a static warmed drafter vs the spot-trained one over RL.

    python -m experiments.paper.drafter_staleness --quick            # 4 steps per arm of configs/tlt.py:quick
    python -m experiments.paper.drafter_staleness --steps 12         # the full run

Two GRPO runs in lockstep (experiments/lib/lockstep.py), identical but for `config.spot.mode`: "off" keeps the
warmed EAGLE drafter of `--drafter-path` as it is, the other trains it online on every rollout's own hidden
states (between tail chunks on one device: `between_chunks`; `--mode idle_devices` with several data
devices) and pushes it after each step. With coupled verification both runs sample the same sequences, so
the policy they draft for is the same at every step: the accept-length curves differ only by the drafter. SD
is on for the whole rollout (threshold = the batch) so every step measures acceptance on all of its text.

Published context: TLT reports 4.59 -> 6.53 accept length from adaptation (Qwen-7B, depth-heavy trees);
another group reports a frozen one-layer drafter holding ~2.55 over 36 RL steps. Which holds here, and after
how many steps adaptation pays, is what the curves show.

Final line: `RESULT accept_static=<a> accept_adaptive=<b> adaptive_gain=<b/a>` (means over the last half of
the steps) plus the step from which the adaptive arm stays ahead; a PNG of accept length per step.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

from experiments.lib import harness as h
from experiments.lib import lockstep
from tlt_jax.rl.speculation import has_drafter


def main() -> None:
    ap = h.parser(__doc__, quick="configs/tlt.py:quick, 4 steps per arm", out=None)
    ap.add_argument("--steps", type=int, default=None, help="RL steps per arm (default 4 quick, else 12)")
    ap.add_argument("--config", default=str(h.TLT_CONFIG))
    ap.add_argument("--drafter-path", default=None, help="the warmed drafter (default: the config's)")
    ap.add_argument(
        "--mode", default="between_chunks", choices=("between_chunks", "idle_devices", "after_rollout")
    )
    ap.add_argument("--spot-steps", type=int, default=4, help="drafter updates after each tail chunk")
    args = ap.parse_args()
    t_start = time.perf_counter()
    steps = args.steps or (4 if args.quick else 12)
    out = h.out_dir(args, "drafter_staleness")

    configs = {}
    for arm, mode in (("static", "off"), ("adaptive", args.mode)):
        cfg = lockstep.quiet(
            h.load_config(args.config, "drafter=eagle,bandit=off" + (",quick" if args.quick else "")), steps
        )
        if args.drafter_path:
            cfg.drafter.path = args.drafter_path
        cfg.spec.threshold = 1 << 20  # SD for the whole rollout: acceptance measured on all the text
        cfg.spot.mode = mode
        cfg.spot.steps_per_chunk = args.spot_steps
        cfg.spot.threshold = 1 << 20
        configs[arm] = cfg
    if not has_drafter(configs["static"].drafter.path):
        sys.exit(
            f"no warmed drafter in {configs['static'].drafter.path}: run `python -m tlt_jax.main --config "
            "configs/drafter_warmup.py:tlt --workdir workdirs/drafter_tlt` first (or pass --drafter-path)."
        )

    def report(step: int, arm: str, m: dict[str, float]) -> None:
        print(
            f"step {step} {arm:>8}: accept {m.get('spec/accept_len', float('nan')):.3f} reward "
            f"{m['reward/mean']:.3f} spot steps {m.get('spot/steps', 0):.0f} stale top1 "
            f"{m.get('spot/stale_top1', float('nan')):.3f} step {m['time/step']:.0f}s",
            flush=True,
        )

    history = lockstep.run_lockstep(configs, out, steps, report)
    (out / "history.json").write_text(json.dumps(history, indent=1))
    acc = {a: np.asarray([m.get("spec/accept_len", np.nan) for m in h]) for a, h in history.items()}
    half = steps // 2
    static, adaptive = float(np.nanmean(acc["static"][half:])), float(np.nanmean(acc["adaptive"][half:]))
    ahead = np.nonzero(acc["adaptive"] <= acc["static"])[0]
    pays_from = int(ahead[-1]) + 2 if len(ahead) else 1  # the first step after which adaptive stays ahead
    print(f"\n{'step':>4} {'static':>8} {'adaptive':>8}")
    for i in range(steps):
        print(f"{i + 1:>4} {acc['static'][i]:>8.3f} {acc['adaptive'][i]:>8.3f}")
    plot(acc, out / "drafter_staleness.png")
    print(f"plot: {out / 'drafter_staleness.png'}; wall {time.perf_counter() - t_start:.0f} s")
    res = dict(accept_static=static, accept_adaptive=adaptive, adaptive_gain=adaptive / static)
    h.result(res | dict(adaptive_ahead_from_step=pays_from, steps=steps), args)


def plot(acc: dict[str, np.ndarray], path: Any) -> None:
    fig, ax = h.pyplot().subplots(figsize=(6, 4))
    for arm, a in acc.items():
        ax.plot(np.arange(1, len(a) + 1), a, marker="o", label=arm)
    ax.set(xlabel="RL step", ylabel="accept length (tokens per verify round)", title="drafter staleness")
    ax.legend()
    h.save_plot(fig, path)


if __name__ == "__main__":
    main()
