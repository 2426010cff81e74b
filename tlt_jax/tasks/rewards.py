"""Reward checkers for tasks with a reference answer, VeRL's routing by data_source, and the `<think>`
handling of R1-style responses.

`config.task.reward` picks the checker:
- "answer": tlt_jax's checker, the `Answer:` value (or the last number, `answer_mode`) compared to the
  reference by normalised numbers or text (`answers.answers_match`); reasoning-gym tasks use the dataset's own
  verifier instead.
- "math_verify": HF's math-verify (`math_verify_reward`): sympy equivalence of the response's answer with the
  reference; `math_verify_mode` "verl" calls it as VeRL's math_verify.py does, "tail" is tlt_jax's variant.
- "dapo": DAPO's Minerva check of the last `Answer:` line (`dapo_reward`, VeRL's math_dapo.py).
- "math_reward": the MATH scorer (`math_reward`, VeRL's math_reward.py: Hendrycks' `is_equiv` of the boxed
  answer). "gsm8k": GSM8K's `#### n` check (`gsm8k_reward`, VeRL's gsm8k.py).
- "verl": each row's checker picked by its data_source as VeRL's `default_compute_score` does
  (`verl_routing`; file tasks only).
- "module:function" / "path/to/file.py:function": a function of the user's (`custom_reward`), VeRL's
  custom_reward_function; its score is the reward as it is.

`reward_scale`: "verl" (default) scores each checker as VeRL does (dapo -1 / +1, the others 0 / 1), "unit"
scores every checker 0 / 1 (GRPO's advantages are unchanged by that affine map; Dr.GRPO's halve, and a DAPO
overlong penalty then weighs twice as much against correctness). A wrong, unanswered, failed (timeout) or
unterminated-think response gets the checker's low value.

Think handling (`think` on, or a prompt preset that opens `<think>`): the answer is read after the last
`</think>`; a response that never closes its think block scores low and is counted
(`reward/think_unterminated`). `think` off: the whole response, as VeRL's scorers read it. A custom function
gets the whole response, as in VeRL, with `reward_kwargs` and VeRL's acc (`custom_acc`, custom_reward).

Each result carries the scorer's own value (`RewardResult.score`: high or low, before the format bonus and
overlong shaping, VeRL's reward_extra_info "score") beside the reward.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tlt_jax.tasks.answers import (
    answers_match,
    check_answer_mode,
    ends_with_answer_line,
    extract_answer,
    last_boxed,
    split_think,
)
from tlt_jax.tasks.base import RewardResult
from tlt_jax.tasks.custom_reward import CUSTOM_ACC, call_reward_fn, is_custom, load_reward_fn
from tlt_jax.tasks.dapo_reward import dapo_check, dapo_normalize
from tlt_jax.tasks.gsm8k_reward import gsm8k_check
from tlt_jax.tasks.math_reward import math_reward_check
from tlt_jax.tasks.math_verify_reward import MATH_VERIFY_MODES, CheckVerdict, math_verify_check
from tlt_jax.tasks.verl_routing import route, why_unrouted

__all__ = ["REWARD_KINDS", "ReferenceScorer", "dapo_normalize", "reward_counts"]

REWARD_KINDS = ("answer", "math_verify", "dapo", "math_reward", "gsm8k", "verl")
REWARD_SCALES = ("verl", "unit")
VERL_LOW = {"dapo": -1.0}  # VeRL's score of a wrong answer, where it is not 0 (math_dapo.py)
_RESERVED = {"mean", "std", "overlong_mean", "overlong_frac", "verify_failed", "think_unterminated", "score"}


def check_reward_kind(reward: str) -> None:
    if not is_custom(reward) and reward not in REWARD_KINDS:
        raise ValueError(
            f"unknown reward {reward!r}: set config.task.reward to one of {list(REWARD_KINDS)} or to a "
            "function of yours, 'module:function' or 'path/to/file.py:function'"
        )


def reward_problems(
    reward: str, reward_scale: str, math_verify_mode: str, verify_timeout: int, custom_acc: str = "score"
) -> list[str]:
    """What is wrong with the reward keys (a custom function is imported and its signature checked)."""
    out = []
    if custom_acc not in CUSTOM_ACC:
        out.append(f"config.task.custom_acc={custom_acc!r}: use one of {list(CUSTOM_ACC)}")
    try:
        check_reward_kind(reward)
        if is_custom(reward):
            load_reward_fn(reward)
    except ValueError as e:
        out.append(str(e))
    if reward_scale not in REWARD_SCALES:
        out.append(f"config.task.reward_scale={reward_scale!r}: use one of {list(REWARD_SCALES)}")
    if math_verify_mode not in MATH_VERIFY_MODES:
        out.append(f"config.task.math_verify_mode={math_verify_mode!r}: use one of {list(MATH_VERIFY_MODES)}")
    if verify_timeout < 0:
        out.append(f"verify_timeout={verify_timeout}: must be >= 0 seconds (0: no limit)")
    return out


class ReferenceScorer:
    """Scores a response against a reference answer with one checker (`reward`; "verl": the row's
    data_source picks it), after the think block.

    reward = the checker's high value when correct, else its low value (`reward_scale`), plus `format_reward`
    when the format is kept: for "answer", the response ends with its `Answer:` line; "dapo": an `Answer:`
    line; "gsm8k": a `#### n` line; "math_reward": a `\\boxed{}` answer; "math_verify": a `\\boxed{}` answer
    or a final `Answer:` line, the two formats the prompt presets ask for.
    """

    def __init__(
        self,
        reward: str = "answer",
        answer_mode: str = "answer",
        format_reward: float = 0.0,
        think: bool = False,
        verify_timeout: int = 5,
        reward_scale: str = "verl",
        math_verify_mode: str = "verl",
        reward_kwargs: Mapping[str, object] | None = None,
        custom_acc: str = "score",
    ) -> None:
        check_answer_mode(answer_mode)
        problems = reward_problems(reward, reward_scale, math_verify_mode, verify_timeout, custom_acc)
        if reward_kwargs is not None and not isinstance(reward_kwargs, Mapping):
            problems.append(f"config.task.reward_kwargs={reward_kwargs!r}: must be a dict of keywords")
        if problems:
            raise ValueError("; ".join(problems))
        self.reward, self.answer_mode, self.reward_scale = reward, answer_mode, reward_scale
        self.format_reward, self.think = float(format_reward), bool(think)
        self.verify_timeout, self.math_verify_mode = verify_timeout, math_verify_mode
        self.reward_kwargs, self.custom_acc = dict(reward_kwargs or {}), custom_acc

    def checker(self, data_source: str | None) -> str:
        """The checker of a row from `data_source` (its route when reward is "verl")."""
        if self.reward != "verl":
            return self.reward
        checker = route(data_source)
        if checker is None:
            why = why_unrouted(data_source)
            raise ValueError(f"config.task.reward='verl': data_source {data_source!r}: {why}")
        return checker

    def values(self, checker: str) -> tuple[float, float]:
        """(low, high): the reward of a wrong and of a right answer."""
        return (VERL_LOW.get(checker, 0.0) if self.reward_scale == "verl" else 0.0), 1.0

    def verdict(self, checker: str, answer_text: str, reference: str) -> tuple[CheckVerdict, bool]:
        """(the checker's verdict, format kept) for the answer part of a response."""
        if checker == "math_verify":
            v = math_verify_check(answer_text, reference, self.verify_timeout, self.math_verify_mode)
            return v, last_boxed(answer_text) is not None or ends_with_answer_line(answer_text)
        if checker in ("dapo", "gsm8k", "math_reward"):
            check = {"dapo": dapo_check, "gsm8k": gsm8k_check, "math_reward": math_reward_check}[checker]
            v = check(answer_text, reference)
            return v, v.extracted is not None
        extracted = extract_answer(answer_text, self.answer_mode)
        return CheckVerdict(answers_match(extracted, reference), extracted), ends_with_answer_line(
            answer_text
        )

    def __call__(
        self,
        response: str,
        reference: str,
        data_source: str | None = None,
        extra_info: Mapping | None = None,
    ) -> RewardResult:
        if is_custom(self.reward):
            s = call_reward_fn(
                self.reward, data_source, response, reference, extra_info, self.reward_kwargs, self.custom_acc
            )
            return RewardResult(
                s.score, s.correct, False, None, source=data_source, extra=s.extra, score=s.score, acc=s.acc
            )
        checker = self.checker(data_source)
        low, high = self.values(checker)
        answer_text, unterminated = split_think(response, self.think)
        if answer_text is None:
            return RewardResult(
                low, False, False, None, think_unterminated=unterminated, source=data_source, score=low
            )
        v, format_ok = self.verdict(checker, answer_text, reference)
        score = high if v.correct else low
        reward = score + (self.format_reward if format_ok else 0.0)
        return RewardResult(
            reward, v.correct, format_ok, v.extracted, verify_failed=v.failed, source=data_source, score=score
        )


def reward_counts(results: list[RewardResult]) -> dict[str, float]:
    """A step's counted reward failures (responses whose checker gave up, responses that never closed their
    think block), the accuracy per data_source when the step mixes sources (`reward/<source>/acc`), and the
    step means of a custom function's other numeric entries (`reward/<key>`, VeRL's reward_extra_info)."""
    out = {
        "reward/verify_failed": float(sum(r.verify_failed for r in results)),
        "reward/think_unterminated": float(sum(r.think_unterminated for r in results)),
    }
    sources = sorted({r.source for r in results if r.source is not None})
    if len(sources) > 1:
        for s in sources:
            out[f"reward/{s}/acc"] = float(np.mean([r.correct for r in results if r.source == s]))
    keys = sorted({k for r in results for k in r.extra} - _RESERVED)
    for k in keys:
        out[f"reward/{k}"] = float(np.mean([r.extra[k] for r in results if k in r.extra]))
    return out
