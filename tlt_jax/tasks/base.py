"""RL task interface: problems, reward results, chat messages, and a resumable seeded order of prompts.

A task turns problems into chat messages (the caller applies the tokenizer's chat template), scores a decoded
response with a deterministic verifier, and hands out prompts in a seeded order that can be resumed from a
single integer position (stored in the checkpoint). The concrete tasks are in `tlt_jax.tasks.datasets`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np

from tlt_jax.tasks.answers import normalize_number, normalize_text

# maj@k's votes (Task.vote): auto (verl with task.reward="verl", else normalized) | verl | normalized
MAJ_VOTES = ("auto", "verl", "normalized")
VERL_NO_ANSWER = "[INVALID]"  # VeRL's pred without an answer (math_dapo.py is_correct_minerva)


def normalized_vote(extracted: str | None) -> str | None:
    """tlt_jax's maj@k vote: the canonical number ("0.5" for "\\frac{1}{2}"), else the normalised text;
    None (abstains) without an extracted answer."""
    if extracted is None or not extracted.strip():
        return None
    return normalize_number(extracted) or normalize_text(extracted)


DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. You solve problems by reasoning step by step."
DEFAULT_INSTRUCTION = (
    "Think step by step. Then give the final answer on the last line in the form 'Answer: <value>'."
)


class PromptTokenizer(Protocol):
    """What prompt encoding needs of a tokenizer (tlt_jax.models.tokenizer.Tokenizer has it)."""

    bos_token_id: int | None
    eos_token_id: int

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def encode_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]: ...

    def id_to_token(self, token_id: int) -> str | None: ...


@runtime_checkable
class ChatTokenizer(PromptTokenizer, Protocol):
    """A tokenizer that renders chat templates to text and encodes many texts at once (the load-time prompt
    length check's fast path; tlt_jax.models.tokenizer.Tokenizer has it)."""

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]: ...


TRUNCATIONS = ("error", "left", "right", "middle")


@dataclasses.dataclass(frozen=True)
class PromptLimit:
    """What happens to a prompt longer than the engine takes (`tasks.prompt_fit`): `filter` drops it when
    the data loads (VeRL's data.filter_overlong_prompts); otherwise `truncation` keeps its end ("left": the
    start is cut), its start ("right") or both ends ("middle"), or "error" refuses the data naming the rows
    (VeRL's data.truncation)."""

    filter: bool = True
    truncation: str = "error"

    def problems(self) -> list[str]:
        if self.truncation not in TRUNCATIONS:
            return [f"config.task.truncation={self.truncation!r}: use one of {list(TRUNCATIONS)}"]
        return []


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt: a stable id, the question text (chat data: the last user message), the reference answer,
    the source entry (reasoning-gym: what its verifier reads; files: data_source, file, row) and the data's
    own chat messages, if any."""

    uid: str
    question: str
    answer: str
    entry: dict
    messages: tuple[dict[str, str], ...] | None = None  # chat-message prompts (VeRL's `prompt`), else None


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """The score of one response.

    reward: the scalar used by RL (verifier score plus any format bonus).
    correct: the answer is fully right (verifier score 1.0), independent of partial credit and format bonus.
    format_ok: the response ends with the requested `Answer:` line (`answers.ends_with_answer_line`; counting
        task: the response is non-empty).
    extracted: the answer string that was scored, or None when none could be extracted.
    verify_failed / think_unterminated: why a response scored low without a verdict (`rewards.reward_counts`).
    source: the row's data_source (file tasks), for per-source accuracy when a step mixes sources.
    extra: a custom reward function's other numeric entries (logged as step means, `reward/<key>`).
    score: the scorer's own value, before a format bonus and overlong shaping (VeRL's reward_extra_info
        "score", what `filter_metric="score"` compares); None: `reward`.
    acc: VeRL's "acc" where it is not the verdict: a custom function's number itself (partial credit), or its
        dict's "acc" (what `filter_metric="acc"` and mean@k read, `acc_value`); None: `correct`.
    """

    reward: float
    correct: bool
    format_ok: bool
    extracted: str | None
    verify_failed: bool = False  # the checker gave up (timeout, parser error): scored low, counted
    think_unterminated: bool = False  # the think block never closed: scored low, counted
    source: str | None = None
    extra: Mapping[str, float] = dataclasses.field(default_factory=dict)
    score: float | None = None
    acc: float | None = None

    @property
    def score_value(self) -> float:
        """The scorer's value (VeRL's "score"): `score`, else the reward."""
        return self.reward if self.score is None else self.score

    @property
    def acc_value(self) -> float:
        """VeRL's "acc" as a number: `acc`, else the verdict (1.0 / 0.0)."""
        return float(self.correct) if self.acc is None else self.acc


