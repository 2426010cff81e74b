"""File tasks: parquet and JSONL in each layout (VeRL, MATH, question/answer) from small files written here,
globs and several files, only the mapped columns read, every bad-file case named by file, row and field
(at config validation, before anything is written), multi-epoch order resumable from one position, and
the reasoning-gym parquet writer."""

from __future__ import annotations

import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt_jax import config_lib
from tlt_jax.rl import config as rl_config
from tlt_jax.tasks import files, make_task
from tlt_jax.tasks.base import TrainSplit
from tlt_jax.tasks.datasets import task_config
from tlt_jax.tasks.write_parquet import main as write_parquet

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def verl_row(i: int, answer: str = "7", **extra) -> dict:
    return {
        "data_source": "toy",
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"What is {i}+7?"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": 100 + i},
        **extra,
    }


def write_parquet_rows(path: pathlib.Path, rows: list[dict], row_group_size: int = 2) -> pathlib.Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def write_jsonl(path: pathlib.Path, rows: list[object]) -> pathlib.Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_verl_parquet_reads_chat_prompts_and_only_the_mapped_columns(tmp_path, monkeypatch) -> None:
    path = write_parquet_rows(tmp_path / "train.parquet", [verl_row(i, blob="x" * 100) for i in range(5)])
    seen: list[list[str]] = []
    iter_batches = pq.ParquetFile.iter_batches
    monkeypatch.setattr(
        pq.ParquetFile,
        "iter_batches",
        lambda self, **kw: seen.append(kw["columns"]) or iter_batches(self, **kw),
    )
    task = make_task({"kind": "parquet", "path": str(path), "shuffle": False})
    assert task.layout == files.LAYOUTS["verl"] and len(task) == 5
    assert seen == [["data_source", "prompt", "reward_model", "extra_info"]]  # not `ability`, not `blob`
    p = task.problem(2)
    assert (p.uid, p.answer, p.question, p.entry["data_source"]) == ("102", "7", "What is 2+7?", "toy")
    # chat data is passed through as it is ("auto" prompt: "none"), a system prompt replaces the data's
    assert task.messages(p) == list(p.messages)
    custom = make_task(task_config("parquet", path=str(path), system_prompt="S", instruction="Box it."))
    assert custom.messages(p) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "What is 2+7?\n\nBox it."},
    ]
    assert make_task({"kind": "parquet", "path": str(path), "max_rows": 3}).problems[-1].uid == "102"


def test_math_layout_boxed_answers_in_jsonl_and_parquet(tmp_path) -> None:
    rows = [
        {"problem": "Half?", "solution": "It is \\boxed{\\frac{1}{2}}.", "unique_id": "a"},
        {
            "problem": "Set?",
            "solution": "First \\boxed{1}, finally \\boxed{\\{1, \\sqrt{2}\\}}",
            "unique_id": "b",
        },
    ]
    for path in (write_jsonl(tmp_path / "m.jsonl", rows), write_parquet_rows(tmp_path / "m.parquet", rows)):
        task = make_task(
            {"kind": path.suffix[1:], "path": str(path), "shuffle": False, "reward": "math_verify"}
        )
        assert task.layout.answer_from == "boxed"
        assert [task.problem(i).answer for i in range(2)] == ["\\frac{1}{2}", "\\{1, \\sqrt{2}\\}"]
        assert task.score(task.problem(0), "so \\boxed{0.5}").correct
        assert task.messages(task.problem(0))[-1]["content"].startswith("Half?\n\nThink step by step.")


def test_question_answer_layout_globs_several_files_and_a_field_map(tmp_path) -> None:
    for k in range(3):
        write_parquet_rows(
            tmp_path / f"part{k}.parquet", [{"q": f"Q{k}{i}", "a": k * 10 + i} for i in range(2)]
        )
    task = make_task(
        {"kind": "parquet", "path": f"{tmp_path}/part[12].parquet,{tmp_path}/part0.parquet", "layout": "qa",
         "prompt_key": "q", "answer_key": "a", "shuffle": False}
    )  # fmt: skip
    assert [task.problem(i).question for i in range(6)] == ["Q10", "Q11", "Q20", "Q21", "Q00", "Q01"]
    assert [task.problem(i).answer for i in range(2)] == ["10", "11"]
    assert task.problem(0).uid == "part1.parquet:0"
    # ids repeated across files (VeRL's extra_info.index counts from 0 in each): uids stay unique
    for k in range(2):
        write_parquet_rows(tmp_path / f"v{k}.parquet", [verl_row(i) for i in range(2)])
    both = make_task({"kind": "parquet", "path": f"{tmp_path}/v*.parquet", "shuffle": False})
    assert [both.problem(i).uid for i in range(4)] == [
        "v0.parquet:0",
        "v0.parquet:1",
        "v1.parquet:0",
        "v1.parquet:1",
    ]


