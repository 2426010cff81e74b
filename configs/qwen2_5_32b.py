"""GRPO on Qwen2.5-32B with the paper's settings (`config_lib.paper_grpo`), for multi-host GPU runs:
tensor-parallel 8 within a node, data-parallel across nodes. The trainer's float32 master weights and AdamW
state are also sharded over the data axis (trainer.fsdp): 32B x 12 bytes does not fit one node's TP group.

  python -m tlt_jax.main --config configs/qwen2_5_32b.py --config.model.path=/models/Qwen2.5-32B \\
      --workdir /ckpt/qwen32b          (run on every host; jax.distributed finds the others)
TLT is on as in configs/qwen2_5_7b.py (`config_lib.paper_tlt`: EAGLE drafter from `drafter_path` or
--config.drafter.init_from, e.g. a published EAGLE-1 drafter for Qwen2.5-32B; n-gram until one is given; the
spot trainer on idle TP groups, from a fresh drafter without one; BEG-MAB).
Args: as configs/qwen2_5_7b.py (dataset, steps, evals, runlocal, drafter, drafter_path, spot, bandit).
Random weights of the same shapes (timing and memory only; GRPO refuses them, it scores text):
`--config.model.init=random`, built on the devices by `config_lib.build_model(config)`;
`experiments/models/memory_plans.py` plans this config's per-device memory from abstract shapes.
"""

from tlt_jax import config_lib, config_schema


def get_config(arg: str | None = None):
    arg = config_lib.parse_arg(arg, **config_lib.PAPER_ARGS)
    c = config_lib.paper_grpo(config_schema.base_config(), arg.dataset, arg.steps, arg.evals)
    config_lib.paper_tlt(c, arg.drafter, arg.drafter_path, arg.spot, arg.bandit)
    c.multiprocess = True
    c.mesh.data, c.mesh.model = -1, 8
    # KV budget per 80 GB GPU on >= 2 nodes (one node, 1 x 8, holds 64.3 GiB of resident state: no room for
    # the rollout): 72 GiB - 37.6 resident on 2 x 8 (`memory_plan.resident`: bf16 weights 7.6 + drafter 0.2,
    # float32 masters 7.6, AdamW 15.3, reference 3.8, the spot trainer's drafter state 3.0) - 16 GiB kept for
    # the programs (the 7B rollout plan's largest such need is 14.1 GiB; the 32B's, with 64 layers, is not
    # planned) leaves 18.4 GiB. KV per row per device at the top cache bucket 35,328: (64 + 1 drafter layer)
    # x K,V x 1 of 8 KV heads x 128 x bf16 x 35,328 = 1.10 GiB: 18 GiB holds 16 rows, a cap of 16 per group
    c.rollout.kv_budget_gib = 18.0
    # the spot trainer's recorded span, as configs/qwen2_5_7b.py at a per-row random depth, but 2,048 tokens:
    # the cap counts the recorded states beside the KV, and 8,192 (80 MiB per row: 1.173 GiB with the KV)
    # would fit 15 rows in 18 GiB, a cap of 8; 2,048 (20 MiB per row) keeps 16 rows (17.8 GiB). Its random
    # depth, not its length, is what covers long responses (one 512-token window per sequence is trained on)
    c.rollout.hidden_window = 2048
    c.rollout.hidden_span = "random"
    c.trainer.fsdp = True
    # one response row per data group per micro-step (sub-groups of a group: `rl.batch.regroup`; on more
    # than two nodes, the data axis's size): by the memory plan the update at 32K-token responses then needs
    # 63.4 GiB per device on 2 x 8, where micro-batches of a whole group of 8 rows need 89.1
    c.trainer.micro_batch_size = 2
    if arg.runlocal:
        config_lib.shrink_for_cpu(c, "qwen2")
        c.multiprocess = False  # the pipeline on one machine
    else:
        c.model.arch = "qwen2_5_32b"  # the checkpoint's shapes are checked; init=random: random weights
    return c
