"""Tasks and verifiable rewards: answer extraction, normalisation, verifiers, JSONL, resumable order."""

from __future__ import annotations

import json

import ml_collections
import pytest

from tlt_jax.tasks.answers import answers_match, ends_with_answer_line, extract_answer, normalize_number
from tlt_jax.tasks.base import Problem, RewardResult, build_messages
from tlt_jax.tasks.datasets import CountingTask, JsonlTask, ReasoningGymTask, make_task, score_batch

# ---------------------------------------------------------------------------------------------------------
# extract_answer / normalize_number
# ---------------------------------------------------------------------------------------------------------

EXTRACT_CASES = [
    # (text, answer-mode result, answer_or_last_number result)
    ("2 + 2 = 4.\nAnswer: 4", "4", "4"),
    ("Answer: 3\nwait, no.\nAnswer: 5.", "5", "5"),
    ("**Answer:** 42", "42", "42"),
    ("**Answer**: **42**", "42", "42"),
    ("answer: -7", "-7", "-7"),
    ("Final Answer: $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", "\\frac{1}{2}"),
    ("Answer:\n\n12\nmore text 99", "12", "12"),
    ("Answer: 3.5 apples", "3.5 apples", "3.5 apples"),
    ("The sum is 12, then 13.", None, "13"),
    ("I got 8. Answer:", None, "8"),
    ("total is 1,000 dollars", None, "1000"),
    ("3-4", None, "4"),
    ("so x = -4.", None, "-4"),
    ("pi is about 3.14", None, "3.14"),
    ("no numbers at all", None, None),
    ("", None, None),
]


@pytest.mark.parametrize("text,strict,fallback", EXTRACT_CASES)
def test_extract_answer(text: str, strict: str | None, fallback: str | None) -> None:
    assert extract_answer(text) == strict
    assert extract_answer(text, mode="answer_or_last_number") == fallback


def test_extract_answer_unknown_mode() -> None:
    with pytest.raises(ValueError, match="answer_or_last_number"):
        extract_answer("Answer: 1", mode="last")


NORMALIZE_CASES = [
    ("1,000", "1000"),
    ("3.50", "3.5"),
    ("3.5", "3.5"),
    ("\\frac{1}{2}", "0.5"),
    ("0.5", "0.5"),
    ("$5", "5"),
    ("\\$1{,}000.00", "1000"),
    ("5%", "5"),
    ("5\\%", "5"),
    ("\\boxed{5}", "5"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("$\\frac{1}{2}$", "0.5"),
    ("-0", "0"),
    ("-0.0", "0"),
    ("+7", "7"),
    ("- 7", "-7"),
    ("\u22125", "-5"),
    ("007", "7"),
    ("12.", "12"),
    (" 42 ", "42"),
    ("1e3", "1000"),
    ("2.5e-1", "0.25"),
    ("0.125", "0.125"),
    ("1/3", "1/3"),
    ("\\dfrac{2}{6}", "1/3"),
    ("-\\frac{3}{4}", "-0.75"),
    ("\\frac12", "0.5"),
    ("abc", None),
    ("", None),
    (None, None),
    ("1/0", None),
    ("1,2", None),
    ("5 apples", None),
]


@pytest.mark.parametrize("text,expected", NORMALIZE_CASES)
def test_normalize_number(text: str | None, expected: str | None) -> None:
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    "pred,ref,expected",
    [
        ("1,000", "1000", True),
        ("0.5", "\\frac{1}{2}", True),
        ("3.50", "3.5", True),
        ("Paris.", "paris", True),
        ("5", "6", False),
        ("5 apples", "5", False),
        (None, "5", False),
    ],
)
def test_answers_match(pred: str | None, ref: str, expected: bool) -> None:
    assert answers_match(pred, ref) is expected


