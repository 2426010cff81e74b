"""GRPO on Qwen2.5-7B with the paper's settings (`config_lib.paper_grpo`: 8 samples/prompt, T=0.9, low_var_kl
0.001, lr 1e-6, responses up to 32K tokens) for one GPU node: tensor-parallel 4 x data-parallel (the rest).

  python -m tlt_jax.main --config configs/qwen2_5_7b.py --config.model.path=/models/Qwen2.5-7B \\
      --workdir /ckpt/qwen7b [--config.mesh.model=8] [--config.multiprocess=True on several hosts]
Args: dataset=parquet (VeRL-layout parquet scored by math-verify: --config.task.path=/data/train.parquet),
jsonl (--config.task.path=/data/x.jsonl) or a reasoning-gym name (default gsm_symbolic); evals=NAME@PATH+...
(benchmark sets, e.g. evals=math500@/data/math500.parquet+aime24@/data/aime24.parquet); steps=N; runlocal
(the same algorithm on a tiny random Qwen2-architecture model on CPU: a pipeline check).
Random weights of the same shapes (timing and memory only; GRPO refuses them, it scores text):
`--config.model.init=random`, built on the devices by `config_lib.build_model(config)`;
`experiments/models/memory_plans.py` plans this config's per-device memory from abstract shapes.
"""

from tlt_jax import config_lib, config_schema


def get_config(arg: str | None = None):
    arg = config_lib.parse_arg(arg, dataset="gsm_symbolic", steps=200, evals="", runlocal=False)
    c = config_lib.paper_grpo(config_schema.base_config(), arg.dataset, arg.steps, arg.evals)
    c.mesh.data, c.mesh.model = -1, 4
    if arg.runlocal:
        config_lib.shrink_for_cpu(c, "qwen2")
    else:
        c.model.arch = "qwen2_5_7b"  # the checkpoint's shapes are checked; init=random: random weights
    return c