def build_messages(
    problem: Problem,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    instruction: str | None = DEFAULT_INSTRUCTION,
) -> list[dict[str, str]]:
    """Chat messages for one problem: an optional system message, then the question plus the instruction.

    The instruction asks for step-by-step reasoning and a final `Answer: <value>` line, the format
    `extract_answer` reads. The caller applies the tokenizer's chat template. Pass `system_prompt=None` to
    omit the system message (note: some templates, e.g. SmolLM2's chatml, then insert their own default).
    """
    messages: list[dict[str, str]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    content = problem.question if not instruction else f"{problem.question}\n\n{instruction}"
    messages.append({"role": "user", "content": content})
    return messages


# ----------------------------------------------------------------------------------------------------------
# Tasks
# ----------------------------------------------------------------------------------------------------------


class Task(abc.ABC):
    """A finite set of problems, a verifier, and a resumable seeded order.

    The order is a stream of positions 0, 1, 2, ...: position p is problem `perm_e[p % N]` of epoch
    e = p // N, where `perm_e` is a permutation seeded by (seed, e) (identity when shuffle is False). Every
    epoch visits every problem once and epochs are reshuffled. The stream depends only on (seed, N), so a run
    resumes exactly by storing the position returned by `batch`.
    """

    prompt_limit = PromptLimit()  # what the load-time length check does with an over-long prompt

    def __init__(self, seed: int, shuffle: bool) -> None:
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self._perm_cache: tuple[int, np.ndarray] | None = None

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of distinct problems."""

    @abc.abstractmethod
    def problem(self, index: int) -> Problem:
        """Problem number `index` in the task's natural (unshuffled) order."""

    @abc.abstractmethod
    def score(self, problem: Problem, response_text: str) -> RewardResult:
        """Score one decoded response (deterministic)."""

    maj_votes = "normalized"  # how a sample votes in maj@k (`vote`; MAJ_VOTES)

    def vote(self, result: RewardResult) -> str | None:
        """What a scored sample votes for in maj@k: "verl" (VeRL's convention, calc_maj_val over the scorer's
        `pred`): the extracted answer as it is, "[INVALID]" without one (a vote like any other);
        "normalized" (tlt_jax's): the canonical number, else the normalised text, equivalent strings merged,
        and a sample without an answer abstains (None)."""
        if self.maj_votes == "verl":
            return VERL_NO_ANSWER if result.extracted is None else result.extracted
        return normalized_vote(result.extracted)

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """Chat messages for one problem (default: `build_messages` with the default prompts)."""
        return build_messages(problem)

    def encode_prompt(self, problem: Problem, tokenizer: PromptTokenizer) -> list[int]:
        """Prompt token ids: the messages through the tokenizer's chat template (tasks with their own
        template, `config.task.chat_template`, render it themselves)."""
        return tokenizer.encode_chat(self.messages(problem))

    def prompt_text(self, problem: Problem, tokenizer: ChatTokenizer) -> str | None:
        """The text `encode_prompt` tokenizes (no special tokens added), None when it is not one text."""
        return tokenizer.apply_chat_template(self.messages(problem))

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The problem indices of one epoch, in the order they are served."""
        if self._perm_cache is not None and self._perm_cache[0] == epoch:
            return self._perm_cache[1]
        n = len(self)
        if self.shuffle:
            perm = np.random.default_rng(np.random.SeedSequence([self.seed, epoch])).permutation(n)
        else:
            perm = np.arange(n)
        self._perm_cache = (epoch, perm)
        return perm

    def batch(self, position: int, num_prompts: int) -> tuple[list[Problem], int]:
        """`num_prompts` problems starting at stream `position`, and the position after them.

        The same position always yields the same problems; a batch may span an epoch boundary.
        """
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        n = len(self)
        out = []
        for p in range(position, position + num_prompts):
            epoch, offset = divmod(p, n)
            out.append(self.problem(int(self.epoch_order(epoch)[offset])))
        return out, position + num_prompts


class TrainSplit(Task):
    """The training side of a held-out split: `task` without the last `held_out` problems of its first
    epoch (the held-out eval's problems, `held_out_indices`), for every epoch.

    Epoch 0 serves the remaining problems in the task's own epoch-0 order, so a run that stays in its first
    epoch reads exactly what it read before the split existed; later epochs are permutations seeded by
    (seed, epoch) of the remaining problems (when the task shuffles). Resumable from one position as any task.
    """

    def __init__(self, task: Task, held_out: int) -> None:
        n = len(task)
        if not 0 < held_out < n:
            raise ValueError(
                f"config.eval.prompts={held_out}: the held-out split needs 0 < prompts < the task's {n} "
                "problems (raise config.task.size / use more data, or lower config.eval.prompts)"
            )
        super().__init__(task.seed, task.shuffle)
        order = task.epoch_order(0)
        self.base, self.prompt_limit = task, task.prompt_limit
        self.train_indices, self.held_out_indices = order[: n - held_out], order[n - held_out :]

    def __len__(self) -> int:
        return len(self.train_indices)

    def problem(self, index: int) -> Problem:
        return self.base.problem(int(self.train_indices[index]))

    def score(self, problem: Problem, response_text: str) -> RewardResult:
        return self.base.score(problem, response_text)

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return self.base.messages(problem)

    def encode_prompt(self, problem: Problem, tokenizer: PromptTokenizer) -> list[int]:
        return self.base.encode_prompt(problem, tokenizer)

    def prompt_text(self, problem: Problem, tokenizer: ChatTokenizer) -> str | None:
        return self.base.prompt_text(problem, tokenizer)

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.arange(len(self)) if epoch == 0 else super().epoch_order(epoch)
