"""Default experiment: GRPO on SmolLM2-135M-Instruct, easy reasoning-gym chain_sum, sized for a 2-core CPU.

`make run` = `python -m tlt_jax.main --config configs/default.py --workdir workdirs/default` (< 20 min on the
project's 2-core CPU; the mean reward of the last 3 steps beats the first 3).
Problems: sums/differences of 2-3 numbers with 1-2 digits. Reward: 1 for the right value, read from the
`Answer:` line or else the last number in the response, plus a small bonus for using the `Answer:` format.
Args (`configs/default.py:seed=1,steps=10`): seed, steps, runlocal (a 3-step check of the pipeline).
"""

from tlt_jax import config_lib, config_schema
from tlt_jax.models.loading import DEFAULT_GGUF_PATH

SYSTEM_PROMPT = "You are a calculator. Reply with the result only."
INSTRUCTION = None  # the question alone; the reward reads an `Answer:` line if any, else the last number


def get_config(arg: str | None = None):
    arg = config_lib.parse_arg(arg, seed=0, steps=20, runlocal=False)
    c = config_schema.base_config()
    c.seed = arg.seed
    c.num_steps = 3 if arg.runlocal else arg.steps
    c.checkpoint_every = 5
    c.keep_checkpoints = 2

    c.model.path = str(DEFAULT_GGUF_PATH)
    c.model.dtype = "float32"  # this CPU has no bf16 instructions
    c.mesh.data, c.mesh.model = 1, 1  # one CPU device: fake devices only split the same 2 cores

    c.task = dict(
        kind="reasoning_gym",
        name="chain_sum",
        size=5000,
        seed=arg.seed,
        dataset_kwargs=dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2),
        answer_mode="answer_or_last_number",
        format_reward=0.0,
        system_prompt=SYSTEM_PROMPT,
        instruction=INSTRUCTION,
    )

    c.rollout.temperature = 0.9
    c.rollout.max_new_tokens = 32
    c.rollout.max_cache_len = 256
    c.rollout.chunk_steps = 16
    c.rollout.min_cache_bucket = 64
    c.rollout.prompt_bucket = 16

    c.rl.prompts_per_step = 16  # 64 rollouts per step: 8 left the reward trend at the mercy of sampling noise
    c.rl.samples_per_prompt = 4
    c.rl.advantage = "grpo"
    c.rl.loss_agg = "seq_mean_token_mean"
    c.rl.kl_coef = 0.0
    c.rl.lr = 1e-4
    c.rl.warmup_steps = 0
    c.rl.weight_decay = 0.0
    c.rl.grad_clip = 1.0

    c.trainer.micro_batch_size = 8
    c.trainer.train_layers = 10  # the top 10 of 30 layers: ~2x cheaper update on this CPU
    c.trainer.seq_bucket = 32  # prompts (42-48 tokens) -> 64, responses -> 32: one update program per run
    return c
