"""Drafter warm-up: train a first EAGLE drafter for a target model on the target's own generations.

    python -m tlt_jax.main --config configs/drafter_warmup.py --workdir workdirs/drafter_warmup

Args (`--config configs/drafter_warmup.py:PRESET,key=value,...`). Presets: none = SmolLM2-135M-Instruct (the
GGUF under the repository's .cache/models, fetched by `make setup`) on CPU in < 30 min;
"long" = the same target with 6x the data and 9x the training steps (768 prompts x 4 = 3072 sequences, 3600
steps; ~2 h on the 2-core CPU): the drafter behind the >= 2x batch-1 speedup in docs/benchmarks.md;
"gpu" = the :long data and steps in engine batches of 64 prompts (gpu/suite.py);
"tiny" / "runlocal" = a tiny random target with a byte tokenizer and the counting task (seconds; tests).
The presets that SERVE a GRPO config take its task section (every task key: kind, path, layout, prompt preset,
think, ...), its sampling (temperature, top_p) and its response cap, so the drafter learns the text that
run's rollouts produce:
  "tlt"    = the drafter for configs/tlt.py (SmolLM2 on this CPU, < 30 min; `make warmup`);
  "dapo7b" = the drafter for configs/recipes/dapo_qwen2_5_7b.py (DAPO's prompt, temperature 1.0, its
             20,480-token response cap), otherwise as qwen7b: `dapo7b,policy=DIR,data=PATH`;
  "qwen7b" = the drafter for configs/qwen2_5_7b.py: `policy=DIR` (an HF directory, its shapes checked as the
             GRPO config checks them) in bfloat16 on one GPU (the warm-up's engine runs on one device), the
             :gpu data and steps; `policy=DIR` alone means this preset. (No 32B preset: its 61 GiB of bf16
             weights leave one 80 GB GPU no room for 32K-token rows; configs/qwen2_5_32b.py takes a
             published EAGLE drafter through --config.drafter.init_from.)
  data=PATH: train on a parquet / JSONL file (or glob) instead of the served config's default task, e.g.
             `configs/drafter_warmup.py:qwen7b,policy=/models/Qwen2.5-7B,data=/data/dapo.parquet` (the GRPO
             config's `dataset=parquet` + `--config.task.path=PATH`; tlt: configs/tlt.py's `data=PATH`);
             task keys as the GRPO config's: `--config.task.prompt=r1 --config.task.think=True`.
  dataset=parquet|jsonl|NAME: the qwen presets' GRPO `dataset` arg; parquet / jsonl then need
             --config.task.path=PATH (the run is refused without it).
  response_tokens=N: the response cap of the run the drafter serves (default: the served config's
             rollout.max_new_tokens, 32,768 for the qwen presets; above it is an error: the policy never
             writes longer). The engine records the target's hidden states of whole responses and each
             sequence keeps one window of `forward.seq_len` tokens (2,048 for the qwen presets) at a random
             depth of its response (`warmup_data.cut_sample`).
What a 32K response costs (qwen7b; `rollout_memory_plan.warmup_memory`, journal 2026-11 "Drafter warm-up
on the user's data"): per running row on the GPU 1.86 GiB of KV at the 34,816-token cache plus 0.22 GiB of
recorded hidden states (the cap counts both), so `generation.kv_budget_gib=34` runs 16 of an engine call's
128 rows at once (continuous batching, the rest queued): 33.3 GiB beside 14.2 GiB of weights. Generation: up
to 16x the tokens of 2,048-token responses, decoded at 16 rows instead of 128. Host: the recorded states
stream to the cut as rows finish, at most the 16 running rows' 3.5 GiB at once (not an engine call's 128 x
32K x 7 KiB = 28 GiB); the kept data 3,072 x 2,048 x 7 KiB = 42 GiB (float16).
Training: unchanged per step (rows of forward.seq_len tokens), one window per response.
Every field can be overridden, e.g. `--config.train.steps=400 --config.task.name=gsm_symbolic`.
"""

from __future__ import annotations

import copy
import pathlib

import ml_collections

from tlt_jax import config_lib, config_schema
from tlt_jax.tasks.datasets import task_config

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# the GRPO config each serving preset mirrors, and its architecture preset (the checkpoint's shapes checked)
SERVED = {
    "tlt": ("configs/tlt.py", ""),
    "qwen7b": ("configs/qwen2_5_7b.py", "qwen2_5_7b"),
    "dapo7b": ("configs/recipes/dapo_qwen2_5_7b.py", "qwen2_5_7b"),
}
# the presets whose target is an HF directory (policy=DIR)
POLICY_PRESETS = ("qwen7b", "dapo7b")
# qwen presets: tokens per warm-up sample (a window of a long response; the training rows' length)
SAMPLE_TOKENS = 2048
# tokens of prompt room beside the response for file data on presets that serve no GRPO config
PROMPT_ROOM = 1024


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    first, comma, rest = (arg or "").partition(",")  # a leading bare name is the preset ("tlt,data=x")
    spec = f"preset={first.strip()}{comma}{rest}" if first.strip() and "=" not in first else arg
    args = config_lib.parse_arg(spec, preset="", policy="", data="", dataset="", response_tokens=0)
    preset = args.preset or ("qwen7b" if args.policy else "")
    if args.policy and preset not in POLICY_PRESETS:
        raise ValueError(
            f"config arg {arg!r}: policy=DIR is the target of the {' and '.join(POLICY_PRESETS)} presets, "
            f"not {preset!r}"
        )
    if preset in POLICY_PRESETS and not args.policy:
        raise ValueError(f"config arg {arg!r}: the {preset} preset needs policy=<the HF model directory>")
    if args.response_tokens < 0:
        raise ValueError(f"config arg response_tokens={args.response_tokens}: must be >= 1 (0: the default)")
    if preset not in SERVED:
        if args.dataset:
            raise ValueError(f"config arg dataset={args.dataset!r}: a qwen preset's (use data=PATH here)")
        c = preset_config(preset)
        if args.data:
            c.task = ml_collections.ConfigDict(task_config(file_kind(args.data), path=args.data))
            gen = c.generation
            gen.max_cache_len = max(gen.max_cache_len, gen.max_new_tokens + PROMPT_ROOM)
        if args.response_tokens:
            room = c.generation.max_cache_len - c.generation.max_new_tokens
            c.generation.max_new_tokens = args.response_tokens
            c.generation.max_cache_len = args.response_tokens + room
        return c
    grpo = served_config(preset, args.data, args.dataset)
    c = preset_config("gpu" if args.policy else "")
    serve(c, grpo, args.response_tokens)
    if args.policy:
        policy_config(c, args.policy, SERVED[preset][1], grpo)
    return c


