"""RL tasks: prompts plus verifiable rewards, and a resumable data order.

A task turns problems into chat messages (the caller applies the tokenizer's chat template), scores a decoded
response with a deterministic verifier, and hands out prompts in a seeded order that can be resumed from a
single integer position (stored in the checkpoint).

Kinds (see `make_task`):
- "reasoning_gym": procedurally generated problems from the `reasoning-gym` package, scored by the dataset's
  own verifier (`ds.score_answer`). Some verifiers give partial credit for wrong answers (countdown 0.05,
  gsm_symbolic 0.01), so `RewardResult.correct` is "verifier score == 1.0", not "reward > 0".
- "jsonl": GSM8K/MATH-style local files (`{"question": ..., "answer": ...}` per line), scored by normalised
  numeric/string equality.
- "counting": a toy task for smoke tests with a tiny random model: a dense reward (the fraction of response
  characters equal to a target digit) that GRPO can raise within a few steps.

Responses are asked to end with a line `Answer: <value>`; `extract_answer` reads it (optionally falling back
to the last number in the text, which small models produce far more often than the requested format).
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import json
import pathlib
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

ANSWER_MODES = ("answer", "answer_or_last_number")

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
    format_ok: the response has the requested `Answer:` line (counting task: the response is non-empty).
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
# Answer extraction and normalisation
# ----------------------------------------------------------------------------------------------------------

# "Answer:", "answer :", "**Answer:**", "**Answer**:", "Final answer:".
_ANSWER_RE = re.compile(r"answer\s*(?:\*\*|__)?\s*:", re.IGNORECASE)
# A number not glued to a preceding word or decimal point ("3-4" gives 3 and 4, "x=-4" gives -4); thousands
# separators only in groups of three ("1,000" is one number, "1,2" is two).
_NUMBER_RE = re.compile(r"(?:(?<![\w.])-)?(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _unwrap_boxed(s: str) -> str:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `s`, braces matched; else `s`."""
    start = max(s.rfind(cmd + "{") for cmd in _BOX_COMMANDS)
    if start < 0:
        return s
    open_idx = s.index("{", start)
    depth = 0
    for i in range(open_idx, len(s)):
        if s[i] == "{":
            depth += 1
        elif s[i] == "}":
            depth -= 1
            if depth == 0:
                return s[open_idx + 1 : i]
    return s[open_idx + 1 :]  # unbalanced (truncated response): take what is there


def _strip_math_delimiters(s: str) -> str:
    s = s.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s


def _clean_answer(value: str) -> str:
    """Strip markdown bold, trailing periods, `\\boxed{}` and math delimiters from an extracted answer."""
    value = value.strip().replace("**", "").replace("__", "").strip()
    value = value.rstrip(".").strip()
    value = _unwrap_boxed(value)
    value = _strip_math_delimiters(value)
    return value.rstrip(".").strip()


