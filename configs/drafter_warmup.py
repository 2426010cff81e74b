"""Drafter warm-up: train a first EAGLE drafter for a target model on the target's own generations.

    python -m tlt_jax.main --config configs/drafter_warmup.py --workdir workdirs/drafter_warmup

Args (`--config configs/drafter_warmup.py:ARG`): none = SmolLM2-135M-Instruct (the GGUF under the repository's
.cache/models, fetched by `make setup`) on CPU in < 30 min;
"long" = the same target with 6x the data and 9x the training steps (768 prompts x 4 = 3072 sequences, 3600
steps; ~2 h on the 2-core CPU): the drafter behind the >= 2x batch-1 speedup in docs/benchmarks.md;
"tiny" / "runlocal" = a tiny random target with a byte tokenizer and the counting task (seconds; tests);
"tlt" = the drafter for configs/tlt.py (its task, prompts and response cap; < 30 min here);
"policy=/models/Qwen2.5-7B" (an HF directory) = the drafter for configs/qwen2_5_7b.py (pass this workdir as
its drafter_path): that target in bfloat16 on one GPU (the warm-up's engine runs on one device), the paper
config's task and temperature, the :gpu data and steps, 2,048-token responses; the drafter's shape
follows the target's (one EAGLE layer of the target's hidden size and heads).
Every field can be overridden, e.g. `--config.train.steps=400 --config.task.name=gsm_symbolic`.
"""

from __future__ import annotations

import pathlib

import ml_collections

from tlt_jax import config_lib, config_schema

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# policy=DIR: responses generated per prompt (the paper's rollouts reach 32K; the spot trainer trains on the
# first 512 response tokens of each, so the warm-up's data needs no more than a few times that)
RESPONSE_TOKENS = 2048


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = config_lib.parse_arg(arg, preset="", policy="")
    if args.policy:
        if args.preset:
            raise ValueError(f"config arg {arg!r}: policy=DIR is a preset of its own (no {args.preset!r})")
        return policy_config(args.policy)
    return preset_config(args.preset)


def policy_config(path: str) -> ml_collections.ConfigDict:
    """The warm-up of a drafter for configs/qwen2_5_7b.py's target, read from the HF directory `path` (see the
    module docstring): the paper config's task and temperature, sized for a GPU, not for this CPU."""
    c = preset_config("gpu")
    c.model.path = path
    c.model.dtype = "bfloat16"
    paper = config_lib.load_config_file(REPO_ROOT / "configs" / "qwen2_5_7b.py")
    c.task = ml_collections.ConfigDict(paper.task.to_dict())
    c.generation.temperature = paper.rollout.temperature
    c.drafter_eval.temperature = paper.rollout.temperature
    c.generation.max_new_tokens = RESPONSE_TOKENS
    c.generation.max_cache_len = RESPONSE_TOKENS + 1024  # + the longest prompt
    c.generation.chunk_steps = paper.rollout.chunk_steps
    # 32 prompts x 4 = 128 rows per engine call: Qwen2.5-7B KV is 56 KiB per token (28 layers x K,V x 4 heads
    # x 128 x bf16), so 128 rows x 3,072 tokens = 21 GiB beside 14.2 GiB of weights on one 80 GB GPU
    c.generation.batch_prompts = 32
    c.forward.seq_len = c.train.seq_len = c.drafter_eval.seq_len = RESPONSE_TOKENS
    return c


def preset_config(arg: str) -> ml_collections.ConfigDict:
    """The SmolLM2 presets (none, long, gpu, tlt) and the tiny one (see the module docstring)."""
    # The schema's warm-up defaults (tlt_jax.drafter.warmup_config: generation, forward, train, drafter_eval)
    c = config_schema.base_config("drafter_warmup")
    c.model.path = str(DEFAULT_MODEL)  # the target: a .gguf file or HF model directory, OR model.random
    # Prompts for the target's own responses; held-out eval prompts follow the training prompts in the
    # task's seeded order, so they are different problems.
    c.task = ml_collections.ConfigDict(
        dict(
            kind="reasoning_gym",
            name="chain_sum",
            size=5000,
            seed=0,
            dataset_kwargs=ml_collections.ConfigDict(),
        )
    )

    if arg in ("tiny", "runlocal"):
        c.model.path = None
        c.model.random = config_lib.tiny_random_model("llama")
        c.task = ml_collections.ConfigDict({"kind": "counting", "size": 10, "seed": 0})
        c.generation.num_prompts = 4
        c.generation.n = 2
        c.generation.batch_prompts = 2
        c.generation.max_new_tokens = 24
        c.generation.temperature = 1.0
        c.generation.max_cache_len = 128
        c.generation.chunk_steps = 8
        c.forward.rows = 2
        c.forward.seq_len = 128
        c.train.steps = 6
        c.train.warmup = 2
        c.train.lr = 3e-3
        c.train.rows = 2
        c.train.seq_len = 128
        c.train.log_every = 2
        c.train.ce_tokens = 64
        c.train.checkpoint_every = 3
        c.drafter_eval.before = True
        c.drafter_eval.depth = 3
        c.drafter_eval.num_prompts = 2
        c.drafter_eval.n = 2
        c.drafter_eval.temperature = 1.0
        c.drafter_eval.rows = 2
        c.drafter_eval.seq_len = 128
    elif arg == "long":
        # acceptance is bound by data and then by steps (docs/benchmarks.md: 512 -> 3072 sequences and 400 ->
        # 3600 steps take a 3-draft chain's held-out accept length from 1.93 to 2.68)
        c.generation.num_prompts = 768
        c.train.steps = 3600
    elif arg == "gpu":
        # one H100/H200 in minutes (gpu/gpu_suite.py): the :long data and steps, engine batches of 256
        # rows (64 prompts x 4: on a GPU the data costs compiles more than decode steps), float32 like
        # bench_sd's target; a checkpoint every 200 steps, so a run cut by the suite's time budget is
        # finalised at a recent one (rerun with --config.train.steps=<that step>)
        c.generation.num_prompts = 768
        c.generation.batch_prompts = 64
        c.train.steps = 3600
        c.train.checkpoint_every = 200
        c.train.log_every = 50
    elif arg == "tlt":
        # the drafter for configs/tlt.py: the RL task's prompts (its task section, read from that file) and
        # response cap, so the drafter learns the text the RL rollouts produce; the default data and steps
        tlt = config_lib.load_config_file(REPO_ROOT / "configs" / "tlt.py")
        c.task = ml_collections.ConfigDict(tlt.task.to_dict())
        c.generation.max_new_tokens = tlt.rollout.max_new_tokens
        c.generation.max_cache_len = tlt.rollout.max_cache_len
        c.generation.temperature = tlt.rollout.temperature
        c.drafter_eval.temperature = tlt.rollout.temperature
    elif arg:
        raise ValueError(
            f"unknown config arg {arg!r}: use none, 'tiny', 'runlocal', 'long', 'gpu', 'tlt' or policy=HF_DIR"
        )
    return c
