"""The whole RL step of configs/qwen2_5_7b.py on ONE GPU, as a user launches it, with random weights of
Qwen2.5-7B's layer shapes (no model file) and a task on token ids (no tokenizer): what the GPU suite's
`rl_step_7b` phase runs (gpu/rl_step_phases.py, docs/gpu.md) to time the step and its compiles and to compare
its peak memory with the memory plans.

  python -m tlt_jax.main --config configs/qwen2_5_7b_gpu_step.py:layers=4,steps=3 --workdir /tmp/w

Kept from configs/qwen2_5_7b.py (its sections, loaded from the file): GRPO's settings (8 samples per prompt,
T 0.9, low_var_kl, clipping), the trainer's stacked scanned update with remat, FSDP, chunked MLP and logits,
bf16 compute with float32 masters, TLT (the spot trainer training a fresh EAGLE drafter, BEG-MAB over plain
and the paper's EAGLE trees per running-batch bucket), continuous batching under a running-rows cap.
Changed for one GPU and a few minutes: `layers` decoder layers of Qwen2.5-7B (vocabulary, width, heads and
the untied embedding unchanged; `config.model.init=random`), a 1 x 1 mesh, 4 prompts x 8 samples with a cap
of 16 running rows (the other 16 wait and are inserted as rows finish), responses up to 1,024 tokens of
a geometric law with mean 256 (`tasks.synthetic`: the rollout's long tail), one cache bucket (1,536), SD
below 8 running rows, the spot trainer between chunks (one device has no idle data group), 2 PPO
mini-batches per step, the held-out evaluation before the first step and after the last, a checkpoint
only at the end.
Args: layers=N (default 4), steps=N (default 3), tiny (the same sections on a tiny Qwen2 on CPU: the dry run).
"""

import pathlib

from tlt_jax import config_lib
from tlt_jax.models import presets
from tlt_jax.tasks.datasets import task_config


def get_config(arg: str | None = None):
    a = config_lib.parse_arg(arg, layers=4, steps=3, tiny=False)
    c = config_lib.load_config_file(pathlib.Path(__file__).with_name("qwen2_5_7b.py"))
    c.model.init = "random"
    c.model.random = {"num_layers": a.layers}
    vocab = presets.arch_config(c.model.arch).vocab_size
    c.mesh.data, c.mesh.model = 1, 1
    c.num_steps, c.checkpoint_every, c.keep_checkpoints = a.steps, 0, 1
    c.progress_bar, c.log_samples = False, 1
    c.wandb.mode = "disabled"
    c.rl.prompts_per_step, c.rl.samples_per_prompt, c.rl.mini_batches = 4, 8, 2
    new, mean, prompt = 1024, 256, 64
    c.rollout.max_running_rows, c.rollout.kv_budget_gib = 16, 0.0
    c.spec.threshold = 8
    c.spot.mode = "between_chunks"
    c.eval.prompts, c.eval.samples, c.eval.every = 4, 2, a.steps  # before step 1 and after the last
    if a.tiny:  # the CPU dry run: a tiny Qwen2 in float32, short rows, small drafter batches
        c.model.random = dict(config_lib.tiny_random_model("qwen2", num_layers=a.layers))
        c.model.dtype = "float32"
        vocab = c.model.random["vocab_size"]
        new, mean, prompt = 48, 12, 16
        c.rollout.max_running_rows, c.spec.threshold = 8, 4
        c.rl.prompts_per_step = 2
        c.trainer.seq_bucket, c.trainer.logits_chunk, c.trainer.mlp_chunk = 16, 0, 0
        c.spot.window, c.spot.context, c.spot.ce_tokens, c.spot.ttt_steps = 32, 16, 32, 0
        c.spot.max_steps_per_rollout, c.spot.after_rollout_steps = 2, 1
    c.task = task_config("synthetic", vocab_size=vocab, size=256, mean_length=mean, prompt_len=prompt)
    c.rollout.max_new_tokens = new
    c.rollout.max_cache_len = new + 2 * prompt
    c.rollout.min_cache_bucket = c.rollout.max_cache_len  # one cache bucket: few programs to compile
    c.rollout.prompt_bucket = prompt
    c.trainer.micro_batch_size = c.rl.samples_per_prompt  # one group per micro-batch, as the paper config
    return c
