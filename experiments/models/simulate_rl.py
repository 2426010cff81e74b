"""A discrete-event model of one GRPO step of TLT: validated against `e2e_speedup.py`, then projected.

The model (`experiments/models/rl_model.py`): a batch of response lengths decodes in chunks on D devices,
compacted into power-of-two batch buckets per device; each chunk costs steps x the measured cost of a step of
its mode at (batch bucket, cache bucket), plus host overhead; speculative rounds emit `accept` tokens per row;
the mode per chunk is plain, the threshold switch or the converged bandit; devices whose rows have finished
are idle (the spot trainer's time); the step adds reward, log-prob and update time.

    python -m experiments.models.simulate_rl --validate workdirs/e2e_val  # runs e2e + step_costs if absent
    python -m experiments.models.simulate_rl --validate workdirs/e2e_val --costs workdirs/step_costs.json
    python -m experiments.models.simulate_rl                              # Qwen2.5-7B / 8 x H100 projection

Validation without circularity: the costs come from `step_costs.py` (a separate benchmark on the same
machine: the engine's chunk programs on synthetic states, real rollouts on held-out prompts for prefill,
host overhead and accept length); from the `e2e_speedup --out DIR` run the simulator takes ONLY the plain
arm's per-step response and prompt lengths (rollouts.jsonl) and its time outside the rollout (reward,
log-probs, update: time/step - time/rollout, the same work in every arm since coupled verification leaves
the samples unchanged). It predicts every arm's step time (compilation excluded, as e2e_speedup's `net`)
and the speedups over plain, and compares them with what the run measured, steps after the first.
A `--validate` folder without an e2e run in it gets one first (`e2e_speedup --quick --out DIR`), so one
command reproduces the inputs and the check. Final line (validation): `RESULT rollout_time_error=..
speedup_sign_agrees=.. speedup_pred_<arm>=.. speedup_meas_<arm>=.. speedup_total_error=.. speedup_error=..
step_time_error=.. other_time_spread=..`: first what the model predicts on its own (the rollout time's
largest relative error; whether predicted and measured speedups fall on the same side of 1), then the
speedups and the step time, which also holds the measured non-rollout time fed back in (largest relative
errors over arms and steps >= 2; the total: over all those steps; the spread: how far the arms' own
non-rollout times differ, the noise floor of a prediction from the plain arm's)
and `simulate_rl_validate.png` (running rows, measured vs predicted) in the run's folder.

The projection, every number labelled as one: Qwen2.5-7B GRPO on `--devices` H100s (data parallel), the
paper's setup (`--prompts` x 8 samples, responses up to 32K: a log-normal long tail, or `--lengths` from a
run), costs from `project_sd.py`'s roofline of the measured H100 (paged KV) and the H100 run's host time per
chunk, SD below `--threshold` rows per device with the fastest strategy per bucket, acceptance from both
sources (ours, the paper's; `--accept-scale` for a staleness curve), the rest of the step from the paper's
85% rollout share, the spot trainer on idle devices (`--spot-step`). Prints plain vs TLT rollout and step
times, E2E speedup, time at <= 32/8/2 running rows, idle and spot-used device-seconds, and the Fig 14 case
study (128 requests, SD below 32); `simulate_rl_projection.png` in `--out`. With `--measured JSON` (a GPU
call's 7B costs, `docs/gpu_runs/<date>-<device>/summary.json` of the GPU suite's call 1) the steps and
rounds are the measured ones (`measured_costs.py`: fixed per-kernel costs included, the roofline only
interpolates between measured cells, rounds by cache too), the spot drafter step the measured one; the output
lists which inputs are measured and which assumed, and a BIAS line what still biases it. Final line: `RESULT
e2e_speedup_<source>=.. rollout_speedup_<source>=.. ... fig14_rollout_speedup_<source>=..`.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import pathlib
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np

from experiments.lib import harness as h
from experiments.models import measured_costs as mc
from experiments.models import project_sd as ps
from experiments.models import rl_model as rm
from experiments.models.roofline import strategy_for


class CostTable:
    """Seconds of a step of `mode` at (batch, cache) from a step_costs JSON: exact entries, else linear
    interpolation in batch at the smallest measured cache bucket >= the one asked for (nearest beyond the
    measured range). Modes are looked up by name, else by tokens_to_verify (`tv:<n>`)."""

    def __init__(self, data: dict[str, Any]):
        self.data = data
        self.table: dict[str, dict[int, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
        for r in data["step_seconds"]:
            for key in (r["mode"], f"tv:{r['tv']}"):
                self.table[key][int(r["cache"])][int(r["batch"])] = float(r["seconds"])

    @classmethod
    def load(cls, path: str | pathlib.Path) -> CostTable:
        return cls(json.loads(pathlib.Path(path).read_text()))

    def __call__(self, mode: str, batch: int, cache: int, kv: int = 0) -> float:
        """Seconds per step at (batch bucket, cache bucket); `kv` (live KV tokens) plays no part: a chunk
        program's cost depends on its buckets only."""
        if mode not in self.table:
            raise KeyError(f"no costs for mode {mode!r} (have {sorted(self.table)})")
        by_cache = self.table[mode]
        caches = sorted(by_cache)
        c = caches[min(bisect.bisect_left(caches, cache), len(caches) - 1)]
        pts = sorted(by_cache[c].items())
        bs = [b for b, _ in pts]
        if batch in by_cache[c]:
            return by_cache[c][batch]
        return float(np.interp(batch, bs, [s for _, s in pts]))

    def arm(self, name: str) -> dict[str, Any]:
        return self.data["arms"][name]

    def shape(self) -> rm.EngineShape:
        e = self.data["engine"]
        return rm.EngineShape(int(e["chunk_steps"]), int(e["min_cache_bucket"]), int(e["max_cache_len"]))


