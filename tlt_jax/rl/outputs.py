"""What a GRPO run writes to its workdir besides checkpoints: the metric trackers (metrics.jsonl, console,
wandb) and a few sampled responses per step (samples.jsonl: what the policy actually writes).

On resume both files drop the lines of the steps that will be re-run, so a resumed run's files read like an
uninterrupted run's.
"""

from __future__ import annotations

import json
import os

import ml_collections
import numpy as np
from absl import logging

from tlt_jax.rl.reward import Scores
from tlt_jax.rollout.types import Rollout
from tlt_jax.tasks import Problem
from tlt_jax.utils.tracking import MultiTracker, make_trackers, shorten, truncate_jsonl

SAMPLES_FILE = "samples.jsonl"


def open_outputs(
    config: ml_collections.ConfigDict, workdir: str, step: int, is_main: bool
) -> MultiTracker | None:
    """Trim samples.jsonl to the steps done (`step`), open the trackers (process 0 only) and log the config.
    A fresh run logs its held-out eval as step 0: a restart before step 1 drops that line too."""
    if not is_main:
        return None
    truncate_jsonl(os.path.join(workdir, SAMPLES_FILE), step + 1)
    trackers = make_trackers(config, workdir, resume_step=step + 1 if step else 0)
    trackers.log_config(config)
    return trackers


def log_samples(
    workdir: str, step: int, problems: list[Problem], rollout: Rollout, scores: Scores, k: int
) -> None:
    """`k` of the step's responses, evenly spaced over its rows, to workdir/samples.jsonl (the first: to the
    log, question and response cut in the middle at "…" when long)."""
    rows_total = len(scores.texts)
    k = min(k, rows_total)
    if not k:
        return
    rows = np.linspace(0, rows_total - 1, k).astype(int)
    with open(os.path.join(workdir, SAMPLES_FILE), "a", encoding="utf-8") as f:
        for i in rows:
            p, r = problems[int(rollout.prompt_index[i])], scores.results[i]
            line = {
                "step": step,
                "question": p.question,
                "answer": p.answer,
                "response": scores.texts[i],
                "reward": r.reward,
                "correct": r.correct,
            }
            f.write(json.dumps(line) + "\n")
    logging.info(
        "step %d sample (reward %.2f): %r -> %r",
        step,
        scores.results[rows[0]].reward,
        shorten(problems[int(rollout.prompt_index[rows[0]])].question, 80),
        shorten(scores.texts[rows[0]], 200),
    )