def file_kind(path: str) -> str:
    """The task kind of a data file by its suffix (parquet, else jsonl, as configs/tlt.py's `data=`)."""
    return "parquet" if path.rstrip("*").endswith(".parquet") else "jsonl"


def served_config(preset: str, data: str, dataset: str) -> ml_collections.ConfigDict:
    """The GRPO config a preset serves, with the data arguments as that config takes them."""
    path = REPO_ROOT / SERVED[preset][0]
    if preset == "tlt":
        if dataset:
            raise ValueError(
                f"config arg dataset={dataset!r}: the tlt preset takes data=PATH, as configs/tlt.py"
            )
        return config_lib.load_config_file(path, f"data={data}" if data else None)
    kind = dataset or (file_kind(data) if data else "")
    if data and kind not in ("parquet", "jsonl"):
        raise ValueError(f"config args data={data!r}, dataset={dataset!r}: a data file is parquet or jsonl")
    grpo = config_lib.load_config_file(path, f"dataset={kind}" if kind else None)
    if data:
        grpo.task.path = data
    return grpo


def serve(c: ml_collections.ConfigDict, grpo: ml_collections.ConfigDict, response_tokens: int) -> None:
    """The served GRPO config's task (a copy: every key, required ones still required), sampling and response
    cap (or `response_tokens`, at most that cap) with the same prompt room in the cache."""
    ro = grpo.rollout
    if response_tokens > ro.max_new_tokens:
        raise ValueError(
            f"config arg response_tokens={response_tokens}: the served run's responses stop at "
            f"rollout.max_new_tokens={ro.max_new_tokens}; a drafter trained past them learns text the policy "
            "never writes (use <= that cap, or raise the GRPO config's first)."
        )
    c.task = copy.deepcopy(grpo.task)
    n = response_tokens or ro.max_new_tokens
    c.generation.max_new_tokens = n
    c.generation.max_cache_len = n + (ro.max_cache_len - ro.max_new_tokens)
    c.generation.temperature = c.drafter_eval.temperature = ro.temperature
    c.generation.top_p = ro.top_p


def policy_config(
    c: ml_collections.ConfigDict, path: str, arch: str, grpo: ml_collections.ConfigDict
) -> None:
    """The warm-up of a drafter for a qwen GRPO config's target, read from the HF directory `path` (see the
    module docstring), sized for one GPU, not for this CPU."""
    c.model.path = path
    c.model.arch = arch  # the checkpoint's shapes are checked, as the GRPO config checks them
    c.model.dtype = "bfloat16"
    c.generation.chunk_steps = grpo.rollout.chunk_steps
    # 32 prompts x 4 = 128 rows per engine call, at most 16 decoding at once: Qwen2.5-7B's KV is 56 KiB per
    # token on one device (28 layers x K,V x 4 heads x 128 x bf16), 1.86 GiB per row at 34,816 tokens, plus
    # 0.22 GiB of recorded hidden states (32,768 x 3,584 x bf16; the cap counts both): 16 rows hold 33.3 GiB
    # beside 14.2 GiB of weights (`rollout_memory_plan.warmup_memory`); shorter responses fit more rows
    c.generation.batch_prompts = 32
    c.generation.kv_budget_gib = 34.0
    c.forward.seq_len = c.train.seq_len = c.drafter_eval.seq_len = SAMPLE_TOKENS


def preset_config(arg: str) -> ml_collections.ConfigDict:
    """The SmolLM2 presets (none, long, gpu) and the tiny one (see the module docstring)."""
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
        c.forward.context = 32
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
        # one H100/H200 in minutes (gpu/suite.py): the :long data and steps, engine batches of 256
        # rows (64 prompts x 4: on a GPU the data costs compiles more than decode steps), float32 like
        # bench_sd's target; a checkpoint every 200 steps, so a run cut by the suite's time budget is
        # finalised at a recent one (rerun with --config.train.steps=<that step>)
        c.generation.num_prompts = 768
        c.generation.batch_prompts = 64
        c.train.steps = 3600
        c.train.checkpoint_every = 200
        c.train.log_every = 50
    elif arg:
        raise ValueError(
            f"unknown config arg {arg!r}: use none, 'tiny', 'runlocal', 'long', 'gpu', 'tlt' or 'qwen7b' "
            "(with policy=HF_DIR; policy=HF_DIR alone is qwen7b)"
        )
    return c