def arm_chooser(costs: CostTable, arm: str, policy: str = "threshold") -> tuple[rm.Chooser, int]:
    """The arm's mode per chunk (policy "threshold": its threshold switch; "best": the converged bandit over
    plain and its modes, for an arm with a bandit) with the accept length per batch bucket where measured,
    and the largest lookahead of its modes."""
    a = costs.arm(arm)
    modes = {
        name: (m["accept"], {int(b): v for b, v in m.get("accept_by_batch", {}).items()})
        for name, m in a["modes"].items()
    }
    if not modes:
        return (lambda r, b, c: rm.Mode()), 0

    def mode_at(name: str, batch: int) -> rm.Mode:
        acc, by_batch = modes[name]
        return rm.Mode.speculative(name, by_batch.get(batch, acc))

    ahead = max(rm.Mode.speculative(n, 1.0).lookahead for n in modes)
    if policy == "best":
        return (lambda r, b, c: rm.best_chooser([mode_at(n, b) for n in modes], costs)(r, b, c)), ahead
    name = next(iter(modes))
    thr = int(a["threshold"])
    return (lambda r, b, c: mode_at(name, b) if r <= thr else rm.Mode()), ahead


def predict_rollout(costs: CostTable, arm: str, rec: dict[str, Any], max_new: int) -> rm.RolloutTimeline:
    """The arm's rollout of the response lengths in `rec` (a rollouts.jsonl line)."""
    a = costs.arm(arm)
    choose, ahead = arm_chooser(costs, arm, a.get("policy", "threshold"))
    return rm.simulate_rollout(
        rec["lengths"],
        rec["prompt_lengths"],
        costs,
        choose,
        devices=int(costs.data.get("devices", 1)),
        shape=costs.shape(),
        max_new=max_new,
        max_lookahead=ahead,
        prefill=float(a["prefill"]),
        chunk_overhead=float(a["chunk_overhead"]),
        rollout_overhead=float(a["rollout_overhead"]),
    )


def load_run(run: pathlib.Path) -> tuple[dict[str, list[dict[str, float]]], dict[tuple[str, int], dict]]:
    """history.json (arm -> per-step metrics) and rollouts.jsonl ((arm, step) -> record) of an e2e run."""
    history = json.loads((run / "history.json").read_text())
    recs = {}
    for line in (run / "rollouts.jsonl").read_text().splitlines():
        r = json.loads(line)
        recs[(r["arm"], int(r["step"]))] = r
    if not recs:
        raise SystemExit(f"{run}/rollouts.jsonl is empty: rerun e2e_speedup.py --out (it records rollouts)")
    return history, recs


