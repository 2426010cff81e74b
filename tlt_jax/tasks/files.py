"""Problems from local data files: parquet (VeRL, DAPO-Math-17k, MATH-500 exports) and JSONL (GSM8K-style).

`config.task.kind` "parquet" or "jsonl"; `path` is one file, a glob, or several of either separated by commas
(read in that order, each glob sorted). A layout (`layout`) says which fields hold the prompt and the
reference answer (LAYOUTS; "auto" picks it from the first file's fields):
- "verl": VeRL's rows: `prompt` a list of chat messages {role, content}, `reward_model.ground_truth`,
  `data_source`, `extra_info.index` (the id, when present).
- "math": MATH's `problem` / `solution`, the answer the last `\\boxed{...}` of the solution (nested braces).
- "qa": `question` / `answer` (GSM8K: the part after "####"), an optional `id`.
`prompt_key`, `answer_key`, `id_key` ("a.b" for nested fields) and `answer_from` ("value" | "boxed" | "gsm8k")
override the layout's. Parquet is read with pyarrow, only the mapped columns, a record batch at a time;
`max_rows` (0: all) stops reading early. A bad file fails with ONE ValueError naming the file, the row (JSONL:
the line) and the field: a missing field, an empty answer, a prompt that is not text or chat messages, an
unreadable file, an unknown layout. Loads are cached by (files, their mtimes, mapping), so validating the
config and building the learner read a file once.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import pathlib
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from absl import logging

from tlt_jax.tasks.answers import last_boxed
from tlt_jax.tasks.base import (
    MAJ_VOTES,
    ChatTokenizer,
    Problem,
    PromptLimit,
    PromptTokenizer,
    RewardResult,
    Task,
)
from tlt_jax.tasks.prompts import NONE, encode_prompt, prompt_messages, prompt_text, resolve_prompt
from tlt_jax.tasks.rewards import ReferenceScorer
from tlt_jax.tasks.verl_routing import check_sources

ANSWER_FROM = ("value", "boxed", "gsm8k")
BATCH_ROWS = 1024  # parquet rows converted to Python at a time


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which fields of a row hold the prompt, the reference answer (and how to read it), the id and the
    data source ("" = none; a missing id or source is not an error)."""

    prompt: str
    answer: str
    answer_from: str
    id: str = ""
    source: str = ""


LAYOUTS = {
    "verl": Layout("prompt", "reward_model.ground_truth", "value", "extra_info.index", "data_source"),
    "math": Layout("problem", "solution", "boxed", "unique_id"),
    "qa": Layout("question", "answer", "gsm8k", "id"),
}
_QA_HINT = '{"question": "...", "answer": "..." or a number}'


class RowError(ValueError):
    """What is wrong with one row (the caller adds the file and row)."""


def expand_paths(path: str | os.PathLike | Sequence[str]) -> list[pathlib.Path]:
    """The files of `path`: comma-separated entries (or a list), each a file or a glob (sorted)."""
    if isinstance(path, os.PathLike):
        path = [os.fspath(path)]
    entries = [p.strip() for p in path.split(",")] if isinstance(path, str) else [str(p) for p in path]
    out: list[pathlib.Path] = []
    for entry in filter(None, entries):
        matches = sorted(glob.glob(os.path.expanduser(entry))) if glob.has_magic(entry) else [entry]
        if not matches or not all(os.path.isfile(m) for m in matches):
            raise FileNotFoundError(
                f"task file {entry} does not exist (or the glob matches no file): set config.task.path to "
                "local files (one, a glob, or several separated by commas)"
            )
        out += [pathlib.Path(m) for m in matches]
    if not out:
        raise FileNotFoundError("config.task.path is empty: set it to a local data file")
    return out


def _get(row: dict, key: str) -> Any:
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            present = sorted(value) if isinstance(value, dict) else []
            raise RowError(f"missing field {key!r} (fields present: {present})")
        value = value[part]
    return value


