"""Shared config fragments, `parse_arg`, validation with clear messages, and the builders entry points use.

Config files (`configs/*.py`) start from `base_config()` and override what they need; `validate(config)` names
every inconsistent field and the fix. The builders turn a validated config into objects:

    model, tokenizer = build_model_and_tokenizer(config)   # .gguf / HF dir, or a tiny random model
    model, tokenizer = build_model(config, mesh)           # the same; random-weight presets born sharded
    mesh = build_mesh(config)                              # (data, model) mesh from config.mesh
    engine = build_engine(config, model, tokenizer, mesh)  # RolloutEngine with engine_config_from(config)
    sampling = sampling_from(config)                       # SamplingParams from config.rollout

`tlt_jax.main` (training) and `tlt_jax.generate` (sampling) both use them, so keep their signatures stable.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections as mlc
from jax.sharding import Mesh
from ml_collections import config_dict

from tlt_jax import sharding as shd
from tlt_jax.drafter.eagle_format import init_from_problems
from tlt_jax.drafter.spot_trainer import SpotConfig
from tlt_jax.models.build import TextCodec, build_model_and_tokenizer, model_problems
from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.programs import MATMUL_PRECISIONS
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.strategy import SpecConfig

JOBS = ("grpo", "drafter_warmup")
DRAFTER_KINDS = ("none", "ngram", "eagle", "auto")
SPEC_FROM_DRAFTER = ("enabled", "drafter")  # SpecConfig fields that config.drafter.kind decides
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


# ----------------------------------------------------------------------------------------------------------
# parse_arg: the single string after `configs/x.py:` (big_vision style).
# ----------------------------------------------------------------------------------------------------------


def _convert(name: str, raw: str, default: Any) -> Any:
    """Parse `raw` with the type of `default` (bool accepts true/false/1/0; None defaults keep strings)."""
    if isinstance(default, bool):
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"config arg {name}={raw!r}: expected a boolean (true/false/1/0).")
    if default is None or isinstance(default, str):
        return raw
    try:
        return type(default)(raw)
    except ValueError as e:
        raise ValueError(f"config arg {name}={raw!r}: expected {type(default).__name__} ({e}).") from e


def load_config_file(path: str | os.PathLike, arg: str | None = None) -> mlc.ConfigDict:
    """`get_config(arg)` of a config file (`configs/*.py`), for scripts and tests that build a config without
    the command-line flags of `tlt_jax.main`."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"tlt_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def parse_arg(arg: str | None, **defaults: Any) -> mlc.ConfigDict:
    """Parse a config-file argument "runlocal,n=4,name=x" into a ConfigDict over `defaults`.

    A bare name is a boolean flag set to True ("runlocal"); "k=v" is parsed with the type of the default.
    A single bare value that is not a key sets the FIRST default ("x.py:8" with `n=1` first gives n=8).
    Unknown names raise a ValueError listing the valid ones.
    """
    out = mlc.ConfigDict(dict(defaults))
    arg = (arg or "").strip()
    if not arg:
        return out
    parts = [p.strip() for p in arg.split(",") if p.strip()]
    if len(parts) == 1 and "=" not in parts[0] and parts[0] not in defaults and defaults:
        parts = [f"{next(iter(defaults))}={parts[0]}"]
    for part in parts:
        name, eq, raw = part.partition("=")
        name = name.strip()
        if name not in defaults:
            raise ValueError(
                f"unknown config arg {name!r} in {arg!r}; valid args: {sorted(defaults)} "
                "(e.g. 'runlocal,n=4')."
            )
        if not eq and not isinstance(defaults[name], bool):
            raise ValueError(f"config arg {name!r} needs a value: write {name}=<value>.")
        out[name] = _convert(name, raw if eq else "true", defaults[name])
    return out


# ----------------------------------------------------------------------------------------------------------
# Fragments
# ----------------------------------------------------------------------------------------------------------