def validate(run: pathlib.Path, costs: CostTable, max_new: int) -> dict[str, float]:
    """Predict every arm's net step time per step from the plain arm's lengths and other time; compare.
    Net: without the compilation first met in the step (experiments.lib.step_time.net: rollout programs and
    the rest)."""
    from experiments.lib.step_time import net

    history, recs = load_run(run)
    arms = list(history)
    steps = range(2, len(history["none"]) + 1)  # step 1 compiles
    pred: dict[str, dict[int, float]] = defaultdict(dict)
    meas: dict[str, dict[int, float]] = defaultdict(dict)
    roll_err, timelines = [], {}
    print(
        f"\n{'arm':>6} {'step':>4} {'rollout pred':>12} {'meas':>7} {'step pred':>10} {'meas':>7} {'err':>6}"
    )
    for s in steps:
        base = history["none"][s - 1]
        other = net(base, "time/step") - net(base, "time/rollout")
        for arm in arms:
            m = history[arm][s - 1]
            tl = predict_rollout(costs, arm, recs[("none", s)], max_new)
            timelines[(arm, s)] = tl
            r_meas = net(m, "time/rollout")
            pred[arm][s] = rm.step_time(tl.seconds, other)
            meas[arm][s] = net(m, "time/step")
            roll_err.append(abs(tl.seconds - r_meas) / r_meas)
            err = (pred[arm][s] - meas[arm][s]) / meas[arm][s]
            print(
                f"{arm:>6} {s:>4} {tl.seconds:>12.1f} {r_meas:>7.1f} {pred[arm][s]:>10.1f} "
                f"{meas[arm][s]:>7.1f} {100 * err:>+5.1f}%"
            )
    step_err = max(abs(pred[a][s] - meas[a][s]) / meas[a][s] for a in arms for s in steps)
    # the floor of any prediction from the plain arm's non-rollout time: how far the arms' own non-rollout
    # times (the same work: coupled verification) differ in each step, as a share of the arm's step
    spread = max(
        abs(
            (net(history[a][s - 1], "time/step") - net(history[a][s - 1], "time/rollout"))
            - (net(history["none"][s - 1], "time/step") - net(history["none"][s - 1], "time/rollout"))
        )
        / meas[a][s]
        for a in arms
        for s in steps
    )
    loads = [history[a][s - 1].get("machine/load_avg_1m", float("nan")) for s in steps for a in arms]
    print(f"\nload average (1 min) at the end of each arm's step: {', '.join(f'{x:.1f}' for x in loads)}")
    sp_err, total_err = 0.0, 0.0
    totals: dict[str, tuple[float, float]] = {}  # arm -> (predicted, measured) speedup over all steps
    print(f"\n{'arm':>6} {'step':>4} {'speedup pred':>12} {'meas':>7}")
    for arm in arms[1:]:
        for s in list(steps) + ["all"]:
            ss = steps if s == "all" else [s]
            p = sum(pred["none"][k] for k in ss) / sum(pred[arm][k] for k in ss)
            q = sum(meas["none"][k] for k in ss) / sum(meas[arm][k] for k in ss)
            print(f"{arm:>6} {s!s:>4} {p:>11.3f}x {q:>6.3f}x")
            if s == "all":
                total_err = max(total_err, abs(p - q) / q)
                totals[arm] = (p, q)
            else:
                sp_err = max(sp_err, abs(p - q) / q)
    diagnose(history, recs, timelines, arms, steps)
    # what the model predicts on its own leads: the rollout time, and whether SD gains or loses (the step
    # time also contains the measured non-rollout time, fed back in, so its error is mostly not the model's)
    sign_agrees = all((sp[0] - 1.0) * (sp[1] - 1.0) > 0 or abs(sp[1] - 1.0) < 1e-3 for sp in totals.values())
    out = {"rollout_time_error": max(roll_err), "speedup_sign_agrees": float(sign_agrees)}
    for arm, (p, q) in totals.items():
        out[f"speedup_pred_{arm}"], out[f"speedup_meas_{arm}"] = p, q
    return out | {
        "speedup_total_error": total_err,
        "speedup_error": sp_err,
        "step_time_error": step_err,
        "other_time_spread": spread,
    }


