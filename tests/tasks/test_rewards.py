"""The reward checkers on one table of answer pairs: today's `Answer:` checker (answer_or_last_number), HF's
math-verify, DAPO's `Answer:` string check; the think block; math-verify's failures counted, never raised.

The verdicts are what the checkers give today (math-verify 0.9.0), surprising ones commented, not what an
ideal checker would say: a change in a checker shows up here.
"""

from __future__ import annotations

import pytest

from tlt_jax.tasks import math_verify_reward
from tlt_jax.tasks.answers import last_boxed, split_think
from tlt_jax.tasks.base import RewardResult
from tlt_jax.tasks.rewards import ReferenceScorer, dapo_normalize, reward_counts

CHECKERS = {
    "answer": ReferenceScorer("answer", answer_mode="answer_or_last_number"),
    "math_verify": ReferenceScorer("math_verify"),
    "dapo": ReferenceScorer("dapo"),
}

# (reference, response, answer, math_verify, dapo): 1 = judged correct
TABLE = [
    # dapo compares strings after Minerva's normalisation: '1/2' is not '\\frac{1}{2}'
    ("\\frac{1}{2}", "Answer: 1/2", 1, 1, 0),
    ("\\frac{1}{2}", "Answer: 0.5", 1, 1, 0),
    # answer: the last-number fallback reads the denominator '2' (issue #37); dapo: no `Answer:` line
    ("\\frac{1}{2}", "so it is \\boxed{\\frac{1}{2}}", 0, 1, 1),
    # dapo: \\dfrac is not rewritten to \\frac
    ("\\frac{1}{2}", "Answer: \\boxed{\\dfrac{1}{2}}", 1, 1, 0),
    ("\\frac{1}{2}", "Answer: 2/4", 1, 1, 0),
    ("\\frac{1}{2}", "Answer: 1/3", 0, 0, 0),
    ("\\frac{1}{3}", "Answer: 0.333", 0, 0, 0),
    ("3.5", "Answer: 3.50", 1, 1, 0),
    ("3.5", "Answer: 7/2", 1, 1, 0),
    ("0.1", "Answer: .1", 1, 1, 0),
    ("3.5", "Answer: 3.6", 0, 0, 0),
    ("50\\%", "Answer: 50%", 1, 1, 0),
    # answer: a percentage equals its number (50% = 50), not its fraction; math_verify accepts both
    ("50\\%", "Answer: 0.5", 0, 1, 0),
    # answer and math_verify: '50\\%' = 50
    ("50", "Answer: 50\\%", 1, 1, 0),
    ("(1, 2]", "\\boxed{(1,2]}", 0, 1, 0),
    ("(1, 2]", "\\boxed{[1,2]}", 0, 0, 0),
    ("[0, \\infty)", "\\boxed{[0,\\infty)}", 0, 1, 0),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}", 0, 1, 0),
    # math_verify: bare LaTeX after `Answer:` (no $...$, no \\boxed) is not extracted
    ("\\sqrt{2}", "Answer: \\sqrt{2}", 1, 0, 1),
    # math_verify: a decimal rounded to 6 places equals the radical
    ("\\sqrt{2}", "Answer: 1.41421356", 0, 1, 0),
    ("\\sqrt{3}", "\\boxed{\\sqrt{2}}", 0, 0, 0),
    ("2\\pi", "\\boxed{2\\pi}", 0, 1, 1),
    # math_verify: numeric equality to 6 places, so 2*pi written as a decimal passes
    ("2\\pi", "\\boxed{6.283185307}", 0, 1, 0),
    ("\\pi", "\\boxed{3.14}", 0, 0, 0),
    # math_verify: a bare tuple after `Answer:` is not extracted; dapo: string-equal after removing spaces
    ("(1, 2)", "Answer: (1,2)", 0, 0, 1),
    ("(1, 2)", "\\boxed{(2, 1)}", 0, 0, 0),
    ("(3, -4)", "The point is \\boxed{(3,-4)}", 0, 1, 0),
    ("\\{1, 2, 3\\}", "\\boxed{\\{3, 2, 1\\}}", 0, 1, 0),
    # math_verify: a comma-separated list compares as a set
    ("1, 2", "\\boxed{2, 1}", 0, 1, 0),
    ("\\{1, 2\\}", "\\boxed{\\{1, 3\\}}", 0, 0, 0),
    # answer: 'x = 5' is text, not the number 5; math_verify and dapo take the right-hand side
    ("5", "Answer: x = 5", 0, 1, 1),
    # answer: \\boxed{x=5} has no `Answer:` line: the last number 5
    ("5", "\\boxed{x=5}", 1, 1, 0),
    ("x=5", "Answer: 5", 0, 1, 1),
    ("5", "Answer: x = 6", 0, 0, 0),
    # answer: '\\text{Monday}' and 'Monday' differ as text; math_verify extracts no expression from 'Monday'
    ("\\text{Monday}", "Answer: Monday", 0, 0, 1),
    # math_verify: \\text{(B)} and B are the same choice
    ("\\text{(B)}", "\\boxed{B}", 0, 1, 0),
    ("10", "\\boxed{10\\text{ cm}}", 1, 1, 0),
    # units: the answer checker reads '10 cm' as text (math_verify and dapo drop the unit)
    ("10", "Answer: 10 cm", 0, 1, 1),
    ("5", "Answer: 5 dollars", 0, 1, 1),
    ("90", "\\boxed{90^\\circ}", 1, 1, 0),
    ("1000", "Answer: 1,000", 1, 1, 1),
    # answer: '1{,}000' is not an `Answer:` line and the last number is '000'
    ("1000", "\\boxed{1{,}000}", 0, 1, 0),
    ("1,000", "Answer: 1000", 1, 1, 1),
    ("1000000", "Answer: 1,000,000", 1, 1, 1),
    ("1000", "Answer: 1,001", 0, 0, 0),
    # dapo: no `Answer:` line; math_verify and answer: the last number
    ("42", "The answer is 42.", 1, 1, 0),
    # every checker reads the LAST answer (boxed 41), not the first number
    ("42", "First 42, then I get \\boxed{41}.", 0, 0, 0),
    # answer: no `Answer:` line, the last number is the denominator
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{2}}", 0, 1, 1),
    ("-3", "Answer: -3", 1, 1, 1),
    ("-3", "Answer: 3", 0, 0, 0),
    # symbolic equivalence: only math_verify
    ("x^2+2x+1", "\\boxed{(x+1)^2}", 0, 1, 0),
    ("2x+1", "\\boxed{1+2x}", 0, 1, 0),
]


