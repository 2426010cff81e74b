"""Rewards as VeRL computes them: routing by data_source for each VeRL family (reward="verl"), the families
refused when the data loads, the override per task and per eval set, the -1 / +1 scale, the GSM8K and MATH
ports on their quirks, math-verify called as VeRL calls it, a custom reward function (good, bad path, bad
signature, bad return) and the step metrics (per-source accuracy, a custom function's extra entries).

The ports were also checked against VeRL's own files (b178a3c) on 200,000 random strings: docs/benchmarks.md.
"""

from __future__ import annotations

import pathlib
import re

import ml_collections as mlc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt_jax.rl import config as rl_config
from tlt_jax.rl.evaluation import eval_set_configs
from tlt_jax.tasks import make_task
from tlt_jax.tasks.datasets import task_config
from tlt_jax.tasks.gsm8k_reward import gsm8k_check
from tlt_jax.tasks.math_reward import is_equiv, math_reward_check
from tlt_jax.tasks.math_verify_reward import math_verify_check
from tlt_jax.tasks.rewards import ReferenceScorer, reward_counts
from tlt_jax.tasks.verl_routing import route

# one row per VeRL family routed here: (data_source, reference)
ROWS = [
    ("openai/gsm8k", "72"),
    ("HuggingFaceH4/MATH-500", "\\frac{1}{2}"),
    ("math_dapo", "34"),
    ("aime2024", "204"),
]
# (row, response, reward under reward="verl"): GSM8K needs `#### n`, MATH a box (Hendrycks' normalisation),
# DAPO an `Answer:` line, scored -1 / +1
CASES = [
    (0, "48 + 24 = 72\n#### 72", 1.0),
    (0, "The answer is 72.", 0.0),
    (1, "so \\boxed{\\dfrac12}", 1.0),
    (1, "Answer: 1/2", 0.0),
    (2, "... so\nAnswer: 34", 1.0),
    (2, "Answer: 35", -1.0),
    (3, "\\boxed{204}", 1.0),  # VeRL 0.9.1: no `Answer:` line, the last box (math_dapo.py verify)
    (3, "\\boxed{204.0}", -1.0),  # the box compared as it is
]


def verl_parquet(path: pathlib.Path, rows: list[tuple[str, str]]) -> pathlib.Path:
    table = [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": f"Problem {i}?"}],
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"index": i, "level": i % 3},
        }
        for i, (source, answer) in enumerate(rows)
    ]
    pq.write_table(pa.Table.from_pylist(table), path)
    return path


def file_task(path: pathlib.Path, **keys: object):
    return make_task(task_config("parquet", path=str(path), shuffle=False, **keys))


def test_route_names_each_family() -> None:
    assert route("openai/gsm8k") == "gsm8k"
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert route(source) == "math_reward"
    for source in ("math_dapo", "math", "math_dapo_reasoning", "aime", "aime2024", "aime_2025"):
        assert route(source) == "dapo"
    for source in ("numina_olympiads", "codecontests", "hiyouga/geometry3k", "searchR1_nq", "gsm8k", None):
        assert route(source) is None


def test_verl_routing_scores_each_row_by_its_source(tmp_path) -> None:
    task = file_task(verl_parquet(tmp_path / "mix.parquet", ROWS), reward="verl")
    results = [task.score(task.problem(row), response) for row, response, _ in CASES]
    assert [r.reward for r in results] == [want for _, _, want in CASES]
    assert [r.correct for r in results] == [want > 0 for _, _, want in CASES]
    assert [r.source for r in results] == [ROWS[row][0] for row, _, _ in CASES]
    # the step's accuracy per source when sources mix (each source: one right, one wrong)
    counts = reward_counts(results)
    assert {k: v for k, v in counts.items() if k.endswith("/acc")} == {
        f"reward/{source}/acc": 0.5 for source, _ in ROWS
    }
    assert not any(k.endswith("/acc") for k in reward_counts(results[:2]))  # one source: nothing extra
    # reward_scale="unit": every checker 0 / 1
    unit = file_task(tmp_path / "mix.parquet", reward="verl", reward_scale="unit")
    got = [unit.score(unit.problem(row), response).reward for row, response, _ in CASES]
    assert got == [max(want, 0.0) for _, _, want in CASES]


