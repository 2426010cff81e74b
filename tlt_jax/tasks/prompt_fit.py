"""Over-long prompts handled when the data loads, never inside generation: every prompt of a task is
chat-templated and tokenized once, and those longer than the engine takes (`max_tokens`: max_cache_len -
max_new_tokens, the bound `rollout.row_programs.validate_prompts` enforces) are dropped, truncated or refused
as the task's `PromptLimit` says (`config.task.filter_overlong_prompts`, `config.task.truncation`: VeRL's
data.filter_overlong_prompts in verl/utils/dataset/rl_dataset.py and data.truncation as
verl/utils/torch_functional.py's `postprocess_data` applies it).

Filtering makes a `FittedTask` of the remaining problems: its order is the seeded permutation of (seed, N')
(`Task.epoch_order`), so a resumed run reads exactly what it read (the same data and bound give the same N').
When nothing is over-long the task is returned unchanged. The count and the longest prompt are logged once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from absl import logging

from tlt_jax.tasks.base import ChatTokenizer, Problem, PromptTokenizer, RewardResult, Task

ENCODE_BATCH = 4096  # prompts per encode_batch call (bounds the Encoding objects alive at once)


def truncate(ids: list[int], max_tokens: int, side: str) -> list[int]:
    """`ids` cut to `max_tokens` as VeRL's postprocess_data cuts: "left" keeps the end, "right" the start,
    "middle" the first max // 2 and the last max - max // 2 tokens."""
    if len(ids) <= max_tokens:
        return ids
    if side == "left":
        return ids[-max_tokens:]
    if side == "right":
        return ids[:max_tokens]
    if side == "middle":
        head = max_tokens // 2
        return ids[:head] + ids[len(ids) - (max_tokens - head) :]
    raise ValueError(f"truncation {side!r}: use left, right or middle")


def prompt_lengths(task: Task, problems: Sequence[Problem], tokenizer: PromptTokenizer) -> np.ndarray:
    """The token count of every problem's prompt [N] (int64): the chat-templated texts encoded in batches
    when the tokenizer can (`ChatTokenizer`; checked equal to `encode_prompt` on the first problem), else
    one `encode_prompt` each."""
    first = task.encode_prompt(problems[0], tokenizer)
    if isinstance(tokenizer, ChatTokenizer):
        texts = [task.prompt_text(p, tokenizer) for p in problems[:1]]
        if texts[0] is not None and tokenizer.encode_batch(texts)[0] == first:
            out = np.empty(len(problems), np.int64)
            for start in range(0, len(problems), ENCODE_BATCH):
                chunk = [task.prompt_text(p, tokenizer) or "" for p in problems[start : start + ENCODE_BATCH]]
                out[start : start + len(chunk)] = [len(ids) for ids in tokenizer.encode_batch(chunk)]
            return out
    return np.asarray([len(first)] + [len(task.encode_prompt(p, tokenizer)) for p in problems[1:]], np.int64)


class FittedTask(Task):
    """`base` with its over-long prompts dropped (`keep`: the base indices kept, in order) or truncated to
    `max_tokens` tokens (`keep` None: every problem, in the base's own order)."""

    def __init__(self, base: Task, keep: np.ndarray | None, max_tokens: int, truncation: str) -> None:
        super().__init__(base.seed, base.shuffle)
        self.base, self.keep, self.max_tokens, self.truncation = base, keep, int(max_tokens), truncation
        self.prompt_limit = base.prompt_limit

    def __len__(self) -> int:
        return len(self.base) if self.keep is None else len(self.keep)

    def problem(self, index: int) -> Problem:
        return self.base.problem(index if self.keep is None else int(self.keep[index]))

    def score(self, problem: Problem, response_text: str) -> RewardResult:
        return self.base.score(problem, response_text)

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return self.base.messages(problem)

    def encode_prompt(self, problem: Problem, tokenizer: PromptTokenizer) -> list[int]:
        ids = self.base.encode_prompt(problem, tokenizer)
        if len(ids) > self.max_tokens and self.keep is not None:  # filtered at load: cannot happen
            raise ValueError(f"prompt {problem.uid} has {len(ids)} tokens, more than {self.max_tokens}")
        return truncate(ids, self.max_tokens, self.truncation) if self.keep is None else ids

    def prompt_text(self, problem: Problem, tokenizer: ChatTokenizer) -> str | None:
        return self.base.prompt_text(problem, tokenizer) if self.keep is not None else None

    def epoch_order(self, epoch: int) -> np.ndarray:
        return self.base.epoch_order(epoch) if self.keep is None else super().epoch_order(epoch)


def _where(problem: Problem) -> str:
    entry = problem.entry if isinstance(problem.entry, dict) else {}
    if "file" in entry and "row" in entry:
        return f"{entry['file']} row {entry['row']} (uid {problem.uid})"
    return f"problem {problem.uid}"


def fit_prompts(task: Task, tokenizer: PromptTokenizer, max_tokens: int, what: str = "config.task") -> Task:
    """`task` with every prompt at most `max_tokens` tokens, as `task.prompt_limit` says (module docstring);
    a ValueError naming the rows when it says "error" (or when filtering would leave nothing)."""
    if max_tokens < 1:
        raise ValueError(f"{what}: no room for a prompt ({max_tokens} tokens): raise rollout.max_cache_len")
    problems = [task.problem(i) for i in range(len(task))]
    lengths = prompt_lengths(task, problems, tokenizer)
    over = np.flatnonzero(lengths > max_tokens)
    longest = int(np.argmax(lengths))
    summary = (
        f"{what}: {over.size} of {len(problems)} prompts are longer than {max_tokens} tokens "
        f"(rollout.max_cache_len - max_new_tokens); the longest, {_where(problems[longest])}, has "
        f"{lengths[longest]} tokens"
    )
    if not over.size:
        logging.info("%s", summary)
        return task
    limit = task.prompt_limit
    fix = (
        "set config.task.filter_overlong_prompts=True (drop them) or config.task.truncation=left|right|"
        "middle, or raise config.rollout.max_cache_len"
    )
    if limit.filter:
        keep = np.flatnonzero(lengths <= max_tokens)
        if not keep.size:
            raise ValueError(f"{summary}: every prompt is over-long; raise config.rollout.max_cache_len")
        logging.warning("%s: dropped (filter_overlong_prompts), %d left", summary, keep.size)
        return FittedTask(task, keep, max_tokens, "error")
    if limit.truncation == "error":
        rows = "; ".join(f"{_where(problems[i])}: {lengths[i]} tokens" for i in over[:5])
        more = f" and {over.size - 5} more" if over.size > 5 else ""
        raise ValueError(f"{summary} ({rows}{more}); truncation=error refuses them: {fix}")
    logging.warning("%s: truncated to %d tokens (truncation=%s)", summary, max_tokens, limit.truncation)
    return FittedTask(task, None, max_tokens, limit.truncation)
