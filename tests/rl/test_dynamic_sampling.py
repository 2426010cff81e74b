"""DAPO's dynamic sampling (tlt_jax/rl/dynamic_sampling.py): which groups a filter metric keeps, generation
batches collected until the step is full or the batch limit is reached (fillers masked), the merged batch.
A learner that refills with TLT on and resumes exactly: tests/rl/test_learner_sd.py's resumed run."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tlt_jax.rl.dynamic_sampling import (
    GenBatch,
    GroupCollector,
    filter_values,
    generation_key,
    group_keep,
)
from tlt_jax.rl.reward import Scores
from tlt_jax.rollout.types import ChunkRecord, Rollout, RolloutStats
from tlt_jax.tasks import Problem, RewardResult


def gen_batch(tag: str, correct: list[list[bool]], rewards: list[list[float]], width: int) -> GenBatch:
    """Groups of `len(correct[g])` rows; row tokens [row id + 1] * length, lengths 1, 2, ...; one chunk."""
    group = len(correct[0])
    rows = len(correct) * group
    lengths = np.arange(rows) % width + 1
    tokens = np.where(np.arange(width)[None] < lengths[:, None], np.arange(rows)[:, None] + 1, 0)
    chunk = ChunkRecord("plain", rows, 16, 4, rows, 1.0, new_tokens=int(lengths.sum()))
    rollout = Rollout(
        prompt_tokens=[[g] for g in range(len(correct)) for _ in range(group)],
        prompt_index=np.repeat(np.arange(len(correct)), group),
        tokens=tokens,
        logprobs=-np.ones((rows, width), np.float32),
        lengths=lengths,
        finish_reason=["eos"] * rows,
        stats=RolloutStats(chunks=[chunk], num_tokens=int(lengths.sum()), wall_seconds=1.5),
    )
    flat_c, flat_r = sum(correct, []), sum(rewards, [])
    results = [RewardResult(r, c, True, None) for c, r in zip(flat_c, flat_r, strict=True)]
    scores = Scores([f"{tag}{i}" for i in range(rows)], results, np.asarray(flat_r, np.float32))
    problems = [Problem(f"{tag}-{g}", f"q{g}", "a", {}) for g in range(len(correct))]
    return GenBatch(problems, rollout, scores)


def test_filter_metrics_and_group_keep() -> None:
    # group 0: one right (acc varies); group 1: all wrong, rewards differ by the overlong shaping term;
    # group 2: all right, equal rewards
    b = gen_batch("x", [[1, 0], [0, 0], [1, 1]], [[1.0, 0.0], [-0.25, 0.0], [1.0, 1.0]], 4)
    acc, score = filter_values(b.scores, "acc"), filter_values(b.scores, "score")
    np.testing.assert_array_equal(acc, [1, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(group_keep(acc, 2), [True, False, False])
    np.testing.assert_array_equal(group_keep(score, 2), [True, True, False])
    np.testing.assert_array_equal(filter_values(b.scores, "seq_final_reward"), score)
    np.testing.assert_array_equal(group_keep(np.asarray([0.0, 0.0]), 1), [True, True])  # VeRL: n == 1
    with pytest.raises(ValueError, match="unknown filter metric"):
        filter_values(b.scores, "pass")
    with pytest.raises(ValueError, match="whole number of groups"):
        group_keep(acc, 4)


def test_collector_refills_in_order_then_fills_short_steps_masked() -> None:
    r = [[1.0, 0.0]]  # rewards only matter for the merged scores
    first = gen_batch("a", [[1, 1], [1, 0], [0, 0]], r * 3, width=3)  # keeps group 1
    second = gen_batch("b", [[0, 1], [0, 0], [1, 0]], r * 3, width=5)  # keeps groups 0 and 2
    full = GroupCollector(prompts=2, group=2, metric="acc", max_batches=5)
    full.add(first)
    assert not full.full and full.kept == 1
    full.add(second)
    assert full.full and full.kept == 3
    s = full.samples()
    assert [p.uid for p in s.batch.problems] == ["a-1", "b-0"]  # the first two kept, in generation order
    np.testing.assert_array_equal(s.keep, [True] * 4)
    ro = s.batch.rollout
    assert ro.tokens.shape == (4, 5)  # padded to the wider batch
    np.testing.assert_array_equal(ro.tokens[:, 0], [3, 4, 1, 2])  # rows 2-3 of `first`, 0-1 of `second`
    np.testing.assert_array_equal(ro.lengths, [3, 1, 1, 2])
    np.testing.assert_array_equal(ro.prompt_index, [0, 0, 1, 1])
    assert ro.prompt_tokens == [[1], [1], [0], [0]] and s.batch.scores.texts == ["a2", "a3", "b0", "b1"]
    assert ro.stats.num_tokens == first.rollout.stats.num_tokens + second.rollout.stats.num_tokens
    assert len(ro.stats.chunks) == 2 and ro.stats.wall_seconds == 3.0  # every batch's decode time
    assert s.metrics == {
        "dynamic_sampling/gen_batches": 2.0,
        "dynamic_sampling/generated_groups": 6.0,
        "dynamic_sampling/kept_groups": 2.0,
        "dynamic_sampling/short_groups": 0.0,
        "dynamic_sampling/generated_reward_mean": 0.5,
        "dynamic_sampling/generated_accuracy": 5 / 12,
    }
    # at the batch limit with one group kept: VeRL's error (its DAPO recipe's text) ...
    verl = GroupCollector(prompts=2, group=2, metric="acc", max_batches=1)
    verl.add(first)
    assert verl.full
    with pytest.raises(ValueError, match=r"num_gen_batches=1 >= max_num_gen_batches=1.*Generated too many"):
        verl.samples()
    # ... or (train_short_steps) it trains, a dropped group fills the step, masked out
    short = GroupCollector(prompts=2, group=2, metric="acc", max_batches=1, train_short=True)
    short.add(first)
    assert short.full
    s = short.samples()
    assert [p.uid for p in s.batch.problems] == ["a-1", "a-0"]
    np.testing.assert_array_equal(s.keep, [True, True, False, False])
    assert s.metrics["dynamic_sampling/short_groups"] == 1.0
    # off: one batch, every group as generated, no metrics
    off = GroupCollector(prompts=3, group=2, metric="acc", max_batches=5, enabled=False)
    assert not off.full  # every step generates once
    off.add(first)
    assert off.full and [p.uid for p in off.samples().batch.problems] == ["a-0", "a-1", "a-2"]
    assert off.samples().keep.all() and off.samples().metrics == {}
    # no limit: keeps generating
    endless = GroupCollector(prompts=2, group=2, metric="acc", max_batches=0)
    for _ in range(3):
        endless.add(gen_batch("c", [[0, 0]], [[0.0, 0.0]], 2))
    assert not endless.full


def test_generation_keys() -> None:
    key = jax.random.key(7)
    first = generation_key(key, 0)
    np.testing.assert_array_equal(jax.random.key_data(first), jax.random.key_data(jax.random.fold_in(key, 0)))
    later = [jax.random.key_data(generation_key(key, i)) for i in (1, 2)]
    assert not np.array_equal(later[0], later[1]) and not np.array_equal(later[0], jax.random.key_data(first))


def test_filter_metrics_read_verls_score_and_acc() -> None:
    """VeRL's filter metrics (recipe/dapo's `metric_vals = batch.non_tensor_batch[metric_name]`): "score"
    the scorer's own value (reward_extra_info["score"]: no format bonus, no overlong term), "seq_reward" the
    reward with the overlong term, "acc" VeRL's acc (a custom function's number: partial credit varies a
    group)."""
    b = gen_batch("x", [[0, 0], [0, 0]], [[0.0, 0.0], [0.0, 0.0]], 4)
    results = [
        RewardResult(-0.5, False, True, "1", score=-1.0),  # group 0: the same score, a format bonus on one
        RewardResult(-1.0, False, False, "2", score=-1.0),
        RewardResult(0.5, False, False, None, score=0.5, acc=0.5),  # group 1: partial credit, 0.5 and 0.25
        RewardResult(0.25, False, False, None, score=0.25, acc=0.25),
    ]
    overlong = np.asarray([0.0, 0.0, -0.1, 0.0], np.float32)
    rewards = np.asarray([r.reward for r in results], np.float32) + overlong
    scores = Scores(b.scores.texts[:4], results, rewards, overlong)
    np.testing.assert_array_equal(filter_values(scores, "score"), [-1.0, -1.0, 0.5, 0.25])
    np.testing.assert_allclose(filter_values(scores, "seq_reward"), rewards)
    np.testing.assert_array_equal(filter_values(scores, "acc"), [0.0, 0.0, 0.5, 0.25])
    np.testing.assert_array_equal(group_keep(filter_values(scores, "score"), 2), [False, True])
    np.testing.assert_array_equal(group_keep(filter_values(scores, "seq_reward"), 2), [True, True])
    np.testing.assert_array_equal(group_keep(filter_values(scores, "acc"), 2), [False, True])