def test_build_messages() -> None:
    p = Problem(uid="u", question="What is 1 + 1?", answer="2", entry={})
    msgs = build_messages(p, system_prompt="SYS", instruction="End with 'Answer: <value>'.")
    assert msgs == [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "What is 1 + 1?\n\nEnd with 'Answer: <value>'."},
    ]
    assert build_messages(p, system_prompt=None, instruction=None) == [
        {"role": "user", "content": "What is 1 + 1?"}
    ]
    assert "Answer: <value>" in build_messages(p)[-1]["content"]


# ---------------------------------------------------------------------------------------------------------
# reasoning-gym
# ---------------------------------------------------------------------------------------------------------

EASY_CHAIN_SUM = dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2)


@pytest.fixture(scope="module")
def chain_sum() -> ReasoningGymTask:
    return ReasoningGymTask("chain_sum", size=6, seed=3, dataset_kwargs=EASY_CHAIN_SUM)


def _true_value(question: str) -> int:
    # "State the final answer to the following arithmetic problem: 4 - 1 =" -> 3, computed independently.
    expr = question.rsplit(":", 1)[1].strip().rstrip("=")
    assert set(expr) <= set("0123456789+- "), expr
    return int(eval(expr))  # noqa: S307 - digits, +, - and spaces only (checked above)


def test_reasoning_gym_true_answer_scores_one(chain_sum: ReasoningGymTask) -> None:
    assert len(chain_sum) == 6
    for i in range(len(chain_sum)):
        p = chain_sum.problem(i)
        truth = _true_value(p.question)
        right = chain_sum.score(p, f"Let me add.\nAnswer: {truth}")
        assert right == RewardResult(reward=1.0, correct=True, format_ok=True, extracted=str(truth))
        wrong = chain_sum.score(p, f"Let me add.\nAnswer: {truth + 1}")
        assert wrong.reward == 0.0 and not wrong.correct and wrong.format_ok
        missing = chain_sum.score(p, f"It is {truth}")  # strict mode: no Answer line, nothing extracted
        assert missing == RewardResult(reward=0.0, correct=False, format_ok=False, extracted=None)


def test_reasoning_gym_last_number_and_format_reward() -> None:
    task = ReasoningGymTask(
        "chain_sum",
        size=2,
        seed=3,
        dataset_kwargs=EASY_CHAIN_SUM,
        answer_mode="answer_or_last_number",
        format_reward=0.1,
    )
    p = task.problem(0)
    truth = _true_value(p.question)
    assert task.score(p, f"the result is {truth}") == RewardResult(1.0, True, False, str(truth))
    assert task.score(p, f"Answer: {truth}") == RewardResult(1.1, True, True, str(truth), score=1.0)
    assert task.score(p, f"Answer: {truth + 2}") == RewardResult(0.1, False, True, str(truth + 2), score=0.0)
    # the format bonus needs the Answer line LAST (as the instruction asks): not for rambling on after it
    late = task.score(p, f"Answer: {truth}\nThen I add it again and again")
    assert late == RewardResult(1.0, True, False, str(truth))
    assert task.score(p, f"Answer:\n  {truth}  \n\n").format_ok  # value on the next line, blank tail


def test_ends_with_answer_line() -> None:
    ok = ["Answer: 7", "x\nAnswer: 7\n", "**Answer:** 7.", "Answer:\n7", "Answer: a\nAnswer: 8  \n "]
    bad = ["7", "Answer:", "Answer: 7\nmore", "Answer: \n\n", "Answer: 7\nAnswer:"]
    assert [ends_with_answer_line(t) for t in ok] == [True] * len(ok)
    assert [ends_with_answer_line(t) for t in bad] == [False] * len(bad)


def test_reasoning_gym_deterministic_by_seed(chain_sum: ReasoningGymTask) -> None:
    again = ReasoningGymTask("chain_sum", size=6, seed=3, dataset_kwargs=EASY_CHAIN_SUM)
    other = ReasoningGymTask("chain_sum", size=6, seed=4, dataset_kwargs=EASY_CHAIN_SUM)
    qs = [chain_sum.problem(i).question for i in range(6)]
    assert qs == [again.problem(i).question for i in range(6)]
    assert qs != [other.problem(i).question for i in range(6)]
    assert chain_sum.problem(2).uid == "chain_sum/3/2"


