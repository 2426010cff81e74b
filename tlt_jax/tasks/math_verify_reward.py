"""The `math_verify` checker: HF's `math-verify` parses the reference and the response into sympy and compares
them (fractions, decimals, percentages, intervals, radicals, pi, tuples, sets, `x = ...`, `\\text{}`, units).

Two modes (`config.task.math_verify_mode`):
- "verl" (default): as verl/utils/reward_score/math_verify.py's `compute_score` calls it (`math_metric` with
  LaTeX extraction of the gold, expression + LaTeX of the prediction): the reference read as
  `\\boxed{<reference>}` only (one that does not parse scores 0, counted as a failure here), the whole
  response parsed.
- "tail": tlt_jax's variant: the response's last 4,000 characters parsed (a long reasoning trace costs no
  parse time; an answer further back is missed), and a reference the boxed LaTeX reader extracts nothing from
  read again with expression extraction (on the references tried, none: the reader takes what the other
  does).

Parsing and verification each run under a time limit (`timeout` seconds, math-verify's SIGALRM timer, so only
on the main thread; elsewhere without a limit; VeRL uses math-verify's defaults, 5 s). Whatever goes wrong (a
timeout, a parser error, a reference that does not parse) is a failed verdict, counted by the caller, never
raised: model output is untrusted.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any

TAIL_CHARS = 4000  # mode "tail": the response's last characters are parsed
MATH_VERIFY_MODES = ("verl", "tail")


@dataclasses.dataclass(frozen=True)
class CheckVerdict:
    """A checker's verdict: correct, the answer it read (None: none found), failed (the checker gave up:
    timeout or error; scored 0)."""

    correct: bool
    extracted: str | None
    failed: bool = False


def _library() -> Any:
    try:
        import math_verify
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("reward 'math_verify' needs `pip install math-verify==0.9.0`") from e
    return math_verify


def _timeout_error() -> type[BaseException]:
    from math_verify.errors import TimeoutException

    return TimeoutException


def _limit(timeout: int) -> int | None:
    """math-verify's timer is SIGALRM: usable on the main thread only."""
    return timeout if timeout > 0 and threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=65536)
def _gold(reference: str, timeout: int, fallback: bool) -> tuple[Any, ...]:
    """The parsed reference (cached: a group scores the same reference n times); () when it does not parse.
    `fallback`: a reference the boxed LaTeX reader rejects is read again as an expression."""
    mv = _library()
    latex = [mv.LatexExtractionConfig()]
    parsed = mv.parse(f"\\boxed{{{reference}}}", latex, parsing_timeout=_limit(timeout), raise_on_error=True)
    if not parsed and fallback:
        both = [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
        parsed = mv.parse(reference, both, parsing_timeout=_limit(timeout), raise_on_error=True)
    return tuple(parsed)


def math_verify_check(response: str, reference: str, timeout: int = 5, mode: str = "verl") -> CheckVerdict:
    """Whether `response`'s final answer equals `reference` mathematically (a failed verdict on any error)."""
    if mode not in MATH_VERIFY_MODES:
        raise ValueError(f"math_verify mode {mode!r}: use one of {list(MATH_VERIFY_MODES)}")
    mv = _library()
    tail = mode == "tail"
    try:
        gold = _gold(reference, timeout, tail)
        if not gold:
            return CheckVerdict(False, None, failed=True)
        configs = [mv.ExprExtractionConfig(), mv.LatexExtractionConfig()]
        text = response[-TAIL_CHARS:] if tail else response
        pred = mv.parse(text, configs, parsing_timeout=_limit(timeout), raise_on_error=True)
        if not pred:
            return CheckVerdict(False, None)
        extracted = str(pred[-1]) if isinstance(pred[-1], str) else str(pred[0])
        ok = mv.verify(list(gold), pred, timeout_seconds=_limit(timeout), raise_on_error=True)
        return CheckVerdict(bool(ok), extracted)
    except (Exception, _timeout_error()):  # the timeout is a BaseException
        return CheckVerdict(False, None, failed=True)
