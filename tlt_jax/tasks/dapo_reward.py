"""DAPO's answer check as VeRL 0.9.1 runs it for math_dapo / math / aime* rows: a port of
verl/utils/reward_score/math_dapo.py (`compute_score` with its defaults, strict_box_verify False).

The response's last 300 characters are searched for `Answer: <value>` lines (case-insensitive); the last
one's value and the reference are normalised the Minerva way (the right-hand side of `=`, words and units out,
`$`, `\\text{}`, `\\boxed{}` unwrapped, `\\frac12` braced, thousands separators of integers removed) and
compared as strings (DAPO-Math-17k's answers are integers). Without an `Answer:` line (0.9.1's `verify`,
math_dapo.py:224), the last `\\boxed{...}` in the last 100 of those characters is the answer, compared with
the reference as it is (no normalisation). VeRL scores it -1 / +1 (`task.reward_scale`).
"""

from __future__ import annotations

import re

from tlt_jax.tasks.math_verify_reward import CheckVerdict

_DAPO_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_TAIL_CHARS = 300  # "The longest answer in MATH-500 has 159 characters"
_BOX_TAIL_CHARS = 100  # is_correct_strict_box: pred[-100:]
_INVALID = "[INVALID]"  # is_correct_minerva's answer when no `Answer:` line matched
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
    """DAPO's (Minerva's) normalisation of a final answer (VeRL's `normalize_final_answer`)."""
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


def _last_boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}` with balanced braces (VeRL's last_boxed_only_string +
    remove_boxed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] == "{") - (text[i] == "}")
        if text[i] == "}" and depth == 0:
            return text[start + len("\\boxed{") : i]
    return None


def dapo_check(response: str, reference: str) -> CheckVerdict:
    """DAPO's verdict (VeRL 0.9.1's math_dapo `verify`): the last `Answer:` value in the response's tail
    equals the reference, both normalised (`is_correct_minerva`); with no `Answer:` line, the last boxed
    answer of the tail's last 100 characters equals the reference (`is_correct_strict_box`)."""
    tail = response[-_TAIL_CHARS:]
    matches = _DAPO_ANSWER_RE.findall(tail)
    pred = dapo_normalize(matches[-1] if matches else _INVALID)
    if pred != _INVALID:
        return CheckVerdict(pred == dapo_normalize(reference), pred)
    boxed = _last_boxed_content(tail[-_BOX_TAIL_CHARS:])
    if boxed is not None:
        return CheckVerdict(boxed == reference, boxed)
    return CheckVerdict(False, None)