def base_config() -> mlc.ConfigDict:
    """Every field the GRPO learner reads, with neutral defaults; config files override what they need.

    Sections: model (what to load), mesh, task (kwargs of `tlt_jax.tasks.make_task`), rollout (engine +
    sampling), drafter (what drafts for speculative rollouts), spec (how: strategy, threshold, acceptance), rl
    (GRPO algorithm + optimizer), trainer (shapes/batching of the learner's forward and backward), wandb. The
    sections with many fields are built by the `_*_section` functions below.
    """
    c = mlc.ConfigDict()
    c.job = "grpo"  # "grpo" | "drafter_warmup"
    c.seed = 0
    c.multiprocess = False  # jax.distributed.initialize() before anything touches a device
    c.num_steps = 10
    c.checkpoint_every = 5  # save every k steps (and always at the end / on SIGTERM); 0: only then
    c.keep_checkpoints = 2
    c.log_every = 1  # console summary line every k steps (metrics.jsonl gets every step)
    c.progress_bar = True  # tqdm rollout bar (shown only on a TTY)
    c.log_samples = 2  # responses per step written to workdir/samples.jsonl (and the first to the console)
    # persistent XLA compilation cache: "auto" = $TLT_JAX_COMPILATION_CACHE, else ~/.cache/tlt_jax/xla (shared
    # by the runs on a machine: a rerun of a config compiles nothing); a folder; or "" (off)
    c.compilation_cache_dir = "auto"
    c.model = _model_section()
    c.mesh = mlc.ConfigDict(dict(data=-1, model=1))  # data=-1: all remaining devices
    c.task = mlc.ConfigDict(dict(kind="counting"))
    c.rollout = _rollout_section()
    # What drafts for the rollouts (tlt_jax.rl.speculation): "none" (plain decoding), "ngram" (model-free,
    # TLT-Base), "eagle" (a warmed drafter: `path`, a warm-up workdir, or `init_from`, an EAGLE export), or
    # "auto" (eagle when `path` holds one, else ngram). min_accept_len: the acceptance-collapse alarm's floor.
    c.drafter = mlc.ConfigDict(dict(kind="none", path="", init_from="", min_accept_len=1.05))
    # How speculative rollouts run (rollout.strategy.SpecConfig minus what `drafter` decides)
    c.spec = mlc.ConfigDict(
        {k: v for k, v in dataclasses.asdict(SpecConfig()).items() if k not in SPEC_FROM_DRAFTER}
    )
    # The spot trainer (tlt_jax.drafter.spot_trainer): the EAGLE drafter trained online during the rollout on
    # idle devices ("idle_devices"), between tail chunks on one device ("between_chunks"), after the rollout
    # ("after_rollout"), or not at all ("off")
    c.spot = mlc.ConfigDict(dataclasses.asdict(SpotConfig()))
    c.bandit = _bandit_section()
    # Held-out evaluation (tlt_jax.rl.evaluation): the same problems and sampling keys before training and
    # every `every` steps, a paired measure of learning; 0 = off
    c.eval = mlc.ConfigDict(dict(every=0, prompts=16, samples=2))
    c.rl = _rl_section()
    c.trainer = _trainer_section()
    c.wandb = mlc.ConfigDict()
    c.wandb.mode = config_dict.placeholder(str)  # None: $WANDB_MODE, else offline
    c.wandb.project = "tlt_jax"
    c.wandb.name = config_dict.placeholder(str)
    return c


def _model_section() -> mlc.ConfigDict:
    """`config.model`: what to load (a checkpoint path, a tiny random architecture or a named one), in which
    dtype, with which projection kernels."""
    m = mlc.ConfigDict()
    m.path = config_dict.placeholder(str)  # a .gguf file or a HF model directory
    m.random = mlc.ConfigDict()  # OR tiny random architecture (ModelConfig fields) + ByteTokenizer
    # OR a named architecture (tlt_jax.models.presets: qwen2_5_0_5b / 1_5b / 7b / 32b): with `path` it checks
    # the checkpoint's shapes; with init="random" it is built with random weights born sharded on the devices
    # and no tokenizer: timing and memory only, jobs that need text refuse it (`random` may override fields)
    m.arch = ""
    m.init = "auto"  # "auto" | "checkpoint" (weights from `path`) | "random"
    m.dtype = "float32"  # "bfloat16" on GPUs (this CPU has no bf16 instructions: use float32)
    # projections: "auto" (the CPU small-M kernel on one CPU device, else XLA), "xla", "cpu_ffi"
    m.linear_impl = "auto"
    return m


