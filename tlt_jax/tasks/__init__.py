"""RL tasks (prompts + verifiable rewards) shared by the GRPO learner and the drafter warm-up.

`base` holds the interface (Problem, RewardResult, Task with its resumable seeded order, TrainSplit,
PromptLimit), `answers` the answer extraction and normalisation, `rewards` the checkers (`task.reward`:
answer | math_verify | dapo | math_reward | gsm8k | verl | module:function, with `<think>` handling and the
reward scale; VeRL's scorers in `math_verify_reward`, `dapo_reward`, `math_reward`, `gsm8k_reward`, its
routing by data_source in `verl_routing`, a user's function in `custom_reward`), `prompts` the prompt presets
and overrides, `prompt_fit` the over-long prompts dropped or cut when the data loads, `files` the parquet /
JSONL data files, `datasets` the kinds (reasoning-gym, files, the counting toy), `task_config` and
`make_task`; `write_parquet` writes reasoning-gym problems in VeRL's layout. The package imports nothing else
of tlt_jax, so any layer may use it.
"""

from tlt_jax.tasks.base import Problem, RewardResult, Task, build_messages
from tlt_jax.tasks.datasets import make_task

__all__ = ["Problem", "RewardResult", "Task", "build_messages", "make_task"]
