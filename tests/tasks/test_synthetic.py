"""The token task (tlt_jax/tasks/synthetic.py): stop ids, the id codec the learner uses as its tokenizer, the
reward on ids, reproducible prompts, the geometric length law, and the model builder's hook (GRPO on random
weights of a named architecture only with this task). Pure numpy on hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from tlt_jax.models.build import model_problems
from tlt_jax.tasks import make_task
from tlt_jax.tasks.datasets import task_config
from tlt_jax.tasks.synthetic import SyntheticTask, TokenIdCodec, stop_ids, token_codec


def test_stop_ids_spread_and_count() -> None:
    assert stop_ids(100, 10).tolist() == [5, 15, 25, 35, 45, 55, 65, 75, 85, 95]  # k = 100 / 10, stride 10
    ids = stop_ids(152_064, 256)  # Qwen2.5's vocabulary, mean 256: 594 ids, distinct, in range
    assert len(ids) == 594 and len(set(ids.tolist())) == 594 and 0 <= ids.min() and ids.max() < 152_064
    assert stop_ids(8, 1000).tolist() == [4]  # at least one
    with pytest.raises(ValueError, match="mean_length >= 1"):
        stop_ids(100, 0.5)


def test_codec_round_trips_ids_and_refuses_text() -> None:
    codec = TokenIdCodec(100, [5, 15])
    assert codec.decode([3, 5, 77, 15]) == "3 77" and codec.decode([3, 5], skip_special_tokens=False) == "3 5"
    assert codec.encode("3 77") == [3, 77] and codec.eos_token_ids == (5, 15) and codec.pad_token_id == 5
    with pytest.raises(ValueError, match="ids below 100"):
        codec.encode("hello")
    with pytest.raises(ValueError, match="no text or chat template"):
        codec.encode_chat([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="within"):
        TokenIdCodec(10, [10])


def test_reward_is_the_fraction_of_tokens_in_the_problems_class() -> None:
    task = make_task(task_config("synthetic", vocab_size=100, mean_length=10, classes=4, size=8))
    assert isinstance(task, SyntheticTask)
    p = task.problem(2)  # class 2 (index mod 4)
    assert p.entry["target_class"] == 2 and p.answer == "2"
    r = task.score(p, "2 6 10 3")  # 3 of 4 tokens are 2 mod 4
    assert r.reward == 0.75 and r.correct and r.format_ok
    assert task.score(p, "1 3 7 6").reward == 0.25 and not task.score(p, "1 3 7 6").correct
    assert task.score(p, "").reward == 0.0 and not task.score(p, "").format_ok
    assert task.score(p, "5 15 2").reward == 1.0  # stop ids never count


def test_prompts_are_reproducible_ids_without_stop_ids() -> None:
    task = SyntheticTask(vocab_size=64, size=16, seed=3, mean_length=8, prompt_len=20)
    again = SyntheticTask(vocab_size=64, size=16, seed=3, mean_length=8, prompt_len=20)
    stops = set(stop_ids(64, 8).tolist())
    for i in range(16):
        ids = task.encode_prompt(task.problem(i), None)
        assert ids == again.encode_prompt(again.problem(i), None) and 10 <= len(ids) <= 20
        assert not stops & set(ids) and max(ids) < 64 and task.problem(i).question == " ".join(map(str, ids))
    assert task.problem(0).entry != SyntheticTask(64, seed=4, mean_length=8, prompt_len=20).problem(0).entry


def test_uniform_sampling_gives_geometric_lengths_with_the_mean() -> None:
    """Sampling ids uniformly (what random weights do in expectation) until a stop id: mean `mean_length`,
    median ~0.69 x mean, and the longest of 32 rows several times the median (the long tail)."""
    vocab, mean = 4096, 64
    stops = np.zeros(vocab, bool)
    stops[stop_ids(vocab, mean)] = True
    rng = np.random.default_rng(0)
    lengths = np.array([np.argmax(stops[rng.integers(0, vocab, 4000)]) + 1 for _ in range(4000)])
    assert abs(lengths.mean() - mean) < 4 and abs(np.median(lengths) / mean - 0.69) < 0.06
    longest = np.mean([rng.choice(lengths, 32).max() for _ in range(200)])
    assert 3.0 < longest / mean < 5.0  # (ln 32 + 0.58) = 4.0


def test_builder_takes_random_weights_for_the_token_task_only() -> None:
    import ml_collections as mlc

    c = mlc.ConfigDict(
        {"job": "grpo", "seed": 0, "model": {"path": None, "random": {}, "arch": "qwen2_5_7b"}}
    )
    c.model.update(init="random", dtype="bfloat16", linear_impl="auto")
    c.task = {"kind": "counting"}
    assert any("needs meaningful text" in p for p in model_problems(c, check_paths=False))
    c.task = task_config("synthetic", vocab_size=152_064)
    assert not model_problems(c, check_paths=False)
    assert token_codec(c.task, 152_064).vocab_size == 152_064 and token_codec({"kind": "counting"}, 9) is None
    with pytest.raises(ValueError, match="--config.task.vocab_size=512"):
        token_codec(c.task, 512)