def _rollout_section() -> mlc.ConfigDict:
    """`config.rollout`: the engine (lengths, buckets, chunking, kernels, stop strings, recorded hidden
    states) and the sampling (temperature, top-k, top-p)."""
    r = mlc.ConfigDict()
    r.temperature = 1.0
    r.top_k = 0
    r.top_p = 1.0
    r.max_new_tokens = 256
    r.max_cache_len = 1024
    r.chunk_steps = 16
    r.min_cache_bucket = 64
    r.prompt_bucket = 16
    r.compact = True
    # "auto": Pallas on GPU, the CPU FFI kernel on one CPU device, else the jnp reference
    r.attn_impl = "auto"
    # dots in the rollout programs: "auto" = full float32 for float32 models whatever the process default
    # (lossless coupled verification on GPUs, whose default is TF32), the process default for bfloat16
    r.matmul_precision = "auto"
    r.stop_strings = ()
    # the target's hidden states of the prompt and the first `hidden_window` response tokens of every sequence
    # (drafter training data; recorded whenever the spot trainer runs)
    r.record_hidden = False
    r.hidden_window = 512
    return r


def _bandit_section() -> mlc.ConfigDict:
    """`config.bandit`, the adaptive engine (tlt_jax.rollout.adaptive): a selector picks each chunk's mode
    among `arms` ("plain", EAGLE strategies "3_1_4", n-gram "ngram_4_1_5") per running-batch bucket; "off":
    the SpecConfig threshold switch."""
    return mlc.ConfigDict(
        dict(
            algorithm="off",  # off | beg_mab | egreedy | ucb1 | fixed | sglang | threshold
            arms=("plain", "3_1_4"),
            bucket_bounds=(1, 2, 4, 8),  # inclusive upper bounds of the running-row buckets (+ the rest)
            all_arms=True,  # every arm in every bucket (False: BEG-MAB's grouping by tokens_to_verify)
            bucket_targets=(),
            epsilon=0.1,
            window=64,  # beg_mab / ucb1: the bucket's last 64 chunks
            min_plays=3,  # beg_mab: chunks an arm needs in the window before its median is trusted
            fixed_table=(),
            threshold=32,
            min_steps_below=10,
            sd_arm="",
            sglang_ladder=(),
        )
    )


def _rl_section() -> mlc.ConfigDict:
    """`config.rl`: the GRPO algorithm (group size, advantages, loss aggregation, clipping, KL) and the
    optimizer (AdamW, warm-up, clipping)."""
    r = mlc.ConfigDict()
    r.prompts_per_step = 8
    r.samples_per_prompt = 8  # GRPO group size
    r.advantage = "grpo"  # grpo | drgrpo (see tlt_jax.rl.grpo.ADVANTAGE_METHODS)
    r.adv_eps = 1e-6
    r.loss_agg = "seq_mean_token_mean"  # token_mean (DAPO) | seq_mean_token_mean | seq_mean_token_sum_norm
    r.clip_low = 0.2
    r.clip_high = 0.2  # DAPO clip-higher: 0.28
    r.dynamic_sampling = False  # DAPO: groups with equal rewards are masked out of the loss
    r.kl_coef = 0.0  # low_var_kl to the frozen initial policy; 0 skips the reference forward
    r.mini_batches = 1  # optimizer updates per RL step (PPO mini-batches over the step's samples)
    r.lr = 1e-6
    r.warmup_steps = 0  # linear warm-up in optimizer updates
    r.weight_decay = 0.01
    r.b1 = 0.9
    r.b2 = 0.999
    r.grad_clip = 1.0  # global-norm clip; 0 disables
    return r


