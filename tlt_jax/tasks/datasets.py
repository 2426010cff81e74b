"""RL tasks: prompts plus verifiable rewards (the concrete kinds and `make_task`).

A task turns problems into chat messages (the caller applies the tokenizer's chat template), scores a decoded
response with a deterministic verifier, and hands out prompts in a seeded order that can be resumed from a
single integer position (stored in the checkpoint).

Kinds (see `make_task`):
- "reasoning_gym": procedurally generated problems from the `reasoning-gym` package, scored by the dataset's
  own verifier (`ds.score_answer`). Some verifiers give partial credit for wrong answers (countdown 0.05,
  gsm_symbolic 0.01), so `RewardResult.correct` is "verifier score == 1.0", not "reward > 0".
- "jsonl", "parquet": local data files (`tasks.files`: VeRL's parquet layout, MATH's problem/solution,
  GSM8K-style question/answer; globs and several files), scored by `config.task.reward` (`tasks.rewards`:
  normalised numeric/string equality, math-verify, DAPO's, MATH's or GSM8K's check as VeRL runs them, VeRL's
  routing by each row's data_source, or a function of the user's).

Every kind but counting takes the prompt keys of `tasks.prompts` (`prompt` preset, `system_prompt`,
`instruction`, `chat_template`), the reward keys (`reward`, `reward_scale`, `math_verify_mode`, `think`,
`verify_timeout`, `answer_mode`, `format_reward`) and the over-long prompt keys (`filter_overlong_prompts`,
`truncation`: tasks.prompt_fit).
- "counting": a toy task for smoke tests with a tiny random model: a dense reward (the fraction of response
  characters equal to a target digit) that GRPO can raise within a few steps.

Responses are asked to end with a line `Answer: <value>`; `extract_answer` reads it (optionally falling back
to the last number in the text, which small models produce far more often than the requested format).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections as mlc

from tlt_jax.tasks.answers import (
    check_answer_mode,
    ends_with_answer_line,
    extract_answer,
    normalize_number,
    split_think,
)
from tlt_jax.tasks.base import ChatTokenizer, Problem, PromptLimit, PromptTokenizer, RewardResult, Task
from tlt_jax.tasks.files import JsonlTask, ParquetTask
from tlt_jax.tasks.prompts import encode_prompt, prompt_messages, prompt_text, resolve_prompt
from tlt_jax.tasks.rewards import ReferenceScorer
from tlt_jax.tasks.synthetic import SyntheticTask


class ReasoningGymTask(Task):
    """Problems from `reasoning_gym.create_dataset(name, size=, seed=, **dataset_kwargs)` and its verifier.

    reward = verifier score of the extracted answer (+ `format_reward` when an `Answer:` line exists).
    The verifier is also tried on the normalised number (e.g. "1,000" -> "1000", which gsm_symbolic's verifier
    would otherwise read as 1) and the higher score counts. A verifier that raises on malformed model output
    scores 0. correct = verifier score == 1.0 (partial credit is not "correct").
    """

    def __init__(
        self,
        name: str,
        size: int = 1000,
        seed: int = 0,
        dataset_kwargs: Mapping[str, Any] | None = None,
        answer_mode: str = "answer",
        format_reward: float = 0.0,
        system_prompt: str | None = "",
        instruction: str | None = "",
        shuffle: bool = True,
        reward: str = "answer",
        think: bool = False,
        verify_timeout: int = 5,
        prompt: str = "default",
        chat_template: str = "",
        reward_scale: str = "verl",
        math_verify_mode: str = "verl",
        filter_overlong_prompts: bool = True,
        truncation: str = "error",
    ) -> None:
        super().__init__(seed, shuffle)
        check_answer_mode(answer_mode)
        if reward == "verl":
            raise ValueError(
                "config.task.reward='verl' routes each row by its data_source (parquet / JSONL data in "
                "VeRL's layout); reasoning-gym problems have none: use 'answer' (the dataset's verifier)"
            )
        self.prompt_limit = PromptLimit(bool(filter_overlong_prompts), truncation)
        if problems := self.prompt_limit.problems():
            raise ValueError(problems[0])
        self.spec = resolve_prompt(prompt, system_prompt, instruction, chat_template, think)
        # reward "answer": the dataset's verifier (below); otherwise a checker against the entry's answer
        self.scorer = ReferenceScorer(
            reward,
            answer_mode,
            format_reward,
            self.spec.think,
            verify_timeout,
            reward_scale,
            math_verify_mode,
        )
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        try:
            import reasoning_gym
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("ReasoningGymTask needs `pip install reasoning-gym==0.1.25`") from e
        kwargs = dict(dataset_kwargs or {})
        try:
            self.dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **kwargs)
        except ValueError as e:
            raise ValueError(
                f"reasoning-gym could not create dataset {name!r}: {e}. Valid names are listed in "
                "reasoning_gym.factory.DATASETS (e.g. 'chain_sum', 'basic_arithmetic', 'gsm_symbolic')."
            ) from e
        except TypeError as e:
            raise ValueError(
                f"bad dataset_kwargs {kwargs} for reasoning-gym dataset {name!r}: {e}. Use the fields of its "
                "config class."
            ) from e
        self.name = name
        self.size = int(size)
        self.answer_mode = answer_mode
        self.format_reward = float(format_reward)
        self._cache: dict[int, Problem] = {}

    def __len__(self) -> int:
        return self.size

    def problem(self, index: int) -> Problem:
        if index not in self._cache:
            entry = self.dataset[index]
            self._cache[index] = Problem(
                uid=f"{self.name}/{self.seed}/{index}",
                question=str(entry["question"]),
                answer=str(entry["answer"]),
                entry=entry,
            )
        return self._cache[index]

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return prompt_messages(self.spec, problem.question)

    def encode_prompt(self, problem: Problem, tokenizer: PromptTokenizer) -> list[int]:
        return encode_prompt(self.spec, self.messages(problem), tokenizer)

    def prompt_text(self, problem: Problem, tokenizer: ChatTokenizer) -> str | None:
        return prompt_text(self.spec, self.messages(problem), tokenizer)

    def _verify(self, answer: str, problem: Problem) -> float:
        try:
            return float(self.dataset.score_answer(answer, problem.entry))
        except Exception:  # untrusted model output must not crash training
            return 0.0

    def score(self, problem: Problem, response_text: str) -> RewardResult:
        if self.scorer.reward != "answer":  # a custom function sees data_source "reasoning_gym/<name>"
            return self.scorer(response_text, problem.answer, f"reasoning_gym/{self.name}", problem.entry)
        response_text, unterminated = split_think(response_text, self.spec.think)
        if response_text is None:
            return RewardResult(0.0, False, False, None, think_unterminated=unterminated)
        format_ok = ends_with_answer_line(response_text)
        extracted = extract_answer(response_text, self.answer_mode)
        verifier_score = 0.0
        if extracted is not None:
            verifier_score = self._verify(extracted, problem)
            canonical = normalize_number(extracted)
            if verifier_score < 1.0 and canonical is not None and canonical != extracted:
                verifier_score = max(verifier_score, self._verify(canonical, problem))
        reward = verifier_score + (self.format_reward if format_ok else 0.0)
        return RewardResult(
            reward=reward,
            correct=verifier_score >= 1.0,
            format_ok=format_ok,
            extracted=extracted,
            score=verifier_score if reward != verifier_score else None,  # the verifier's, before the bonus
        )


class CountingTask(Task):
    """Toy task for smoke runs: "Write the digit 7 many times." (one problem per entry of `digits`, cycled).

    reward = (number of response characters equal to the target digit) / (number of response characters), 0.0
    for an empty response. Every character counts, whitespace included, so the reward is dense: a tiny random
    model with a byte-level tokenizer already scores ~1/vocab and each sampled target byte raises it, so GRPO
    visibly improves it within a few steps. correct = the response is non-empty and all target digits.
    """

    def __init__(
        self, size: int = 10, seed: int = 0, digits: str = "0123456789", shuffle: bool = True
    ) -> None:
        super().__init__(seed, shuffle)
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not digits or not all(len(d) == 1 for d in digits):
            raise ValueError(f"digits must be a non-empty string of target characters, got {digits!r}")
        self.size = int(size)
        self.digits = digits

    def __len__(self) -> int:
        return self.size

    def problem(self, index: int) -> Problem:
        digit = self.digits[index % len(self.digits)]
        return Problem(
            uid=f"counting/{index}",
            question=f"Write the digit {digit} many times.",
            answer=digit,
            entry={"digit": digit, "index": index},
        )

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return [{"role": "user", "content": problem.question}]

    def score(self, problem: Problem, response_text: str) -> RewardResult:
        n = len(response_text)
        hits = response_text.count(problem.answer)
        reward = hits / n if n else 0.0
        return RewardResult(reward=reward, correct=n > 0 and hits == n, format_ok=n > 0, extracted=None)


TASK_KINDS: dict[str, type[Task]] = {
    "reasoning_gym": ReasoningGymTask,
    "jsonl": JsonlTask,
    "parquet": ParquetTask,
    "counting": CountingTask,
    "synthetic": SyntheticTask,  # token ids, no text (tasks/synthetic.py)
}
FILE_KINDS = ("jsonl", "parquet")  # read from `path` (validation reads them through)


def check_task_config(config: mlc.ConfigDict | Mapping[str, object]) -> tuple[type[Task], dict[str, Any]]:
    """The task class of `config["kind"]` and its constructor arguments (the other keys), without building
    the task; a ValueError naming an unknown kind, unknown keys or missing keys, and the valid ones."""
    cfg = dict(config.to_dict()) if hasattr(config, "to_dict") else dict(config)
    kind = cfg.pop("kind", None)
    if kind not in TASK_KINDS:
        raise ValueError(f"unknown task kind {kind!r}: set config.task.kind to one of {sorted(TASK_KINDS)}")
    cls = TASK_KINDS[kind]
    params = {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}
    unknown = sorted(set(cfg) - set(params))
    if unknown:
        raise ValueError(f"unknown keys {unknown} for task kind {kind!r}; valid keys: {sorted(params)}")
    missing = sorted(k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in cfg)
    if missing:
        raise ValueError(f"task kind {kind!r} needs config keys {missing}")
    return cls, cfg


def task_config(kind: str, **keys: object) -> dict[str, object]:
    """Every key of task kind `kind` with its default, updated by `keys`: a config file that starts from it
    lets the command line override any key (`--config.task.system_prompt=...`; ml_collections refuses keys a
    config lacks). Defaults of None (no command-line type) are left out."""
    if kind not in TASK_KINDS:
        raise ValueError(f"unknown task kind {kind!r}: use one of {sorted(TASK_KINDS)}")
    params = inspect.signature(TASK_KINDS[kind].__init__).parameters
    out: dict[str, object] = {"kind": kind}
    out.update({k: p.default for k, p in params.items() if k != "self" and p.default not in (None, p.empty)})
    out.update(keys)
    check_task_config(out)
    return out


def make_task(config: mlc.ConfigDict | Mapping[str, object]) -> Task:
    """Build a task from a config (ml_collections.ConfigDict or dict) with `kind` in TASK_KINDS; the other
    keys are the constructor arguments of its class (`check_task_config` names unknown or missing ones)."""
    cls, cfg = check_task_config(config)
    return cls(**cfg)


def score(task: Task, problem: Problem, response_text: str) -> RewardResult:
    """Reward function: `task.score(problem, response_text)`."""
    return task.score(problem, response_text)


def score_batch(task: Task, problems: Sequence[Problem], responses: Sequence[str]) -> list[RewardResult]:
    """Score responses paired with their problems (for GRPO, repeat each problem n times)."""
    if len(problems) != len(responses):
        raise ValueError(f"got {len(problems)} problems but {len(responses)} responses; pair them one to one")
    return [task.score(p, r) for p, r in zip(problems, responses, strict=True)]
