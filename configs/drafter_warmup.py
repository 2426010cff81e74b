"""Drafter warm-up: train a first EAGLE drafter for a target model on the target's own generations.

    python -m tlt_jax.main --config configs/drafter_warmup.py --workdir workdirs/drafter_warmup
    python -m tlt_jax.drafter.warmup --config configs/drafter_warmup.py --workdir workdirs/drafter_warmup

Args (`--config configs/drafter_warmup.py:ARG`): none = SmolLM2-135M-Instruct (the GGUF under the repository's
.cache/models, fetched by `make setup`) on CPU in < 30 min;
"long" = the same target with 6x the data and 9x the training steps (768 prompts x 4 = 3072 sequences, 3600
steps; ~2 h on the 2-core CPU): the drafter behind the >= 2x batch-1 speedup in docs/benchmarks.md;
"tiny" / "runlocal" = a tiny random target with a byte tokenizer and the counting task (seconds; tests);
"tlt" = the drafter for configs/tlt.py (its task, prompts and response cap; < 30 min here).
Every field can be overridden, e.g. `--config.train.steps=400 --config.task.name=gsm_symbolic`.
"""

from __future__ import annotations

import pathlib

import ml_collections
from ml_collections import config_dict

from tlt_jax import config_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.job = "drafter_warmup"
    c.seed = 0
    c.multiprocess = False
    c.compilation_cache_dir = "auto"  # the persistent XLA cache (utils.compile_stats.resolve_cache_dir)

    # The target: a .gguf file or HF model directory (path), OR a tiny random architecture (random).
    c.model = ml_collections.ConfigDict()
    c.model.path = config_dict.placeholder(str)
    c.model.path = str(DEFAULT_MODEL)
    c.model.random = ml_collections.ConfigDict()
    c.model.dtype = "float32"  # fp32 on CPU (no bf16 instructions); "bfloat16" on GPUs
    c.model.linear_impl = "auto"  # the CPU small-M matmul kernel on one CPU device, XLA elsewhere
    c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1))  # read by tlt_jax.main's validation only

    # Prompts for the target's own responses; held-out eval prompts follow the training prompts in the
    # task's seeded order, so they are different problems.
    c.task = ml_collections.ConfigDict()
    c.task.kind = "reasoning_gym"
    c.task.name = "chain_sum"
    c.task.size = 5000
    c.task.seed = 0
    c.task.dataset_kwargs = ml_collections.ConfigDict()

    c.generation = ml_collections.ConfigDict()
    c.generation.num_prompts = 128  # training prompts (x n samples: the data; acceptance grows with it)
    c.generation.n = 4  # samples per prompt
    c.generation.batch_prompts = (
        16  # prompts per engine call (batch = batch_prompts * n); one cache file each
    )
    c.generation.max_new_tokens = 256
    c.generation.temperature = 0.9  # the RL sampling temperature: the drafter learns the RL distribution
    c.generation.top_p = 1.0
    c.generation.max_cache_len = 1024
    c.generation.chunk_steps = 16
    # the features are the engine's own target states, recorded as it generates (no second forward; the
    # newest token of a response has none, so a sample is prompt + response[:-1]); False: a packed target
    # forward over prompt + response afterwards (`config.forward`)
    c.generation.record_hidden = True

    # Target forward for the hidden states when generation.record_hidden=False: sequences packed into
    # [rows, seq_len] with a block mask (seq_len also caps a sample's length either way).
    c.forward = ml_collections.ConfigDict()
    c.forward.rows = 4
    c.forward.seq_len = 512
    c.forward.hidden_dtype = "float16"  # cache / host storage of the features (packed as float32)

    c.train = ml_collections.ConfigDict()
    c.train.steps = 400
    c.train.lr = 1e-3
    c.train.warmup = 20
    c.train.schedule = "cosine"
    c.train.end_lr_ratio = 0.1
    c.train.rows = 4
    c.train.seq_len = 512
    c.train.w_feat = 1.0  # offline EAGLE warm-up weights (online RL training uses 0.5 / 0.5)
    c.train.w_ce = 0.1
    c.train.weight_decay = 0.0
    c.train.clip_norm = 0.5
    # The LM head (49152 x 576) dominates a step: compute it only at loss positions (-1: sized from the data,
    # 0: all positions) and the soft CE on `ce_tokens` random loss positions per step (0: all of them).
    c.train.max_loss_tokens = -1
    c.train.ce_tokens = 384
    c.train.feature_noise = 0.0  # EAGLE's uniform noise on the input features (width; 0 = off)
    # Training-time test (EAGLE-3 / HASS): also train chain steps 2..ttt_steps + 1 on the drafter's own
    # features, at ttt_positions random loss positions per row, step j's loss weighted ttt_weight^(j-1).
    c.train.ttt_steps = 2
    c.train.ttt_positions = 64
    c.train.ttt_weight = 1.0
    # Soft CE over the draft vocabulary (draft_vocab_size below) only: the head the engine drafts with.
    c.train.ce_draft_vocab = True
    c.train.b1 = 0.9
    c.train.b2 = 0.95
    c.train.log_every = 10
    c.train.checkpoint_every = 50

    # The drafter head's reduced vocabulary (tlt_jax.drafter.draft_vocab): the most frequent generated tokens,
    # saved as drafter/draft_vocab.npy for bench_sd / the engine (0: none).
    c.draft_vocab_size = 8192

    c.eval = ml_collections.ConfigDict()
    c.eval.before = False  # also evaluate the untrained drafter (a baseline of ~1.0; costs ~1-2 min here)
    c.eval.depth = 6
    c.eval.num_prompts = 16
    # Held-out data sampled like the training data (same engine shapes: no extra compiles); drafts are checked
    # against the target's argmax given the true prefix. temperature=0 makes the number exact for greedy SD.
    c.eval.n = 4
    c.eval.temperature = 0.9
    c.eval.rows = 4
    c.eval.seq_len = 512

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
        c.eval.before = True
        c.eval.depth = 3
        c.eval.num_prompts = 2
        c.eval.n = 2
        c.eval.temperature = 1.0
        c.eval.rows = 2
        c.eval.seq_len = 128
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
        c.eval.temperature = tlt.rollout.temperature
    elif arg:
        raise ValueError(f"unknown config arg {arg!r}: use none, 'tiny', 'runlocal', 'long', 'gpu' or 'tlt'")
    return c
