"""VeRL's reward routing: the checker a row is scored with, picked by its `data_source`, as
verl/utils/reward_score/__init__.py's `default_compute_score` picks it (`config.task.reward="verl"`).

Routed here (the math families): `openai/gsm8k` -> GSM8K's `#### n` check (gsm8k_reward); `lighteval/MATH`,
`DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500` -> the MATH scorer (math_reward);
`math_dapo`, `math`, `math_dapo_reasoning` and every source starting with `aime` -> DAPO's Minerva check
(dapo_reward, -1 / +1). VeRL's other families are not ported (UNSUPPORTED says why); a source VeRL does not
route at all is VeRL's NotImplementedError. Both are refused when the data loads, naming the sources, their
row counts and the fix, never in the middle of a run.
"""

from __future__ import annotations

from collections import Counter

ROUTES: dict[str, tuple[str, ...]] = {
    "gsm8k": ("openai/gsm8k",),
    "math_reward": ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"),
    "dapo": ("math_dapo", "math", "math_dapo_reasoning"),
}
PREFIX_ROUTES = {"aime": "dapo"}  # data_source.startswith(prefix)
_NUMINA = (
    "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
    "numina_olympiads",
)  # fmt: skip
_SEARCH = tuple(
    f"searchR1_{s}"
    for s in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
)
# VeRL family -> why it is not ported
UNSUPPORTED: dict[tuple[str, ...], str] = {
    _NUMINA: "VeRL scores them with PRIME's grader (prime_math: sympy simplification, pylatexenc and a "
    "process-pool timeout, ~33 KB), not ported",
    ("codecontests", "apps", "codeforces", "taco"): "code: VeRL runs the tests in a sandbox (sandbox_fusion "
    "or prime_code's subprocesses), which tlt_jax has not",
    ("hiyouga/geometry3k",): "geometry3k is image + text (geo3k); tlt_jax's models take text only",
    _SEARCH: "Search-R1 rows need multi-turn rollouts with a search tool, which tlt_jax's engine has not",
}
FIX = (
    "set config.task.reward to a checker that scores every row (math_verify | dapo | math_reward | gsm8k | "
    "answer), or to a function 'module:function' or 'path/to/file.py:function' (VeRL's "
    "custom_reward_function; with verl installed, 'verl.utils.reward_score:default_compute_score' runs "
    "VeRL's own scorers)"
)


def route(data_source: str | None) -> str | None:
    """The checker VeRL's `default_compute_score` uses for `data_source` (a REWARD_KINDS name), or None
    when it is not routed here (unsupported, unknown or missing)."""
    if not isinstance(data_source, str):
        return None
    for checker, sources in ROUTES.items():
        if data_source in sources:
            return checker
    for prefix, checker in PREFIX_ROUTES.items():
        if data_source.startswith(prefix):
            return checker
    return None


def why_unrouted(data_source: str | None) -> str:
    """Why `data_source` has no checker here."""
    if data_source is None:
        return "the rows carry no data_source (their layout has no such field)"
    for sources, reason in UNSUPPORTED.items():
        if data_source in sources:
            return reason
    return "VeRL routes no scorer for it (default_compute_score raises NotImplementedError)"


def check_sources(sources: Counter) -> None:
    """One ValueError naming every data_source (with its row count) that `route` does not route."""
    bad = {s: n for s, n in sources.items() if route(s) is None}
    if not bad:
        return
    lines = [
        f"{f'data_source {s!r}' if s is not None else 'no data_source'} ({n} rows): {why_unrouted(s)}"
        for s, n in sorted(bad.items(), key=str)
    ]
    raise ValueError(
        "config.task.reward='verl' routes each row by its data_source (VeRL's default_compute_score); "
        + "; ".join(lines)
        + f". To score these rows, {FIX}."
    )