def diagnose(history: dict, recs: dict, timelines: dict, arms: list[str], steps: range) -> None:
    """Where predicted and measured rollouts differ: decode seconds per (mode, batch bucket), prefill and
    host time, summed over the steps compared."""
    for arm in arms:
        pred: dict[tuple[str, int], float] = defaultdict(float)
        meas: dict[tuple[str, int], float] = defaultdict(float)
        p_fix = m_fix = 0.0
        for s in steps:
            tl = timelines[(arm, s)]
            for c in tl.chunks:
                pred[("plain" if c.mode == "plain" else "sd", c.batch)] += c.seconds
            p_fix += tl.prefill + tl.overhead
            rec = recs[(arm, s)]
            for c in rec["chunks"]:
                meas[("plain" if c["mode"] == "plain" else "sd", c["batch_bucket"])] += c["seconds"]
            m = history[arm][s - 1]
            m_fix += (
                m["time/rollout"]
                - m.get("time/compile_rollout", 0.0)
                - sum(c["seconds"] for c in rec["chunks"])
            )
        keys = sorted(set(pred) | set(meas), key=lambda k: (k[0], -k[1]))
        cells = ", ".join(f"{k[0]} b{k[1]} {pred[k]:.1f}/{meas[k]:.1f}" for k in keys)
        print(f"{arm}: predicted/measured seconds: {cells}; prefill+host {p_fix:.1f}/{m_fix:.1f}")


def plot_validation(run: pathlib.Path, costs: CostTable, step: int, max_new: int, path: pathlib.Path) -> None:
    """Running rows over the rollout, measured (chunk records) vs predicted, per arm at one step."""
    plt = h.pyplot()

    history, recs = load_run(run)
    fig, ax = plt.subplots(figsize=(7, 4))
    for color, arm in zip(("C0", "C3", "C2", "C1"), history, strict=False):
        t, xs, ys = 0.0, [], []
        for c in recs[(arm, step)]["chunks"]:
            dt = c["seconds"] / max(len(c["running"]), 1)
            for r in c["running"]:
                xs.append(t)
                ys.append(r)
                t += dt
        ax.step(xs, ys, where="post", color=color, label=f"{arm} measured")
        prof = predict_rollout(costs, arm, recs[("none", step)], max_new).profile()
        xp, yp = [p[0] for p in prof], [p[1] for p in prof]
        ax.step(xp, yp, where="post", ls="--", color=color, label=f"{arm} predicted")
    ax.set(xlabel="decode seconds", ylabel="running rows", title=f"rollout of RL step {step}")
    ax.legend(fontsize=7)
    h.save_plot(fig, path)


PAPER = {"e2e": (1.7, 2.1), "fig14_rollout": 2.44, "rollout_share": 0.85}


