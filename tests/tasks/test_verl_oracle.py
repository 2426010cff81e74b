"""Our reward ports against VeRL 0.9.1's own scorers (tests/verl_oracle loads them from the installed wheel),
on generated responses: hundreds per family from a seeded grammar of answer-like pieces (`Answer:` lines,
boxes, `####` lines, `</think>`, units, separators, long filler that moves an answer out of a scorer's tail).

Each test names the VeRL file and line it follows (`verl_line` finds the line in the installed file, so a
VeRL that moved it fails here rather than citing a stale line).
"""

from __future__ import annotations

import pathlib
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.verl_oracle import verl_function, verl_line, verl_module
from tlt_jax.rl.reward import OverlongShaping
from tlt_jax.tasks import make_task
from tlt_jax.tasks.datasets import task_config
from tlt_jax.tasks.math_verify_reward import math_verify_check
from tlt_jax.tasks.rewards import ReferenceScorer

SCORE = "verl.utils.reward_score"
REFERENCES = [
    "34", "72", "72 ", " 72", "-3", "1000", "1,000", "\\frac{1}{2}", "0.5", "2\\pi", "x=5", "204", "10",
]  # fmt: skip
PIECES = [
    "Answer: ", "answer:", "ANSWER :", "\\boxed{", "}", "{", "34", "72", "-3", "1,000", "1000", "204",
    "0.5", "\\frac{1}{2}", "\\frac12", "\\dfrac{1}{2}", "#### ", "####", "$", " cm", " dollars", "x = ",
    "=", " ", "\n", "</think>", "<think>", "The answer is ", ".", ",", "\\text{", "2\\pi", "10", "^\\circ",
    "so ", "Therefore ",
]  # fmt: skip


