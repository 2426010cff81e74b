"""Held-out evaluation: the policy's reward on a fixed set of problems, sampled with fixed keys.

Why: the training reward of a step is measured on that step's fresh prompts, and on a small model the
spread between prompt batches hides learning. For SmolLM2-135M on chain_sum (32 samples a step) a frozen
policy's per-step reward ranges 0.04-0.17 over 10 steps, larger than what 10 RL steps can move. The held-out
eval scores the SAME problems with the SAME sampling keys at every evaluation: plain decoding draws token i
of a row by inverse CDF from the row's (key, i) uniform, so an unchanged policy reproduces its samples token
for token and a changed one departs from them only where its probabilities moved. The difference between two
evaluations is then a paired measurement of the policy change, not of the prompts drawn.

The problems are the LAST `prompts` of the task stream's first epoch (the learner reads the stream from
position 0 upward); `HeldOutEval` refuses a run whose training would reach them. The rollout is plain
decoding (`FixedMode("plain")`, no bandit, no spot trainer, no speculation), so evaluation neither feeds
the adaptive engine's rewards nor the drafter's data; its time is reported as `eval/seconds`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np

from tlt_jax.config_schema import GrpoConfig
from tlt_jax.config_sections import EvalConfig
from tlt_jax.models.build import TextCodec
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FixedMode
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.tasks import Problem, Task

EVAL_KEY_SALT = 0x5EED  # folded into the run's seed: the eval keys never coincide with a training step's


class HeldOutEval:
    """Scores the engine's current policy on the held-out problems; `run()` returns `eval/*` metrics."""

    def __init__(
        self,
        cfg: EvalConfig,
        task: Task,
        encode: Callable[[Problem], list[int]],  # prompt token ids (the learner's cached chat encoding)
        tokenizer: TextCodec,
        engine: RolloutEngine,
        sampling: SamplingParams,
        seed: int,
        train_positions: int,
    ):
        """`train_positions`: how far the training run reads the task stream (num_steps * prompts_per_step);
        the held-out problems must lie beyond it."""
        n = len(task)
        start = n - cfg.prompts
        if start < train_positions:
            raise ValueError(
                f"config.eval.prompts={cfg.prompts}: the held-out problems are the last {cfg.prompts} of the "
                f"task's {n}, but training reads the first {train_positions} (num_steps * prompts_per_step): "
                "raise config.task.size, or lower config.eval.prompts or config.num_steps."
            )
        self.cfg, self.task, self.tokenizer = cfg, task, tokenizer
        self.engine, self.sampling = engine, sampling
        self.problems, _ = task.batch(start, cfg.prompts)
        self.prompts = [encode(p) for p in self.problems]
        self.key = jax.random.fold_in(jax.random.key(seed), EVAL_KEY_SALT)

    def run(self) -> dict[str, float]:
        t0 = time.perf_counter()
        rollout = self.engine.generate(
            self.prompts, n=self.cfg.samples, key=self.key, sampling=self.sampling, hooks=[FixedMode("plain")]
        )
        rows = len(self.prompts) * self.cfg.samples
        results = [
            self.task.score(self.problems[int(g)], self.tokenizer.decode(rollout.response(i)))
            for i, g in zip(range(rows), rollout.prompt_index, strict=True)
        ]
        lengths = np.asarray(rollout.lengths, np.float64)
        return {
            "eval/reward": float(np.mean([r.reward for r in results])),
            "eval/accuracy": float(np.mean([r.correct for r in results])),
            "eval/format": float(np.mean([r.format_ok for r in results])),
            "eval/length_mean": float(lengths.mean()),
            "eval/clip_frac": float(np.mean(np.asarray(rollout.finish_reason) == "length")),
            "eval/seconds": time.perf_counter() - t0,
        }


def held_out_eval(
    job: GrpoConfig,
    task: Task,
    encode: Callable[[Problem], list[int]],
    tokenizer: TextCodec,
    engine: RolloutEngine,
    sampling: SamplingParams,
) -> HeldOutEval | None:
    """The GRPO run's held-out eval (`job.eval`), None when off (`every` = 0)."""
    if not job.eval.every:
        return None
    train_positions = job.run.num_steps * job.rl.prompts_per_step
    return HeldOutEval(
        job.eval,
        task,
        encode,
        tokenizer,
        engine,
        sampling,
        seed=job.run.seed,
        train_positions=train_positions,
    )
