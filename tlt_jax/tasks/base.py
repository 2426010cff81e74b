"""RL task interface: problems, reward results, chat messages, and a resumable seeded order of prompts.

A task turns problems into chat messages (the caller applies the tokenizer's chat template), scores a decoded
response with a deterministic verifier, and hands out prompts in a seeded order that can be resumed from a
single integer position (stored in the checkpoint). The concrete tasks are in `tlt_jax.tasks.datasets`.
"""

from __future__ import annotations

import abc
import dataclasses

import numpy as np

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. You solve problems by reasoning step by step."
DEFAULT_INSTRUCTION = (
    "Think step by step. Then give the final answer on the last line in the form 'Answer: <value>'."
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt: a stable id, the question text, the reference answer and the raw source entry."""

    uid: str
    question: str
    answer: str
    entry: dict


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """The score of one response.

    reward: the scalar used by RL (verifier score plus any format bonus).
    correct: the answer is fully right (verifier score 1.0), independent of partial credit and format bonus.
    format_ok: the response ends with the requested `Answer:` line (`answers.ends_with_answer_line`; counting
        task: the response is non-empty).
    extracted: the answer string that was scored, or None when none could be extracted.
    """

    reward: float
    correct: bool
    format_ok: bool
    extracted: str | None


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

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """Chat messages for one problem (default: `build_messages` with the default prompts)."""
        return build_messages(problem)

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
