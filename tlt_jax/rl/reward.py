"""The RL step's reward phase: every response decoded and scored by the task's verifier (`Task.score`)."""

from __future__ import annotations

import dataclasses

import chex
import numpy as np

from tlt_jax.models.build import TextCodec
from tlt_jax.rollout.types import Rollout
from tlt_jax.tasks import Problem, RewardResult, Task


@dataclasses.dataclass(frozen=True)
class Scores:
    """One step's responses as text, their verifier results and the rewards [rows] (float32) RL uses."""

    texts: list[str]
    results: list[RewardResult]
    rewards: np.ndarray

    @property
    def accuracy(self) -> float:
        return float(np.mean([r.correct for r in self.results]))

    @property
    def format_rate(self) -> float:
        return float(np.mean([r.format_ok for r in self.results]))


def score_rollout(
    task: Task, tokenizer: TextCodec, problems: list[Problem], rollout: Rollout, rows: int
) -> Scores:
    """Decode the `rows` responses of `rollout` and score each against its prompt's problem."""
    texts = [tokenizer.decode(rollout.response(i)) for i in range(rows)]
    results = [task.score(problems[int(g)], t) for g, t in zip(rollout.prompt_index, texts, strict=True)]
    rewards = np.asarray([r.reward for r in results], np.float32)
    chex.assert_shape([rewards, rollout.lengths], [(rows,), (rows,)])
    return Scores(texts, results, rewards)
