"""The RL step's rollout phase: the step's prompts through the chat template, `n` samples of each.

The engine's hooks watch and steer the rollout (tlt_jax.rollout.hooks): the strategy selector picks each
chunk's mode and learns from its speed, the monitor records speculation, the spot trainer collects drafter
data and trains on idle devices; the learner passes them in. A progress bar shows finished rows on a TTY.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from tlt_jax.models.build import TextCodec
from tlt_jax.rollout.adaptive import AdaptivePolicy
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import ProgressHook, RolloutHooks
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.types import Rollout
from tlt_jax.tasks import Problem, Task
from tlt_jax.utils import compile_stats
from tlt_jax.utils.tracking import RolloutProgress


class PromptEncoder:
    """Problem -> prompt token ids through the task's chat messages and the tokenizer's chat template,
    cached by problem uid (a run encodes each problem once: later epochs and the held-out eval reuse it)."""

    def __init__(self, task: Task, tokenizer: TextCodec):
        self.task, self.tokenizer = task, tokenizer
        self._cache: dict[str, list[int]] = {}

    def __call__(self, problem: Problem) -> list[int]:
        if problem.uid not in self._cache:
            self._cache[problem.uid] = self.task.encode_prompt(problem, self.tokenizer)
        return self._cache[problem.uid]


def generate_rollout(
    engine: RolloutEngine,
    prompts: list[list[int]],
    *,
    group: int,
    key: jax.Array,
    sampling: SamplingParams,
    selector: AdaptivePolicy | None,
    watchers: Sequence[RolloutHooks | None],
    desc: str,
    progress: bool,
    params: Any,
    drafter_params: Any | None,
) -> Rollout:
    """`group` samples of every prompt (prompt-major rows) with the policy's weights `params` and the
    drafter's `drafter_params` (None: the engine's own drafter, if any). The hooks run in this order: the
    `selector` (it chooses each chunk's mode), the progress bar (named `desc`, shown on a TTY when
    `progress`), then the `watchers`. Compilations count as the "rollout" kind."""
    with RolloutProgress(total=len(prompts) * group, desc=desc, disable=None if progress else True) as bar:
        hooks = [selector, ProgressHook(bar), *watchers]
        with compile_stats.scope("rollout"):
            return engine.generate(
                prompts, n=group, key=key, sampling=sampling, hooks=hooks, params=params,
                drafter_params=drafter_params,
            )  # fmt: skip
