"""Drafter architectures (paper Table 7): EAGLE / HASS / EAGLE-3 warmed up at the same budget on the RL task.

    python -m experiments.paper.drafter_arch --quick        # the tiny random target (smoke: seconds per arm)
    python -m experiments.paper.drafter_arch                # SmolLM2 on chain_sum, the default warm-up budget
    python -m experiments.paper.drafter_arch --preset long  # :long (768 prompts, 3600 steps per arm)
    python -m experiments.paper.drafter_arch --prompts 16 --steps 100   # a small budget (~20 min here)

Three offline warm-ups (`tlt_jax.drafter.warmup`) with the same data, steps and schedule, differing only in
the drafter and its loss:
    eagle   EAGLE-1: fc over [embed ; final state], the target's head, SmoothL1 + soft CE, no chain steps
    hass    the same drafter with HASS's objective: the training-time test (context alignment, ttt_steps)
            and the top-K distillation (`train.topk`)
    eagle3  EAGLE-3: fc over three target layers' states, its own head over the draft vocabulary, CE over
            the training-time-test chain, no feature regression (tlt_jax.models.eagle3)
EAGLE and HASS train on the same recorded states (the data folder is shared); EAGLE-3's records [three layers
; final] and is generated once more with the same prompts and keys. Reported per arm: the held-out accepted
tokens per round of a greedy chain (`accept_length`) and of rejection-sampled chains at the data's
temperature, and the training step's cost (train seconds / steps, this machine).

Published (Table 7, Qwen-7B, depth-heavy trees): accepted tokens EAGLE 6.53, HASS 6.67, EAGLE-3 6.83; training
cost 1x / 3x / 7x. Not done here: the arms through the same spot training in RL and the projected speedup from
measured round costs (`project_sd --measured`).

Final line: `RESULT accept_eagle=.. accept_hass=.. accept_eagle3=.. sampled_eagle=.. ... step_ms_eagle=..
best=<arm>`; a PNG of accepted tokens and step cost per arm.
"""

from __future__ import annotations

import json
import shutil
import time
from typing import Any

from experiments.lib import harness as h

ARMS = ("eagle", "hass", "eagle3")
HASS_TOPK = 10  # HASS's K


def arm_config(preset: str, arm: str, steps: int | None, prompts: int | None = None) -> Any:
    """The warm-up config of one arm (module docstring)."""
    c = h.load_config("drafter_warmup.py", preset or None)
    if steps:
        c.train.steps = steps
    if prompts:
        c.generation.num_prompts = prompts
    c.train.ttt_steps, c.train.topk = 0, 0
    if arm == "hass":
        c.train.ttt_steps, c.train.topk = 2, HASS_TOPK
    elif arm == "eagle3":
        c.arch, c.train.ttt_steps = "eagle3", 2
        rand = c.model.get("random")
        if rand is not None and "num_layers" in rand and rand.num_layers < 3:
            c.aux_layers = (0, 1, rand.num_layers)  # a tiny target: every point it has
    return c


def run_arm(
    preset: str, arm: str, steps: int | None, wd: Any, shared_data: Any | None, prompts: int | None = None
) -> dict[str, float]:
    from tlt_jax import config_schema
    from tlt_jax.drafter import warmup

    if shared_data is not None and not (wd / "data").exists():
        shutil.copytree(shared_data, wd / "data")  # the same recorded states (EAGLE and HASS)
    c = arm_config(preset, arm, steps, prompts)
    t0 = time.perf_counter()
    warmup.run_warmup(config_schema.parse(c), wd)
    res = json.loads((wd / warmup.RESULT_FILE).read_text())
    after = res["after"]
    train_s = float(res["phase_seconds"].get("train", 0.0))
    return {
        "accept": float(after["accept_length"]),
        "sampled": float(after.get("sampled_accept_length") or 0.0),
        "step_ms": 1e3 * train_s / max(int(c.train.steps), 1),
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = h.parser(__doc__, quick="the tiny random target (smoke)")
    ap.add_argument("--preset", default="", help="configs/drafter_warmup.py arg: '' (default), long, gpu")
    ap.add_argument("--steps", type=int, default=None, help="training steps per arm (default: the preset's)")
    ap.add_argument("--prompts", type=int, default=None, help="generated prompts (default: the preset's)")
    args = ap.parse_args()
    out = h.out_dir(args, "drafter_arch")
    preset = "tiny" if args.quick else args.preset
    rows: dict[str, dict[str, float]] = {}
    for arm in ARMS:
        shared = out / "eagle" / "data" if arm == "hass" else None
        rows[arm] = run_arm(preset, arm, args.steps, out / arm, shared, args.prompts)
        r = rows[arm]
        print(
            f"{arm}: accepted {r['accept']:.3f} (sampled {r['sampled']:.3f}), step {r['step_ms']:.1f} ms, "
            f"wall {r['wall_s']:.0f} s",
            flush=True,
        )
    plot(rows, out / "drafter_arch.png")
    best = max(rows, key=lambda a: rows[a]["accept"])
    values: dict[str, Any] = {}
    for key, field in (("accept", "accept"), ("sampled", "sampled"), ("step_ms", "step_ms")):
        values.update({f"{key}_{a}": rows[a][field] for a in ARMS})
    values["best"] = best
    print(f"plot: {out / 'drafter_arch.png'}")
    h.result(values, args)


def plot(rows: dict[str, dict[str, float]], path: Any) -> None:
    fig, (a1, a2) = h.pyplot().subplots(1, 2, figsize=(9, 3.5))
    x = range(len(ARMS))
    a1.bar([i - 0.2 for i in x], [rows[a]["accept"] for a in ARMS], width=0.4, label="greedy")
    a1.bar([i + 0.2 for i in x], [rows[a]["sampled"] for a in ARMS], width=0.4, label="sampled")
    a1.set_xticks(list(x), ARMS)
    a1.set_ylabel("accepted tokens per round")
    a1.set_title("paper: 6.53 / 6.67 / 6.83")
    a1.legend()
    a2.bar(list(x), [rows[a]["step_ms"] for a in ARMS])
    a2.set_xticks(list(x), ARMS)
    a2.set_ylabel("training step (ms, this machine)")
    a2.set_title("paper: cost 1x / 3x / 7x")
    h.save_plot(fig, path)


if __name__ == "__main__":
    main()
