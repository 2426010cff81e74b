"""Drafter architectures (paper Table 7): EAGLE / HASS / EAGLE-3 warmed up at the same budget on the RL task,
then through the same spot training in RL, with the speedup each projects at Qwen2.5-7B from measured costs.

    python -m experiments.paper.drafter_arch --quick        # tiny random target, 2 RL steps (smoke: ~minutes)
    python -m experiments.paper.drafter_arch                # SmolLM2, configs/drafter_warmup.py:tlt's budget
    python -m experiments.paper.drafter_arch --prompts 16 --steps 100 --rl-steps 4   # small: 38 min, 2 cores
    python -m experiments.paper.drafter_arch --preset long --rl-full    # :long warm-ups, configs/tlt.py's RL

1. Three offline warm-ups (`tlt_jax.drafter.warmup`) with the same data, steps and schedule, differing only
in the drafter and its loss (the preset: `tlt`, the drafter for configs/tlt.py's task and sampling, by
default; `tiny` with --quick):
    eagle   EAGLE-1: fc over [embed ; final state], the target's head, SmoothL1 + soft CE, no chain steps
    hass    the same drafter with HASS's objective: the training-time test (context alignment, ttt_steps)
            and the top-K distillation (`train.topk`)
    eagle3  EAGLE-3: fc over three target layers' states, its own head over the draft vocabulary, CE over
            the training-time-test chain, no feature regression (tlt_jax.models.eagle3)
EAGLE and HASS train on the same recorded states (the data folder is shared); EAGLE-3's records [three layers
; final] and is generated once more with the same prompts and keys. Reported per arm: the held-out accepted
tokens per round of a greedy chain (`accept_length`) and of rejection-sampled chains at the data's
temperature, and the training step's cost (train seconds / steps, this machine). An arm whose warm-up result
is already in --out is read, not rerun (a resumed run).
2. The warmed drafters through the same spot training: GRPO arms in lockstep, identical but for the drafter
and its loss, SD on for the whole rollout, the spot trainer between chunks (experiments/paper/
drafter_arch_rl.py): accept length (sampled at the run's temperature) and the spot trainer's ms per drafter
update, per RL step, and after the last step each spot-trained drafter's held-out acceptance, greedy and
sampled, measured as its warm-up's (tlt_jax.drafter.heldout: same data, evaluator, draft vocabulary);
`--rl-steps 0` skips it.
3. The speedup at Qwen2.5-7B, batch 1: the RL accept (mean over the last half of the steps) / the round's cost
in plain steps from the H200 call's measured 7B costs (`project_sd --measured`'s files), every arm at the same
`--draft-vocab` head; each round ASSUMES its drafter pass at the roofline for its own parameters
(drafter_arch_rl.py's docstring). A finished RL half in --out (rl_curves.json) is read back, not rerun.

Published (Table 7, Qwen-7B, depth-heavy trees): accepted tokens EAGLE 6.53, HASS 6.67, EAGLE-3 6.83; speedup
2.24x / 2.29x / 2.55x; training cost 1x / 3x / 7x.

Final line: `RESULT accept_eagle=.. accept_hass=.. accept_eagle3=.. sampled_eagle=.. ... step_ms_eagle=..
rl_accept_eagle=.. rl_greedy_eagle=.. rl_sampled_eagle=.. spot_ms_eagle=.. speedup_eagle=.. ... best=<arm>
best_rl=<arm>`; a PNG of accepted tokens (held-out, after the warm-up and after RL) and step cost per arm and
of the RL accept length per step.
"""

from __future__ import annotations

import json
import shutil
import time
from typing import Any

import numpy as np

from experiments.lib import harness as h
from experiments.paper import drafter_arch_rl as rl

