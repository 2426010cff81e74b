"""Answer extraction and normalisation for verifiable rewards: the `Answer:` line, the last number, numbers
in any common notation ("1,000", "3/4", "0.50", "\\boxed{7}") reduced to one canonical form.

Responses are asked to end with a line `Answer: <value>`; `extract_answer` reads it (optionally falling back
to the last number in the text, which small models produce far more often than the requested format).
"""

from __future__ import annotations

import re
from fractions import Fraction

ANSWER_MODES = ("answer", "answer_or_last_number")

# ----------------------------------------------------------------------------------------------------------
# Answer extraction and normalisation
# ----------------------------------------------------------------------------------------------------------

# "Answer:", "answer :", "**Answer:**", "**Answer**:", "Final answer:".
_ANSWER_RE = re.compile(r"answer\s*(?:\*\*|__)?\s*:", re.IGNORECASE)
# A number not glued to a preceding word or decimal point ("3-4" gives 3 and 4, "x=-4" gives -4); thousands
# separators only in groups of three ("1,000" is one number, "1,2" is two).
_NUMBER_RE = re.compile(r"(?:(?<![\w.])-)?(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _unwrap_boxed(s: str) -> str:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `s`, braces matched; else `s`."""
    start = max(s.rfind(cmd + "{") for cmd in _BOX_COMMANDS)
    if start < 0:
        return s
    open_idx = s.index("{", start)
    depth = 0
    for i in range(open_idx, len(s)):
        if s[i] == "{":
            depth += 1
        elif s[i] == "}":
            depth -= 1
            if depth == 0:
                return s[open_idx + 1 : i]
    return s[open_idx + 1 :]  # unbalanced (truncated response): take what is there


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}` in `text` (nested braces matched; a truncated
    box gives what is there), or None when there is none. MATH solutions carry their answer this way."""
    if max(text.rfind(cmd + "{") for cmd in _BOX_COMMANDS) < 0:
        return None
    return _unwrap_boxed(text)


THINK_CLOSE = "</think>"


def split_think(text: str, required: bool) -> tuple[str | None, bool]:
    """(the part of a response a checker reads, whether the think block was left open).

    `required` (config.task.think, or a prompt preset that opens `<think>`): R1-style models reason inside
    `<think>...</think>` (the opening tag is often the chat template's) and answer after it, so the answer
    part is the text after the LAST `</think>`; a response without one never finished reasoning, (None, True),
    and scores low. Not required: the whole response, `</think>` or not, as VeRL's scorers read it (VeRL 0.9.1
    strips no think block: "Answer: 34\n</think>..." is scored on its `Answer:` line).
    """
    if not required:
        return text, False
    _, sep, tail = text.rpartition(THINK_CLOSE)
    return (tail, False) if sep else (None, True)


def _strip_math_delimiters(s: str) -> str:
    s = s.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s


def _clean_answer(value: str) -> str:
    """Strip markdown bold, trailing periods, `\\boxed{}` and math delimiters from an extracted answer."""
    value = value.strip().replace("**", "").replace("__", "").strip()
    value = value.rstrip(".").strip()
    value = _unwrap_boxed(value)
    value = _strip_math_delimiters(value)
    return value.rstrip(".").strip()


def last_number(text: str) -> str | None:
    """The last number in `text` (commas removed), or None. "-4", "3.5" and "1,000" count as numbers."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_answer(text: str, mode: str = "answer") -> str | None:
    """The final answer in a response, or None.

    mode "answer": the value after the LAST `Answer:` marker (case-insensitive; `**Answer:**` works), taken to
    the end of its line (or the next non-empty line when the marker ends its line), with markdown bold,
    trailing periods, `\\boxed{...}` and `$...$` removed.
    mode "answer_or_last_number": the same, falling back to the last number anywhere in the text when there is
    no (non-empty) `Answer:` value.
    """
    if mode not in ANSWER_MODES:
        raise ValueError(f"unknown answer mode {mode!r}; valid modes: {list(ANSWER_MODES)}")
    value, _ = _last_answer_line(text)
    if value:
        return value
    if mode == "answer_or_last_number":
        return last_number(text)
    return None


def _last_answer_line(text: str) -> tuple[str, str]:
    """(the cleaned value after the LAST `Answer:` marker, the text after that value's line); ("", "") when
    there is no marker. The marker may end its line: the value is then on the next non-empty line."""
    matches = list(_ANSWER_RE.finditer(text))
    if not matches:
        return "", ""
    rest = text[matches[-1].end() :].lstrip(" \t*_").lstrip()
    line, _, after = rest.partition("\n")
    return _clean_answer(line), after


def ends_with_answer_line(text: str) -> bool:
    """Whether the response ENDS with its `Answer: <value>` line, as the instruction asks ("the final answer
    on the last line"): the last marker has a non-empty value and nothing but whitespace follows that value's
    line. The format reward uses this, not mere presence: with "any `Answer:` anywhere" RL on a 135M model
    learned to write the marker early and ramble on to the length cap (held-out format 17% -> 91%, answers
    at the cap 2% -> 69%, accuracy 3% -> 0% in 10 steps; docs/benchmarks.md)."""
    value, after = _last_answer_line(text)
    return bool(value) and not after.strip()


def _canonical(value: Fraction) -> str:
    """Exact canonical text for a rational: "1000", "3.5", "-0.125", or "1/3" when not a finite decimal."""
    if value == 0:
        return "0"
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    twos = fives = 0
    while den % 2 == 0:
        den //= 2
        twos += 1
    while den % 5 == 0:
        den //= 5
        fives += 1
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10**places // value.denominator
    digits = str(scaled).rjust(places + 1, "0")
    text = f"{digits[:-places]}.{digits[-places:]}".rstrip("0").rstrip(".")
    return ("-" if value < 0 else "") + text


_FRAC_BRACED_RE = re.compile(r"^([+-]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_FRAC_SHORT_RE = re.compile(r"^([+-]?)\\[dt]?frac(\d)(\d)$")
_THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?$")
_DECIMAL_RE = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$")


def _parse_number(s: str) -> Fraction | None:
    s = s.strip()
    if not s:
        return None
    m = _FRAC_BRACED_RE.match(s) or _FRAC_SHORT_RE.match(s)
    if m:
        num, den = _parse_number(m.group(2)), _parse_number(m.group(3))
        if num is None or den is None or den == 0:
            return None
        return -(num / den) if m.group(1) == "-" else num / den
    if s.count("/") == 1:
        num_s, den_s = s.split("/")
        num, den = _parse_number(num_s), _parse_number(den_s)
        if num is None or den is None or den == 0:
            return None
        return num / den
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    if _DECIMAL_RE.match(s):
        return Fraction(s)
    return None


def normalize_number(s: str | None) -> str | None:
    """Canonical exact text of a number written in plain or light-LaTeX form, or None if `s` is not a number.

    Handles surrounding whitespace, `\\boxed{}`, `$...$`, currency `$`/`\\$`, a trailing `%`/`\\%` or period,
    thousands separators ("1,000", "1{,}000"), a leading "+", unicode minus, "-0", decimals with trailing
    zeros ("3.50" -> "3.5"), exponents ("1e3"), and fractions ("1/2", "\\frac{1}{2}", "\\dfrac12",
    "-\\frac{3}{4}").
    Values are exact rationals: "\\frac{1}{2}" and "0.5" both give "0.5"; "1/3" stays "1/3" (not "0.333").
    """
    if s is None:
        return None
    t = _unwrap_boxed(s.strip())
    t = _strip_math_delimiters(t)
    t = t.replace("\u2212", "-").replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\ ", "")
    t = t.replace("\\$", "").replace("$", "").replace("\\%", "%").strip()
    t = t.rstrip(".").strip()
    if t.endswith("%"):
        t = t[:-1].strip()
    if len(t) > 1 and t[0] in "+-" and t[1] == " ":
        t = t[0] + t[1:].strip()
    value = _parse_number(t)
    return None if value is None else _canonical(value)


def normalize_text(s: str) -> str:
    """Loose text form for non-numeric answers: boxed/math delimiters and trailing period removed, whitespace
    collapsed, lower case."""
    t = _strip_math_delimiters(_unwrap_boxed(s.strip())).rstrip(".")
    return " ".join(t.split()).lower()


def answers_match(predicted: str | None, reference: str) -> bool:
    """Equality of the normalised numbers when both parse as numbers, else normalised text equality."""
    if predicted is None:
        return False
    pred_num, ref_num = normalize_number(predicted), normalize_number(reference)
    if pred_num is not None and ref_num is not None:
        return pred_num == ref_num
    return normalize_text(predicted) == normalize_text(reference)


def check_answer_mode(answer_mode: str) -> None:
    if answer_mode not in ANSWER_MODES:
        raise ValueError(f"unknown answer_mode {answer_mode!r}; valid modes: {list(ANSWER_MODES)}")