BAD_CASES = {
    "missing column": (
        [{"prompt": [{"role": "user", "content": "q"}]}],
        "parquet",
        r"missing field 'reward_model",
    ),
    "missing nested key": (
        [verl_row(0), verl_row(1, reward_model={"style": "rule"})],
        "parquet",
        r"row 1: missing field 'reward_model.ground_truth' \(null in this row\)",
    ),
    "empty answer": (
        [verl_row(0), verl_row(1), verl_row(2, answer=" ")],
        "parquet",
        r"row 2: field .* is empty",
    ),
    "bad messages": (
        [verl_row(0, prompt=[{"role": "user"}])],
        "parquet",
        r"row 0: field 'prompt' must be a string or a list of chat messages",
    ),
    "no boxed answer": (
        [{"problem": "p", "solution": "\\boxed{1}"}, {"problem": "p", "solution": "it is 3"}],
        "jsonl",
        r"m\.jsonl:2: field 'solution' has no \\boxed\{...\} answer",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_rows_name_the_file_row_and_field(tmp_path, case: str) -> None:
    rows, kind, pattern = BAD_CASES[case]
    path = tmp_path / f"m.{kind}"
    write_parquet_rows(path, rows) if kind == "parquet" else write_jsonl(path, rows)
    with pytest.raises(ValueError, match=pattern) as err:
        make_task({"kind": kind, "path": str(path), "layout": "verl" if kind == "parquet" else "math"})
    assert str(path) in str(err.value)


def test_bad_files_and_options(tmp_path) -> None:
    garbage = tmp_path / "bad.parquet"
    garbage.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=rf"{garbage}: not a readable parquet file"):
        make_task({"kind": "parquet", "path": str(garbage)})
    good = write_parquet_rows(tmp_path / "good.parquet", [verl_row(0)])
    with pytest.raises(ValueError, match=r"unknown layout 'dapo'.*\['math', 'qa', 'verl'\]"):
        make_task({"kind": "parquet", "path": str(good), "layout": "dapo"})
    with pytest.raises(
        FileNotFoundError, match=r"nothing\*\.parquet does not exist \(or the glob matches no file"
    ):
        make_task({"kind": "parquet", "path": f"{tmp_path}/nothing*.parquet"})
    with pytest.raises(ValueError, match=r"finds no layout for the fields \['x', 'y'\]"):
        make_task({"kind": "jsonl", "path": str(write_jsonl(tmp_path / "xy.jsonl", [{"x": 1, "y": 2}]))})
    with pytest.raises(ValueError, match=r"config.task.prompt='r2'"):
        make_task({"kind": "parquet", "path": str(good), "prompt": "r2"})


def test_a_bad_file_fails_config_validation_with_one_error(tmp_path) -> None:
    path = write_parquet_rows(tmp_path / "train.parquet", [verl_row(0), verl_row(1, answer="")])
    c = config_lib.load_config_file(CONFIGS / "smoke.py")
    c.task = task_config("parquet", path=str(path))
    with pytest.raises(ValueError, match=r"config.task: .*train\.parquet: row 1: field .* is empty") as err:
        rl_config.validate_grpo(c)
    assert str(err.value).count("train.parquet") == 1


def test_multi_epoch_order_resumes_from_one_position(tmp_path) -> None:
    path = write_parquet_rows(tmp_path / "t.parquet", [verl_row(i) for i in range(7)])
    task = TrainSplit(make_task({"kind": "parquet", "path": str(path), "seed": 3}), held_out=2)
    whole, end = task.batch(0, 4 * 5)  # 4 epochs of the 5 training problems
    first, position = task.batch(0, 7)  # a run stopped after 7, resumed from its stored position
    again = make_task({"kind": "parquet", "path": str(path), "seed": 3})
    rest, _ = TrainSplit(again, held_out=2).batch(position, 13)
    assert [p.uid for p in first + rest] == [p.uid for p in whole] and end == 20
    epochs = [[p.uid for p in whole[i : i + 5]] for i in range(0, 20, 5)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs) and len({tuple(e) for e in epochs}) > 1


def test_write_parquet_makes_verl_rows(tmp_path) -> None:
    out = write_parquet(["--dataset", "chain_sum", "--size", "3", "--out", str(tmp_path / "d" / "c.parquet")])
    task = make_task({"kind": "parquet", "path": str(out), "shuffle": False, "reward": "math_verify"})
    p = task.problem(1)
    assert task.layout == files.LAYOUTS["verl"] and p.entry["data_source"] == "reasoning_gym/chain_sum"
    assert p.question.endswith("in the form 'Answer: <value>'.") and task.messages(p) == list(p.messages)
    assert task.score(p, f"Answer: {p.answer}").correct
    # --data-source math_dapo: rows that reward=verl scores with DAPO's check (-1 / +1)
    args = ["--size", "2", "--data-source", "math_dapo", "--out", str(tmp_path / "dapo.parquet")]
    task = make_task({"kind": "parquet", "path": str(write_parquet(args)), "reward": "verl"})
    p = task.problem(0)
    assert p.entry["data_source"] == "math_dapo" and task.score(p, f"Answer: {p.answer}").reward == 1.0
    assert task.score(p, "Answer: none").reward == -1.0


def test_a_file_of_copied_problems_says_so(tmp_path, caplog) -> None:
    """DAPO's AIME file holds each problem 32 times (VeRL evaluates it with val_kwargs.n=1): loading a file
    whose every problem repeats says so, with the fix; a file with one accidental repeat says nothing."""
    rows = [{"question": f"{i} + 1?", "answer": str(i + 1)} for i in range(3)] * 4
    path = write_jsonl(tmp_path / "copies.jsonl", rows)
    with caplog.at_level("WARNING"):
        task = make_task(task_config("jsonl", path=str(path)))
    assert len(task) == 12
    assert "12 rows hold 3 distinct problems, each 4 times" in caplog.text and "samples=1" in caplog.text
    assert files.repeats_note([task.problem(i) for i in range(12)]) in caplog.text
    assert files.repeats_note([task.problem(i) for i in (0, 1, 2, 3)]) == ""  # one repeat: nothing