ARMS = ("eagle", "hass", "eagle3")
HASS_TOPK = 10  # HASS's K
# the paper's Table 7 (Qwen-7B): accepted tokens per round, speedup
PAPER = {"eagle": (6.53, 2.24), "hass": (6.67, 2.29), "eagle3": (6.83, 2.55)}


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
    """One arm's warm-up in `wd` (read back when `wd` already holds its result) and its held-out numbers."""
    from tlt_jax import config_schema
    from tlt_jax.drafter import warmup

    c = arm_config(preset, arm, steps, prompts)
    t0 = time.perf_counter()
    if not (wd / warmup.RESULT_FILE).exists():
        if shared_data is not None and not (wd / "data").exists():
            shutil.copytree(shared_data, wd / "data")  # the same recorded states (EAGLE and HASS)
        warmup.run_warmup(config_schema.parse(c), wd)
    res = json.loads((wd / warmup.RESULT_FILE).read_text())
    done = int((res.get("drafter_checkpoint") or {}).get("step", -1))
    if not res.get("complete") or done != int(c.train.steps):
        raise ValueError(
            f"{wd} holds a warm-up of {done} steps (complete: {res.get('complete')}), this run asks for "
            f"{c.train.steps}: use a new --out (an arm's finished warm-up is reused only at the same budget)"
        )
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
    ap.add_argument("--preset", default="tlt", help="configs/drafter_warmup.py arg: tlt (default), '', long")
    ap.add_argument("--steps", type=int, default=None, help="training steps per arm (default: the preset's)")
    ap.add_argument("--prompts", type=int, default=None, help="generated prompts (default: the preset's)")
    ap.add_argument("--rl-steps", type=int, default=None, help="RL steps per arm (default 2 quick, else 4)")
    ap.add_argument("--rl-full", action="store_true", help="configs/tlt.py's 8 x 4 rows, not :quick's 4 x 4")
    ap.add_argument("--measured", default=rl.MEASURED, help="the GPU call's 7B costs (project_sd --measured)")
    ap.add_argument("--cache", type=int, default=4096, help="cache bucket of the projected rounds")
    ap.add_argument(
        "--draft-vocab", type=int, default=rl.DRAFT_VOCAB, help="every arm's draft head in the projection"
    )
    args = ap.parse_args()
    t_start = time.perf_counter()
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
    values: dict[str, Any] = {}
    for key in ("accept", "sampled", "step_ms"):
        values.update({f"{key}_{a}": rows[a][key] for a in ARMS})
    values["best"] = max(rows, key=lambda a: rows[a]["accept"])
    rl_steps = args.rl_steps if args.rl_steps is not None else (2 if args.quick else 4)
    curves: dict[str, dict[str, Any]] = {}
    if rl_steps > 0:
        curves, strategy = rl_half(args, preset, out, rl_steps)
        values |= rl_values(args, curves, strategy, rl_steps)
    plot(rows, curves, out / "drafter_arch.png")
    print(f"plot: {out / 'drafter_arch.png'}; wall {time.perf_counter() - t_start:.0f} s")
    h.result(values, args)


def rl_half(args: Any, preset: str, out: Any, steps: int) -> tuple[dict[str, dict[str, Any]], str]:
    """The warmed drafters through the same spot training (drafter_arch_rl): per arm its per-step curves and
    its spot-trained drafter's held-out acceptance ("heldout": greedy, sampled), and the SD strategy every
    arm drafted with."""
    from tlt_jax import config_schema
    from tlt_jax.drafter.heldout import heldout_acceptance

    losses = {}
    for arm in ARMS:
        train = arm_config(preset, arm, args.steps, args.prompts).train
        losses[arm] = (int(train.ttt_steps), int(train.topk))
    configs = rl.rl_configs({a: out / a for a in ARMS}, losses, steps, args.quick, args.rl_full)
    saved = out / "rl_curves.json"
    old = json.loads(saved.read_text()) if saved.is_file() else {}
    if all(len(old.get(a, {}).get("accept", ())) == steps and "heldout" in old[a] for a in ARMS):
        print(f"RL half read back from {saved} ({steps} steps per arm); delete it and rl/ to rerun")
        curves = {a: {k: np.asarray(v, float) for k, v in old[a].items()} for a in ARMS}
    else:
        curves, finals = rl.run_rl(configs, out / "rl", steps)
        # each spot-trained drafter on its warm-up's held-out data, measured as the warm-up measured it
        for arm in ARMS:
            job = config_schema.parse(arm_config(preset, arm, args.steps, args.prompts))
            r = heldout_acceptance(job, out / arm, finals[arm])
            curves[arm]["heldout"] = np.asarray([r.accept_length, r.sampled_accept_length or np.nan])
        keys = ("accept", "spot_ms", "heldout")
        per_step = {a: {k: [float(v) for v in c[k]] for k in keys} for a, c in curves.items()}
        saved.write_text(json.dumps(per_step, indent=1))
    print(f"\n{'step':>4} " + " ".join(f"{a + ' acc':>11} {a + ' ms':>10}" for a in ARMS))
    for i in range(steps):
        cells = [f"{curves[a]['accept'][i]:>11.3f} {curves[a]['spot_ms'][i]:>10.0f}" for a in ARMS]
        print(f"{i + 1:>4} " + " ".join(cells))
    return curves, str(configs[ARMS[0]].spec.strategy)


