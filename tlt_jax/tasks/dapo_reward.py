"""DAPO's answer check as VeRL runs it for math_dapo / math / aime* rows: a port of
verl/utils/reward_score/math_dapo.py (`compute_score` with its defaults: Minerva's check, no strict box).

The response's last 300 characters are searched for `Answer: <value>` lines (case-insensitive); the last
one's value and the reference are normalised the Minerva way (the right-hand side of `=`, words and units out,
`$`, `\\text{}`, `\\boxed{}` unwrapped, `\\frac12` braced, thousands separators of integers removed) and
compared as strings (DAPO-Math-17k's answers are integers). VeRL scores it -1 / +1 (`task.reward_scale`).
"""

from __future__ import annotations

import re

from tlt_jax.tasks.math_verify_reward import CheckVerdict

_DAPO_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_TAIL_CHARS = 300  # "The longest answer in MATH-500 has 159 characters"
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


def dapo_check(response: str, reference: str) -> CheckVerdict:
    """DAPO's verdict (VeRL's `is_correct_minerva`, gt_need_extract False): the last `Answer:` value in the
    response's tail equals the reference, both normalised."""
    matches = _DAPO_ANSWER_RE.findall(response[-_TAIL_CHARS:])
    if not matches:
        return CheckVerdict(False, None)
    pred = dapo_normalize(matches[-1])
    return CheckVerdict(pred == dapo_normalize(reference), pred)
