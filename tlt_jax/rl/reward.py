"""The RL step's reward phase: every response decoded and scored by the task's verifier (`Task.score`), plus
DAPO's overlong-response shaping when it is on (config.rl.overlong_buffer > 0).

The two compose as verl/workers/reward_manager/dapo.py's DAPORewardManager composes them: reward = the
checker's score on its scale (`config.task.reward_scale`: VeRL's by default, DAPO's check -1 / +1) + the
shaping term, no clipping of the sum; its `overlong_buffer.log` entries are `reward/overlong_mean` (the mean
of its overlong_reward) and `reward/overlong_frac` (of its `overlong`, the share with a penalty).

Several processes: each row is scored once, by one process (process p scores rows p, p + P, ...), and the
verdicts are shared (`score_texts`: an all-gather, tlt_jax.utils.distributed.allgather_json), so every
process holds the same results. A checker with a wall-clock limit (math-verify's timeout) could otherwise
pass a row in one process and fail it in another; the processes would then filter different groups (dynamic
sampling), run different numbers of generation batches and wait in different collectives. It also divides
the scoring work by P."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import chex
import jax
import numpy as np

from tlt_jax.models.build import TextCodec
from tlt_jax.rollout.types import Rollout
from tlt_jax.tasks import Problem, RewardResult, Task
from tlt_jax.utils.distributed import allgather_json


@dataclasses.dataclass(frozen=True)
class OverlongShaping:
    """DAPO's soft overlong punishment, added to the verifier's reward (Yu et al. 2025, "DAPO: An Open-Source
    LLM Reinforcement Learning System at Scale", arXiv:2503.14476, Sec. 3.4 "Overlong Reward Shaping", Soft
    Overlong Punishment). For a response of L tokens (EOS included), cap L_max (config.rollout.max_new_tokens)
    and buffer L_cache (`buffer`):

        R_length = 0                                    L <= L_max - L_cache
                   ((L_max - L_cache) - L) / L_cache    L_max - L_cache < L <= L_max
                   -1                                   L > L_max

    scaled by `penalty` (VeRL's overlong_buffer.penalty_factor; its DAPO reward manager adds
    min(-(L - (L_max - L_cache)) / L_cache * penalty_factor, 0), the same for L <= L_max). buffer 0: off."""

    buffer: int = 0
    penalty: float = 1.0
    max_len: int = 0

    @property
    def enabled(self) -> bool:
        return self.buffer > 0

    def rewards(self, lengths: np.ndarray) -> np.ndarray:
        """The shaping term [rows] (float32, <= 0) of responses of `lengths` tokens."""
        if not self.enabled:
            return np.zeros(np.shape(lengths), np.float32)
        expected = self.max_len - self.buffer
        frac = (expected - np.asarray(lengths, np.float64)) / self.buffer
        return (np.clip(frac, -1.0, 0.0) * self.penalty).astype(np.float32)


def overlong_problems(buffer: int, max_new_tokens: int) -> list[str]:
    """config.rl.overlong_buffer against the rollout's cap (a GRPO job check; RLSection checks its range)."""
    if buffer < max_new_tokens:
        return []
    return [
        f"config.rl.overlong_buffer={buffer} must be < config.rollout.max_new_tokens={max_new_tokens}: the "
        "buffer is the last part of the length cap (DAPO: 4096 of 20480); 0 turns the shaping off."
    ]


@dataclasses.dataclass(frozen=True)
class Scores:
    """One step's responses as text, their verifier results and the rewards [rows] (float32) RL uses
    (`overlong`: the overlong shaping term already added to `rewards`, when shaping is on)."""

    texts: list[str]
    results: list[RewardResult]
    rewards: np.ndarray
    overlong: np.ndarray | None = None

    @property
    def accuracy(self) -> float:
        return float(np.mean([r.correct for r in self.results]))

    @property
    def format_rate(self) -> float:
        return float(np.mean([r.format_ok for r in self.results]))

    def overlong_metrics(self) -> dict[str, float]:
        """Mean shaping term and the share of responses it punished (nothing when shaping is off)."""
        if self.overlong is None:
            return {}
        return {
            "reward/overlong_mean": float(self.overlong.mean()),
            "reward/overlong_frac": float(np.mean(self.overlong < 0)),
        }


def score_rollout(
    task: Task,
    tokenizer: TextCodec,
    problems: list[Problem],
    rollout: Rollout,
    rows: int,
    overlong: OverlongShaping = OverlongShaping(),
) -> Scores:
    """Decode the `rows` responses of `rollout` and score each against its prompt's problem, with the
    overlong shaping term added when it is on."""
    texts = [tokenizer.decode(rollout.response(i)) for i in range(rows)]
    results = score_texts(task, problems, texts, rollout.prompt_index)
    rewards = np.asarray([r.reward for r in results], np.float32)
    chex.assert_shape([rewards, rollout.lengths], [(rows,), (rows,)])
    if not overlong.enabled:
        return Scores(texts, results, rewards)
    shaping = overlong.rewards(rollout.lengths)
    return Scores(texts, results, rewards + shaping, shaping)


def score_texts(
    task: Task, problems: Sequence[Problem], texts: Sequence[str], prompt_index: Sequence[int]
) -> list[RewardResult]:
    """`task.score` of every response `texts[i]` against `problems[prompt_index[i]]`, each row scored by one
    process (rows p::P) and the results shared, so that every process returns the same list (module
    docstring). Every process must call it at the same point with the same rows."""
    rows, count, me = len(texts), jax.process_count(), jax.process_index()
    if len(prompt_index) != rows:
        raise ValueError(f"{rows} responses but {len(prompt_index)} prompt indices: one per response row")
    mine = [task.score(problems[int(prompt_index[i])], texts[i]) for i in range(me, rows, count)]
    if count == 1:
        return mine
    shared = allgather_json([dataclasses.asdict(r) for r in mine])
    results: list[RewardResult | None] = [None] * rows
    for p, scored in enumerate(shared):
        for i, fields in zip(range(p, rows, count), scored, strict=True):
            results[i] = RewardResult(**fields)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]