def rl_values(args: Any, curves: dict[str, dict[str, Any]], strategy: str, steps: int) -> dict[str, Any]:
    """RESULT keys of the RL half: late-half accept, spot ms per update (the steps after the first: the
    first one's updates share a cold start), the projected 7B speedup per arm, the RL winner."""
    accept = {a: rl.late_mean(curves[a]["accept"]) for a in ARMS}
    proj, lines = rl.project(accept, strategy, args.measured, args.cache, args.draft_vocab)
    print("\n".join(lines))
    values: dict[str, Any] = {}
    for a in ARMS:
        values[f"rl_accept_{a}"] = accept[a]
        values[f"rl_greedy_{a}"], values[f"rl_sampled_{a}"] = (float(x) for x in curves[a]["heldout"])
        values[f"spot_ms_{a}"] = rl.warm_spot_ms(curves[a]["spot_ms"])
        values[f"round_steps_{a}"] = proj[a]["round_steps"]
        values[f"speedup_{a}"] = proj[a]["speedup"]
        print(
            f"{a}: RL accept {accept[a]:.3f} (last half of {steps} steps; held-out after them: greedy "
            f"{values[f'rl_greedy_{a}']:.3f}, sampled {values[f'rl_sampled_{a}']:.3f}), spot "
            f"{values[f'spot_ms_{a}']:.0f} "
            f"ms/update, 7B round {proj[a]['round_steps']:.3f} plain steps -> {proj[a]['speedup']:.2f}x "
            f"(paper {PAPER[a][1]:.2f}x at accept {PAPER[a][0]:.2f})"
        )
    values["best_rl"] = max(ARMS, key=lambda a: accept[a])
    values["rl_steps"] = steps
    return values


def plot(rows: dict[str, dict[str, float]], curves: dict[str, dict[str, Any]], path: Any) -> None:
    fig, axes = h.pyplot().subplots(1, 3 if curves else 2, figsize=(13.5 if curves else 9, 3.5))
    a1, a2 = axes[0], axes[1]
    x = range(len(ARMS))
    bars = [("greedy", [rows[a]["accept"] for a in ARMS]), ("sampled", [rows[a]["sampled"] for a in ARMS])]
    if curves:
        bars += [
            (f"{k} after RL", [curves[a]["heldout"][i] for a in ARMS])
            for i, k in enumerate(("greedy", "sampled"))
        ]
    w = 0.8 / len(bars)
    for j, (label, ys) in enumerate(bars):
        a1.bar([i + (j - (len(bars) - 1) / 2) * w for i in x], ys, width=w, label=label)
    a1.set_xticks(list(x), ARMS)
    a1.set_ylim(0, 1.45 * max(max(ys) for _, ys in bars))  # room for the legend above the bars
    a1.set_ylabel("accepted tokens per round (held-out)")
    a1.set_title("paper: " + " / ".join(f"{PAPER[a][0]}" for a in ARMS))
    a1.legend(ncol=2, fontsize="small", loc="upper center")
    costs = [("warm-up step", [rows[a]["step_ms"] for a in ARMS])]
    if curves:
        costs.append(("spot update (RL)", [rl.warm_spot_ms(curves[a]["spot_ms"]) for a in ARMS]))
    w = 0.8 / len(costs)
    for j, (label, ys) in enumerate(costs):
        a2.bar([i + (j - (len(costs) - 1) / 2) * w for i in x], ys, width=w, label=label)
    a2.set_xticks(list(x), ARMS)
    a2.set_ylabel("ms per drafter update (this machine)")
    a2.set_title("paper: cost 1x / 3x / 7x")
    a2.legend(fontsize="small")
    if curves:
        for a in ARMS:
            acc = curves[a]["accept"]
            axes[2].plot(np.arange(1, len(acc) + 1), acc, marker="o", label=a)
        axes[2].set_xticks(np.arange(1, len(curves[ARMS[0]]["accept"]) + 1))
        axes[2].set(xlabel="RL step", ylabel="accept length (rollout)", title="same spot training in RL")
        axes[2].legend()
    h.save_plot(fig, path)


if __name__ == "__main__":
    main()