def _trainer_section() -> mlc.ConfigDict:
    """`config.trainer`: shapes and batching of the learner's forward and backward, and what it trains."""
    t = mlc.ConfigDict()
    t.micro_batch_size = 8  # rows per forward/backward (gradient accumulation over micro-batches)
    t.seq_bucket = 32  # prompt/response lengths are padded to multiples of this (fewer compiles)
    t.fuse_old_logprobs = True  # with one mini-batch, take old log-probs from the update's forward
    t.logits_chunk = 0  # compute response logits in chunks of this many positions (0: at once)
    t.master_dtype = "float32"  # optimizer/master weights (the model computes in model.dtype)
    t.fsdp = False  # also shard the trainer's params/optimizer state over the data axis (ZeRO-3-like)
    t.train_layers = 0  # 0: train every parameter; K: only the top K decoder layers + final norm
    return t


def tiny_random_model(architecture: str = "llama", vocab_size: int = 264, **kw: Any) -> mlc.ConfigDict:
    """A `config.model.random` for CPU smoke runs: `tiny_config` fields, vocab covering the ByteTokenizer."""
    cfg = dataclasses.asdict(tiny_config(architecture, vocab_size=vocab_size, **kw))
    cfg.pop("dtype")  # config.model.dtype decides
    return mlc.ConfigDict(cfg)


def paper_grpo(c: mlc.ConfigDict, dataset: str = "gsm_symbolic", steps: int = 200) -> mlc.ConfigDict:
    """The TLT reference scripts' GRPO settings for 7B-70B models on GPUs (the paper's setup): 8 samples per
    prompt, temperature 0.9, low_var_kl 0.001 to the initial policy, lr 1e-6, responses up to 32K tokens,
    bfloat16 compute with float32 master weights.

    dataset: a reasoning-gym dataset name (generated offline), or "jsonl" for a local GSM8K/MATH-style file
    (then pass --config.task.path=/data/train.jsonl).
    """
    c.num_steps = steps
    c.checkpoint_every = 10
    c.keep_checkpoints = 3
    c.model.dtype = "bfloat16"
    c.trainer.master_dtype = "float32"  # AdamW at lr 1e-6 needs float32 master weights
    if dataset == "jsonl":
        c.task = mlc.ConfigDict(
            dict(kind="jsonl", path=config_dict.placeholder(str), answer_mode="answer", format_reward=0.0)
        )
    else:
        c.task = mlc.ConfigDict(
            dict(kind="reasoning_gym", name=dataset, size=100_000, seed=0, answer_mode="answer")
        )

    c.rollout.temperature = 0.9
    c.rollout.top_p = 1.0
    c.rollout.max_new_tokens = 32768
    c.rollout.max_cache_len = 32768 + 2048  # responses + the longest prompt
    c.rollout.chunk_steps = 64
    c.rollout.min_cache_bucket = 1024
    c.rollout.prompt_bucket = 128
    c.rollout.attn_impl = "auto"  # the Pallas kernel on GPU

    c.rl.prompts_per_step = 128
    c.rl.samples_per_prompt = 8
    c.rl.mini_batches = 4  # PPO updates per step (mini-batches of 32 prompts)
    c.rl.advantage = "grpo"
    c.rl.loss_agg = "token_mean"
    c.rl.clip_low = 0.2
    c.rl.clip_high = 0.2
    c.rl.kl_coef = 0.001
    c.rl.lr = 1e-6
    c.rl.warmup_steps = 0
    c.rl.weight_decay = 0.01
    c.rl.grad_clip = 1.0

    c.trainer.micro_batch_size = 8  # one group per micro-batch
    c.trainer.seq_bucket = 512
    c.trainer.logits_chunk = 1024  # never materialise [rows, 32K, vocab] logits
    return c


def shrink_for_cpu(c: mlc.ConfigDict, architecture: str = "llama") -> mlc.ConfigDict:
    """The `runlocal` switch of cluster configs: same algorithm settings (group size, loss, KL, clipping), but
    a tiny random model of the same architecture (float32, ByteTokenizer), the counting task, short responses,
    2 steps on whatever devices exist. It checks the pipeline on a laptop, not the learning."""
    c.num_steps = 2
    c.checkpoint_every = 1
    c.model.path = None
    c.model.random = tiny_random_model(architecture)
    c.model.dtype = "float32"
    c.mesh.data, c.mesh.model = -1, 1
    c.task = mlc.ConfigDict(dict(kind="counting", size=8, seed=c.seed))
    c.rollout.max_new_tokens = 16
    c.rollout.max_cache_len = 128
    c.rollout.min_cache_bucket = 16
    c.rollout.chunk_steps = 8
    c.rl.prompts_per_step = 2
    c.rl.mini_batches = 1
    c.trainer.micro_batch_size = c.rl.samples_per_prompt
    c.trainer.seq_bucket = 16
    c.trainer.logits_chunk = 0
    c.trainer.fsdp = False
    c.trainer.train_layers = 0
    return c


