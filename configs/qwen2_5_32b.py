"""GRPO on Qwen2.5-32B with the paper's settings (`config_lib.paper_grpo`), for multi-host GPU runs:
tensor-parallel 8 within a node, data-parallel across nodes. The trainer's float32 master weights and AdamW
state are also sharded over the data axis (trainer.fsdp): 32B x 12 bytes does not fit one node's TP group.

  python -m tlt_jax.main --config configs/qwen2_5_32b.py --config.model.path=/models/Qwen2.5-32B \\
      --workdir /ckpt/qwen32b          (run on every host; jax.distributed finds the others)
Args: as configs/qwen2_5_7b.py (dataset, steps, runlocal).
Random weights of the same shapes (timing and memory only; GRPO refuses them, it scores text):
`--config.model.init=random`, built on the devices by `config_lib.build_model(config)`;
`experiments/models/memory_plans.py` plans this config's per-device memory from abstract shapes.
"""

from tlt_jax import config_lib, config_schema


def get_config(arg: str | None = None):
    arg = config_lib.parse_arg(arg, dataset="gsm_symbolic", steps=200, evals="", runlocal=False)
    c = config_lib.paper_grpo(config_schema.base_config(), arg.dataset, arg.steps, arg.evals)
    c.multiprocess = True
    c.mesh.data, c.mesh.model = -1, 8
    c.trainer.fsdp = True
    if arg.runlocal:
        config_lib.shrink_for_cpu(c, "qwen2")
        c.multiprocess = False  # the pipeline on one machine
    else:
        c.model.arch = "qwen2_5_32b"  # the checkpoint's shapes are checked; init=random: random weights
    return c
