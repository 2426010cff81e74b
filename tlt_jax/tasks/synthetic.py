"""A task on token ids, for a model with random weights and no tokenizer (kind "synthetic").

What it is for: the whole RL step (`python -m tlt_jax.main`) at a real model's shapes with random weights
(`config.model.arch` + `init=random`, e.g. configs/qwen2_5_7b_gpu_step.py on a lent GPU), where no text
exists. Everything the learner needs from a tokenizer is given without a model file by `TokenIdCodec`:
the stop ids the engine ends rows at, and a lossless text form of ids (decimal numbers, the stop ids
dropped) that responses decode to and the task scores.

Lengths with a long tail. A row ends at its first stop id. `k = round(vocab_size / mean_length)` stop ids
spread over the vocabulary; with random weights every id is a priori alike (the LM head's rows are drawn
i.i.d.), so each sampled token is a stop id with probability k / vocab_size in expectation and a response's
length is geometric with mean `mean_length` (capped by the rollout's `max_new_tokens`): median 0.69 x mean,
the longest of R rows ~ (ln R + 0.58) x mean (R = 32: 4.0 x mean). Most rows finish early and a few run
on: the rollout's tail, where continuous batching refills the slots, speculative decoding takes over below
`spec.threshold` running rows and the spot trainer fills idle time, as in the paper's RL step.

The reward is a function of token ids with variance inside every group: problem i asks for tokens of class
`i % classes` (id mod `classes`); the reward is the fraction of response tokens in that class (1 / classes in
expectation under the random policy, binomial noise of a few percent at ~100s of tokens), so GRPO's
advantages are non-zero. `correct`: at least half the tokens in the class. Prompts are `prompt_len // 2` to
`prompt_len` non-stop ids drawn from a generator seeded by (seed, index), so a run is reproducible.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import numpy as np

from tlt_jax.tasks.base import Problem, PromptTokenizer, RewardResult, Task

KIND = "synthetic"


def stop_ids(vocab_size: int, mean_length: float) -> np.ndarray:
    """The k = round(vocab_size / mean_length) (>= 1) stop ids, evenly spread over [0, vocab_size)."""
    if vocab_size < 2 or mean_length < 1:
        raise ValueError(f"need vocab_size >= 2 and mean_length >= 1, got {vocab_size}, {mean_length}")
    k = int(min(max(round(vocab_size / mean_length), 1), vocab_size - 1))
    stride = vocab_size // k
    return (stride // 2 + stride * np.arange(k)).astype(np.int64)


class StopIds:
    """What the rollout engine needs of a tokenizer without text: the vocabulary size and the stop (EOS)
    ids, the first also the pad id. The base of `TokenIdCodec` and of random weights' `NoTextTokenizer`
    (tlt_jax.models.random_init)."""

    chat_template = None
    bos_token_id = None

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._vocab_size = int(vocab_size)
        self._eos = tuple(int(i) for i in eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def eos_token_id(self) -> int:
        return self._eos[0]

    @property
    def pad_token_id(self) -> int:
        return self._eos[0]


class TokenIdCodec(StopIds):
    """A tokenizer for a model with no vocabulary of text (the learner's `TextCodec` duck type): the stop
    ids are its EOS ids, `decode` writes ids as decimal numbers (stop ids dropped unless asked for) and
    `encode` reads them back. It has no chat template (`encode_chat` refuses): a token task's prompts are
    ids already."""

    def __init__(self, vocab_size: int, stops: Iterable[int]) -> None:
        super().__init__(vocab_size, stops)
        if not self._eos or min(self._eos) < 0 or max(self._eos) >= self._vocab_size:
            raise ValueError(f"stop ids must be non-empty and within [0, {vocab_size}): {self._eos[:8]}")
        self._stop_set = frozenset(self._eos)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The ids as decimal numbers separated by spaces (stop ids dropped with `skip_special_tokens`)."""
        return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) in self._stop_set))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids `decode` wrote (whitespace-separated decimal numbers); anything else is an error."""
        ids = [int(t) for t in text.split()] if re.fullmatch(r"[\d\s]*", text) else None
        if ids is None or any(i >= self._vocab_size for i in ids):
            raise ValueError(
                f"TokenIdCodec.encode reads ids below {self._vocab_size} as numbers: {text[:80]!r}"
            )
        return ids

    def id_to_token(self, token_id: int) -> str | None:
        return str(int(token_id)) if 0 <= int(token_id) < self._vocab_size else None

    def token_to_id(self, token: str) -> int | None:
        return int(token) if token.isdigit() and int(token) < self._vocab_size else None

    def _no_text(self, op: str) -> ValueError:
        return ValueError(
            f"tokenizer.{op}: a token task (config.task.kind={KIND!r}) has ids but no text or chat template; "
            "its prompts are ids (SyntheticTask.encode_prompt)."
        )

    def encode_chat(self, messages: object, add_generation_prompt: bool = True) -> list[int]:
        raise self._no_text("encode_chat")

    def save(self, directory: object) -> None:
        raise self._no_text("save")

    def __repr__(self) -> str:
        return f"TokenIdCodec(vocab_size={self.vocab_size}, {len(self._eos)} stop ids)"


def is_token_task(task: Mapping[str, object] | None) -> bool:
    """Whether a `config.task` section is a task on token ids (its reward needs no text)."""
    return bool(task) and task.get("kind") == KIND


def token_codec(task: Mapping[str, object] | None, vocab_size: int) -> TokenIdCodec | None:
    """The tokenizer of a token task for a model of `vocab_size` ids (None for any other task); a task
    written for another vocabulary is a ValueError naming both sizes."""
    if not is_token_task(task):
        return None
    if int(task.get("vocab_size", -1)) != int(vocab_size):
        raise ValueError(
            f"config.task.vocab_size={task.get('vocab_size')} but the model has {vocab_size} ids: set "
            f"--config.task.vocab_size={vocab_size}."
        )
    return TokenIdCodec(vocab_size, stop_ids(vocab_size, float(task.get("mean_length", 256))))


class SyntheticTask(Task):
    """Prompts of random ids; reward = the fraction of response tokens in the problem's class (module
    docstring). `vocab_size` must be the model's; `mean_length` sets the stop ids (`stop_ids`)."""

    def __init__(
        self,
        vocab_size: int,
        size: int = 1000,
        seed: int = 0,
        mean_length: float = 256.0,
        prompt_len: int = 64,
        classes: int = 8,
        shuffle: bool = True,
    ) -> None:
        super().__init__(seed, shuffle)
        if size < 1 or prompt_len < 2 or classes < 2:
            raise ValueError(
                f"need size >= 1, prompt_len >= 2, classes >= 2; got {size}, {prompt_len}, {classes}"
            )
        self.vocab_size, self.size, self.prompt_len, self.classes = (
            int(vocab_size),
            int(size),
            int(prompt_len),
            int(classes),
        )
        self.mean_length = float(mean_length)
        self.stops = stop_ids(self.vocab_size, self.mean_length)
        self._stop_set = frozenset(self.stops.tolist())
        self._allowed = np.setdiff1d(np.arange(self.vocab_size, dtype=np.int64), self.stops)
        self._cache: dict[int, Problem] = {}

    def __len__(self) -> int:
        return self.size

    def problem(self, index: int) -> Problem:
        if index not in self._cache:
            rng = np.random.default_rng([self.seed, int(index)])
            n = int(rng.integers(self.prompt_len // 2, self.prompt_len + 1))
            ids = self._allowed[rng.integers(0, len(self._allowed), n)]  # no stop id in a prompt
            target = int(index) % self.classes
            self._cache[index] = Problem(
                uid=f"{KIND}/{self.seed}/{index}",
                question=" ".join(map(str, ids.tolist())),
                answer=str(target),
                entry={"prompt_ids": ids.tolist(), "target_class": target},
            )
        return self._cache[index]

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return [{"role": "user", "content": problem.question}]

    def encode_prompt(self, problem: Problem, tokenizer: PromptTokenizer) -> list[int]:
        """The problem's ids (no chat template: there is no text)."""
        return list(problem.entry["prompt_ids"])

    def prompt_text(self, problem: Problem, tokenizer: PromptTokenizer) -> str | None:
        """None: a prompt of ids is not a text (a length check counts `encode_prompt`'s ids)."""
        return None

    def score(self, problem: Problem, response_text: str) -> RewardResult:
        ids = [int(t) for t in response_text.split() if t.isdigit() and int(t) not in self._stop_set]
        target = int(problem.entry["target_class"])
        hits = sum(i % self.classes == target for i in ids)
        frac = hits / len(ids) if ids else 0.0
        return RewardResult(
            reward=frac, correct=bool(ids) and frac >= 0.5, format_ok=bool(ids), extracted=None
        )