def _answer(row: dict, key: str, answer_from: str) -> str:
    value = _get(row, key)
    if value is None:  # parquet: a struct field another row has, absent (null) in this one
        raise RowError(f"missing field {key!r} (null in this row)")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RowError(f"field {key!r} must be a string or a number, got {type(value).__name__}")
    text = str(value)
    if answer_from == "boxed":
        boxed = last_boxed(text)
        if boxed is None:
            raise RowError(
                f"field {key!r} has no \\boxed{{...}} answer (answer_from='boxed'; a plain answer field "
                "needs config.task.answer_from=value)"
            )
        text = boxed
    elif answer_from == "gsm8k" and "####" in text:  # GSM8K: the worked solution, then "#### 42"
        text = text.rsplit("####", 1)[1]
    if not text.strip():
        raise RowError(f"field {key!r} is empty (after the '####' marker or \\boxed{{}}, if any)")
    # a stored value is the ground truth as it is (VeRL 0.9.1 compares it unstripped: "72 " is not "72" in
    # its GSM8K scorer); what a '####' marker or \boxed{} encloses is the answer without the layout's spaces
    return text if answer_from == "value" else text.strip()


def _prompt(row: dict, key: str) -> tuple[str, tuple[dict[str, str], ...] | None]:
    """(question text, chat messages or None) of a row's prompt field."""
    value = _get(row, key)
    if isinstance(value, str):
        return value, None
    ok = isinstance(value, list) and value and all(isinstance(m, dict) for m in value)
    messages = tuple({"role": m.get("role"), "content": m.get("content")} for m in value) if ok else ()
    if not messages or not all(
        isinstance(m["role"], str) and isinstance(m["content"], str) for m in messages
    ):
        raise RowError(
            f"field {key!r} must be a string or a list of chat messages {{'role': str, 'content': str}}, "
            f"got {type(value).__name__}"
        )
    users = [m["content"] for m in messages if m["role"] == "user"]
    return (users[-1] if users else messages[-1]["content"]), messages


def _problem(row: dict, layout: Layout, uid: str, entry: dict) -> Problem:
    if not isinstance(row, dict):
        raise RowError(f"expected a JSON object, got {type(row).__name__}")
    question, messages = _prompt(row, layout.prompt)
    answer = _answer(row, layout.answer, layout.answer_from)
    for name, key in (("id", layout.id), ("data_source", layout.source)):
        try:
            entry[name] = _get(row, key) if key else None
        except RowError:
            entry[name] = None
    if isinstance(row.get("extra_info"), dict):  # what VeRL passes a custom reward function
        entry["extra_info"] = row["extra_info"]
    if entry["id"] is not None:
        uid = str(entry["id"])
    return Problem(uid=uid, question=question, answer=answer, entry=entry, messages=messages)


# ----------------------------------------------------------------------------------------------------------
# Readers: (row number as reported, the row) pairs, only the fields the layout reads
# ----------------------------------------------------------------------------------------------------------


