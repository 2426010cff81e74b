"""End-to-end TLT: the same GRPO run with drafter none / ngram / eagle, step for step, in one process.

    python -m experiments.paper.e2e_speedup --quick        # configs/tlt.py:quick, 3 steps per arm (< 15 min)
    python -m experiments.paper.e2e_speedup --steps 8      # configs/tlt.py, 8 steps per arm

Three learners share the config and seed and differ only in `config.drafter.kind`; their steps run
interleaved (step 1 of each, then step 2 of each, ...) so a drift of the machine's speed hits all three alike.
With coupled verification the three see the same samples, so their rewards coincide (what differs, and why,
is printed). Step 1 compiles most programs and is excluded from the timings; the compile time of programs
first met in a later step (a new batch/cache bucket, a new update shape) is measured (`time/compile_rollout`,
`compile/<kind>_s`) and subtracted.

The bound, from physics: SD changes only the decode time spent in the batch buckets where it is used. From the
plain run's own decode time per batch bucket t_b and this run's per-bucket SD speedup s_b (SD tokens/s in
bucket b over plain tokens/s in bucket b; SD should be off where s_b < 1), the best RL step is
    T_best = T_plain - sum_b t_b * (1 - 1 / max(s_b, 1))  and  e2e_bound = T_plain / T_best.
Per-bucket speeds come from the chunk records of the steps measured (the chunk's batch bucket).

Final line: `RESULT e2e_speedup_eagle=.. e2e_bound_eagle=.. e2e_speedup_ngram=.. rollout_speedup_eagle=..
reward_curve_max_abs_diff=..` plus per-arm details; a PNG with step time and reward per step. `--out DIR`
keeps history.json (every arm's per-step metrics, time/* included), rollouts.jsonl (one line per arm and
step: the rollout's per-row response and prompt lengths and its chunk records, `lockstep.rollout_record`:
what `python -m experiments.models.simulate_rl --validate DIR` replays) and the arms' workdirs.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from typing import Any

import numpy as np

from experiments.lib import harness, lockstep
from experiments.lib.step_time import net

ARMS = ("none", "ngram", "eagle")
# the config args of each arm: drafter none / ngram / eagle with SpecConfig's threshold switch and no online
# training (what issue #12 compares), and "tlt": the full system (spot trainer + BEG-MAB) on the eagle drafter
ARM_ARGS = {
    "none": "drafter=none,spot=off,bandit=off",
    "ngram": "drafter=ngram,spot=off,bandit=off",
    "eagle": "drafter=eagle,spot=off,bandit=off",
    "tlt": "drafter=eagle",
}


def bucket_times(metrics: list[dict[str, float]], tag: str) -> dict[int, tuple[float, float]]:
    """Batch bucket -> (decode seconds, tokens) of `tag` chunks ("plain" / "sd") summed over steps."""
    out: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for m in metrics:
        for k, v in m.items():
            parts = k.split("/")
            if parts[0] == "bucket" and parts[2].startswith(tag + "_"):
                out[int(parts[1])][0 if parts[2].endswith("seconds") else 1] += v
    return {b: (s, t) for b, (s, t) in out.items()}


def bound(plain: list[dict[str, float]], spec: list[dict[str, float]]) -> tuple[float, dict[int, float]]:
    """(e2e bound, per-bucket SD speedup) from the plain run's time per bucket and both runs' speeds."""
    t_plain = sum(net(m, "time/step") for m in plain)
    p_b, s_b = bucket_times(plain, "plain"), bucket_times(spec, "sd")
    speed = {}
    saved = 0.0
    for b, (secs, toks) in p_b.items():
        if b in s_b and s_b[b][0] > 0 and toks > 0 and secs > 0:
            speed[b] = (s_b[b][1] / s_b[b][0]) / (toks / secs)
            saved += secs * (1.0 - 1.0 / max(speed[b], 1.0))
    return t_plain / max(t_plain - saved, 1e-9), speed


def sd_phase_speedup(plain: list[dict[str, float]], spec: list[dict[str, float]]) -> float:
    """The SD phase's speedup: the time plain decoding needs for the SD chunks' tokens (at the plain run's
    tokens/s in each batch bucket) over the SD chunks' time. The bucket metrics leave out chunks that compiled
    a program, so compilation never lands in either side; nan when the arm never ran SD."""
    sd, pl = bucket_times(spec, "sd"), bucket_times(plain, "plain")
    common = [b for b in sd if b in pl and sd[b][0] > 0 and pl[b][1] > 0]
    sd_time = sum(sd[b][0] for b in common)
    plain_time = sum(sd[b][1] * pl[b][0] / pl[b][1] for b in common)
    return plain_time / sd_time if sd_time else float("nan")


def plain_phase_speedup(plain: list[dict[str, float]], spec: list[dict[str, float]]) -> float:
    """The arm's plain chunks against the plain arm's, per batch bucket (the time the plain arm needs for the
    arm's plain-chunk tokens over the arm's plain-chunk time): below 1 when the arm's plain decoding does more
    than decode, e.g. the EAGLE arm keeping its drafter's KV cache in step for a later switch to SD."""
    mine, pl = bucket_times(spec, "plain"), bucket_times(plain, "plain")
    common = [b for b in mine if b in pl and mine[b][0] > 0 and pl[b][1] > 0]
    mine_time = sum(mine[b][0] for b in common)
    plain_time = sum(mine[b][1] * pl[b][0] / pl[b][1] for b in common)
    return plain_time / mine_time if mine_time else float("nan")


