"""Over-long prompts handled when the data loads (tasks.prompt_fit, rl.prompt_budget): dropped with the count
and the longest logged, the remaining order a pure function of (seed, N') so resume stays exact, truncated
left / right / middle as VeRL cuts, or refused naming the rows; the batch-encoded lengths equal one-by-one
encoding; the budget is the bound the engine enforces (ByteTokenizer: one token per byte)."""

from __future__ import annotations

import logging
import pathlib
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt_jax.config_sections import RolloutSection
from tlt_jax.models.tokenizer import ByteTokenizer
from tlt_jax.rl.prompt_budget import fit_to_rollout, prompt_budget
from tlt_jax.rollout.row_programs import RowPrograms
from tlt_jax.tasks import make_task
from tlt_jax.tasks.base import TrainSplit
from tlt_jax.tasks.datasets import task_config
from tlt_jax.tasks.prompt_fit import fit_prompts, prompt_lengths, truncate

TOK = ByteTokenizer()
WORDS = [3, 40, 5, 60, 8, 10, 2, 50]  # question lengths (words): rows 1, 3 and 7 are the long ones


def data(tmp_path: pathlib.Path) -> pathlib.Path:
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": " ".join(["two"] * n)}],
            "reward_model": {"style": "rule", "ground_truth": str(i)},
        }
        for i, n in enumerate(WORDS)
    ]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def task(path: pathlib.Path, **keys: object):
    return make_task(task_config("parquet", path=str(path), seed=3, **keys))


def test_overlong_prompts_are_filtered_and_the_order_stays_resumable(tmp_path, caplog) -> None:
    base = task(data(tmp_path))
    lengths = [len(base.encode_prompt(base.problem(i), TOK)) for i in range(len(base))]
    budget = sorted(lengths)[4]  # the five shortest fit: rows 0, 2, 4, 5, 6
    with caplog.at_level(logging.INFO):
        fitted = fit_prompts(base, TOK, budget)
    assert len(fitted) == 5 and fitted.keep.tolist() == [0, 2, 4, 5, 6]
    assert [fitted.problem(i).uid for i in range(5)] == [base.problem(i).uid for i in (0, 2, 4, 5, 6)]
    assert max(len(fitted.encode_prompt(fitted.problem(i), TOK)) for i in range(5)) == budget
    logged = caplog.text
    assert f"config.task: 3 of 8 prompts are longer than {budget} tokens" in logged
    assert f"the longest, d.parquet row 3 (uid d.parquet:3), has {max(lengths)} tokens" in logged
    assert "dropped (filter_overlong_prompts), 5 left" in logged
    # the served order: a pure function of (seed, N'): a fresh load serves the same, from any position
    again = fit_prompts(task(tmp_path / "d.parquet"), TOK, budget)
    stream = [p.uid for p in fitted.batch(0, 12)[0]]
    assert stream == [p.uid for p in again.batch(0, 12)[0]]
    assert [p.uid for p in again.batch(7, 5)[0]] == stream[7:]
    assert sorted(stream[:5]) == sorted(stream[5:10]) and stream[:5] != stream[5:10]  # reshuffled epochs
    # the held-out split of a filtered task holds filtered problems only
    split = TrainSplit(fitted, 2)
    assert set(split.held_out_indices.tolist()) <= set(range(5)) and len(split) == 3
    # nothing over-long: the task itself, unchanged
    assert fit_prompts(base, TOK, max(lengths)) is base


def test_truncation_sides_and_error(tmp_path) -> None:
    path = data(tmp_path)
    base = task(path)
    ids = base.encode_prompt(base.problem(3), TOK)
    budget = 100
    for side, want in (("left", ids[-100:]), ("right", ids[:100]), ("middle", ids[:50] + ids[-50:])):
        fitted = fit_prompts(task(path, filter_overlong_prompts=False, truncation=side), TOK, budget)
        assert len(fitted) == 8 and fitted.encode_prompt(fitted.problem(3), TOK) == want
        assert fitted.encode_prompt(fitted.problem(0), TOK) == base.encode_prompt(base.problem(0), TOK)
        assert fitted.epoch_order(1).tolist() == base.epoch_order(1).tolist()  # the order is the task's
    assert truncate([1, 2, 3, 4, 5], 4, "middle") == [1, 2, 4, 5] and truncate([1, 2], 4, "left") == [1, 2]
    with pytest.raises(ValueError) as e:
        fit_prompts(task(path, filter_overlong_prompts=False), TOK, budget)
    assert "3 of 8 prompts are longer than 100 tokens" in str(e.value)
    assert "d.parquet row 1 (uid d.parquet:1):" in str(e.value) and "truncation=error refuses them" in str(
        e.value
    )
    with pytest.raises(ValueError, match=r"config.task.truncation='top': use one of"):
        task(path, filter_overlong_prompts=False, truncation="top")
    with pytest.raises(ValueError, match=r"every prompt is over-long"):
        fit_prompts(task(path), TOK, 5)


def test_batch_encoding_equals_one_by_one(tmp_path) -> None:
    base = task(data(tmp_path), prompt="default")  # a system prompt and an instruction around the question
    problems = [base.problem(i) for i in range(len(base))]
    one_by_one = [len(base.encode_prompt(p, TOK)) for p in problems]

    class Plain:  # no apply_chat_template / encode_batch: one encode_prompt per problem
        bos_token_id, eos_token_id = TOK.bos_token_id, TOK.eos_token_id
        encode, encode_chat, id_to_token = TOK.encode, TOK.encode_chat, TOK.id_to_token

    assert prompt_lengths(base, problems, TOK).tolist() == one_by_one
    assert prompt_lengths(base, problems, Plain()).tolist() == one_by_one


def test_the_budget_is_the_engine_bound(tmp_path) -> None:
    engine = types.SimpleNamespace(config=types.SimpleNamespace(max_cache_len=64))
    budget = prompt_budget(64, 16)
    RowPrograms.validate_prompts(engine, [[1] * budget], 16)  # the longest prompt the budget lets through
    with pytest.raises(ValueError, match="needs 65 cache slots but max_cache_len=64"):
        RowPrograms.validate_prompts(engine, [[1] * (budget + 1)], 16)
    # the learner's and an eval set's task (its own, shorter max_new_tokens leaves more room)
    base = task(data(tmp_path))
    lengths = sorted(len(base.encode_prompt(base.problem(i), TOK)) for i in range(len(base)))
    rollout = RolloutSection(max_new_tokens=256, max_cache_len=lengths[4] + 256)
    assert len(fit_to_rollout(base, rollout, TOK)) == 5
    own = lengths[4] + 256 - lengths[6]  # an eval set's max_new_tokens: room for the 7 shortest
    assert len(fit_to_rollout(base, rollout, TOK, "config.eval.sets.x", own)) == 7
