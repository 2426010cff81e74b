"""A kill anywhere, then the same run: SIGKILL the RL job at chosen phases, relaunch it, compare (issue #26).

The job is `python -m tlt_jax.main` on the smoke config with speculative rollouts, the spot trainer (an EAGLE
drafter trained from scratch between chunks, its data buffer saved beside each checkpoint) and a fixed-table
selector (EAGLE above 8 running rows, plain at 5-8, n-gram at <= 4: its choices do not depend on timing).
The script runs it once uninterrupted (the reference), then in a second workdir launches it, SIGKILLs it in
a chosen phase, relaunches the same command, and so on `--kills` times; the last launch runs to the end.

Where a kill lands (tlt_jax/utils/kill_runs.py): the learner writes its phase to `<workdir>/.phase` ("<step>
<phase>", tlt_jax/utils/phase.py). A watcher polls it (and `checkpoints/` for orbax's `<step>.orbax-
checkpoint-tmp` folder) every ~0.5 ms, waits for the target phase at or after the aimed step (random, or the
plan's), sleeps a random delay and sends SIGKILL; the phase file read after the process is dead says where it
was (a phase that went by unseen: the first later one). Targets:
  init          building the learner and restoring the latest checkpoint
  rollout       generation: SD chunks, the spot trainer's steps between them
  reward        scoring and advantages
  update        the policy update and the pushes of policy and drafter into the engine
  buffer_save   the spot trainer's data buffer written for the checkpoint (synchronous, before it)
  checkpoint    the checkpoint's blocking part: device->host copies of the policy and AdamW state, the
                drafter and its optimizer, the selector state, the rng (a save in flight is waited on first)
  async_write   orbax writing that checkpoint in the background while the next step runs. The drafter and
                the selector state are leaves of that one checkpoint: they have no save of their own.
`landed` is "async_write" when a kill outside the checkpoint phase left a half-written checkpoint folder.

Checks (`compare_runs`, shared with tests/test_kill_loop.py): the run finishes; the final checkpoint's
leaves (policy, AdamW state, drafter weights and optimizer, selector state, rng) and the final spot buffer are
bit-identical to the reference's, except the selector's reward windows (tokens/s: timings), of which only the
filled slots are compared; the deterministic metrics and samples.jsonl equal the reference's; metrics.jsonl
has each step exactly once; nothing half-written remains (`leftovers`).

    python -m experiments.checks.kill_loop                 # 12 kills over an 8-step run
    python -m experiments.checks.kill_loop --quick         # 3 kills over 3 steps (the test's plan)

Final line: `RESULT kills=N phases=<landed phase>:<count>,... identical=yes|no steps_once=yes|no
leftovers=N`; plots/kill_loop.png (the phases of every launch over time, the kills marked) and with --json
the kills and the comparison.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

from experiments.lib import harness
from tlt_jax.utils.kill_runs import (
    PHASES,
    QUICK_PLAN,
    Launch,
    compare_runs,
    job_command,
    job_env,
    kill_loop,
    launch,
)

# 12 kills: every target, those the issue names twice
LONG_PLAN = tuple(
    "rollout reward update buffer_save checkpoint async_write init "
    "rollout reward update checkpoint async_write".split()
)

# ---- the script --------------------------------------------------------------------------------------------


def landed_summary(launches: Sequence[Launch]) -> str:
    """'<landed phase>:<count>,...' over the kills, in phase order."""
    order = [*PHASES, "async_write", "startup"]
    counts = collections.Counter(run.kill.landed for run in launches if run.kill)
    return ",".join(
        f"{p}:{counts[p]}" for p in sorted(counts, key=lambda p: order.index(p) if p in order else 99)
    )


def plot(launches: Sequence[Launch], reference: Launch, path: pathlib.Path) -> pathlib.Path:
    """One row per launch (the reference at the bottom): its phases over time as coloured spans (hatched
    while a checkpoint is written in the background), each kill as a red cross labelled with where it
    landed."""
    plt = harness.pyplot()
    rows = [reference, *launches]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * len(rows)))
    colours = dict(zip(PHASES, plt.get_cmap("tab20").colors, strict=False))
    seen: set[str] = set()
    for y, run in enumerate(rows):
        marks = [*run.trace, (run.kill.seconds if run.kill else run.seconds, "end")]
        for (t, mark), (t_next, _) in zip(marks[:-1], marks[1:], strict=True):
            phase = mark.split()[1]
            label = None if phase in seen else phase
            seen.add(phase)
            ax.barh(
                y,
                t_next - t,
                left=t,
                height=0.6,
                color=colours.get(phase, "lightgrey"),
                label=label,
                hatch="//" if mark.endswith("+write") else None,
                edgecolor="white",
                linewidth=0.2,
            )
        if run.kill:
            ax.plot(run.kill.seconds, y, "x", color="red", markersize=10, mew=2.5)
            ax.annotate(
                run.kill.where,
                (run.kill.seconds, y + 0.32),
                fontsize=7,
                color="darkred",
            )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(
        ["uninterrupted"] + [f"launch {r.index} (from {r.resumed_from or 'scratch'})" for r in launches]
    )
    ax.set_xlabel("seconds since the launch (hatched: a checkpoint written in the background)")
    ax.set_title(f"{sum(1 for r in launches if r.kill)} SIGKILLs, then the same run: where each landed")
    ax.legend(fontsize=7, ncol=7, loc="upper center", bbox_to_anchor=(0.5, -0.35 * 6 / (len(rows) + 4)))
    return harness.save_plot(fig, path)


def parse_args() -> Any:
    ap = harness.parser(__doc__, quick="3 steps, 3 kills (rollout, async_write, checkpoint: the test's plan)")
    ap.add_argument("--steps", type=int, default=8, help="steps of the run (default 8; --quick: 3)")
    ap.add_argument("--kills", type=int, default=len(LONG_PLAN), help="kills, targets cycled from the plan")
    ap.add_argument("--seed", type=int, default=0, help="seeds the aimed steps and the delays")
    ap.add_argument("--cache", default=None, help="the jobs' compilation cache (default: the job's own)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    # this process restores the jobs' checkpoints, written from 2 fake devices: JAX must see as many here
    os.environ["XLA_FLAGS"] = job_env()["XLA_FLAGS"]
    out = harness.out_dir(args, "kill_loop")
    steps = 3 if args.quick else args.steps
    plan: list[tuple[str, int | None]] = (
        list(QUICK_PLAN) if args.quick else [(LONG_PLAN[i % len(LONG_PLAN)], None) for i in range(args.kills)]
    )
    env = job_env(args.cache)
    ref_dir, got_dir = out / "reference", out / "killed"
    for d in (ref_dir, got_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    print(f"job: {' '.join(job_command('W', steps)[1:])}", flush=True)
    t0 = time.monotonic()
    reference = launch(ref_dir, steps, env, out / "reference.log", 0)
    if reference.returncode != 0:
        sys.exit(f"the uninterrupted run failed ({reference.returncode}); see {out / 'reference.log'}")
    print(f"reference: {steps} steps in {reference.seconds:.1f}s", flush=True)
    launches = kill_loop(got_dir, steps, plan, env, out, seed=args.seed, say=lambda s: print(s, flush=True))
    cmp = compare_runs(ref_dir, got_dir, steps)
    for d in cmp.differences + [f"leftover {x}" for x in cmp.leftovers]:
        print(f"  {d}")
    png = plot(launches, reference, out / "plots" / "kill_loop.png")
    print(f"plot: {png}; {time.monotonic() - t0:.0f}s in all", flush=True)
    kills = [run.kill for run in launches if run.kill]
    path = harness.json_path(args)
    if path is not None:
        details = {
            "command": job_command("W", steps)[1:],
            "steps": steps,
            "launches": [
                dataclasses.asdict(r) | {"landed": r.kill.landed if r.kill else None} for r in launches
            ],
            "comparison": dataclasses.asdict(cmp),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(details, indent=2))
    harness.result(
        {
            "kills": len(kills),
            "phases": landed_summary(launches),
            "identical": "yes" if cmp.identical else "no",
            "steps_once": "yes" if cmp.steps_once else "no",
            "leftovers": len(cmp.leftovers),
        },
        args,
    )


if __name__ == "__main__":
    main()
