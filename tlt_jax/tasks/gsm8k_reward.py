"""GSM8K's scorer as VeRL runs it: verl/utils/reward_score/gsm8k.py, `compute_score` with the arguments
`default_compute_score` gives it (method "strict", format_score 0, score 1), after ReFT (Trung et al., ACL
2024).

The response's last 300 characters are searched for `#### <number>` (VeRL clips there: a regex over a long
response is slow and the answer sits at the end); the last match, commas and `$` removed, must equal the
reference as a string (VeRL's preprocessing writes GSM8K's ground truth as the number after "####", commas
removed). No `####` line: no answer, scored as wrong.
"""

from __future__ import annotations

import re

from tlt_jax.tasks.math_verify_reward import CheckVerdict

_TAIL_CHARS = 300  # VeRL's _SOLUTION_CLIP_CHARS
_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_extract(response: str) -> str | None:
    """The answer VeRL's `extract_solution(method="strict")` reads from a response, or None."""
    found = _STRICT_RE.findall(response[-_TAIL_CHARS:])
    return found[-1].replace(",", "").replace("$", "") if found else None


def gsm8k_check(response: str, reference: str) -> CheckVerdict:
    """VeRL's GSM8K verdict: the extracted answer equals the reference string exactly."""
    answer = gsm8k_extract(response)
    return CheckVerdict(answer is not None and answer == reference, answer)