def _jsonl_rows(path: pathlib.Path) -> Iterator[tuple[int, dict | RowError]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, RowError(f"invalid JSON ({e.msg} at column {e.colno})")
                continue
            yield lineno, row


def _parquet_rows(path: pathlib.Path, layout: Layout) -> Iterator[tuple[int, dict]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    names = pf.schema_arrow.names
    for key in (layout.prompt, layout.answer):
        if key.split(".")[0] not in names:
            raise ValueError(
                f"{path}: missing field {key!r} (columns present: {names}): choose config.task.layout "
                f"from {sorted(LAYOUTS)} or map the fields with config.task.prompt_key / answer_key"
            )
    wanted = {k.split(".")[0] for k in (layout.prompt, layout.answer, layout.id, layout.source) if k}
    wanted.add("extra_info")  # VeRL passes a row's extra_info dict to a custom reward function
    row = 0
    for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=[n for n in names if n in wanted]):
        for record in batch.to_pylist():
            yield row, record
            row += 1


def _rows(path: pathlib.Path, kind: str, layout: Layout) -> Iterator[tuple[int, dict | RowError]]:
    return _parquet_rows(path, layout) if kind == "parquet" else _jsonl_rows(path)


def _where(path: pathlib.Path, kind: str, row: int) -> str:
    return f"{path}: row {row}" if kind == "parquet" else f"{path}:{row}"


def _hint(kind: str, layout: Layout, row: int) -> str:
    if kind == "parquet":
        return f"fix or drop row {row} (0-based), or map the fields with config.task.prompt_key / answer_key"
    keys = _QA_HINT if layout == LAYOUTS["qa"] else f"with fields {layout.prompt!r} and {layout.answer!r}"
    return f"Each line must be one JSON object {keys} (blank lines are skipped): fix or remove line {row}"


@functools.lru_cache(maxsize=8)
def _load(
    files: tuple[tuple[str, float], ...], kind: str, layout: Layout, max_rows: int
) -> tuple[Problem, ...]:
    problems: list[Problem] = []
    for name, _mtime in files:
        path = pathlib.Path(name)
        for row, record in _rows(path, kind, layout):
            if max_rows and len(problems) >= max_rows:
                return tuple(problems)
            entry = {"file": path.name, "row": row}
            try:
                if isinstance(record, RowError):
                    raise record
                problems.append(_problem(record, layout, f"{path.name}:{row}", entry))
            except RowError as e:
                raise ValueError(f"{_where(path, kind, row)}: {e}. {_hint(kind, layout, row)}.") from e
    if not problems:
        names = ", ".join(f for f, _ in files)
        raise ValueError(f"task file {names} contains no problems (it is empty or only blank lines)")
    if note := repeats_note(problems):
        logging.warning("%s: %s", ", ".join(f for f, _ in files), note)
    return _unique_uids(problems)


def repeats_note(problems: Sequence[Problem]) -> str:
    """What to know when a file is its problems copied (every problem at least twice, as DAPO's AIME-2024
    file holds each of its 30 problems 32 times so that one sample per row, VeRL's val_kwargs.n=1, is 32 per
    problem), or "": n samples per row are then n x the copies per problem."""
    counts = Counter(
        (p.question, tuple(tuple(m.items()) for m in p.messages or ()), p.answer) for p in problems
    )
    least, most = min(counts.values()), max(counts.values())
    if least < 2:
        return ""
    copies = f"{least}" if least == most else f"{least} to {most}"
    return (
        f"{len(problems)} rows hold {len(counts)} distinct problems, each {copies} times: every row is "
        f"sampled, so n samples per row are n x {copies} per problem (DAPO's AIME file repeats each problem "
        "32 times and VeRL evaluates it with val_kwargs.n=1); set the eval set's samples=1 or deduplicate it"
    )


def _unique_uids(problems: list[Problem]) -> tuple[Problem, ...]:
    """The problems, their uids made unique when ids repeat (several files each counting from 0): prompts
    are cached by uid. Then every uid is "<file>:<row>"."""
    if len({p.uid for p in problems}) == len(problems):
        return tuple(problems)
    return tuple(dataclasses.replace(p, uid=f"{p.entry['file']}:{p.entry['row']}") for p in problems)


def _first_fields(path: pathlib.Path, kind: str) -> list[str]:
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            return list(pq.ParquetFile(path).schema_arrow.names)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    for _, row in _jsonl_rows(path):
        return sorted(row) if isinstance(row, dict) else []
    return []


def resolve_layout(
    layout: str,
    path: pathlib.Path,
    kind: str,
    prompt_key: str,
    answer_key: str,
    answer_from: str,
    id_key: str,
) -> Layout:
    """The layout preset (or the one "auto" detects in `path`), with the given field overrides."""
    if layout == "auto":
        fields = set(_first_fields(path, kind))
        found = [n for n, lay in LAYOUTS.items() if {lay.prompt, lay.answer.split(".")[0]} <= fields]
        if not found and fields and not (prompt_key and answer_key):  # (an empty file: "no problems" below)
            raise ValueError(
                f"{path}: config.task.layout='auto' finds no layout for the fields {sorted(fields)}: set "
                f"config.task.layout to one of {sorted(LAYOUTS)}, or prompt_key and answer_key"
            )
        layout = found[0] if found else "qa"
    if layout not in LAYOUTS:
        raise ValueError(
            f"unknown layout {layout!r}: set config.task.layout to 'auto' or one of {sorted(LAYOUTS)}"
        )
    if answer_from and answer_from not in ANSWER_FROM:
        raise ValueError(f"config.task.answer_from={answer_from!r}: use one of {list(ANSWER_FROM)}")
    base = LAYOUTS[layout]
    prompt, answer = prompt_key or base.prompt, answer_key or base.answer
    return Layout(prompt, answer, answer_from or base.answer_from, id_key or base.id, base.source)


class FileTask(Task):
    """Problems read from local parquet / JSONL files (module docstring), scored against their reference by
    `config.task.reward` (tasks.rewards; "verl": by each row's data_source, every source checked routable
    when the data loads) and prompted as `config.task.prompt` says (tasks.prompts; "auto": "none" for
    chat-message data, "default" for question text). Over-long prompts: `filter_overlong_prompts`,
    `truncation` (tasks.prompt_fit)."""

    FORMAT = "jsonl"

    def __init__(
        self,
        path: str | os.PathLike | Sequence[str],
        layout: str = "auto",
        prompt_key: str = "",
        answer_key: str = "",
        answer_from: str = "",
        id_key: str = "",
        max_rows: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        reward: str = "answer",
        answer_mode: str = "answer",
        format_reward: float = 0.0,
        think: bool = False,
        verify_timeout: int = 5,
        prompt: str = "auto",
        system_prompt: str | None = "",
        instruction: str | None = "",
        chat_template: str = "",
        reward_scale: str = "verl",
        math_verify_mode: str = "verl",
        filter_overlong_prompts: bool = True,
        truncation: str = "error",
        reward_kwargs: dict | None = None,
        custom_acc: str = "score",
        maj_votes: str = "auto",
    ) -> None:
        super().__init__(seed, shuffle)
        if max_rows < 0:
            raise ValueError(f"config.task.max_rows={max_rows}: must be >= 0 (0 = every row)")
        self.prompt_limit = PromptLimit(bool(filter_overlong_prompts), truncation)
        if problems := self.prompt_limit.problems():
            raise ValueError(problems[0])
        files = expand_paths(path)
        self.layout = resolve_layout(
            layout, files[0], self.FORMAT, prompt_key, answer_key, answer_from, id_key
        )
        stamps = tuple((str(f), f.stat().st_mtime) for f in files)
        self.problems = _load(stamps, self.FORMAT, self.layout, int(max_rows))
        chat = self.problems[0].messages is not None
        preset = (NONE if chat else "default") if prompt == "auto" else prompt
        self.spec = resolve_prompt(preset, system_prompt, instruction, chat_template, think)
        self.scorer = ReferenceScorer(
            reward,
            answer_mode,
            format_reward,
            self.spec.think,
            verify_timeout,
            reward_scale,
            math_verify_mode,
            reward_kwargs,
            custom_acc,
        )
        if maj_votes not in MAJ_VOTES:
            raise ValueError(f"config.task.maj_votes={maj_votes!r}: use one of {list(MAJ_VOTES)}")
        self.maj_votes = ("verl" if reward == "verl" else "normalized") if maj_votes == "auto" else maj_votes
        if reward == "verl":
            check_sources(Counter(p.entry["data_source"] for p in self.problems))

    def __len__(self) -> int:
        return len(self.problems)

    def problem(self, index: int) -> Problem:
        return self.problems[index]

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return prompt_messages(self.spec, problem.question, problem.messages)

    def encode_prompt(self, problem: Problem, tokenizer: PromptTokenizer) -> list[int]:
        return encode_prompt(self.spec, self.messages(problem), tokenizer)

    def prompt_text(self, problem: Problem, tokenizer: ChatTokenizer) -> str | None:
        return prompt_text(self.spec, self.messages(problem), tokenizer)

    def score(self, problem: Problem, response_text: str) -> RewardResult:
        entry = problem.entry
        return self.scorer(response_text, problem.answer, entry.get("data_source"), entry.get("extra_info"))


class JsonlTask(FileTask):
    """`kind: jsonl`: one JSON object per line (blank lines skipped; errors name the 1-based line)."""

    FORMAT = "jsonl"


class ParquetTask(FileTask):
    """`kind: parquet`: parquet files read with pyarrow (errors name the 0-based row)."""

    FORMAT = "parquet"