def responses(seed: int, count: int) -> list[str]:
    """`count` random responses of 1-14 PIECES (one in five with 80-400 filler characters inside)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        parts = [rng.choice(PIECES) for _ in range(rng.randint(1, 14))]
        if rng.random() < 0.2:
            parts.insert(rng.randint(0, len(parts)), "reasoning " * rng.randint(8, 40))
        out.append("".join(parts))
    return out


def cases(seed: int, count: int) -> list[tuple[str, str]]:
    rng = random.Random(seed + 1)
    return [(r, rng.choice(REFERENCES)) for r in responses(seed, count)]


@pytest.mark.parametrize(
    ("checker", "source", "follows"),
    [
        ("dapo", "math_dapo", ("verl.utils.reward_score.math_dapo", "def verify(")),
        ("gsm8k", "openai/gsm8k", ("verl.utils.reward_score.gsm8k", "def compute_score(")),
        ("math_reward", "lighteval/MATH", ("verl.utils.reward_score.math_reward", "def compute_score(")),
    ],
)
def test_scorer_matches_verl(checker: str, source: str, follows: tuple[str, str]) -> None:
    """Ours (think off: the whole response) == VeRL's default_compute_score(source, ...) on 600 responses,
    the -1 / +1 scale for DAPO (reward_scale="verl"); the DAPO box fallback of 0.9.1 included."""
    verl_line(*follows)
    compute = verl_function(SCORE, "default_compute_score")
    ours = ReferenceScorer(checker)
    for response, reference in cases(seed=len(checker), count=600):
        want = compute(source, response, reference)
        want = want["score"] if isinstance(want, dict) else want
        assert ours(response, reference).reward == want, (checker, response, reference)


def test_verl_routing_matches_default_compute_score() -> None:
    """reward="verl" picks the scorer by data_source as verl/utils/reward_score/__init__.py does."""
    where = verl_line(SCORE, "def default_compute_score(")
    compute = verl_function(SCORE, "default_compute_score")
    ours = ReferenceScorer("verl")
    sources = ["openai/gsm8k", "HuggingFaceH4/MATH-500", "math_dapo", "math", "aime2024", "aime_2025"]
    rng = random.Random(7)
    for response, reference in cases(seed=11, count=300):
        source = rng.choice(sources)
        want = compute(source, response, reference)
        want = want["score"] if isinstance(want, dict) else want
        assert ours(response, reference, source).reward == want, (where, source, response, reference)


def test_dapo_answer_before_think_close_scores_as_in_verl() -> None:
    """think off: "Answer: 34\\n</think>..." is read whole, +1 as in VeRL (no think handling anywhere in
    verl/utils/reward_score/math_dapo.py); think on (ours, for prompts that open a think block): the text
    after the last </think> only; the box without an `Answer:` line scores +1 in 0.9.1."""
    where = verl_line("verl.utils.reward_score.math_dapo", 'if pred != "[INVALID]":')
    compute = verl_function(SCORE, "default_compute_score")
    for response, want in [("Answer: 34\n</think> done", 1.0), ("The answer is \\boxed{34}", 1.0)]:
        assert compute("math_dapo", response, "34")["score"] == want, where
        assert ReferenceScorer("dapo")(response, "34").reward == want
    assert ReferenceScorer("dapo", think=True)("Answer: 34\n</think> done", "34").reward == -1.0


def test_math_verify_matches_verl_subprocess_function() -> None:
    """math_verify_mode="verl" == VeRL's math_verify.py `_verify_in_subprocess` (what its process pool runs,
    called here in-process) on 120 responses."""
    where = verl_line("verl.utils.reward_score.math_verify", "def _verify_in_subprocess(")
    verify = verl_function("verl.utils.reward_score.math_verify", "_verify_in_subprocess")
    for response, reference in cases(seed=5, count=120):
        want = verify("\\boxed{" + reference + "}", response)
        got = math_verify_check(response, reference, 5, "verl")
        assert float(got.correct) == want, (where, response, reference)


def _parquet(path: pathlib.Path, source: str, truth: str, extra: dict | None) -> pathlib.Path:
    row = {"data_source": source, "prompt": [{"role": "user", "content": "Q?"}]}
    row["reward_model"] = {"style": "rule", "ground_truth": truth}
    if extra is not None:
        row["extra_info"] = extra
    pq.write_table(pa.Table.from_pylist([row]), path)
    return path


def test_ground_truth_is_not_stripped(tmp_path) -> None:
    """A stored ground truth "72 " is compared as it is: VeRL's gsm8k.py compares `answer == ground_truth`,
    so "#### 72" scores 0 against it."""
    where = verl_line("verl.utils.reward_score.gsm8k", "if answer == ground_truth:")
    path = _parquet(tmp_path / "g.parquet", "openai/gsm8k", "72 ", None)
    task = make_task(task_config("parquet", path=str(path), reward="verl"))
    problem = task.problem(0)
    assert problem.answer == "72 "
    compute = verl_function(SCORE, "default_compute_score")
    assert task.score(problem, "#### 72").reward == compute("openai/gsm8k", "#### 72", "72 ") == 0.0, where


CUSTOM = """
CALLS = []


def score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    CALLS.append(dict(data_source=data_source, extra_info=extra_info, bonus=bonus))
    return solution_str.count("7") / 4 + bonus
