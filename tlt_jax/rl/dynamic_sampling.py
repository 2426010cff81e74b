"""DAPO's dynamic sampling: groups that teach nothing are dropped and more prompts are generated until the
step has its groups (Yu et al. 2025, arXiv:2503.14476, Sec. 3.2; VeRL's `algorithm.filter_groups`, as
recipe/dapo/dapo_ray_trainer.py runs it).

A group whose samples all score the same (all right or all wrong) has zero GRPO advantage: masking it, as a
plain GRPO step would, leaves the step with fewer effective samples, late in training most of them. DAPO
instead keeps generating: each generation batch reads the next `gen_prompts` prompts of the data stream
(`Task.batch`, so the data position stays one integer and a resumed run reads what an uninterrupted one
read), is scored, and contributes its groups whose `filter_metric` varies (`group_keep`: VeRL's
`np.std(...) > 0`) until `prompts` groups are kept; the first `prompts` kept groups, in generation order,
train. When `max_num_gen_batches` batches were not enough, the step stops with VeRL's error (its DAPO
recipe, recipe/dapo/dapo_ray_trainer.py: "Generated too many. Please check if your data are too
difficult."), unless `train_short` (config.rl.train_short_steps, tlt_jax's variant): then the step trains on
what it has, the missing groups filled with dropped ones whose rows are masked out of the loss (static
shapes: the trainer's programs do not change), and says so in `dynamic_sampling/short_groups`. With one
generation batch (dynamic sampling off) the step is exactly the batch it generated.

Filter metrics (VeRL's names): "acc" VeRL's acc (the verdict, or a custom function's number itself:
`RewardResult.acc_value`), "score" the scorer's own value (`RewardResult.score_value`: before a format bonus
and overlong shaping, VeRL's reward_extra_info "score"), "seq_reward" the reward the advantages use before
any KL penalty (score, format bonus and overlong shaping), "seq_final_reward" VeRL's reward after a KL
penalty in the reward: here the same as "seq_reward", and refused together with KL in the reward (its
reference pass would run over every generation batch, dropped groups included;
tlt_jax.config_sections.RLSection).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import chex
import jax
import numpy as np

from tlt_jax.config_sections import FILTER_METRICS
from tlt_jax.rl.reward import Scores
from tlt_jax.rollout.types import Rollout, RolloutStats
from tlt_jax.tasks import Problem


@dataclasses.dataclass(frozen=True)
class GenBatch:
    """One generation batch: its prompts' problems (prompt-major rows: `group` rows per problem), the
    rollout and its scores."""

    problems: list[Problem]
    rollout: Rollout
    scores: Scores


def generation_key(step_key: jax.Array, index: int) -> jax.Array:
    """The sampling key of the step's generation batch `index`: batch 0 keeps the key a step without
    dynamic sampling uses (fold_in(step_key, 0)), later batches fold their index into it."""
    key = jax.random.fold_in(step_key, 0)
    return key if index == 0 else jax.random.fold_in(key, index)


def filter_values(scores: Scores, metric: str) -> np.ndarray:
    """[rows] float64: what `metric` compares within a group."""
    if metric not in FILTER_METRICS:
        raise ValueError(f"unknown filter metric {metric!r}; valid: {FILTER_METRICS}")
    if metric == "acc":
        return np.asarray([r.acc_value for r in scores.results], np.float64)
    if metric == "score":
        return np.asarray([r.score_value for r in scores.results], np.float64)
    return np.asarray(scores.rewards, np.float64)


def group_keep(values: np.ndarray, group: int) -> np.ndarray:
    """[groups] bool: True for groups whose values are not all equal (VeRL: std > 0, or a group of one)."""
    chex.assert_rank(values, 1)
    if values.shape[0] % group:
        raise ValueError(f"{values.shape[0]} rows are not a whole number of groups of {group}")
    grouped = values.reshape(-1, group)
    return (np.std(grouped, axis=1) > 0) | (group == 1)


def _merge_stats(stats: list[RolloutStats]) -> RolloutStats:
    """The step's rollout statistics: every generation batch's decode steps, chunks and times, in order."""
    out = RolloutStats()
    for s in stats:
        out.running_per_step += s.running_per_step
        out.sd_per_step += s.sd_per_step
        out.seconds_per_step += s.seconds_per_step
        out.chunks += s.chunks
        for phase, seconds in s.phase_seconds.items():
            out.add_time(phase, seconds)
        out.num_tokens += s.num_tokens
        out.wall_seconds += s.wall_seconds
    return out


def _pad_columns(x: np.ndarray, width: int) -> np.ndarray:
    return np.pad(x, ((0, 0), (0, width - x.shape[1])))


def take_groups(batches: list[GenBatch], picks: list[tuple[int, int]], group: int) -> GenBatch:
    """The groups `picks` ((batch, group index) pairs, in order) as one batch: rows prompt-major, response
    columns padded to the widest batch, the rollout statistics of every batch (the step's whole rollout)."""
    width = max(b.rollout.tokens.shape[1] for b in batches)
    problems, rows = [], []
    for bi, gi in picks:
        problems.append(batches[bi].problems[gi])
        rows += [(bi, r) for r in range(gi * group, (gi + 1) * group)]

    def cat(get: Callable[[GenBatch, int], object]) -> list:
        return [get(batches[bi], r) for bi, r in rows]

    rollout = Rollout(
        prompt_tokens=cat(lambda b, r: b.rollout.prompt_tokens[r]),
        prompt_index=np.repeat(np.arange(len(picks)), group),
        tokens=np.stack(cat(lambda b, r: _pad_columns(b.rollout.tokens[r : r + 1], width)[0])),
        logprobs=np.stack(cat(lambda b, r: _pad_columns(b.rollout.logprobs[r : r + 1], width)[0])),
        lengths=np.asarray(cat(lambda b, r: b.rollout.lengths[r])),
        finish_reason=cat(lambda b, r: b.rollout.finish_reason[r]),
        stats=_merge_stats([b.rollout.stats for b in batches]),
    )
    shaped = all(b.scores.overlong is not None for b in batches)
    scores = Scores(
        texts=cat(lambda b, r: b.scores.texts[r]),
        results=cat(lambda b, r: b.scores.results[r]),
        rewards=np.asarray(cat(lambda b, r: b.scores.rewards[r]), np.float32),
        overlong=np.asarray(cat(lambda b, r: b.scores.overlong[r]), np.float32) if shaped else None,
    )
    return GenBatch(problems, rollout, scores)


@dataclasses.dataclass(frozen=True)
class StepSamples:
    """What the step trains on: `prompts` groups (`batch`), `keep` [rows] (False: a filler group's rows,
    masked out of the loss), and the dynamic-sampling metrics."""

    batch: GenBatch
    keep: np.ndarray
    metrics: dict[str, float]


class GroupCollector:
    """Collects a step's groups over generation batches: `add` each scored batch, `full` says when to stop
    generating, `samples()` assembles the step (`prompts` groups of `group` rows each)."""

    def __init__(
        self,
        prompts: int,
        group: int,
        metric: str,
        max_batches: int,
        enabled: bool = True,
        train_short: bool = False,
    ):
        self.prompts, self.group, self.metric = prompts, group, metric
        self.max_batches, self.enabled, self.train_short = max_batches, enabled, train_short
        self.batches: list[GenBatch] = []
        self.keeps: list[np.ndarray] = []

    def add(self, batch: GenBatch) -> None:
        values = filter_values(batch.scores, self.metric)
        keep = group_keep(values, self.group) if self.enabled else np.ones(len(batch.problems), bool)
        chex.assert_shape(keep, (len(batch.problems),))
        self.batches.append(batch)
        self.keeps.append(keep)

    @property
    def kept(self) -> int:
        return int(sum(k.sum() for k in self.keeps))

    @property
    def full(self) -> bool:
        """Enough groups kept, or no more generation batches allowed (dynamic sampling off: after one)."""
        if not self.batches:
            return False
        if self.kept >= self.prompts or not self.enabled:
            return True
        return 0 < self.max_batches <= len(self.batches)

    def samples(self) -> StepSamples:
        """The first `prompts` kept groups in generation order, then (when short, with `train_short`) dropped
        ones as fillers; short without `train_short`: VeRL's error."""
        kept = [(b, g) for b, k in enumerate(self.keeps) for g in np.flatnonzero(k)]
        if self.enabled and len(kept) < self.prompts and not self.train_short:
            raise ValueError(
                f"num_gen_batches={len(self.batches)} >= max_num_gen_batches={self.max_batches}: "
                f"{len(kept)} of the {self.prompts} groups the step needs were kept. Generated too many. "
                "Please check if your data are too difficult. You could also try set max_num_gen_batches=0 "
                "to enable endless trials (VeRL's DAPO recipe); or set config.rl.train_short_steps=True to "
                "train on the groups kept (the rest masked out of the loss)."
            )
        dropped = [(b, g) for b, k in enumerate(self.keeps) for g in np.flatnonzero(~k)]
        picks = (kept + dropped)[: self.prompts]
        if len(picks) < self.prompts:
            raise ValueError(f"{len(picks)} groups generated, the step needs {self.prompts}")
        short = max(self.prompts - len(kept), 0)
        keep = np.repeat(np.arange(self.prompts) < self.prompts - short, self.group)
        batch = take_groups(self.batches, [(b, int(g)) for b, g in picks], self.group)
        rewards = np.concatenate([b.scores.rewards for b in self.batches])
        correct = [r.correct for b in self.batches for r in b.scores.results]
        metrics = {  # what was generated (all batches) beside what trains
            "dynamic_sampling/gen_batches": float(len(self.batches)),
            "dynamic_sampling/generated_groups": float(sum(len(k) for k in self.keeps)),
            "dynamic_sampling/kept_groups": float(min(len(kept), self.prompts)),
            "dynamic_sampling/short_groups": float(short),
            "dynamic_sampling/generated_reward_mean": float(np.mean(rewards)),
            "dynamic_sampling/generated_accuracy": float(np.mean(correct)),
        }
        return StepSamples(batch, keep, metrics if self.enabled else {})
