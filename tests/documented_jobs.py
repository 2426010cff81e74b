"""The jobs README.md and the Makefile run, each at smoke size: its own config file, argument and sections
(task, drafter, spec, spot, bandit, loss, mesh), with only the model, the sizes and the step counts shrunk.

`shrink(config)` is the one place that says what "smoke size" changes; everything it leaves alone is what
the documented command runs. `JOBS` lists the commands (`tests/test_documented_jobs.py` runs them through
`tlt_jax.main.run`, the function the command line calls after parsing its flags).
"""

from __future__ import annotations

import dataclasses
import pathlib

import ml_collections as mlc

from tlt_jax import config_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Job:
    """A documented command: `python -m tlt_jax.main --config <config> <overrides> --workdir W`."""

    name: str
    config: str  # "configs/x.py:arg"
    overrides: tuple[tuple[str, object], ...] = ()  # dotted key -> value, as --config.<key>=<value>
    warmed_drafter: bool = False  # drafter.path points at the smoke warm-up's workdir
    data_files: bool = False  # the config's {train} / {test} are parquet files the README's commands write
    hf_dir: bool = False  # model.path is a tiny HF directory of the config's architecture (real checkpoints)
    extended: bool = False  # run by `make test-extended`: its sections are another job's here, at smoke size

    def load(self, **files: str) -> mlc.ConfigDict:
        path, _, arg = self.config.format(**files).partition(":")
        c = config_lib.load_config_file(ROOT / path, arg or None)
        for key, value in self.overrides:
            value = value.format(**files) if isinstance(value, str) else value
            *parents, leaf = key.split(".")
            node = c
            for p in parents:
                node = node[p]
            node[leaf] = value
        return c


# README.md's CPU DAPO command (tlt.py:dapo on a math_dapo parquet file, 3 generation batches at most, the
# test file evaluated); run by tests/test_documented_jobs.py's DAPO test, which checks its metrics. At smoke
# size the random model answers nothing right, so no group survives the filter: train_short_steps lets the
# step train on masked fillers (README's SmolLM2 keeps some) and log what it generated.
EASY = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'  # README.md's $EASY
DAPO_CPU = Job(
    "README dapo on CPU",
    "configs/tlt.py:dapo,steps=4,data={train},eval_data={test}",
    (("rl.max_num_gen_batches", 3), ("rl.train_short_steps", True)),
    data_files=True,
)

# README.md's DAPO on one 8-GPU node: the recipe on the user's parquet file with an AIME-style eval set, the
# model from an HF directory (at smoke size the tiny Qwen2 directory on the data x model 4 mesh of the
# suite's 8 fake CPU devices; the random model answers nothing right, so its steps train on masked fillers)
DAPO_NODE = Job(
    "README dapo recipe on one node",
    "configs/recipes/dapo_qwen2_5_7b.py:evals=aime24@{test}",
    (("task.path", "{train}"), ("rl.train_short_steps", True)),
    data_files=True,
    hf_dir=True,
)
# ... and the drafter warm-up that fits it (one GPU), on the same file
DAPO_WARMUP = Job(
    "README dapo7b drafter warm-up",
    "configs/drafter_warmup.py:dapo7b,policy={hf},data={train}",
    data_files=True,
)

# The warm-up first: the GRPO jobs with drafter=auto/eagle read its workdir, as `make warmup` then `make run`.
WARMUP = Job("make warmup", "configs/drafter_warmup.py:tlt")
JOBS = (
    Job("make run", "configs/tlt.py", warmed_drafter=True),
    Job("tlt drafter=none (plain baseline)", "configs/tlt.py:drafter=none", extended=True),
    Job(
        "tlt eagle arm",
        "configs/tlt.py:drafter=eagle,spot=off,bandit=off",
        warmed_drafter=True,
        extended=True,
    ),
    Job("tlt ngram, quick (e2e arm)", "configs/tlt.py:drafter=ngram,quick"),
    Job("tlt idle-device spot", "configs/tlt.py:spot=idle_devices", (("mesh.data", 2),)),
    Job("default", "configs/default.py"),
    Job("smoke", "configs/smoke.py"),
    Job("qwen2.5-0.5b runlocal", "configs/qwen2_5_0_5b.py:runlocal", extended=True),
    Job("qwen2.5-7b runlocal", "configs/qwen2_5_7b.py:runlocal", extended=True),
    Job("dapo recipe runlocal", "configs/recipes/dapo_qwen2_5_7b.py:runlocal", extended=True),
    # the cluster command's shape: --config.model.path=<HF dir> on the config's tensor-parallel mesh
    Job("qwen2.5-7b from an HF directory", "configs/qwen2_5_7b.py", hf_dir=True, extended=True),
    Job("qwen2.5-32b runlocal", "configs/qwen2_5_32b.py:runlocal", extended=True),
    Job("qwen2.5-7b tpu runlocal", "configs/qwen2_5_7b_tpu.py:runlocal", extended=True),
)


