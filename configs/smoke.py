"""Smoke config: a tiny random Llama + ByteTokenizer on the counting task; a few seconds per step on CPU.

Used by the tests (end to end through `tlt_jax.main`, resume, preemption); its reward starts near 0 and
rises after ~10 steps (`:steps=20`). Run it:
  python -m tlt_jax.main --config configs/smoke.py --workdir workdirs/smoke
Args (`configs/smoke.py:steps=2,kl=0.001,spec=true`): steps, kl (coefficient of the low_var_kl term), spec
(speculative rollouts with the model-free n-gram drafter, on for the whole rollout); runlocal is accepted
and changes nothing (this config is already local).
"""

from tlt_jax import config_lib, config_schema


def get_config(arg: str | None = None):
    arg = config_lib.parse_arg(arg, steps=4, kl=0.0, spec=False, runlocal=False)
    c = config_schema.base_config()
    c.seed = 0
    c.num_steps = arg.steps
    c.checkpoint_every = 2
    c.keep_checkpoints = 3
    c.progress_bar = False

    c.model.random = config_lib.tiny_random_model("llama")

    c.task = dict(kind="counting", size=8, seed=0, digits="7")  # one target: learnable in ~15 steps

    c.rollout.temperature = 1.0
    c.rollout.max_new_tokens = 16
    c.rollout.max_cache_len = 128
    c.rollout.chunk_steps = 8
    c.rollout.min_cache_bucket = 16

    c.drafter.kind = "ngram" if arg.spec else "none"
    c.drafter.min_accept_len = 0.0  # a random model's text gives the n-gram drafter nothing to copy
    c.spec.strategy = "3_1_4"
    c.spec.threshold = 1024  # >= the batch: SD for the whole rollout
    c.spec.min_steps_below = 0

    c.rl.prompts_per_step = 2
    c.rl.samples_per_prompt = 8
    c.rl.lr = 1e-2
    c.rl.weight_decay = 0.0
    c.rl.kl_coef = arg.kl
    c.rl.warmup_steps = 0

    c.trainer.micro_batch_size = 8  # 2 micro-batches: gradient accumulation
    c.trainer.seq_bucket = 16
    c.wandb.mode = "disabled"
    return c
