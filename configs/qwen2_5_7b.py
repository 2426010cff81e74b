"""GRPO on Qwen2.5-7B with the paper's settings (`config_lib.paper_grpo`: 8 samples/prompt, T=0.9, low_var_kl
0.001, lr 1e-6, responses up to 32K tokens) for one GPU node: tensor-parallel 4 x data-parallel (the rest).

  python -m tlt_jax.main --config configs/qwen2_5_7b.py --config.model.path=/models/Qwen2.5-7B \\
      --workdir /ckpt/qwen7b [--config.mesh.model=8] [--config.multiprocess=True on several hosts]
TLT is on (`config_lib.paper_tlt`): the rollouts draft with the EAGLE drafter of a warm-up workdir,
  python -m tlt_jax.main --config configs/drafter_warmup.py:policy=/models/Qwen2.5-7B --workdir /ckpt/d7b
  then --config configs/qwen2_5_7b.py:drafter_path=/ckpt/d7b (or --config.drafter.init_from=<an EAGLE
export: python -m tlt_jax.export_drafter>), and with the n-gram drafter until one is given; the spot trainer
trains the EAGLE drafter on the data groups (4-GPU TP groups) whose rows have all finished; BEG-MAB picks each
chunk's mode. At most `rollout.max_running_rows` rows decode per data group (from `kv_budget_gib` below), the
rest of the step's 512 rows wait and are inserted as rows finish.
Args: dataset=parquet (VeRL-layout parquet scored as VeRL scores it, by each row's data_source:
--config.task.path=/data/train.parquet),
jsonl (--config.task.path=/data/x.jsonl) or a reasoning-gym name (default gsm_symbolic); evals=NAME@PATH+...
(benchmark sets, e.g. evals=math500@/data/math500.parquet+aime24@/data/aime24.parquet); steps=N; runlocal
(the same algorithm on a tiny random Qwen2-architecture model on CPU: a pipeline check; the spot trainer
between tail chunks); drafter=auto|eagle|ngram|none (none: the plain GRPO baseline), drafter_path=<warm-up
workdir>, spot=idle_devices|between_chunks|after_rollout|off, bandit=beg_mab|egreedy|ucb1|off (off: SD below
`spec.threshold` = 32 running rows).
Random weights of the same shapes (timing and memory only; GRPO refuses them, it scores text):
`--config.model.init=random`, built on the devices by `config_lib.build_model(config)`;
`experiments/models/memory_plans.py` plans this config's per-device memory from abstract shapes.
"""

from tlt_jax import config_lib, config_schema


def get_config(arg: str | None = None):
    arg = config_lib.parse_arg(arg, **config_lib.PAPER_ARGS)
    c = config_lib.paper_grpo(config_schema.base_config(), arg.dataset, arg.steps, arg.evals)
    config_lib.paper_tlt(c, arg.drafter, arg.drafter_path, arg.spot, arg.bandit)
    c.mesh.data, c.mesh.model = -1, 4
    # KV budget per 80 GB GPU (the memory plans' target: 72 GiB per device) on the 2 x 4 mesh, from the
    # rollout memory plan (docs/journal/2026-11.md, "Rollout memory plan"). KV per row per device at
    # the top cache bucket 35,328: (28 + 1 drafter layer) x K,V x 1 of 4 KV heads x 128 x bf16 x 35,328 =
    # 0.49 GiB. 72 - 17.6 resident (bf16 weights 3.6 + drafter 0.2, float32 masters 3.6, AdamW 7.1,
    # reference 1.8, the spot trainer's drafter state 1.5) - up to 14.1 GiB of temporaries, prompt cache and
    # the rows' other state (an insert of 16 rows per data group) leaves 40.3 GiB: 40 GiB holds 81 rows, so
    # a cap of 64 running rows per data group (31.3 GiB of KV; 128 rows would need 62.5)
    c.rollout.kv_budget_gib = 40.0
    # the spot trainer's data: the target's hidden states of 8,192 response tokens of every row (rows x
    # 8,192 x 3,584 x bf16: 3.5 GiB per device at 64 rows per data group, replicated over the model axis and
    # counted in kv_budget_gib's cap; 0.22 GiB at the default 512; the whole 32K response would take 14 GiB),
    # at a per-row random depth of the response (hidden_span random: [s, s + 8,192), s uniform in [0, 24,576]
    # from the row's key, or the last 8,192 of a response that ends before; so the depths past 8,192 the long
    # tail drafts at are trained on), as one spot.window = 512-token window per sequence at a random depth of
    # that span; on the host they stream to the spot trainer (rollout memory plan: docs/journal/2026-11.md,
    # "Drafter warm-up on the user's data")
    c.rollout.hidden_window = 8192
    c.rollout.hidden_span = "random"
    if arg.runlocal:
        config_lib.shrink_for_cpu(c, "qwen2")
    else:
        c.model.arch = "qwen2_5_7b"  # the checkpoint's shapes are checked; init=random: random weights
    return c