def test_unrouted_sources_are_refused_when_the_data_loads(tmp_path) -> None:
    rows = [("numina_olympiads", "1"), ("numina_olympiads", "2"), ("codecontests", "x"), ("my_set", "3")]
    path = verl_parquet(tmp_path / "bad.parquet", rows + [("math_dapo", "4")])
    with pytest.raises(ValueError) as e:
        file_task(path, reward="verl")
    msg = str(e.value)
    assert "data_source 'numina_olympiads' (2 rows): VeRL scores them with PRIME's grader" in msg
    assert "data_source 'codecontests' (1 rows): code: VeRL runs the tests in a sandbox" in msg
    assert "data_source 'my_set' (1 rows): VeRL routes no scorer for it" in msg
    assert "set config.task.reward to a checker that scores every row" in msg
    # a config error before anything is built; another checker scores every row
    config = mlc.ConfigDict(task_config("parquet", path=str(path), reward="verl"))
    assert "numina_olympiads" in rl_config.task_problems(config)[0]
    assert file_task(path, reward="math_verify").score(file_task(path).problem(4), "\\boxed{4}").correct


def test_override_per_task_and_per_eval_set(tmp_path) -> None:
    path = verl_parquet(tmp_path / "aime.parquet", [("aime2024", "204")])
    boxed = "\\boxed{204.0}"  # DAPO's box fallback compares strings, math-verify numbers
    assert file_task(path, reward="verl").score(file_task(path).problem(0), boxed).reward == -1.0
    assert file_task(path, reward="math_verify").score(file_task(path).problem(0), boxed).reward == 1.0
    train = task_config("parquet", path=str(path), reward="verl", reward_scale="unit")
    sets = eval_set_configs({"routed": str(path), "mv": {"path": str(path), "reward": "math_verify"}}, train)
    routed, mv = make_task(sets["routed"][0]), make_task(sets["mv"][0])
    assert sets["routed"][0]["reward"] == "verl" and sets["mv"][0]["reward"] == "math_verify"
    assert not routed.score(routed.problem(0), boxed).correct and mv.score(mv.problem(0), boxed).correct


def test_math_and_gsm8k_ports_keep_verl_quirks() -> None:
    # Hendrycks' normalisation: \\dfrac, \\frac12, a/b, 0.5, units after "\\text{ ", a short "k =" prefix
    for a, b in [("\\dfrac{1}{2}", "\\frac12"), ("1/2", "0.5"), ("10\\text{ cm}", "10"), ("k = 5", "5"),
                 ("\\left(1,2\\right)", "(1,2)"), ("90^\\circ", "90"), (".5", "\\frac{1}{2}")]:  # fmt: skip
        assert is_equiv(a, b), (a, b)
    assert not is_equiv("3.5", "7/2")  # no sympy: that is math-verify's job
    # two "\\text{ " parts: VeRL's assert fails and the raw strings are compared
    assert is_equiv("1\\text{ a}\\text{ b}", "1\\text{ a}\\text{ b}")
    assert not is_equiv("1\\text{ a}\\text{ b}", "1")
    assert math_reward_check("x \\boxed 5$ done", "5").correct  # "\\boxed 5" up to the `$`
    assert math_reward_check("\\fbox{5}", "5").extracted is None  # found but not unwrapped: 0, as VeRL
    assert math_reward_check("\\boxed{5", "5").extracted is None  # never closed
    # GSM8K: `#### n` in the last 300 characters, commas removed, compared as strings
    assert gsm8k_check("so #### 1,234", "1234").correct
    assert not gsm8k_check("so ####1234", "1234").correct and not gsm8k_check("#### 72.0", "72").correct
    assert not gsm8k_check("#### 72" + " " * 300, "72").correct  # out of the tail