def test_reasoning_gym_partial_credit_is_not_correct() -> None:
    task = ReasoningGymTask("countdown", size=1, seed=1)
    p = task.problem(0)
    wrong = task.score(p, "Answer: 1 + 1")
    assert wrong.reward == pytest.approx(0.05) and not wrong.correct
    right = task.score(p, f"Answer: {p.answer}")
    assert right.reward == 1.0 and right.correct


def test_reasoning_gym_bad_name_and_kwargs() -> None:
    with pytest.raises(ValueError, match="no_such_dataset.*chain_sum"):
        ReasoningGymTask("no_such_dataset", size=2)
    with pytest.raises(ValueError, match="bogus"):
        ReasoningGymTask("chain_sum", size=2, dataset_kwargs={"bogus": 1})


# ---------------------------------------------------------------------------------------------------------
# JSONL
# ---------------------------------------------------------------------------------------------------------

GSM_LINES = [
    {"question": "Tom has 3 apples and buys 39 more. How many?", "answer": "3 + 39 = 42\n#### 42"},
    {"question": "Half of one?", "answer": "\\frac{1}{2}"},
    {"question": "A thousand?", "answer": "10 * 100 = 1000\n#### 1,000", "id": "big"},
]


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_loads_gsm8k_answers(tmp_path) -> None:
    lines = [json.dumps(GSM_LINES[0]), json.dumps(GSM_LINES[1]), "", json.dumps(GSM_LINES[2])]
    task = JsonlTask(_write(tmp_path, lines), shuffle=False, format_reward=0.5)
    assert len(task) == 3
    assert [task.problem(i).answer for i in range(3)] == ["42", "\\frac{1}{2}", "1,000"]
    assert [task.problem(i).uid for i in range(3)] == ["gsm.jsonl:1", "gsm.jsonl:2", "big"]
    p0, p1, p2 = (task.problem(i) for i in range(3))
    assert task.score(p0, "3 + 39 = 42\nAnswer: 42") == RewardResult(1.5, True, True, "42", score=1.0)
    assert task.score(p0, "Answer: 41") == RewardResult(0.5, False, True, "41", score=0.0)
    assert task.score(p0, "it is 42") == RewardResult(0.0, False, False, None, score=0.0)
    assert task.score(p1, "Answer: 0.5").correct
    assert task.score(p2, "Answer: **1000**.").correct


def test_jsonl_last_number_mode(tmp_path) -> None:
    task = JsonlTask(_write(tmp_path, [json.dumps(GSM_LINES[0])]), answer_mode="answer_or_last_number")
    assert task.score(task.problem(0), "3 + 39 = 42") == RewardResult(1.0, True, False, "42", score=1.0)


@pytest.mark.parametrize(
    "bad_line,what",
    [
        ('{"question": "q", "answer": ', "invalid JSON"),
        ('{"question": "q"}', "missing field 'answer'"),
        ('{"answer": "1"}', "missing field 'question'"),
        ('{"question": "q", "answer": [1]}', "'answer' must be a string or a number"),
        ('{"question": 5, "answer": "1"}', "'question' must be a string"),
        ('["q", "1"]', "expected a JSON object"),
        ('{"question": "q", "answer": "#### "}', "'answer' is empty"),
    ],
)
def test_jsonl_malformed_line_names_path_and_line(tmp_path, bad_line: str, what: str) -> None:
    good = json.dumps(GSM_LINES[0])
    path = _write(tmp_path, [good, "", good, bad_line, good])  # the bad line is line 4 (blank line 2 counts)
    with pytest.raises(ValueError) as err:
        JsonlTask(path)
    message = str(err.value)
    assert f"{path}:4:" in message
    assert what in message


def test_jsonl_empty_and_missing_file(tmp_path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="contains no problems"):
        JsonlTask(empty)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        JsonlTask(tmp_path / "nope.jsonl")


