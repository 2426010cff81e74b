"""GRPO on Qwen2.5-7B with the paper's settings (`config_lib.paper_grpo`) on a Cloud TPU slice: bfloat16
compute, float32 masters, the Mosaic tree-verification kernel (`rollout.attn_impl="pallas_tpu"`,
kernels/tree_attention_tpu.py) in the speculative chunks.

  # on every host of the slice (a v5p-8 has one host; a v5e-16 four), after `pip install -e . "jax[tpu]"`:
  TLT_JAX_COORDINATOR=auto python -m tlt_jax.main --config configs/qwen2_5_7b_tpu.py:slice=v5p-8 \\
      --config.model.path=/models/Qwen2.5-7B --workdir gs://bucket/qwen7b   (or a shared local path)

Args: slice=v5p-8 (default) | v5e-16; dataset, steps, runlocal as configs/qwen2_5_7b.py.
The mesh of each slice is the smallest one whose resident state (engine weights, float32 masters, AdamW
moments, reference weights, the spot trainer's drafter state: `tlt_jax.memory_plan.resident`)
leaves most of the HBM to the KV cache; `tests/test_tpu_config.py` recomputes it from abstract shapes:
  v5p-8   4 chips x 95 GiB (JAX sees 4 devices: megacore), one host; data 1 x model 4, 30.0 GiB resident.
  v5e-16  16 chips x 16 GiB over 4 hosts; data 4 x model 4 with the trainer's state also sharded over data
          (trainer.fsdp), 11.4 GiB resident: 4.6 GiB per chip for caches and activations.
A v5e-8 (8 x 16 GiB) cannot hold it: its best mesh (2 x 4, fsdp) needs 17.6 GiB per chip before any cache, so
`slice=v5e-8` is refused with that number, computed there from abstract shapes (`memory_plan.best_mesh`).
Qwen2.5-7B's 28 query and 4 KV heads bound the model axis at 4.
Several hosts: `TLT_JAX_COORDINATOR=auto` lets `jax.distributed` find the slice's hosts from the TPU VM's
metadata (README, "Running on a TPU VM").
"""

from tlt_jax import config_lib, config_schema

# chips JAX sees, HBM per chip (GiB), the (data, model) mesh, trainer.fsdp, hosts
SLICES = {
    "v5p-8": dict(devices=4, hbm_gib=95.0, data=1, model=4, fsdp=False, hosts=1),
    "v5e-16": dict(devices=16, hbm_gib=16.0, data=4, model=4, fsdp=True, hosts=4),
}
# slices refused: chips JAX sees, HBM per chip (GiB)
TOO_SMALL = {"v5e-8": dict(devices=8, hbm_gib=16.0)}


def too_small(name: str, c) -> ValueError:
    """Why slice `name` cannot hold the config: the resident state per chip on its best mesh (trainer state
    sharded over data), computed from abstract shapes (nothing is materialised)."""
    from tlt_jax import memory_plan

    s = TOO_SMALL[name]
    c.trainer.fsdp = True
    gib, data, model = memory_plan.best_mesh(c, s["devices"])
    return ValueError(
        f"slice={name}: Qwen2.5-7B GRPO needs {gib:.1f} GiB per chip on its best mesh "
        f"({data} x {model}, fsdp) before any KV cache; {s['hbm_gib']:g} GiB per chip. "
        "Use slice=v5p-8 or slice=v5e-16."
    )


def get_config(arg: str | None = None):
    arg = config_lib.parse_arg(
        arg, slice="v5p-8", dataset="gsm_symbolic", steps=200, evals="", runlocal=False
    )
    if arg.slice not in SLICES and arg.slice not in TOO_SMALL:
        raise ValueError(f"slice={arg.slice!r}: unknown; known slices: {', '.join(SLICES)}.")
    c = config_lib.paper_grpo(config_schema.base_config(), arg.dataset, arg.steps, arg.evals)
    if arg.slice in TOO_SMALL:
        c.model.arch = "qwen2_5_7b"
        raise too_small(arg.slice, c)
    s = SLICES[arg.slice]
    c.mesh.data, c.mesh.model = s["data"], s["model"]
    c.trainer.fsdp = s["fsdp"]
    c.multiprocess = s["hosts"] > 1
    c.rollout.attn_impl = "pallas_tpu"
    if arg.runlocal:  # the pipeline on a laptop: tiny model, whatever devices exist, the jnp reference
        config_lib.shrink_for_cpu(c, "qwen2")
        c.multiprocess = False
        c.rollout.attn_impl = "auto"
    else:
        c.model.arch = "qwen2_5_7b"  # the checkpoint's shapes are checked; init=random: random weights
    return c
