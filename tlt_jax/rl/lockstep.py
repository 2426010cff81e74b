"""Several GRPO runs in lockstep, in one process: the paired-run harness of the end-to-end experiments.

`run_lockstep({"none": cfg_a, "eagle": cfg_b}, root, steps)` builds one `Learner` per config (workdirs
`root/<name>`) and runs step 1 of each, then step 2 of each, and so on, so a drift of the machine's speed
affects every arm alike and the per-step metrics are paired. With coupled verification the arms see the
same samples, so what differs between them is speed (and the drafter), not the learning.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping
from typing import Any

from tlt_jax.rl.learner import Learner


def run_lockstep(
    configs: Mapping[str, Any],
    root: str | pathlib.Path,
    steps: int,
    on_step: Callable[[int, str, dict[str, float]], None] | None = None,
) -> dict[str, list[dict[str, float]]]:
    """Run `steps` RL steps of every config in lockstep; returns each arm's per-step metrics."""
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
        for step in range(1, steps + 1):
            for name, learner in learners.items():
                m = learner.train_step()
                history[name].append(m)
                if on_step is not None:
                    on_step(step, name, m)
    finally:
        for learner in learners.values():
            learner.close()
    return history


def quiet(cfg: Any, steps: int) -> Any:
    """A config for a benchmark arm: `steps` steps, no progress bar, no sample logs, no wandb."""
    cfg.num_steps = steps
    cfg.progress_bar = False
    cfg.log_samples = 0
    cfg.wandb.mode = "disabled"
    return cfg