def long_tail(n: int, seed: int, median: float, sigma: float, cap: int) -> np.ndarray:
    """Response lengths with a long tail: log-normal around `median`, cut at `cap` (the responses that
    reach the cap are the tail every step waits for)."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))), 1, cap).astype(int)


def step_lengths(args: argparse.Namespace, step: int, n: int | None = None) -> np.ndarray:
    """One RL step's response lengths: the log-normal long tail, or (`--lengths FILE`: a rollouts.jsonl of
    an e2e run, its plain arm) measured lengths resampled to the step's rows and scaled from that run's
    cap (`--lengths-cap`) to `--max-new`. n: rows (default the step's)."""
    n, rng = n or args.prompts * args.samples, np.random.default_rng(args.seed + step)
    if not args.lengths:
        return long_tail(n, args.seed + step, args.median, args.sigma, args.max_new)
    recs = [json.loads(x) for x in pathlib.Path(args.lengths).read_text().splitlines() if x.strip()]
    pool = np.concatenate([r["lengths"] for r in recs if r.get("arm", "none") == "none"])
    scaled = np.round(rng.choice(pool, n) * args.max_new / args.lengths_cap)
    return np.clip(scaled, 1, args.max_new).astype(int)


def tlt_chooser(modes: list[rm.Mode], cost: rm.StepCost, threshold: int) -> rm.Chooser:
    """TLT's rollout engine, converged: plain above `threshold` running rows per device, below it the
    fastest of plain and every strategy at the bucket (BEG-MAB's arms, once its medians have settled)."""
    best = rm.best_chooser(modes, cost)
    return lambda running, batch, cache: best(running, batch, cache) if running <= threshold else rm.Mode()


def project_sources(gpu: dict[str, Any]) -> dict[str, tuple[list[rm.Mode], float]]:
    """Per acceptance source: one mode per TV (bench_sd's strategy mapping) with that source's accept, and
    its accept at TV 48."""

    out = {}
    for name, acc in ps.accept_sources(gpu).items():
        modes = [rm.Mode.speculative("{}_{}_{}".format(*strategy_for(tv), tv), acc(tv)) for tv in ps.TVS]
        out[name] = (modes, acc(48))
    return out


def project_steps(args: argparse.Namespace, roof: Any, sources: dict, kw: dict) -> tuple[dict, dict]:
    """`args.steps` RL steps (fresh lengths each; accept - 1 scaled per step by `--accept-scale`, a given
    staleness curve): per source, the plain and TLT rollouts and steps, time at <= 32/8/2 running rows,
    idle and spot-used device-seconds; and the last step's timelines."""
    stats: dict[str, dict[str, list]] = {name: defaultdict(list) for name in sources}
    last = {}
    for step in range(args.steps):
        lengths = step_lengths(args, step)
        plain = rm.simulate_rollout(lengths, args.prompt_len, roof, lambda *a: rm.Mode(), **kw)
        other = plain.seconds * (1 - PAPER["rollout_share"]) / PAPER["rollout_share"]
        scale = args.accept_scale[step % len(args.accept_scale)]  # the drafter's staleness at this step
        for name, (modes0, _) in sources.items():
            modes = [dataclasses.replace(m, accept=1 + (m.accept - 1) * scale) for m in modes0]
            tlt = rm.simulate_rollout(
                lengths, args.prompt_len, roof, tlt_chooser(modes, roof, args.threshold), **kw
            )
            st, end = stats[name], tlt.decode_seconds
            st["roll"].append((plain.seconds, tlt.seconds))
            st["step"].append((rm.step_time(plain.seconds, other), rm.step_time(tlt.seconds, other)))
            st["tail"].append([tl.seconds_at_running(k) for tl in (plain, tlt) for k in (32, 8, 2)])
            st["idle"].append(rm.idle_device_seconds(tlt.device_done, end))
            st["spot"].append(rm.spot_seconds_used(tlt.device_done, end, args.spot_step))
            last[name] = (plain, tlt)
    return stats, last


def project(args: argparse.Namespace) -> None:
    """Qwen2.5-7B GRPO steps on D x H100 (roofline or --measured costs): plain vs TLT per accept source."""

    gpu = ps.load_gpu_run(pathlib.Path(args.gpu_run))
    rows = max(args.prompts * args.samples // args.devices, 128)  # a device's rows (Fig 14: 128 on one)
    more = "; host time per chunk SmolLM2's on the H100, the non-rollout time the paper's share (not 7B's)"
    roof, costs, spot, args.spot_step = mc.projection_costs(
        gpu, args.measured, args.spot_step, rows, ps.accept_bias(gpu) + more
    )
    device = getattr(roof, "device", "") or gpu["device"]
    d = args.devices
    sources = project_sources(gpu)
    kw = dict(
        devices=d,
        shape=rm.EngineShape(16, 1024, args.prompt_len + args.max_new),
        max_new=args.max_new,
        max_lookahead=max(m.lookahead for ms, _ in sources.values() for m in ms),
        prefill=roof.forward(args.prompts // d, args.prompt_len, args.prompt_len),  # unique prompts, once
        chunk_overhead=args.chunk_overhead,
        rollout_overhead=args.rollout_overhead,
    )
    lengths = (
        f"resampled from {args.lengths} (scaled x{args.max_new / args.lengths_cap:.0f})"
        if args.lengths
        else f"log-normal (median {args.median:.0f}, sigma {args.sigma})"
    )
    print(
        f"PROJECTION (not measured): Qwen2.5-7B bf16 GRPO on {d} x {device} (data parallel, one "
        f"replica each), {args.prompts} prompts x {args.samples} samples, prompt {args.prompt_len} tokens, "
        f"responses {lengths} cut at {args.max_new}; costs: {costs}, host "
        f"{1e3 * args.chunk_overhead:.1f} ms per chunk of 16 steps and {args.rollout_overhead} s per rollout "
        f"(the H100 e2e run's); SD below {args.threshold} running rows per device, the fastest of plain and "
        "TV 4..64 per bucket (converged BEG-MAB); the rest of the step = "
        f"{100 * (1 - PAPER['rollout_share']):.0f}% of the plain step (the paper's rollout share); spot "
        f"drafter step {1e3 * args.spot_step:.0f} ms ({spot}); {args.steps} RL steps, fresh lengths each, "
        f"accept - 1 scaled per step by {args.accept_scale}"
    )
    stats, last = project_steps(args, roof, sources, kw)
    head = ("source", "accept@48", "roll plain", "roll TLT", "step plain", "step TLT", "rollout", "e2e")
    print("\n" + " ".join(f"{h:>10}" for h in head) + "  idle/spot dev-s  <=32/8/2 rows s: plain -> TLT")
    res = {}
    for name, st in stats.items():
        rp, rt = (float(np.mean(x)) for x in zip(*st["roll"], strict=True))
        sp, stl = (float(np.mean(x)) for x in zip(*st["step"], strict=True))
        tail = np.mean(st["tail"], axis=0)
        idle, spot = float(np.mean(st["idle"])), float(np.mean(st["spot"]))
        cells = (name, f"{sources[name][1]:.2f}", *(f"{x:.0f}s" for x in (rp, rt, sp, stl)))
        print(
            " ".join(f"{c:>10}" for c in (*cells, f"{rp / rt:.2f}x", f"{sp / stl:.2f}x"))
            + f"  {idle:>6.0f}/{spot:<6.0f}  "
            + f"{tail[0]:.0f}/{tail[1]:.0f}/{tail[2]:.0f} -> {tail[3]:.0f}/{tail[4]:.0f}/{tail[5]:.0f}"
        )
        res.update({f"e2e_speedup_{name}": sp / stl, f"rollout_speedup_{name}": rp / rt})
        res.update({f"step_s_plain_{name}": sp, f"step_s_tlt_{name}": stl})
        res.update({f"idle_device_s_{name}": idle, f"spot_used_device_s_{name}": spot})
    print(f"paper (measured, 64 H100): e2e {PAPER['e2e'][0]}-{PAPER['e2e'][1]}x")
    res.update(fig14(args, roof, sources))
    plot_profile(last, pathlib.Path(args.out) / "simulate_rl_projection.png")
    h.result(res, args)


def fig14(args: argparse.Namespace, roof: Any, sources: dict) -> dict[str, float]:
    """The paper's case study shape: 128 requests on one device, SD below 32 running; rollout speedup."""
    lengths = step_lengths(args, 0, 128)
    shape = rm.EngineShape(16, 1024, args.prompt_len + args.max_new)
    kw = dict(shape=shape, max_new=args.max_new, max_lookahead=64, chunk_overhead=args.chunk_overhead)
    plain = rm.simulate_rollout(lengths, args.prompt_len, roof, lambda *a: rm.Mode(), **kw)
    out = {}
    print("\nFig 14 case study (PROJECTION): 128 requests, one device, SD below 32 running (paper 2.44x)")
    for name, (modes, _) in sources.items():
        tlt = rm.simulate_rollout(lengths, args.prompt_len, roof, tlt_chooser(modes, roof, 32), **kw)
        out[f"fig14_rollout_speedup_{name}"] = plain.seconds / tlt.seconds
        t32 = (plain.seconds_at_running(32), tlt.seconds_at_running(32))
        sp = out[f"fig14_rollout_speedup_{name}"]
        print(
            f"  {name:>10}: {plain.seconds:.0f} s -> {tlt.seconds:.0f} s ({sp:.2f}x); time at <= 32 running "
            f"rows {t32[0]:.0f} s -> {t32[1]:.0f} s"
        )
    return out


def plot_profile(tls: dict[str, tuple[rm.RolloutTimeline, rm.RolloutTimeline]], path: pathlib.Path) -> None:
    """Running rows over the rollout, plain vs TLT, per acceptance source (the paper's Fig 14 shape)."""
    plt = h.pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    plain = next(iter(tls.values()))[0].profile()
    ax.step([p[0] for p in plain], [p[1] for p in plain], where="post", label="plain", color="k")
    for name, (_, tlt) in tls.items():
        prof = tlt.profile()
        ax.step([p[0] for p in prof], [p[1] for p in prof], where="post", label=f"TLT, accept: {name}")
    ax.set(xlabel="decode seconds", ylabel="running rows (all devices)", yscale="log")
    ax.set_title("PROJECTED running rows of one rollout (Qwen2.5-7B, 8 x H100)", fontsize=9)
    ax.legend(fontsize=7)
    h.save_plot(fig, path)
    print(f"plot: {path}")


def main() -> None:
    """`--validate DIR`: predict an e2e run from measured costs; otherwise the 7B projection."""
    ap = h.parser(__doc__, quick=None, out=h.ROOT / "workdirs" / "simulate_rl")
    ap.add_argument("--validate", default=None, help="an e2e_speedup --out folder to predict")
    ap.add_argument("--costs", default=None, help="a step_costs.py JSON (default: measure it now)")
    ap.add_argument("--max-new", type=int, default=384, help="the run's response cap (configs/tlt.py)")
    ap.add_argument("--plot", default=None, help="PNG path (default <run>/simulate_rl_validate.png)")
    ap.add_argument("--gpu-run", default=str(ps.GPU_RUN), help="projection: a GPU suite output folder")
    ap.add_argument("--devices", type=int, default=8, help="projection: data-parallel devices")
    ap.add_argument("--prompts", type=int, default=128, help="projection: prompts per RL step")
    ap.add_argument("--samples", type=int, default=8, help="projection: samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--median", type=float, default=4096.0, help="projection: median response length")
    ap.add_argument("--sigma", type=float, default=0.8, help="projection: log-normal sigma of the lengths")
    ap.add_argument("--threshold", type=int, default=32, help="projection: SD below this many rows/device")
    ap.add_argument("--chunk-overhead", type=float, default=2.7e-3, help="projection: host s per chunk")
    ap.add_argument("--rollout-overhead", type=float, default=0.13, help="projection: host s per rollout")
    ap.add_argument(
        "--spot-step",
        type=float,
        default=None,
        help=f"projection: drafter step s (default: --measured's, else {mc.SPOT_STEP_ASSUMED}, assumed)",
    )
    ap.add_argument(
        "--measured",
        default=None,
        help="projection: a GPU call's 7B costs (the GPU suite's call 1 summary.json; several, "
        "comma-separated, merge), not the roofline",
    )
    ap.add_argument("--steps", type=int, default=3, help="projection: RL steps (fresh lengths each)")
    ap.add_argument("--lengths", default=None, help="projection: a rollouts.jsonl to resample lengths from")
    ap.add_argument("--lengths-cap", type=int, default=384, help="projection: that run's response cap")
    ap.add_argument(
        "--accept-scale",
        default="1",
        help="projection: per-step multipliers of (accept - 1), cycled: a staleness curve (e.g. 0.8,1,1)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.validate is None:
        args.max_new = 32768 if args.max_new == 384 else args.max_new
        args.accept_scale = [float(x) for x in args.accept_scale.split(",")]
        project(args)
        return
    t0 = time.perf_counter()
    run = pathlib.Path(args.validate)
    if not (run / "history.json").exists():  # one command reproduces the validation's inputs too
        print(f"no e2e run in {run}: e2e_speedup --quick --out {run}", flush=True)
        cmd = [sys.executable, "-m", "experiments.paper.e2e_speedup", "--quick", "--out", str(run)]
        subprocess.run(cmd, cwd=h.ROOT, check=True)
    cost_path = args.costs
    if cost_path is None:
        cost_path = str(run / "step_costs.json")
        print(f"measuring costs on this machine: step_costs.py --out {cost_path}", flush=True)
        cmd = [sys.executable, "-m", "experiments.models.step_costs", "--out", cost_path]
        subprocess.run(cmd, cwd=h.ROOT, check=True)
    costs = CostTable.load(cost_path)
    res = validate(run, costs, args.max_new)
    history = json.loads((run / "history.json").read_text())
    plot = pathlib.Path(args.plot or run / "simulate_rl_validate.png")
    plot_validation(run, costs, len(history["none"]), args.max_new, plot)
    print(f"plot: {plot}; costs {cost_path} ({costs.data['meta'].get('load_average')})")
    res["wall_s"] = time.perf_counter() - t0
    h.result(res, args)


if __name__ == "__main__":
    main()