def _architecture(c: mlc.ConfigDict) -> str:
    random = c.model.get("random") or {}
    return str(random.get("architecture", "llama"))


def save_tiny_hf_dir(path: pathlib.Path, architecture: str = "qwen2") -> pathlib.Path:
    """A tiny random Llama / Qwen2 written by transformers (safetensors, 2+ shards and an index) with the
    byte tokenizer: what `--config.model.path=/path/to/Qwen2.5-7B` reads, at smoke size."""
    import torch
    import transformers

    from tlt_jax.models.tokenizer import ByteTokenizer

    kw = dict(vocab_size=264, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    kw |= dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    cls, cfg = {
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
    }[architecture]
    cls(cfg(**kw)).save_pretrained(path, max_shard_size="100KB")
    ByteTokenizer().save(path)
    return path


def shrink(
    c: mlc.ConfigDict, warmup_dir: pathlib.Path | None = None, model_dir: pathlib.Path | None = None
) -> mlc.ConfigDict:
    """Smoke size for either job: a tiny model of the config's architecture (random, or read from the HF
    directory `model_dir`; byte tokenizer), one step (or a few drafter steps), 2 prompts x 2 samples, 8 new
    tokens; what the job does is unchanged."""
    c.model.path = str(model_dir) if model_dir else None
    c.model.arch = None
    c.model.init = "auto"
    c.model.dtype = "float32"
    c.model.random = {} if model_dir else config_lib.tiny_random_model(_architecture(c))
    c.compilation_cache_dir = str(ROOT / ".cache" / "jax_test_cache")
    if c.job == "drafter_warmup":
        return _shrink_warmup(c)
    c.num_steps = 1
    c.checkpoint_every = 1
    c.wandb.mode = "disabled"
    c.rollout.max_new_tokens = 8
    c.rollout.max_cache_len = 1024  # byte-tokenized chat prompts are a few hundred tokens
    c.rollout.min_cache_bucket = 64
    c.rollout.chunk_steps = 4
    c.rl.prompts_per_step = 2
    c.rl.samples_per_prompt = 2
    c.rl.mini_batches = 1
    # dynamic sampling's generation batches as the step's batch (the same programs); DAPO's overlong buffer
    # the last half of the 8 tokens
    c.rl.gen_prompts_per_batch = min(c.rl.gen_prompts_per_batch, 2)
    c.rl.overlong_buffer = min(c.rl.overlong_buffer, 4)
    c.eval.prompts = min(c.eval.prompts, 2)
    c.eval.samples = 1
    c.eval.every = min(c.eval.every, 1)
    for name in c.eval.get("sets") or {}:  # benchmark sets: 2 prompts x 2 samples (maj@2 is a vote)
        c.eval.sets[name].max_prompts = 2
        c.eval.sets[name].samples = min(c.eval.sets[name].get("samples", 1), 2)
    c.trainer.micro_batch_size = 2
    c.trainer.seq_bucket = 16
    c.trainer.logits_chunk = 0
    c.trainer.train_layers = min(c.trainer.train_layers, 1)
    c.spot.max_steps_per_rollout = min(c.spot.max_steps_per_rollout, 2)
    c.spot.after_rollout_steps = min(c.spot.after_rollout_steps, 2)
    c.spot.window, c.spot.context, c.spot.ce_tokens = 64, 32, 32
    # a job without the smoke warm-up sees no drafter (as on a fresh clone), whatever the repository's own
    # workdirs/drafter_tlt holds (a SmolLM2 drafter after `make warmup` does not fit the tiny model)
    c.drafter.path = str(warmup_dir) if warmup_dir is not None else ""
    return c


def _shrink_warmup(c: mlc.ConfigDict) -> mlc.ConfigDict:
    c.generation.num_prompts = 4
    c.generation.n = 2
    c.generation.batch_prompts = 2
    c.generation.max_new_tokens = 8
    c.generation.max_cache_len = 1024
    c.generation.chunk_steps = 4
    c.forward.rows = 2
    c.forward.seq_len = 512
    c.train.steps = 2
    c.train.warmup = 1
    c.train.rows = 2
    c.train.seq_len = 512
    c.train.log_every = 1
    c.train.ce_tokens = 64
    c.train.checkpoint_every = 2
    c.drafter_eval.num_prompts = 2
    c.drafter_eval.n = 1
    c.drafter_eval.rows = 2
    c.drafter_eval.seq_len = 512
    return c
