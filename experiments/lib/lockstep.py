"""Several GRPO runs in lockstep, in one process: the paired-run harness of the end-to-end experiments.

`run_lockstep({"none": cfg_a, "eagle": cfg_b}, root, steps)` builds one `Learner` per config (workdirs
`root/<name>`) and runs step 1 of each, then step 2 of each, and so on, so a drift of the machine's speed
affects every arm alike and the per-step metrics are paired. With coupled verification the arms see the
same samples, so what differs between them is speed (and the drafter), not the learning.

Each step's metrics include what the step compiled (`compile/*`: seconds per kind, as `Learner.train` logs
them), so a benchmark can take compilation out of every phase, not only the rollout's, and the machine's
1-minute load average at the step's end (`machine/load_avg_1m`). `on_rollout(step, name, rollout)` sees
each step's training rollout (its response lengths and chunk records: what `experiments/models/simulate_rl.py`
replays); `rollout_record` turns one into a JSON-able dict.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tlt_jax.rl.learner import Learner
from tlt_jax.rollout.types import Rollout
from tlt_jax.utils import compile_stats

# the ChunkRecord fields a rollout record keeps (all but accept_hist)
CHUNK_FIELDS = (
    "mode",
    "batch_bucket",
    "cache_bucket",
    "steps",
    "running_start",
    "seconds",
    "accepted_tokens",
    "verify_rounds",
    "new_tokens",
    "strategy",
    "running",
    "compiled",
    "compile_seconds",
)


def run_lockstep(
    configs: Mapping[str, Any],
    root: str | pathlib.Path,
    steps: int,
    on_step: Callable[[int, str, dict[str, float]], None] | None = None,
    on_rollout: Callable[[int, str, Rollout], None] | None = None,
    on_done: Callable[[str, Learner], None] | None = None,
) -> dict[str, list[dict[str, float]]]:
    """Run `steps` RL steps of every config in lockstep; returns each arm's per-step metrics. `on_done`
    sees each arm's learner after its last step, before it closes (e.g. to read its spot-trained drafter)."""
    root = pathlib.Path(root)
    learners: dict[str, Learner] = {}
    history: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    try:
        for name, cfg in configs.items():
            wd = root / name
            if wd.exists() and any(wd.iterdir()):
                raise FileExistsError(
                    f"{wd} is not empty: use a new output folder (the arms start at step 0)"
                )
            learners[name] = Learner(cfg, str(wd))
            if on_rollout is not None:
                _watch_rollouts(learners[name], name, on_rollout)
        for step in range(1, steps + 1):
            for name, learner in learners.items():
                before = compile_stats.compile_log().snapshot()
                m = learner.train_step()
                m.update(compile_stats.compile_log().snapshot().delta(before).metrics())
                m["machine/load_avg_1m"] = os.getloadavg()[0]  # timings on a shared machine need it
                history[name].append(m)
                if on_step is not None:
                    on_step(step, name, m)
        for name, learner in learners.items():
            if on_done is not None:
                on_done(name, learner)
    finally:
        for learner in learners.values():
            learner.close()
    return history


def _watch_rollouts(learner: Learner, name: str, on_rollout: Callable[[int, str, Rollout], None]) -> None:
    """Pass every training rollout of `learner` to `on_rollout` (the step it belongs to, the arm's name)."""
    inner = learner._rollout

    def rollout(problems: Any, key: Any, params: Any) -> Rollout:
        out = inner(problems, key, params)
        on_rollout(learner.step + 1, name, out)  # learner.step counts completed steps
        return out

    learner._rollout = rollout


def rollout_record(rollout: Rollout) -> dict[str, Any]:
    """What a rollout's timing depends on, as JSON: per-row response and prompt lengths, the host/prefill/
    decode phase seconds, the wall time and every chunk's record (mode, buckets, steps, seconds, ...)."""
    stats = rollout.stats
    return {
        "lengths": [int(x) for x in np.asarray(rollout.lengths)],
        "prompt_lengths": [len(p) for p in rollout.prompt_tokens],
        "finish_reason": list(rollout.finish_reason),
        "phase_seconds": dict(stats.phase_seconds),
        "wall_seconds": float(stats.wall_seconds),
        "chunks": [
            {k: v for k, v in dataclasses.asdict(c).items() if k in CHUNK_FIELDS} for c in stats.chunks
        ],
    }


def quiet(cfg: Any, steps: int) -> Any:
    """A config for a benchmark arm: `steps` steps, no progress bar, no sample logs, no wandb."""
    cfg.num_steps = steps
    cfg.progress_bar = False
    cfg.log_samples = 0
    cfg.wandb.mode = "disabled"
    return cfg
