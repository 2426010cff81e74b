"""The MATH scorer as VeRL runs it for lighteval/MATH, MATH-lighteval and MATH-500: a port of
verl/utils/reward_score/math_reward.py (itself lm-evaluation-harness's hendrycks_math `is_equiv`).

The response's last `\\boxed{...}` (or `\\boxed x` up to a `$`; `\\fbox{}` is found but not unwrapped, which
VeRL scores 0) is compared with the reference after Hendrycks' string normalisation (`strip_string`: spaces,
`\\left`/`\\right`, `\\dfrac`, degrees, `\\$`, `%`, units after `\\text{ `, a short `k =` prefix, `\\sqrt3`,
`\\frac12`, `a/b`, `0.5` -> `\\frac{1}{2}`). Where the normalisation fails (VeRL's asserts) the raw strings
are compared, and where unwrapping the box fails the response scores 0, as in VeRL. No sympy: `1/3` and
`0.333` differ; that is VeRL's MATH reward (math-verify is the lenient one).
"""

from __future__ import annotations

from tlt_jax.tasks.math_verify_reward import CheckVerdict

_REPLACEMENTS = (
    ("\n", ""),
    ("\\!", ""),
    ("\\\\", "\\"),
    ("tfrac", "frac"),
    ("dfrac", "frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\$", ""),
)  # fmt: skip  (strip_string's first steps, in order)


class _BoxError(ValueError):
    """Where VeRL's asserts fail."""


def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed{...}` / `\\fbox{...}` with its braces (nested braces matched), `\\boxed x` up to a
    `$`, or None (no box, or a box never closed)."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    idx = text.rfind("\\boxed")
    if idx < 0:
        idx = text.rfind("\\fbox")
        if idx < 0:
            return None
    depth = 0
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[idx : i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """The content of a `last_boxed_only_string` result (a `\\fbox{}` is an error, as VeRL asserts)."""
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise _BoxError(boxed)
        return boxed[len("\\boxed ") :]
    if not boxed.startswith("\\boxed{") or not boxed.endswith("}"):
        raise _BoxError(boxed)
    return boxed[len("\\boxed{") : -1]


def _fix_fracs(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}` (an empty part raises, as VeRL's)."""
    first, *rest = s.split("\\frac")
    out = first
    for sub in rest:
        out += "\\frac"
        if sub[0] == "{":
            out += sub
        elif len(sub) < 2:
            return s
        elif sub[1] != "{":
            out += "{" + sub[0] + "}{" + sub[1] + "}" + sub[2:]
        else:
            out += "{" + sub[0] + "}" + sub[1] + sub[2:]
    return out


def _fix_a_slash_b(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _remove_right_units(s: str) -> str:
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise _BoxError(s)
    return parts[0]


def _fix_sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    first, *rest = s.split("\\sqrt")
    return first + "".join(
        "\\sqrt" + sub if sub[0] == "{" else "\\sqrt{" + sub[0] + "}" + sub[1:] for sub in rest
    )


def strip_string(s: str) -> str:
    """Hendrycks' normalisation of a MATH answer (VeRL's `strip_string`, step for step)."""
    for before, after in _REPLACEMENTS:
        s = s.replace(before, after)
    s = _remove_right_units(s)
    s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def is_equiv(a: str, b: str) -> bool:
    """Equal after `strip_string`; the raw strings compared when normalising raises (VeRL's fallback)."""
    try:
        return strip_string(a) == strip_string(b)
    except (_BoxError, IndexError):
        return a == b


def math_reward_check(response: str, reference: str) -> CheckVerdict:
    """VeRL's MATH verdict: the last boxed answer `is_equiv` to the reference (no box, or one that does not
    unwrap: wrong, with nothing extracted)."""
    boxed = last_boxed_only_string(response)
    if boxed is None:
        return CheckVerdict(False, None)
    try:
        answer = remove_boxed(boxed)
    except _BoxError:
        return CheckVerdict(False, None)
    return CheckVerdict(is_equiv(answer, reference), answer)
