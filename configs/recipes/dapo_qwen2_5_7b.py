"""DAPO on Qwen2.5-7B as VeRL's recipe runs it, with TLT's rollouts: the recipe a researcher brings from VeRL
(recipe/dapo/run_dapo_qwen2.5_32b.sh, test_dapo_7b_math.sh), on one GPU node (tensor-parallel 4 x data 2).

  python -m tlt_jax.main --config configs/recipes/dapo_qwen2_5_7b.py:evals=aime24@/data/aime-2024.parquet \\
      --config.model.path=/models/Qwen2.5-7B --config.task.path=/data/dapo-math-17k.parquet \\
      --workdir /ckpt/dapo7b

The algorithm (`config_lib.dapo_algorithm`): 16 samples per prompt at temperature 1.0, clip 0.2 / 0.28 with
dual-clip 10, token-mean loss, no KL (neither loss nor reward), no entropy bonus, dynamic sampling on the
verdict (up to 10 generation batches of 3x the step's prompts), DAPO's overlong shaping (the last 4,096 of
20,480 response tokens, penalty 1), rewards routed by each row's `data_source` on VeRL's scale
(`math_dapo` -> DAPO's check, -1 / +1), AdamW lr 1e-6 (10 steps of warm-up), weight decay 0.1, grad clip 1,
prompts up to 2,048 tokens (longer ones filtered out at load, counted in the log), evaluation before training
and every 5 steps at T 1.0 / top-p 0.7, ONE sample per row, as VeRL's val_kwargs.n=1: DAPO's AIME-2024 file
(BytedTsinghua-SIA/AIME-2024) holds each of its 30 problems 32 times, so its 960 rows are already avg@32
(loading it says so); for a deduplicated file ask for 32: `evals=aime24@/data/aime.parquet@samples=32`.
TLT is on
(`config_lib.paper_tlt`): speculative rollouts with the drafter of `drafter_path` (n-gram until one is given),
the spot trainer on idle data groups, BEG-MAB; the evaluations decode with speculation too.

Args: evals=NAME@PATH[@KEY=VALUE...]+... (benchmark sets); scale=node (64 prompts a step, generation batches
of 192, 2 mini-batches: one 8-GPU node) or verl (the recipe's 512 / 1,536 / 32-prompt mini-batches: 16 nodes);
steps (VeRL: trainer.total_training_steps); runlocal (the same algorithm on a tiny random model on CPU);
drafter, drafter_path, spot, bandit as configs/qwen2_5_7b.py.
"""

from tlt_jax import config_lib, config_schema

SCALES = {"node": (64, 32), "verl": (512, 32)}  # prompts per step, prompts per mini-batch
MAX_PROMPT, MAX_RESPONSE, OVERLONG = 2048, 20480, 4096


def get_config(arg: str | None = None):
    arg = config_lib.parse_arg(arg, **{**config_lib.PAPER_ARGS, "dataset": "parquet", "scale": "node"})
    if arg.scale not in SCALES:
        raise ValueError(f"scale={arg.scale!r}: use one of {sorted(SCALES)}")
    c = config_lib.paper_grpo(config_schema.base_config(), arg.dataset, arg.steps, arg.evals)
    config_lib.paper_tlt(c, arg.drafter, arg.drafter_path, arg.spot, arg.bandit)
    c.mesh.data, c.mesh.model = -1, 4
    c.rollout.kv_budget_gib = 40.0  # as configs/qwen2_5_7b.py (the rollout memory plan at 2 x 4)
    c.rollout.hidden_window = 8192
    prompts, mini = SCALES[arg.scale]
    c.rl.prompts_per_step, c.rl.mini_batches = prompts, prompts // mini  # VeRL: ppo_mini_batch_size=32
    # eval_samples=1: VeRL's val_kwargs.n=1 on DAPO's AIME file of 32 copies per problem (docstring)
    config_lib.dapo_algorithm(c, samples=16, overlong_buffer=OVERLONG, eval_samples=1)
    c.rollout.max_new_tokens = MAX_RESPONSE
    c.rollout.max_cache_len = MAX_RESPONSE + MAX_PROMPT  # VeRL: data.max_prompt_length=2048
    c.rl.lr, c.rl.weight_decay, c.rl.grad_clip = 1e-6, 0.1, 1.0
    # VeRL's lr_warmup_steps=10 counts RL steps (its scheduler steps once per update_actor); ours counts
    # optimizer updates
    c.rl.warmup_steps = 10 * c.rl.mini_batches
    c.trainer.micro_batch_size = 8  # sub-groups of 8 of a 16-sample group (each with its prompt)
    if arg.evals:
        c.eval.every = 5  # VeRL: trainer.test_freq=5
    c.checkpoint_every = 5  # VeRL: trainer.save_freq=5
    if arg.runlocal:
        config_lib.shrink_for_cpu(c, "qwen2")
        c.rl.prompts_per_step, c.rl.mini_batches, c.rl.warmup_steps = 2, 1, 0
        # generation batches of the step's size: the same programs as configs/qwen2_5_7b.py:runlocal
        c.rl.gen_prompts_per_batch, c.rl.overlong_buffer, c.rl.max_num_gen_batches = 0, 4, 3
        c.rl.filter_metric = "score"  # the counting task's partial credit: groups that vary exist
        c.rl.train_short_steps = True  # a random model: a step short of varied groups trains on what it kept
    else:
        c.model.arch = "qwen2_5_7b"
    return c
