"""Reward checkers for tasks with a reference answer, and the `<think>` handling of R1-style responses.

`config.task.reward` picks the checker:
- "answer" (default): today's checker, the `Answer:` value (or the last number, `answer_mode`) compared to the
  reference by normalised numbers or text (`answers.answers_match`); reasoning-gym tasks use the dataset's own
  verifier instead.
- "math_verify": HF's math-verify (`math_verify_reward`), as VeRL's `math_verify` reward: sympy equivalence
  of the last `\\boxed{}` (or expression) with the reference; a timeout or parser error is a counted failure.
- "dapo": DAPO's check: the last `Answer:` line within the response's last 300 characters, normalised the
  Minerva way (units, `\\text{}`, `$`, thousands separators removed) and compared as a string (DAPO-Math-17k's
  answers are integers). DAPO scores -1 / +1; here it is 0 / 1 like every checker (GRPO's advantages are
  unchanged by that affine map; Dr.GRPO's are halved).

Think handling (`think` on, or a prompt preset that opens `<think>`): the answer is read after the last
`</think>`; a response that never closes its think block scores 0 and is counted
(`reward/think_unterminated`).
"""

from __future__ import annotations

import re

from tlt_jax.tasks.answers import (
    answers_match,
    check_answer_mode,
    ends_with_answer_line,
    extract_answer,
    last_boxed,
    split_think,
)
from tlt_jax.tasks.base import RewardResult
from tlt_jax.tasks.math_verify_reward import CheckVerdict, math_verify_check

REWARD_KINDS = ("answer", "math_verify", "dapo")

# ----------------------------------------------------------------------------------------------------------
# DAPO's answer check (Minerva-style normalisation)
# ----------------------------------------------------------------------------------------------------------

_DAPO_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_TAIL = 300
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)  # fmt: skip
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip


def dapo_normalize(answer: str) -> str:
    """DAPO's (Minerva's) normalisation of a final answer: the right-hand side of `=`, words and units out,
    `$`, `\\text{}`, `\\boxed{}` unwrapped, `\\frac12` braced, thousands separators of integers removed."""
    s = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in _REMOVED:
        s = s.replace(expr, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    for command in ("text", "textbf", "overline"):
        s = re.sub(r"(\\" + command + r"\{)(.*?)(\})", "\\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", s)
    s = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)
    s = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def dapo_check(response: str, reference: str) -> CheckVerdict:
    """DAPO's verdict: the last `Answer:` value in the response's tail equals the reference, both normalised
    (a boxed reference is unboxed first)."""
    matches = _DAPO_ANSWER_RE.findall(response[-_DAPO_TAIL:])
    if not matches:
        return CheckVerdict(False, None)
    pred = dapo_normalize(matches[-1])
    gold = dapo_normalize(last_boxed(reference) or reference)
    return CheckVerdict(pred == gold, pred)


# ----------------------------------------------------------------------------------------------------------
# Scoring a response against a reference
# ----------------------------------------------------------------------------------------------------------


def check_reward_kind(reward: str) -> None:
    if reward not in REWARD_KINDS:
        raise ValueError(f"unknown reward {reward!r}: set config.task.reward to one of {list(REWARD_KINDS)}")


class ReferenceScorer:
    """Scores a response against a reference answer with one checker (`reward`), after the think block.

    reward = 1.0 when correct (+ `format_reward` when the format is kept: for "answer", the response ends with
    its `Answer:` line; "dapo": an `Answer:` line; "math_verify": a `\\boxed{}` answer or a final `Answer:`
    line, the two formats the prompt presets ask for).
    """

    def __init__(
        self,
        reward: str = "answer",
        answer_mode: str = "answer",
        format_reward: float = 0.0,
        think: bool = False,
        verify_timeout: int = 5,
    ) -> None:
        check_reward_kind(reward)
        check_answer_mode(answer_mode)
        if verify_timeout < 0:
            raise ValueError(f"verify_timeout={verify_timeout}: must be >= 0 seconds (0: no limit)")
        self.reward, self.answer_mode = reward, answer_mode
        self.format_reward, self.think = float(format_reward), bool(think)
        self.verify_timeout = verify_timeout

    def verdict(self, answer_text: str, reference: str) -> tuple[CheckVerdict, bool]:
        """(the checker's verdict, format kept) for the answer part of a response."""
        if self.reward == "math_verify":
            v = math_verify_check(answer_text, reference, self.verify_timeout)
            return v, last_boxed(answer_text) is not None or ends_with_answer_line(answer_text)
        if self.reward == "dapo":
            v = dapo_check(answer_text, reference)
            return v, v.extracted is not None
        extracted = extract_answer(answer_text, self.answer_mode)
        return CheckVerdict(answers_match(extracted, reference), extracted), ends_with_answer_line(
            answer_text
        )

    def __call__(self, response: str, reference: str) -> RewardResult:
        answer_text, unterminated = split_think(response, self.think)
        if answer_text is None:
            return RewardResult(0.0, False, False, None, think_unterminated=unterminated)
        v, format_ok = self.verdict(answer_text, reference)
        reward = (1.0 if v.correct else 0.0) + (self.format_reward if format_ok else 0.0)
        return RewardResult(reward, v.correct, format_ok, v.extracted, verify_failed=v.failed)


def reward_counts(results: list[RewardResult]) -> dict[str, float]:
    """A step's counted reward failures: responses whose checker gave up (timeout/error) and responses that
    never closed their think block (both scored 0)."""
    return {
        "reward/verify_failed": float(sum(r.verify_failed for r in results)),
        "reward/think_unterminated": float(sum(r.think_unterminated for r in results)),
    }
