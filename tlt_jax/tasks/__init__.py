"""RL tasks (prompts + verifiable rewards) shared by the GRPO learner and the drafter warm-up.

`base` holds the interface (Problem, RewardResult, Task with its resumable seeded order), `answers` the answer
extraction and normalisation, `datasets` the kinds (reasoning-gym, JSONL files, the counting toy) and
`make_task`. The package imports nothing else of tlt_jax, so any layer may use it.
"""

from tlt_jax.tasks.base import Problem, RewardResult, Task, build_messages
from tlt_jax.tasks.datasets import make_task

__all__ = ["Problem", "RewardResult", "Task", "build_messages", "make_task"]