def test_math_verify_as_verl_calls_it() -> None:
    far = "\\boxed{7} " + "and so on, " * 500  # the answer 5,500 characters before the end
    assert math_verify_check(far, "7", mode="verl").correct  # the whole response parsed
    assert not math_verify_check(far, "7", mode="tail").correct  # the last 4,000 characters only
    scorer = ReferenceScorer("math_verify", math_verify_mode="tail")
    assert scorer("\\boxed{3}", "3").correct
    with pytest.raises(ValueError, match=r"math_verify_mode='fast': use one of \['verl', 'tail'\]"):
        ReferenceScorer("math_verify", math_verify_mode="fast")


CUSTOM = """
def score(data_source, solution_str, ground_truth, extra_info=None):
    ok = solution_str.strip().endswith(ground_truth)
    return {"score": 2.0 if ok else -0.5, "acc": ok, "pred": solution_str[-3:], "level": extra_info["level"]}


def by_index(data_source, solution_str, ground_truth, extra_info):
    return 1 if extra_info["index"] == 0 else 0.25


def text(data_source, solution_str, ground_truth, extra_info):
    return "yes"


def no_score(**kwargs):
    return {"acc": True}


def two_args(solution_str, ground_truth):
    return 1.0
"""


def test_custom_reward_function(tmp_path, monkeypatch) -> None:
    data = verl_parquet(tmp_path / "d.parquet", [("mine", "42"), ("mine", "43")])
    (tmp_path / "my_reward.py").write_text(CUSTOM)
    task = file_task(data, reward=f"{tmp_path / 'my_reward.py'}:score")
    results = [task.score(task.problem(i), f"Answer: {a}") for i, a in ((0, 42), (1, 7))]
    assert [(r.reward, r.correct) for r in results] == [(2.0, True), (-0.5, False)]  # as returned: no scale
    counts = reward_counts(results)  # numeric entries as step means; "pred" (text) and "score" not
    assert counts["reward/acc"] == 0.5 and counts["reward/level"] == 0.5 and "reward/pred" not in counts
    monkeypatch.syspath_prepend(str(tmp_path))  # a module on the path: module:function
    task = file_task(data, reward="my_reward:by_index")
    results = [task.score(task.problem(i), "anything") for i in (0, 1)]
    assert [(r.reward, r.correct) for r in results] == [(1.0, True), (0.25, False)]  # extra_info passed
    bad = file_task(data, reward="my_reward:text")
    with pytest.raises(ValueError, match=r"returned 'yes'; expected a number or a dict with a numeric"):
        bad.score(bad.problem(0), "x")
    bad = file_task(data, reward="my_reward:no_score")
    with pytest.raises(ValueError, match=r"returned \{'acc': True\}; expected"):
        bad.score(bad.problem(0), "x")


@pytest.mark.parametrize(
    "reward,error",
    [
        ("missing/dir/r.py:score", r"the file 'missing/dir/r.py' does not exist"),
        ("no_such_module_for_tlt:score", r"no module 'no_such_module_for_tlt'"),
        ("my_reward:absent", r"'my_reward' has no 'absent' \(its functions: \['by_index', 'no_score'"),
        ("my_reward:two_args", r"two_args\(solution_str, ground_truth\) cannot take the keywords VeRL"),
        ("my_reward:", r"write 'module:function' or 'path/to/file.py:function'"),
    ],
)
def test_custom_reward_errors_at_validation(tmp_path, monkeypatch, reward: str, error: str) -> None:
    data = verl_parquet(tmp_path / "d.parquet", [("mine", "42")])
    (tmp_path / "my_reward.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    problems = rl_config.task_problems(mlc.ConfigDict(task_config("parquet", path=str(data), reward=reward)))
    assert len(problems) == 1 and problems[0].startswith(f"config.task: config.task.reward={reward!r}")
    assert re.search(error, problems[0]), problems[0]
