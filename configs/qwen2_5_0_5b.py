"""GRPO on Qwen2.5-0.5B with the paper's settings (`config_lib.paper_grpo`) on one GPU (data-parallel over
whatever devices there are, no tensor parallelism): the smallest of the paper-family targets.

  python -m tlt_jax.main --config configs/qwen2_5_0_5b.py --config.model.path=/models/Qwen2.5-0.5B \\
      --workdir /ckpt/qwen05b
Random weights of the same shapes (timing only, e.g. on CPU with --config.model.dtype=float32; GRPO refuses
them, it scores text): `--config.model.init=random`, built by `config_lib.build_model(config)`.
Args: as configs/qwen2_5_7b.py (dataset, steps, runlocal).
"""

from tlt_jax import config_lib, config_schema


def get_config(arg: str | None = None):
    arg = config_lib.parse_arg(arg, dataset="gsm_symbolic", steps=200, evals="", runlocal=False)
    c = config_lib.paper_grpo(config_schema.base_config(), arg.dataset, arg.steps, arg.evals)
    c.mesh.data, c.mesh.model = -1, 1
    if arg.runlocal:
        config_lib.shrink_for_cpu(c, "qwen2")
    else:
        c.model.arch = "qwen2_5_0_5b"  # the checkpoint's shapes are checked; init=random: random weights
    return c
