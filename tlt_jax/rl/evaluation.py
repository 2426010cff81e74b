"""Evaluation during training: the held-out split of the training task, and named benchmark sets.

Held-out split (`config.eval.prompts` > 0): the policy's reward on a fixed set of problems, sampled with fixed
keys. Why: the training reward of a step is measured on that step's fresh prompts, and on a small model the
spread between prompt batches hides learning. For SmolLM2-135M on chain_sum (32 samples a step) a frozen
policy's per-step reward ranges 0.04-0.17 over 10 steps, larger than what 10 RL steps can move. The held-out
eval scores the SAME problems with the SAME sampling keys at every evaluation: plain decoding draws token i
of a row by inverse CDF from the row's (key, i) uniform, so an unchanged policy reproduces its samples token
for token and a changed one departs from them only where its probabilities moved. The problems are the LAST
`prompts` of the task's first epoch; training reads the rest (`tasks.base.TrainSplit`) for as many epochs as
the run lasts, never the held-out ones.

Benchmark sets (`config.eval.sets`, name -> {path, samples, temperature, ...}; `eval_set_configs`): files
read like a file task (the training task's prompt and reward keys unless the set overrides them), each with
its own sample count and sampling (temperature 0: greedy). Logged as `eval/<name>/mean@k` (accuracy over all
k samples), `eval/<name>/pass@j` (the unbiased estimator, j = 1, 2, 4, ... and k), `length_mean`,
`clip_frac` (truncation rate) and `seconds`.

Both run before training, every `every` steps and after the last. The rollout is plain decoding
(`FixedMode("plain")`: no bandit, no spot trainer, no speculation), so evaluation neither feeds the adaptive
engine's rewards nor the drafter's data.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from absl import logging

from tlt_jax.config_schema import GrpoConfig
from tlt_jax.config_sections import EvalConfig
from tlt_jax.models.build import TextCodec
from tlt_jax.rl.rollout import PromptEncoder
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FixedMode
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.types import Rollout
from tlt_jax.tasks import Problem, RewardResult, Task, make_task
from tlt_jax.tasks.base import TrainSplit
from tlt_jax.tasks.datasets import TASK_KINDS

EVAL_KEY_SALT = 0x5EED  # folded into the run's seed: the eval keys never coincide with a training step's
# eval-set keys that are not task keys: the sampling and how many problems
SET_SAMPLING_KEYS = ("samples", "temperature", "top_p", "top_k", "max_new_tokens", "max_prompts")
# training-task keys an eval set inherits (the same prompt and checker), unless it sets them
INHERITED_TASK_KEYS = (
    "reward", "think", "verify_timeout", "answer_mode",
    "prompt", "system_prompt", "instruction", "chat_template",
)  # fmt: skip


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator for one problem with `c` correct of `n` samples: 1 - C(n-c, k) / C(n, k),
    the chance that k of the n samples drawn without replacement hold a correct one (Chen et al., 2021)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sample_metrics(correct: np.ndarray, lengths: np.ndarray, truncated: np.ndarray) -> dict[str, float]:
    """mean@k, pass@j (j = 1, 2, 4, ... < k, and k), length and truncation of [problems, k] samples."""
    problems, k = correct.shape
    counts = correct.sum(axis=1)
    out = {f"mean@{k}": float(correct.mean())}
    for j in sorted({2**i for i in range(k.bit_length()) if 2**i < k} | {k}):
        out[f"pass@{j}"] = float(np.mean([pass_at_k(k, int(c), j) for c in counts]))
    out["length_mean"] = float(np.mean(lengths))
    out["clip_frac"] = float(np.mean(truncated))
    return out


def _score(task: Task, problems: list[Problem], rollout: Rollout, tokenizer: TextCodec) -> list[RewardResult]:
    rows = len(rollout.lengths)
    return [
        task.score(problems[int(g)], tokenizer.decode(rollout.response(i)))
        for i, g in zip(range(rows), rollout.prompt_index, strict=True)
    ]


class HeldOutEval:
    """Scores the engine's current policy on the held-out problems of a `TrainSplit`; `run()` returns the
    `eval/*` metrics."""

    def __init__(
        self,
        cfg: EvalConfig,
        split: TrainSplit,
        encode: Callable[[Problem], list[int]],  # prompt token ids (the learner's cached chat encoding)
        tokenizer: TextCodec,
        engine: RolloutEngine,
        weights: Callable[[], tuple[Any, Any]],  # the current (policy, drafter) weights: the learner's
        sampling: SamplingParams,
        key: jax.Array,
    ):
        self.cfg, self.task, self.tokenizer = cfg, split.base, tokenizer
        self.engine, self.weights, self.sampling, self.key = engine, weights, sampling, key
        self.problems = [split.base.problem(int(i)) for i in split.held_out_indices]
        self.prompts = [encode(p) for p in self.problems]

    def run(self) -> dict[str, float]:
        t0, (params, dparams) = time.perf_counter(), self.weights()
        rollout = self.engine.generate(
            self.prompts, n=self.cfg.samples, key=self.key, sampling=self.sampling,
            hooks=[FixedMode("plain")], params=params, drafter_params=dparams,
        )  # fmt: skip
        results = _score(self.task, self.problems, rollout, self.tokenizer)
        lengths = np.asarray(rollout.lengths, np.float64)
        return {
            "eval/reward": float(np.mean([r.reward for r in results])),
            "eval/accuracy": float(np.mean([r.correct for r in results])),
            "eval/format": float(np.mean([r.format_ok for r in results])),
            "eval/length_mean": float(lengths.mean()),
            "eval/clip_frac": float(np.mean(np.asarray(rollout.finish_reason) == "length")),
            "eval/seconds": time.perf_counter() - t0,
        }


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """One benchmark set: its task (a file task), problems, sampling and sample count."""

    name: str
    task: Task
    problems: list[Problem]
    samples: int
    sampling: SamplingParams
    max_new_tokens: int | None


def eval_set_configs(
    sets: Mapping[str, object], train_task: Mapping[str, object]
) -> dict[str, tuple[dict, dict]]:
    """name -> (the set's task config, its sampling keys), sets in name order; a ValueError naming the set
    and key. The task config: kind from the file's extension (".parquet", else "jsonl") unless given, the
    training task's prompt and reward keys (INHERITED_TASK_KEYS) unless the set gives its own."""
    out = {}
    for name in sorted(sets):
        spec = sets[name]
        if isinstance(spec, str):
            spec = {"path": spec}
        if not isinstance(spec, Mapping) or not spec.get("path"):
            raise ValueError(f"config.eval.sets.{name}: give a file path, or a mapping with a 'path' key")
        spec = dict(spec)
        sampling = {k: spec.pop(k) for k in SET_SAMPLING_KEYS if k in spec}
        path = str(spec["path"]).split(",")[0]
        spec.setdefault("kind", "parquet" if pathlib.Path(path).suffix == ".parquet" else "jsonl")
        if spec["kind"] not in ("parquet", "jsonl"):
            raise ValueError(f"config.eval.sets.{name}.kind={spec['kind']!r}: use parquet or jsonl")
        inherit = train_task.get("kind") in TASK_KINDS and train_task.get("kind") != "counting"
        for key in INHERITED_TASK_KEYS if inherit else ():
            if key in train_task and key not in spec:
                spec[key] = train_task[key]
        spec["shuffle"] = False
        out[name] = (spec, sampling)
    return out


def _eval_set(name: str, task_cfg: dict, sampling: dict, default: SamplingParams) -> EvalSet:
    task = make_task(task_cfg)
    count = int(sampling.get("max_prompts", 0)) or len(task)
    params = SamplingParams(
        temperature=float(sampling.get("temperature", default.temperature)),
        top_k=int(sampling.get("top_k", default.top_k)),
        top_p=float(sampling.get("top_p", default.top_p)),
    )
    samples = int(sampling.get("samples", 1))
    if samples < 1:
        raise ValueError(f"config.eval.sets.{name}.samples={samples}: must be >= 1")
    problems = [task.problem(i) for i in range(min(count, len(task)))]
    return EvalSet(name, task, problems, samples, params, int(sampling.get("max_new_tokens", 0)) or None)


class SetEval:
    """Scores the engine's current policy on the benchmark sets, `batch_prompts` prompts per rollout, with
    the same keys at every evaluation (paired, like the held-out eval)."""

    def __init__(
        self,
        sets: list[EvalSet],
        tokenizer: TextCodec,
        engine: RolloutEngine,
        weights: Callable[[], tuple[Any, Any]],  # the current (policy, drafter) weights: the learner's
        key: jax.Array,
        batch_prompts: int,
    ):
        self.sets, self.tokenizer, self.engine, self.key = sets, tokenizer, engine, key
        self.weights = weights
        self.batch_prompts = max(int(batch_prompts), 1)
        self.encoders = [PromptEncoder(s.task, tokenizer) for s in sets]

    def run_set(self, index: int) -> dict[str, float]:
        s, t0, (params, dparams) = self.sets[index], time.perf_counter(), self.weights()
        correct, lengths, truncated = [], [], []
        for start in range(0, len(s.problems), self.batch_prompts):
            problems = s.problems[start : start + self.batch_prompts]
            rollout = self.engine.generate(
                [self.encoders[index](p) for p in problems],
                n=s.samples,
                key=jax.random.fold_in(jax.random.fold_in(self.key, index), start),
                sampling=s.sampling,
                max_new_tokens=s.max_new_tokens,
                hooks=[FixedMode("plain")],
                params=params,
                drafter_params=dparams,
            )
            order = np.argsort(np.asarray(rollout.prompt_index), kind="stable")  # prompt-major rows
            results = _score(s.task, problems, rollout, self.tokenizer)
            correct.append(np.asarray([results[i].correct for i in order]).reshape(len(problems), s.samples))
            lengths += [int(rollout.lengths[i]) for i in order]
            truncated += [rollout.finish_reason[i] == "length" for i in order]
        metrics = sample_metrics(np.concatenate(correct), np.asarray(lengths), np.asarray(truncated))
        metrics["seconds"] = time.perf_counter() - t0
        k = s.samples
        logging.info(
            "eval %s (%d problems x %d): mean@%d %.3f pass@%d %.3f | length %.0f, truncated %.1f%% (%.1f s)",
            s.name, len(s.problems), k, k, metrics[f"mean@{k}"], k, metrics[f"pass@{k}"],
            metrics["length_mean"], 100 * metrics["clip_frac"], metrics["seconds"],
        )  # fmt: skip
        return {f"eval/{s.name}/{k}": v for k, v in metrics.items()}

    def run(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for i in range(len(self.sets)):
            out.update(self.run_set(i))
        return out


class Evaluator:
    """The run's evaluations (held-out split and/or benchmark sets): `cfg.due(step)` says when, `run()`
    returns their metrics, `train_task` is what training reads (the task without its held-out problems)."""

    def __init__(self, cfg: EvalConfig, train_task: Task, held_out: HeldOutEval | None, sets: SetEval | None):
        self.cfg, self.train_task, self.held_out, self.sets = cfg, train_task, held_out, sets

    def run(self) -> dict[str, float]:
        out = self.held_out.run() if self.held_out is not None else {}
        if self.sets is not None:
            out.update(self.sets.run())
        return out


def held_out_eval(
    job: GrpoConfig,
    task: Task,
    encode: Callable[[Problem], list[int]],
    tokenizer: TextCodec,
    engine: RolloutEngine,
    weights: Callable[[], tuple[Any, Any]],
    sampling: SamplingParams,
) -> Evaluator | None:
    """The GRPO run's evaluations (`job.eval`) of the policy whose (policy, drafter) weights `weights()`
    returns, None when off (`every` = 0, or nothing to evaluate)."""
    cfg = job.eval
    if not cfg.every or not (cfg.prompts or cfg.sets):
        return None
    key = jax.random.fold_in(jax.random.key(job.run.seed), EVAL_KEY_SALT)
    held_out, train_task = None, task
    if cfg.prompts:
        train_task = TrainSplit(task, cfg.prompts)
        held_out = HeldOutEval(cfg, train_task, encode, tokenizer, engine, weights, sampling, key)
    sets = None
    if cfg.sets:
        specs = eval_set_configs(cfg.sets, job.task)
        built = [_eval_set(name, t, s, sampling) for name, (t, s) in specs.items()]
        sets = SetEval(built, tokenizer, engine, weights, jax.random.fold_in(key, 1), job.rl.prompts_per_step)
    return Evaluator(cfg, train_task, held_out, sets)