# ----------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------


def fail(problems: list[str]) -> None:
    """Raise one ValueError listing every problem (no-op when there is none)."""
    if problems:
        raise ValueError("invalid config:\n  - " + "\n  - ".join(problems))


def rollout_problems(config: mlc.ConfigDict, check_paths: bool = True) -> list[str]:
    """Problems of the rollout, drafter and spec sections (shared by every job that samples)."""
    out = []
    ro = config.rollout
    if not 0 < ro.top_p <= 1 or ro.top_k < 0:
        out.append(f"config.rollout.top_p={ro.top_p} / top_k={ro.top_k}: need 0 < top_p <= 1, top_k >= 0.")
    if ro.max_new_tokens < 1 or ro.max_cache_len <= ro.max_new_tokens:
        out.append(
            f"config.rollout.max_new_tokens={ro.max_new_tokens} / max_cache_len={ro.max_cache_len}: need "
            "max_new_tokens >= 1 and max_cache_len > max_new_tokens + the longest prompt."
        )
    if ro.get("matmul_precision", "auto") not in MATMUL_PRECISIONS:
        out.append(
            f"config.rollout.matmul_precision={ro.matmul_precision!r}: use one of {MATMUL_PRECISIONS} (auto: "
            "full float32 dots for float32 models, the process default for bfloat16)."
        )
    dr = config.get("drafter")
    if dr is not None:
        if dr.kind not in DRAFTER_KINDS:
            out.append(f"config.drafter.kind={dr.kind!r}: use one of {DRAFTER_KINDS}.")
        if dr.kind == "eagle" and not dr.path and not dr.get("init_from"):
            out.append(
                "config.drafter.kind=eagle needs config.drafter.path: a drafter warm-up workdir (create one "
                "with `python -m tlt_jax.main --config configs/drafter_warmup.py:tlt --workdir DIR`)."
            )
        elif dr.kind == "eagle" and dr.path and check_paths and not os.path.exists(dr.path):
            out.append(
                f"config.drafter.path={dr.path!r} does not exist: create it with `python -m tlt_jax.main "
                f"--config configs/drafter_warmup.py:tlt --workdir {dr.path}`, or use drafter.kind=ngram."
            )
        if dr.min_accept_len < 0:
            out.append(
                f"config.drafter.min_accept_len={dr.min_accept_len}: must be >= 0 (0 disables the alarm)."
            )
        out.extend(init_from_problems(dr, check_paths))
    try:
        spec_config_from(config)
    except ValueError as e:
        out.append(str(e))
    return out


def validate(config: mlc.ConfigDict, check_paths: bool = True) -> None:
    """Raise one ValueError listing every problem of the shared sections of `config` (with the field and
    the fix): job, model, mesh, and rollout / drafter / spec when present. A job validates its own sections
    on top (`tlt_jax.rl.config.validate_grpo` for GRPO).

    `check_paths=False` skips filesystem checks (cluster configs validated on a laptop).
    """
    problems = []
    if config.job not in JOBS:
        problems.append(f"config.job={config.job!r}: use one of {JOBS}.")
    problems += model_problems(config, check_paths)
    if config.mesh.model < 1 or (config.mesh.data < 1 and config.mesh.data != -1):
        problems.append(
            f"config.mesh data={config.mesh.data}, model={config.mesh.model}: need model >= 1 and data >= 1 "
            "(or -1 for all remaining devices)."
        )
    if "rollout" in config:
        problems += rollout_problems(config, check_paths)
    fail(problems)


# ----------------------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------------------


def build_mesh(config: mlc.ConfigDict) -> Mesh:
    """The (data, model) mesh of `config.mesh` over all visible devices (all hosts in a multi-process run)."""
    return shd.make_mesh(data=config.mesh.data, model=config.mesh.model, devices=jax.devices())