def last_number(text: str) -> str | None:
    """The last number in `text` (commas removed), or None. "-4", "3.5" and "1,000" count as numbers."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_answer(text: str, mode: str = "answer") -> str | None:
    """The final answer in a response, or None.

    mode "answer": the value after the LAST `Answer:` marker (case-insensitive; `**Answer:**` works), taken to
    the end of its line (or the next non-empty line when the marker ends its line), with markdown bold,
    trailing periods, `\\boxed{...}` and `$...$` removed.
    mode "answer_or_last_number": the same, falling back to the last number anywhere in the text when there is
    no (non-empty) `Answer:` value.
    """
    if mode not in ANSWER_MODES:
        raise ValueError(f"unknown answer mode {mode!r}; valid modes: {list(ANSWER_MODES)}")
    matches = list(_ANSWER_RE.finditer(text))
    if matches:
        rest = text[matches[-1].end() :].lstrip(" \t*_").lstrip()
        value = _clean_answer(rest.split("\n", 1)[0])
        if value:
            return value
    if mode == "answer_or_last_number":
        return last_number(text)
    return None


def _canonical(value: Fraction) -> str:
    """Exact canonical text for a rational: "1000", "3.5", "-0.125", or "1/3" when not a finite decimal."""
    if value == 0:
        return "0"
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    twos = fives = 0
    while den % 2 == 0:
        den //= 2
        twos += 1
    while den % 5 == 0:
        den //= 5
        fives += 1
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10**places // value.denominator
    digits = str(scaled).rjust(places + 1, "0")
    text = f"{digits[:-places]}.{digits[-places:]}".rstrip("0").rstrip(".")
    return ("-" if value < 0 else "") + text


_FRAC_BRACED_RE = re.compile(r"^([+-]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_FRAC_SHORT_RE = re.compile(r"^([+-]?)\\[dt]?frac(\d)(\d)$")
_THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?$")
_DECIMAL_RE = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$")


def _parse_number(s: str) -> Fraction | None:
    s = s.strip()
    if not s:
        return None
    m = _FRAC_BRACED_RE.match(s) or _FRAC_SHORT_RE.match(s)
    if m:
        num, den = _parse_number(m.group(2)), _parse_number(m.group(3))
        if num is None or den is None or den == 0:
            return None
        return -(num / den) if m.group(1) == "-" else num / den
    if s.count("/") == 1:
        num_s, den_s = s.split("/")
        num, den = _parse_number(num_s), _parse_number(den_s)
        if num is None or den is None or den == 0:
            return None
        return num / den
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    if _DECIMAL_RE.match(s):
        return Fraction(s)
    return None


def normalize_number(s: str | None) -> str | None:
    """Canonical exact text of a number written in plain or light-LaTeX form, or None if `s` is not a number.

    Handles surrounding whitespace, `\\boxed{}`, `$...$`, currency `$`/`\\$`, a trailing `%`/`\\%` or period,
    thousands separators ("1,000", "1{,}000"), a leading "+", unicode minus, "-0", decimals with trailing
    zeros ("3.50" -> "3.5"), exponents ("1e3"), and fractions ("1/2", "\\frac{1}{2}", "\\dfrac12",
    "-\\frac{3}{4}").
    Values are exact rationals: "\\frac{1}{2}" and "0.5" both give "0.5"; "1/3" stays "1/3" (not "0.333").
    """
    if s is None:
        return None
    t = _unwrap_boxed(s.strip())
    t = _strip_math_delimiters(t)
    t = t.replace("\u2212", "-").replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\ ", "")
    t = t.replace("\\$", "").replace("$", "").replace("\\%", "%").strip()
    t = t.rstrip(".").strip()
    if t.endswith("%"):
        t = t[:-1].strip()
    if len(t) > 1 and t[0] in "+-" and t[1] == " ":
        t = t[0] + t[1:].strip()
    value = _parse_number(t)
    return None if value is None else _canonical(value)


def normalize_text(s: str) -> str:
    """Loose text form for non-numeric answers: boxed/math delimiters and trailing period removed, whitespace
    collapsed, lower case."""
    t = _strip_math_delimiters(_unwrap_boxed(s.strip())).rstrip(".")
    return " ".join(t.split()).lower()


def answers_match(predicted: str | None, reference: str) -> bool:
    """Equality of the normalised numbers when both parse as numbers, else normalised text equality."""
    if predicted is None:
        return False
    pred_num, ref_num = normalize_number(predicted), normalize_number(reference)
    if pred_num is not None and ref_num is not None:
        return pred_num == ref_num
    return normalize_text(predicted) == normalize_text(reference)


def _check_answer_mode(answer_mode: str) -> None:
    if answer_mode not in ANSWER_MODES:
        raise ValueError(f"unknown answer_mode {answer_mode!r}; valid modes: {list(ANSWER_MODES)}")


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
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        instruction: str | None = DEFAULT_INSTRUCTION,
        shuffle: bool = True,
    ) -> None:
        super().__init__(seed, shuffle)
        _check_answer_mode(answer_mode)
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
        self.system_prompt = system_prompt
        self.instruction = instruction
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
        return build_messages(problem, self.system_prompt, self.instruction)

    def _verify(self, answer: str, problem: Problem) -> float:
        try:
            return float(self.dataset.score_answer(answer, problem.entry))
        except Exception:  # untrusted model output must not crash training
            return 0.0

    def score(self, problem: Problem, response_text: str) -> RewardResult:
        format_ok = extract_answer(response_text, "answer") is not None
        extracted = extract_answer(response_text, self.answer_mode)
        verifier_score = 0.0
        if extracted is not None:
            verifier_score = self._verify(extracted, problem)
            canonical = normalize_number(extracted)
            if verifier_score < 1.0 and canonical is not None and canonical != extracted:
                verifier_score = max(verifier_score, self._verify(canonical, problem))
        reward = verifier_score + (self.format_reward if format_ok else 0.0)
        return RewardResult(
            reward=reward, correct=verifier_score >= 1.0, format_ok=format_ok, extracted=extracted
        )


class JsonlTask(Task):
    """GSM8K/MATH-style local JSONL: one `{"question": str, "answer": str | number}` object per line.

    GSM8K answers carry the worked solution before "#### 42": the reference is the part after the last "####".
    An optional "id" field becomes the problem uid (default "<file name>:<line number>"). Blank lines are
    skipped. reward = 1.0 when `answers_match(extracted, reference)`, plus `format_reward` for an `Answer:`
    line.
    """

    def __init__(
        self,
        path: str | pathlib.Path,
        seed: int = 0,
        answer_mode: str = "answer",
        format_reward: float = 0.0,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        instruction: str | None = DEFAULT_INSTRUCTION,
        shuffle: bool = True,
    ) -> None:
        super().__init__(seed, shuffle)
        _check_answer_mode(answer_mode)
        self.path = pathlib.Path(path)
        self.answer_mode = answer_mode
        self.format_reward = float(format_reward)
        self.system_prompt = system_prompt
        self.instruction = instruction
        self.problems = self._load(self.path)

    @staticmethod
    def _load(path: pathlib.Path) -> list[Problem]:
        if not path.is_file():
            raise FileNotFoundError(
                f"JSONL task file {path} does not exist: set the task's `path` to a local file"
            )
        problems = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{where}: invalid JSON ({e.msg}); each line must be one JSON object"
                    ) from e
                if not isinstance(entry, dict):
                    raise ValueError(f"{where}: expected a JSON object, got {type(entry).__name__}")
                for key in ("question", "answer"):
                    if key not in entry:
                        raise ValueError(f"{where}: missing field {key!r} (fields present: {sorted(entry)})")
                question, answer = entry["question"], entry["answer"]
                if not isinstance(question, str):
                    raise ValueError(
                        f"{where}: field 'question' must be a string, got {type(question).__name__}"
                    )
                if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                    raise ValueError(
                        f"{where}: field 'answer' must be a string or a number, got {type(answer).__name__}"
                    )
                answer = str(answer)
                if "####" in answer:
                    answer = answer.rsplit("####", 1)[1]
                answer = answer.strip()
                if not answer:
                    raise ValueError(f"{where}: field 'answer' is empty (after the '####' marker, if any)")
                uid = str(entry["id"]) if "id" in entry else f"{path.name}:{lineno}"
                problems.append(Problem(uid=uid, question=question, answer=answer, entry=entry))
        if not problems:
            raise ValueError(f"JSONL task file {path} contains no problems (it is empty or only blank lines)")
        return problems

    def __len__(self) -> int:
        return len(self.problems)

    def problem(self, index: int) -> Problem:
        return self.problems[index]

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return build_messages(problem, self.system_prompt, self.instruction)

    def score(self, problem: Problem, response_text: str) -> RewardResult:
        format_ok = extract_answer(response_text, "answer") is not None
        extracted = extract_answer(response_text, self.answer_mode)
        correct = answers_match(extracted, problem.answer)
        reward = (1.0 if correct else 0.0) + (self.format_reward if format_ok else 0.0)
        return RewardResult(reward=reward, correct=correct, format_ok=format_ok, extracted=extracted)


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
    "counting": CountingTask,
}


def make_task(config: Mapping[str, Any] | Any) -> Task:
    """Build a task from a config (ml_collections.ConfigDict or dict) with `kind` in TASK_KINDS.

    The other keys are the constructor arguments of the chosen class; unknown or missing keys raise a
    ValueError naming them.
    """
    cfg = dict(config.to_dict()) if hasattr(config, "to_dict") else dict(config)
    kind = cfg.pop("kind", None)
    if kind not in TASK_KINDS:
        raise ValueError(f"unknown task kind {kind!r}: set config.kind to one of {sorted(TASK_KINDS)}")
    cls = TASK_KINDS[kind]
    params = {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}
    unknown = sorted(set(cfg) - set(params))
    if unknown:
        raise ValueError(f"unknown keys {unknown} for task kind {kind!r}; valid keys: {sorted(params)}")
    missing = sorted(k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in cfg)
    if missing:
        raise ValueError(f"task kind {kind!r} needs config keys {missing}")
    return cls(**cfg)


def score(task: Task, problem: Problem, response_text: str) -> RewardResult:
    """Reward function: `task.score(problem, response_text)`."""
    return task.score(problem, response_text)


def score_batch(task: Task, problems: Sequence[Problem], responses: Sequence[str]) -> list[RewardResult]:
    """Score responses paired with their problems (for GRPO, repeat each problem n times)."""
    if len(problems) != len(responses):
        raise ValueError(f"got {len(problems)} problems but {len(responses)} responses; pair them one to one")
    return [task.score(p, r) for p, r in zip(problems, responses, strict=True)]