"""


def test_custom_reward_gets_verl_kwargs_and_acc_is_the_score(tmp_path) -> None:
    """A custom function as VeRL 0.9.1 calls it: reward_kwargs merged into the call
    (verl/trainer/ppo/reward.py get_custom_reward_fn, via its own `_call_with_kwargs`), extra_info the row's
    dict with num_turns and rollout_reward_scores (naive.py run_single; {} when the row has none); a number's
    acc is the number itself (partial credit), as naive.py's `reward_extra_info["acc"] = score`."""
    naive = "verl.experimental.reward_loop.reward_manager.naive"
    where = verl_line(naive, 'reward_extra_info["acc"] = score')
    fn_file = tmp_path / "fn.py"
    fn_file.write_text(CUSTOM)
    spec = f"{fn_file}:score"
    path = _parquet(tmp_path / "c.parquet", "mine", "7", {"index": 3, "split": "train"})
    task = make_task(task_config("parquet", path=str(path), reward=spec, reward_kwargs={"bonus": 0.25}))
    result = task.score(task.problem(0), "77")
    # VeRL's own wrapper around the same function, with the same kwargs
    module = verl_module("verl.trainer.ppo.reward")
    from tlt_jax.tasks.custom_reward import load_reward_fn

    raw = load_reward_fn(spec)
    calls = raw.__globals__["CALLS"]
    extra_info = {"index": 3, "split": "train", "num_turns": None, "rollout_reward_scores": {}}
    want = module._call_with_kwargs(
        raw, {"bonus": 0.25}, data_source="mine", solution_str="77", ground_truth="7", extra_info=extra_info
    )
    assert calls[-2] == calls[-1], where  # ours called it exactly as VeRL's wrapper did
    assert result.reward == result.score == want == 0.75
    assert result.acc == 0.75 and result.acc_value == 0.75 and not result.correct  # acc: the score itself
    full_credit = make_task(task_config("parquet", path=str(path), reward=spec, custom_acc="full_credit"))
    assert full_credit.score(full_credit.problem(0), "77").acc_value == 0.0
    none_path = _parquet(tmp_path / "n.parquet", "mine", "7", None)
    plain = make_task(task_config("parquet", path=str(none_path), reward=spec))
    plain.score(plain.problem(0), "7")
    assert calls[-1]["extra_info"] == {"num_turns": None, "rollout_reward_scores": {}}  # a dict, never None


class _Rows:
    """The rows VeRL's DAPO reward manager reads (`data[i].batch`, `.non_tensor_batch`), as tensors."""

    def __init__(self, prompts: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor, extra: list[dict]):
        self.batch = {"prompts": prompts, "responses": responses, "attention_mask": mask}
        self.non_tensor_batch = extra

    def __len__(self) -> int:
        return self.batch["responses"].shape[0]

    def __getitem__(self, i: int) -> _Rows:
        row = _Rows.__new__(_Rows)
        row.batch = {k: v[i] for k, v in self.batch.items()}
        row.non_tensor_batch = self.non_tensor_batch[i]
        return row


class _Chars:
    """A tokenizer of one character per id (what the manager decodes with)."""

    eos_token = "\x00"

    def decode(self, ids: torch.Tensor, skip_special_tokens: bool = True) -> str:
        return "".join(chr(int(i)) for i in ids)


def test_overlong_composition_matches_verl_dapo_manager() -> None:
    """score + overlong shaping == VeRL's DAPORewardManager (verl/workers/reward_manager/dapo.py) on 200
    responses of random lengths up to the cap, the reward at the last valid token."""
    where = verl_line("verl.workers.reward_manager.dapo", "overlong_reward = min(")
    manager_cls = verl_function("verl.workers.reward_manager.dapo", "DAPORewardManager")
    cfg = type("Cfg", (), {"enable": True, "len": 16, "penalty_factor": 0.7, "log": False})()
    manager = manager_cls(_Chars(), num_examine=0, max_resp_len=48, overlong_buffer_cfg=cfg)
    rng = np.random.default_rng(3)
    rows, width = 200, 48
    lengths = rng.integers(1, width + 1, rows)
    texts = [rng.choice(["Answer: 34", "Answer: 35"]).ljust(int(n), ".")[: int(n)] for n in lengths]
    responses = torch.zeros((rows, width), dtype=torch.long)
    for i, t in enumerate(texts):
        responses[i, : len(t)] = torch.tensor([ord(c) for c in t])
    valid = torch.as_tensor(np.arange(width) < lengths[:, None], dtype=torch.long)
    mask = torch.cat([torch.ones((rows, 2), dtype=torch.long), valid], 1)
    row = {"reward_model": {"ground_truth": "34"}, "data_source": "math_dapo"}
    extra = [{**row, "extra_info": {}} for _ in texts]
    got = manager(_Rows(torch.full((rows, 2), 65), responses, mask, extra))
    want = got[torch.arange(rows), torch.as_tensor(lengths - 1)].numpy()
    shaping = OverlongShaping(buffer=16, penalty=0.7, max_len=48).rewards(lengths)
    ours = np.asarray([ReferenceScorer("dapo")(t, "34").reward for t in texts]) + shaping
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-6, err_msg=where)
