"""The prompt budget of a rollout, and the run's tasks fitted to it when they load (tasks.prompt_fit): a
prompt longer than the engine takes is dropped, truncated or refused there, never met inside generation.

The engine refuses a prompt of P tokens when P + max_new_tokens > max_cache_len
(`rollout.row_programs.validate_prompts`); the prompt bucket (`prompt_bucket`: the next power of two, capped
at max_cache_len) and the cache buckets only pad, so the budget is max_cache_len - max_new_tokens. An eval
set with its own, shorter `max_new_tokens` has the larger budget that leaves.
"""

from __future__ import annotations

from tlt_jax.config_sections import RolloutSection
from tlt_jax.tasks import Task
from tlt_jax.tasks.base import PromptTokenizer
from tlt_jax.tasks.prompt_fit import fit_prompts


def prompt_budget(max_cache_len: int, max_new_tokens: int) -> int:
    """The longest prompt (tokens) a rollout of `max_new_tokens` takes in a `max_cache_len` cache."""
    return int(max_cache_len) - int(max_new_tokens)


def fit_to_rollout(
    task: Task,
    rollout: RolloutSection,
    tokenizer: PromptTokenizer,
    what: str = "config.task",
    max_new_tokens: int | None = None,
) -> Task:
    """`task` with every prompt within the budget of `rollout` (`max_new_tokens`: an eval set's own cap,
    None: the rollout's), as `task.prompt_limit` says; `what` names the task in the log and errors."""
    budget = prompt_budget(rollout.max_cache_len, max_new_tokens or rollout.max_new_tokens)
    return fit_prompts(task, tokenizer, budget, what)