# ---------------------------------------------------------------------------------------------------------
# Counting task and data order
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response,reward,correct",
    [
        ("7777", 1.0, True),
        ("77a7", 0.75, False),
        ("7 7", 2 / 3, False),
        ("123", 0.0, False),
        ("", 0.0, False),
    ],
)
def test_counting_reward(response: str, reward: float, correct: bool) -> None:
    task = CountingTask(size=10, shuffle=False)
    p = task.problem(7)
    assert p.question == "Write the digit 7 many times." and p.answer == "7"
    result = task.score(p, response)
    assert result.reward == pytest.approx(reward)
    assert result.correct is correct
    assert result.format_ok is (response != "")
    assert task.messages(p) == [{"role": "user", "content": "Write the digit 7 many times."}]


def test_batch_order_is_deterministic_and_resumable() -> None:
    task = CountingTask(size=10, seed=0)
    epoch0, pos = task.batch(0, 10)
    assert pos == 10
    epoch1, _ = task.batch(10, 10)
    ids0 = [p.uid for p in epoch0]
    ids1 = [p.uid for p in epoch1]
    assert sorted(ids0) == sorted(ids1) == sorted(f"counting/{i}" for i in range(10))  # each epoch covers all
    assert ids0 != ids1  # reshuffled per epoch
    assert ids0 != [f"counting/{i}" for i in range(10)]  # shuffled at all
    # Consecutive batches of 3 (crossing the epoch boundary at 10) equal one long batch.
    stream, pos = [], 0
    for _ in range(5):
        batch, pos = task.batch(pos, 3)
        stream += [p.uid for p in batch]
    assert pos == 15
    assert stream == [p.uid for p in task.batch(0, 15)[0]]
    # Resume: a fresh task object at a stored position serves the same problems.
    fresh = CountingTask(size=10, seed=0)
    assert [p.uid for p in fresh.batch(6, 3)[0]] == stream[6:9]
    assert [p.uid for p in CountingTask(size=10, seed=1).batch(0, 10)[0]] != ids0
    assert [p.uid for p in CountingTask(size=10, shuffle=False).batch(8, 4)[0]] == [
        "counting/8",
        "counting/9",
        "counting/0",
        "counting/1",
    ]


def test_batch_rejects_bad_arguments() -> None:
    task = CountingTask(size=3)
    with pytest.raises(ValueError, match="position"):
        task.batch(-1, 2)
    with pytest.raises(ValueError, match="num_prompts"):
        task.batch(0, 0)


# ---------------------------------------------------------------------------------------------------------
# make_task
# ---------------------------------------------------------------------------------------------------------


def test_make_task_kinds(tmp_path) -> None:
    counting = make_task({"kind": "counting", "size": 5, "seed": 2})
    assert isinstance(counting, CountingTask) and len(counting) == 5
    cfg = ml_collections.ConfigDict(
        {"kind": "reasoning_gym", "name": "chain_sum", "size": 3, "seed": 3, "dataset_kwargs": EASY_CHAIN_SUM}
    )
    rg_task = make_task(cfg)
    assert isinstance(rg_task, ReasoningGymTask) and len(rg_task) == 3
    path = _write(tmp_path, [json.dumps(GSM_LINES[0])])
    assert isinstance(make_task({"kind": "jsonl", "path": str(path)}), JsonlTask)
    results = score_batch(counting, [counting.problem(0)] * 2, ["00", "0a"])
    assert [r.reward for r in results] == [1.0, 0.5]


def test_make_task_errors() -> None:
    with pytest.raises(
        ValueError, match=r"unknown task kind 'gsm'.*\['counting', 'jsonl', 'parquet', 'reasoning_gym'"
    ):
        make_task({"kind": "gsm"})
    with pytest.raises(ValueError, match="unknown task kind None"):
        make_task({"size": 3})
    with pytest.raises(ValueError, match=r"unknown keys \['sise'\]"):
        make_task({"kind": "counting", "sise": 3})
    with pytest.raises(ValueError, match=r"needs config keys \['path'\]"):
        make_task({"kind": "jsonl"})