# the rollout's disjoint parts (RolloutStats.phase_seconds): where an arm's rollout time goes
ROLLOUT_PARTS = ("prefill", "decode", "speculative", "host", "compile")


def rollout_parts(h: list[dict[str, float]]) -> dict[str, float]:
    """Seconds of each rollout part summed over the timed steps (`rollout/time_<part>`)."""
    return {p: sum(m.get(f"rollout/time_{p}", 0.0) for m in h) for p in ROLLOUT_PARTS}


def print_parts(arms: list[str], timed: dict[str, list[dict[str, float]]]) -> None:
    """Where each arm's rollout time goes, beside the plain arm's: prefill (the EAGLE arm also prefills its
    drafter's cache), plain decode, SD, host work between chunks, compilation."""
    print("\nrollout parts (s, summed over the timed steps): " + ", ".join(ROLLOUT_PARTS))
    for arm in arms:
        parts = rollout_parts(timed[arm])
        print(f"{arm:>9} " + " ".join(f"{p} {v:6.2f}" for p, v in parts.items()))


def main() -> None:
    ap = harness.parser(
        __doc__,
        quick="configs/tlt.py:quick (3 steps of 16 rows per arm)",
        out=None,
        out_help="workdirs, metrics and the plot (default: a temp dir)",
    )
    ap.add_argument("--config", default=str(harness.TLT_CONFIG))
    ap.add_argument("--steps", type=int, default=None, help="RL steps per arm (default 3 quick, else 8)")
    ap.add_argument(
        "--arms",
        default=",".join(ARMS),
        help=f"arms to compare, from {sorted(ARM_ARGS)} (none is the baseline)",
    )
    ap.add_argument("--drafter-path", default=None, help="EAGLE warm-up workdir (default: the config's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t_start = time.perf_counter()
    arms = [a for a in args.arms.split(",") if a]
    if arms[0] != "none":
        raise SystemExit("--arms must start with 'none' (the plain baseline)")
    steps = args.steps or (3 if args.quick else 8)
    out = harness.out_dir(args, "e2e_speedup")

    configs = {}
    for arm in arms:
        arg = f"{ARM_ARGS[arm]},seed={args.seed}" + (",quick" if args.quick else "")
        cfg = lockstep.quiet(harness.load_config(args.config, arg), steps)
        if args.drafter_path:
            cfg.drafter.path = args.drafter_path
        configs[arm] = cfg

    def report(step: int, arm: str, m: dict[str, float]) -> None:
        print(
            f"step {step} {arm:>5}: step {m['time/step']:6.1f}s rollout {m['time/rollout']:6.1f}s "
            f"(compile {m.get('time/compile_rollout', 0.0):5.1f}s) "
            f"tail<=2 {m['rollout/time_running_le2']:5.1f}s reward {m['reward/mean']:.3f} "
            f"accept {m.get('spec/accept_len', 0.0):.2f} "
            f"len p50/max {m['length/p50']:.0f}/{m['length/max']:.0f}",
            flush=True,
        )

    records = out / "rollouts.jsonl"
    records.write_text("")

    def keep_rollout(step: int, arm: str, rollout: Any) -> None:
        with records.open("a") as f:
            f.write(json.dumps({"arm": arm, "step": step, **lockstep.rollout_record(rollout)}) + "\n")

    history = lockstep.run_lockstep(configs, out, steps, report, keep_rollout)
    (out / "history.json").write_text(json.dumps(history, indent=1))

    timed = {a: h[1:] if len(h) > 1 else h for a, h in history.items()}  # step 1 compiles
    base = timed["none"]
    t_none = sum(net(m, "time/step") for m in base)
    r_none = sum(net(m, "time/rollout") for m in base)
    result: dict[str, float] = {}
    rewards = {a: np.asarray([m["reward/mean"] for m in h]) for a, h in history.items()}
    cols = (
        "arm",
        "step s",
        "rollout s",
        "tail<=2 s",
        "e2e",
        "bound",
        "rollout",
        "SD-phase",
        "plain-ph",
        "accept",
    )
    print("\n" + " ".join(f"{c:>9}" for c in cols))
    for arm in arms:
        h = timed[arm]
        t = sum(net(m, "time/step") for m in h)
        r = sum(net(m, "time/rollout") for m in h)
        tail = sum(m["rollout/time_running_le2"] for m in h)
        e2e, roll = t_none / max(t, 1e-9), r_none / max(r, 1e-9)
        accept = float(np.mean([m.get("spec/accept_len", 0.0) for m in h]))
        b, speeds = (1.0, {}) if arm == "none" else bound(base, h)
        sd_phase, plain_phase = sd_phase_speedup(base, h), plain_phase_speedup(base, h)
        row = (f"{t:.1f}", f"{r:.1f}", f"{tail:.1f}", f"{e2e:.2f}x", f"{b:.2f}x", f"{roll:.2f}x")
        print(
            " ".join(
                f"{c:>9}" for c in (arm, *row, f"{sd_phase:.2f}x", f"{plain_phase:.2f}x", f"{accept:.2f}")
            )
        )
        if arm != "none":
            result[f"e2e_speedup_{arm}"] = e2e
            result[f"e2e_bound_{arm}"] = b
            result[f"rollout_speedup_{arm}"] = roll
            result[f"sd_phase_speedup_{arm}"] = sd_phase
            result[f"plain_phase_speedup_{arm}"] = plain_phase
            parts, base_parts = rollout_parts(h), rollout_parts(base)
            result[f"prefill_ratio_{arm}"] = parts["prefill"] / max(base_parts["prefill"], 1e-9)
            result[f"accept_len_{arm}"] = accept
            result[f"of_bound_{arm}"] = (e2e - 1.0) / (b - 1.0) if b > 1.0 + 1e-6 else float("nan")
            print(
                "        per-bucket SD speedup: "
                + ", ".join(f"b{k} {v:.2f}x" for k, v in sorted(speeds.items()))
            )
    print_parts(arms, timed)
    diffs = [float(np.max(np.abs(rewards[a] - rewards["none"]))) for a in arms if a != "none"]
    result["reward_curve_max_abs_diff"] = max(diffs) if diffs else 0.0
    for arm in arms[1:]:
        d = np.nonzero(np.abs(rewards[arm] - rewards["none"]) > 1e-9)[0]
        if len(d):
            print(
                f"rewards of {arm} differ from plain at steps {[int(i) + 1 for i in d]}: a rounding flip "
                "between a verify pass and a decode step changed a sample (coupled verification), or the "
                "acceptance rule is not coupled"
            )
    plot(history, out / "e2e_speedup.png")
    result["wall_s"] = time.perf_counter() - t_start
    print(f"plot: {out / 'e2e_speedup.png'}; workdirs and history.json under {out}")
    order = [  # the rollout and SD-phase ratios lead: at 3 steps on a noisy CPU the e2e ratio is mostly noise
        "rollout_speedup_eagle",
        "sd_phase_speedup_eagle",
        "plain_phase_speedup_eagle",
        "e2e_speedup_eagle",
        "e2e_bound_eagle",
        "rollout_speedup_ngram",
        "e2e_speedup_ngram",
        "reward_curve_max_abs_diff",
    ]
    keys = [k for k in order if k in result] + [k for k in result if k not in order]
    harness.result({k: result[k] for k in keys}, args)


def plot(history: dict[str, list[dict[str, float]]], path: Any) -> None:
    """Step time (stacked rollout / rest) and reward per step, for every arm."""
    fig, (a1, a2) = harness.pyplot().subplots(1, 2, figsize=(11, 4))
    for arm, h in history.items():
        x = np.arange(1, len(h) + 1)
        a1.plot(x, [m["time/step"] for m in h], marker="o", label=f"{arm} step")
        a1.plot(x, [m["time/rollout"] for m in h], ls="--", alpha=0.7, label=f"{arm} rollout")
        a2.plot(x, [m["reward/mean"] for m in h], marker="o", label=arm)
    a1.set(xlabel="RL step", ylabel="seconds", title="step and rollout time (step 1 compiles)")
    a2.set(xlabel="RL step", ylabel="mean reward", title="reward (coupled verification: curves coincide)")
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    harness.save_plot(fig, path)


if __name__ == "__main__":
    main()