def build_model(config: mlc.ConfigDict, mesh: Mesh | None = None) -> tuple[Transformer, TextCodec]:
    """`build_model_and_tokenizer`, with a random-weight architecture (`config.model.arch` and
    `init=random`) born on the devices of `mesh` (default `build_mesh(config)`) in the rollout engine's
    parameter layout: a 7B or 32B policy never passes through the host."""
    mesh = build_mesh(config) if mesh is None else mesh
    return build_model_and_tokenizer(config, shard_fn=lambda params: shd.param_shardings(params, mesh))


def engine_config_from(config: mlc.ConfigDict, drafter_kind: str | None = None) -> EngineConfig:
    """`EngineConfig` from `config.rollout` (buckets, chunking, lengths, stop strings) and the speculative
    sections (`spec_config_from`)."""
    ro = config.rollout
    return EngineConfig(
        max_new_tokens=ro.max_new_tokens,
        max_cache_len=ro.max_cache_len,
        chunk_steps=ro.chunk_steps,
        min_cache_bucket=ro.min_cache_bucket,
        prompt_bucket=ro.prompt_bucket,
        compact=ro.compact,
        attn_impl=ro.attn_impl,
        matmul_precision=str(ro.get("matmul_precision", "auto")),
        stop_strings=tuple(ro.stop_strings),
        spec=spec_config_from(config, drafter_kind),
        record_hidden=bool(ro.get("record_hidden", False))
        or config.get("spot", {}).get("mode", "off") != "off",
        hidden_window=int(ro.get("hidden_window", 512)),
    )


def spec_config_from(config: mlc.ConfigDict, drafter_kind: str | None = None) -> SpecConfig:
    """`SpecConfig` from `config.spec` (strategy, threshold, acceptance, n-gram settings) and the drafter kind
    (default `config.drafter.kind`; "auto" must be resolved first: `tlt_jax.rl.speculation`): SD is on for
    "ngram" and "eagle", off for "none"."""
    kind = drafter_kind or (config.drafter.kind if "drafter" in config else "none")
    if kind == "auto":
        kind = "ngram"  # validation only: the learner resolves "auto" against the drafter path
    fields = dict(config.spec)
    try:
        return SpecConfig(
            **fields, enabled=kind in ("ngram", "eagle"), drafter="eagle" if kind == "eagle" else "ngram"
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.spec is invalid: {e}") from e


def sampling_from(config: mlc.ConfigDict) -> SamplingParams:
    """`SamplingParams` (temperature / top-k / top-p) from `config.rollout`."""
    ro = config.rollout
    return SamplingParams(temperature=float(ro.temperature), top_k=int(ro.top_k), top_p=float(ro.top_p))


def build_engine(
    config: mlc.ConfigDict,
    model: Transformer,
    tokenizer: TextCodec,
    mesh: Mesh | None = None,
    *,
    drafter_kind: str | None = None,
    drafter: Drafter | None = None,
    draft_vocab: Any | None = None,
) -> RolloutEngine:
    """A `RolloutEngine` for `model` that stops at the tokenizer's EOS / end-of-turn ids; speculative for
    drafter kinds "ngram" and "eagle" (which needs the EAGLE `drafter` model and its `draft_vocab`)."""
    ec = engine_config_from(config, drafter_kind)
    if ec.spec.enabled and ec.spec.drafter == "eagle" and drafter is None:
        raise ValueError(
            "config.drafter.kind=eagle needs an EAGLE drafter model, and none was given: load it with "
            "tlt_jax.rl.speculation.resolve_drafter, or use --config.drafter.kind=ngram (model-free)."
        )
    return RolloutEngine(
        model,
        ec,
        eos_ids=list(tokenizer.eos_token_ids),
        mesh=mesh,
        tokenizer=tokenizer,
        drafter=drafter,
        draft_vocab=draft_vocab,
    )


def to_dict(config: mlc.ConfigDict | Mapping[str, object]) -> dict[str, Any]:
    """Plain nested dict of a ConfigDict (or Mapping), for config.json and wandb."""
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return {k: to_dict(v) if isinstance(v, Mapping) else v for k, v in dict(config).items()}