def test_table_is_large_and_covers_both_verdicts() -> None:
    assert len(TABLE) >= 40
    for column in (2, 3, 4):
        assert {row[column] for row in TABLE} == {0, 1}


@pytest.mark.parametrize("reference,response,answer,math_verify,dapo", TABLE)
def test_answer_table(reference: str, response: str, answer: int, math_verify: int, dapo: int) -> None:
    got = {name: int(check(response, reference).correct) for name, check in CHECKERS.items()}
    assert got == {"answer": answer, "math_verify": math_verify, "dapo": dapo}


def test_last_boxed_handles_nested_braces() -> None:
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{\\sqrt{2}}{2}} end") == "\\frac{\\sqrt{2}}{2}"
    assert last_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    assert last_boxed("no box here") is None
    assert last_boxed("cut \\boxed{\\frac{1}{2") == "\\frac{1}{2"  # a truncated response: what is there


def test_think_block() -> None:
    assert split_think("reasoning 7 ... </think> Answer: 3", required=True) == (" Answer: 3", False)
    assert split_think("still thinking 3", required=True) == (None, True)
    assert split_think("plain Answer: 3", required=False) == ("plain Answer: 3", False)
    scorer = ReferenceScorer("math_verify", think=True)
    assert scorer("I guess \\boxed{5}... wait </think> so \\boxed{3}", "3").correct
    assert not scorer("<think> \\boxed{3} is wrong </think> \\boxed{4}", "3").correct  # the answer after it
    open_block = scorer("\\boxed{3} and I keep thinking", "3")
    assert open_block == RewardResult(0.0, False, False, None, think_unterminated=True, score=0.0)
    # think off: the whole response is read, as VeRL 0.9.1's scorers read it (tests/tasks/test_verl_oracle.py)
    assert ReferenceScorer("dapo")("Answer: 34\n</think> more text", "34").correct
    assert not ReferenceScorer("dapo", think=True)("Answer: 34\n</think> more text", "34").correct
    counts = reward_counts([open_block, scorer("</think> \\boxed{3}", "3")])
    assert counts == {"reward/verify_failed": 0.0, "reward/think_unterminated": 1.0}


def test_math_verify_failure_is_counted_not_raised(monkeypatch) -> None:
    from math_verify.errors import TimeoutException

    def too_slow(*args, **kwargs):
        raise TimeoutException("Operation timed out!")

    monkeypatch.setattr("math_verify.verify", too_slow)
    result = ReferenceScorer("math_verify", format_reward=0.5)("\\boxed{3}", "3")
    assert result.reward == 0.5 and not result.correct and result.verify_failed  # format kept, no verdict
    assert reward_counts([result])["reward/verify_failed"] == 1.0
    # an unparsable reference is a failure too; an answerless response is just wrong
    assert math_verify_reward.math_verify_check("\\boxed{3}", "\\frac{").failed
    assert not math_verify_reward.math_verify_check("no answer at all", "3").failed


def test_dapo_normalize() -> None:
    assert dapo_normalize("$1,000$ dollars") == "1000"
    assert dapo_normalize("x = \\boxed{12}") == "12"
    assert dapo_normalize("\\text{(B)}") == "(B)"
    assert dapo_normalize("\\frac12") == "\\frac{1}{2}"


def test_unknown_reward_kind() -> None:
    with pytest.raises(ValueError, match=r"config.task.reward.*'answer', 'math_verify', 'dapo'"):
        ReferenceScorer("exact")
