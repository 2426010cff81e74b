"""Evaluation during training: the held-out split of the training task, and named benchmark sets.

Held-out split (`config.eval.prompts` > 0): the policy's reward on a fixed set of problems, sampled with fixed
keys. Why: the training reward of a step is measured on that step's fresh prompts, and on a small model the
spread between prompt batches hides learning. For SmolLM2-135M on chain_sum (32 samples a step) a frozen
policy's per-step reward ranges 0.04-0.17 over 10 steps, larger than what 10 RL steps can move. The held-out
eval scores the SAME problems with the SAME sampling keys at every evaluation: token i of a row is drawn by
inverse CDF from the row's (key, i) uniform, so an unchanged policy reproduces its samples token for token
and a changed one departs from them only where its probabilities moved. The problems are the LAST `prompts`
of the task's first epoch; training reads the rest (`tasks.base.TrainSplit`) for as many epochs as the run
lasts, never the held-out ones.

Benchmark sets (`config.eval.sets`, name -> {path, samples, temperature, ...}; `eval_set_configs`): files
read like a file task (the training task's prompt and reward keys unless the set overrides them). Sampling
(VeRL's `val_kwargs`): a set's own keys, else `config.eval.samples / temperature / top_p / top_k`, else the
rollout's (temperature 0: greedy). Logged as `eval/<name>/mean@k`, `pass@j`, `maj@j`, `best@j`
(tlt_jax.rl.eval_metrics: exact estimators, j = 1, 2, 4, ... and k), `reward_mean`, `length_mean`,
`clip_frac`, `seconds` and the decode's speed (`decode_seconds`, `sd_share`, `accept_len`, `tok_per_s`; with
`config.eval.plain_baseline` the measured `sd_speedup` and `plain_match`). A set is generated in batches of
the training step's rows (`prompts_per_step x samples_per_prompt` / its samples prompts), so its batch
buckets are the step's and, at the rollout's sampling and token budget, its compiled programs too.

Both run before training (`config.eval.before_train`), every `every` steps and after the last, decoded by the
training rollouts' engine with speculation as configured and nothing taught (tlt_jax.rl.eval_decoding). Each
rollout chunk is a stop agreement point (the learner's `watchers`), and each row is scored by one process of
a multi-process run, the verdicts shared (rl/reward.py's `score_texts`).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from tlt_jax.config_schema import GrpoConfig
from tlt_jax.config_sections import SET_SAMPLING_KEYS, EvalConfig
from tlt_jax.models.build import TextCodec
from tlt_jax.rl.eval_decoding import EvalDecoding
from tlt_jax.rl.eval_metrics import sample_metrics
from tlt_jax.rl.prompt_budget import fit_to_rollout
from tlt_jax.rl.reward import score_texts
from tlt_jax.rl.rollout import PromptEncoder
from tlt_jax.rollout.adaptive import AdaptivePolicy
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import RolloutHooks
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.types import Rollout
from tlt_jax.tasks import Problem, RewardResult, Task, make_task
from tlt_jax.tasks.base import TrainSplit
from tlt_jax.tasks.datasets import TASK_KINDS

EVAL_KEY_SALT = 0x5EED  # folded into the run's seed: the eval keys never coincide with a training step's
# training-task keys an eval set inherits (the same prompt and checker), unless it sets them
INHERITED_TASK_KEYS = (
    "reward", "think", "verify_timeout", "answer_mode", "reward_scale", "math_verify_mode", "reward_kwargs",
    "custom_acc", "maj_votes",
    "prompt", "system_prompt", "instruction", "chat_template", "filter_overlong_prompts", "truncation",
)  # fmt: skip


def eval_sampling(cfg: EvalConfig, rollout: SamplingParams, own: Mapping[str, object]) -> SamplingParams:
    """An evaluation's sampling: its own keys (`own`, a set's), else `config.eval`'s, else the rollout's."""

    def pick(key: str, default: float) -> float:
        value = own.get(key, getattr(cfg, key))
        return default if value is None else value  # type: ignore[return-value]

    return SamplingParams(
        temperature=float(pick("temperature", rollout.temperature)),
        top_k=int(pick("top_k", rollout.top_k)),
        top_p=float(pick("top_p", rollout.top_p)),
    )


def _score(task: Task, problems: list[Problem], rollout: Rollout, tokenizer: TextCodec) -> list[RewardResult]:
    """Every row's verdict, each row scored by one process and shared (rl/reward.py's `score_texts`)."""
    texts = [tokenizer.decode(rollout.response(i)) for i in range(len(rollout.lengths))]
    return score_texts(task, problems, texts, rollout.prompt_index)


def _prefixed(prefix: str, metrics: Mapping[str, float]) -> dict[str, float]:
    return {f"{prefix}{k}": v for k, v in metrics.items()}


class HeldOutEval:
    """Scores the engine's current policy on the held-out problems of a `TrainSplit`; `run()` returns the
    `eval/*` metrics."""

    def __init__(
        self,
        cfg: EvalConfig,
        split: TrainSplit,
        encode: Callable[[Problem], list[int]],  # prompt token ids (the learner's cached chat encoding)
        tokenizer: TextCodec,
        decoding: EvalDecoding,
        sampling: SamplingParams,
        key: jax.Array,
    ):
        self.cfg, self.task, self.tokenizer = cfg, split.base, tokenizer
        self.decoding, self.sampling, self.key = decoding, sampling, key
        self.problems = [split.base.problem(int(i)) for i in split.held_out_indices]
        self.prompts = [encode(p) for p in self.problems]

    def run(self, watchers: Sequence[RolloutHooks] = ()) -> dict[str, float]:
        t0, run = time.perf_counter(), self.decoding.begin(watchers)
        rollout = run.generate(
            self.prompts, n=self.cfg.samples, key=self.key, sampling=self.sampling, max_new=None
        )
        results = _score(self.task, self.problems, rollout, self.tokenizer)
        lengths = np.asarray(rollout.lengths, np.float64)
        return {
            "eval/reward": float(np.mean([r.reward for r in results])),
            "eval/accuracy": float(np.mean([r.correct for r in results])),
            "eval/format": float(np.mean([r.format_ok for r in results])),
            "eval/length_mean": float(lengths.mean()),
            "eval/clip_frac": float(np.mean(np.asarray(rollout.finish_reason) == "length")),
            **_prefixed("eval/", run.tally.metrics()),
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
    """name -> (the set's task config, its own sampling keys), sets in name order; a ValueError naming the
    set and key. The task config: kind from the file's extension (".parquet", else "jsonl") unless given, the
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


def _eval_set(
    name: str,
    task_cfg: dict,
    own: dict,
    cfg: EvalConfig,
    rollout: SamplingParams,
    fit: Callable[..., Task] | None = None,  # prompt_budget.fit_to_rollout with the run's rollout
) -> EvalSet:
    task = make_task(task_cfg)
    if fit is not None:  # its prompts fitted to the room its own max_new_tokens leaves
        max_new = int(own.get("max_new_tokens", 0)) or None
        task = fit(task, what=f"config.eval.sets.{name}", max_new_tokens=max_new)
    count = int(own.get("max_prompts", 0)) or len(task)
    samples = int(own.get("samples", cfg.samples))
    if samples < 1:
        raise ValueError(f"config.eval.sets.{name}.samples={samples}: must be >= 1")
    problems = [task.problem(i) for i in range(min(count, len(task)))]
    sampling = eval_sampling(cfg, rollout, own)
    return EvalSet(name, task, problems, samples, sampling, int(own.get("max_new_tokens", 0)) or None)


class SetEval:
    """Scores the engine's current policy on the benchmark sets, in batches of about `rows` rows (the
    training step's: its batch buckets), with the same keys at every evaluation (paired, like the held-out
    eval)."""

    def __init__(
        self, sets: list[EvalSet], tokenizer: TextCodec, decoding: EvalDecoding, key: jax.Array, rows: int
    ):
        self.sets, self.tokenizer, self.decoding, self.key = sets, tokenizer, decoding, key
        self.rows = max(int(rows), 1)
        self.encoders = [PromptEncoder(s.task, tokenizer) for s in sets]

    def batch_prompts(self, index: int) -> int:
        """Prompts per rollout of set `index`: the step's rows over its samples (at least one prompt)."""
        return max(self.rows // self.sets[index].samples, 1)

    def run_set(self, index: int, watchers: Sequence[RolloutHooks] = ()) -> dict[str, float]:
        s, t0, run = self.sets[index], time.perf_counter(), self.decoding.begin(watchers)
        correct, rewards, votes, lengths, truncated = [], [], [], [], []
        step = self.batch_prompts(index)
        for start in range(0, len(s.problems), step):
            problems = s.problems[start : start + step]
            rollout = run.generate(
                [self.encoders[index](p) for p in problems],
                n=s.samples,
                key=jax.random.fold_in(jax.random.fold_in(self.key, index), start),
                sampling=s.sampling,
                max_new=s.max_new_tokens,
            )
            order = np.argsort(np.asarray(rollout.prompt_index), kind="stable")  # prompt-major rows
            scored = _score(s.task, problems, rollout, self.tokenizer)
            results = [scored[i] for i in order]
            shape = (len(problems), s.samples)
            correct.append(np.asarray([r.acc_value for r in results]).reshape(shape))  # VeRL's acc
            rewards.append(np.asarray([r.reward for r in results], np.float64).reshape(shape))
            keys = [s.task.vote(r) for r in results]  # task.maj_votes: VeRL's with reward=verl
            votes += [keys[i : i + s.samples] for i in range(0, len(keys), s.samples)]
            lengths += [int(rollout.lengths[i]) for i in order]
            truncated += [rollout.finish_reason[i] == "length" for i in order]
        metrics = sample_metrics(
            np.concatenate(correct),
            np.concatenate(rewards),
            votes,
            np.asarray(lengths),
            np.asarray(truncated),
        )
        metrics.update(run.tally.metrics())
        metrics["seconds"] = time.perf_counter() - t0
        _log_set(s, metrics)
        return _prefixed(f"eval/{s.name}/", metrics)

    def run(self, watchers: Sequence[RolloutHooks] = ()) -> dict[str, float]:
        out: dict[str, float] = {}
        for i in range(len(self.sets)):
            out.update(self.run_set(i, watchers))
        return out


def _log_set(s: EvalSet, m: Mapping[str, float]) -> None:
    """The console line of one set's evaluation: its estimators at k, lengths, time and SD."""
    k = s.samples
    sd = f"SD {100 * m['sd_share']:.0f}% of decode"
    if "accept_len" in m:
        sd += f", accept {m['accept_len']:.2f}"
    if "sd_speedup" in m:
        sd += f", {m['sd_speedup']:.2f}x plain (paired pass; {100 * m['plain_match']:.0f}% identical)"
    logging.info(
        "eval %s (%d problems x %d): mean@%d %.3f pass@%d %.3f maj@%d %.3f best@%d %.3f | length %.0f, "
        "truncated %.1f%% | %.1f s, %.0f tok/s, %s",
        s.name, len(s.problems), k, k, m[f"mean@{k}"], k, m[f"pass@{k}"], k, m[f"maj@{k}"], k, m[f"best@{k}"],
        m["length_mean"], 100 * m["clip_frac"], m["seconds"], m["tok_per_s"], sd,
    )  # fmt: skip


class Evaluator:
    """The run's evaluations (held-out split and/or benchmark sets): `cfg.due(step)` says when, `run()`
    returns their metrics, `train_task` is what training reads (the task without its held-out problems)."""

    def __init__(self, cfg: EvalConfig, train_task: Task, held_out: HeldOutEval | None, sets: SetEval | None):
        self.cfg, self.train_task, self.held_out, self.sets = cfg, train_task, held_out, sets

    def run(self, watchers: Sequence[RolloutHooks] = ()) -> dict[str, float]:
        """Every evaluation's metrics; `watchers` ride along in each rollout (EvalDecoding.begin): the
        learner's stop check, which may raise to end the evaluation at a chunk boundary."""
        out = self.held_out.run(watchers) if self.held_out is not None else {}
        if self.sets is not None:
            out.update(self.sets.run(watchers))
        return out


def held_out_eval(
    job: GrpoConfig,
    task: Task,
    encode: Callable[[Problem], list[int]],
    tokenizer: TextCodec,
    engine: RolloutEngine,
    weights: Callable[[], tuple[Any, Any]],  # the current (policy, drafter) weights: the learner's
    sampling: SamplingParams,
    selector: AdaptivePolicy | None = None,
) -> Evaluator | None:
    """The GRPO run's evaluations (`job.eval`) of the policy whose (policy, drafter) weights `weights()`
    returns, decoded by the training rollouts' `engine` with its `selector`'s current choices
    (tlt_jax.rl.eval_decoding); None when off (`every` = 0, or nothing to evaluate). `sampling`: the
    rollout's."""
    cfg = job.eval
    if not cfg.every or not (cfg.prompts or cfg.sets):
        return None
    decoding = EvalDecoding(engine, weights, selector, cfg.plain_baseline)
    key = jax.random.fold_in(jax.random.key(job.run.seed), EVAL_KEY_SALT)
    held_out, train_task = None, task
    if cfg.prompts:
        train_task = TrainSplit(task, cfg.prompts)
        held_out = HeldOutEval(
            cfg, train_task, encode, tokenizer, decoding, eval_sampling(cfg, sampling, {}), key
        )
    sets = None
    if cfg.sets:
        specs = eval_set_configs(cfg.sets, job.task)
        fit = functools.partial(fit_to_rollout, rollout=job.rollout, tokenizer=tokenizer)
        built = [_eval_set(name, t, s, cfg, sampling, fit) for name, (t, s) in specs.items()]
        rows = job.rl.prompts_per_step * job.rl.samples_per_prompt
        sets = SetEval(built, tokenizer, decoding, jax.random.fold_in(key, 1), rows)
    return Evaluator(cfg, train_task, held_out, sets)
