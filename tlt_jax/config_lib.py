"""Config fragments for config files, `parse_arg`, and the builders entry points use.

Config files (`configs/*.py`) start from `config_schema.base_config()` (every key, its type and default,
stated once) and override what they need; `config_schema.parse(config)` makes each section its typed object
and raises one error naming every problem. The fragments here set groups of keys (`paper_grpo`,
`shrink_for_cpu`, `tiny_random_model`); the builders turn a config into objects:

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
from typing import Any

import jax
import ml_collections as mlc
from jax.sharding import Mesh
from ml_collections import config_dict

from tlt_jax import config_schema
from tlt_jax import sharding as shd
from tlt_jax.config_sections import SET_SAMPLING_KEYS
from tlt_jax.models.build import TextCodec, build_model_and_tokenizer
from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.selector_config import MAX_RUNNING, PAPER_BUCKET_BOUNDS, PAPER_BUCKET_TARGETS
from tlt_jax.rollout.strategy import SpecConfig
from tlt_jax.tasks.datasets import task_config

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


def tiny_random_model(architecture: str = "llama", vocab_size: int = 264, **kw: Any) -> mlc.ConfigDict:
    """A `config.model.random` for CPU smoke runs: `tiny_config` fields, vocab covering the ByteTokenizer."""
    cfg = dataclasses.asdict(tiny_config(architecture, vocab_size=vocab_size, **kw))
    cfg.pop("dtype")  # config.model.dtype decides
    return mlc.ConfigDict(cfg)


def _set_value(key: str, raw: str, item: str) -> object:
    """A value of an `evals=` setting: a number for the sampling keys, else a task key's bool or string."""
    if key in SET_SAMPLING_KEYS:
        kind = float if key in ("temperature", "top_p") else int
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"evals item {item!r}: {key}={raw!r} is not {kind.__name__}") from None
    return {"true": True, "false": False}.get(raw.lower(), raw)


def eval_sets(spec: str) -> dict[str, dict[str, object]]:
    """`config.eval.sets` from a config argument: NAME@PATH items joined by '+' (the argument string already
    splits at commas), each optionally followed by @KEY=VALUE settings of that set, e.g.
    "aime24@/data/aime24.parquet@samples=32@temperature=1.0@top_p=0.7+math500@/data/math500.parquet":
    sampling keys (`SET_SAMPLING_KEYS`) or task keys (reward=dapo, prompt=r1, ...). What a set leaves out
    comes from config.eval.samples / temperature / top_p / top_k (VeRL's val_kwargs; command line:
    --config.eval.temperature=1.0), else from the rollout."""
    sets: dict[str, dict[str, object]] = {}
    for item in (x.strip() for x in spec.split("+") if x.strip()):
        parts = item.split("@")
        name, path, settings = parts[0], parts[1] if len(parts) > 1 else "", parts[2:]
        if not path.strip() or not name.strip() or any("=" not in x for x in settings):
            raise ValueError(
                f"evals={spec!r}: write NAME@PATH items joined by '+', each with optional @KEY=VALUE "
                "settings, e.g. aime24@/data/aime.parquet@samples=32@temperature=1.0+math500@/data/m.parquet"
            )
        entry: dict[str, object] = {"path": path.strip()}
        for setting in settings:
            key, _, raw = (x.strip() for x in setting.partition("="))
            entry[key] = _set_value(key, raw, item)
        sets[name.strip()] = entry
    return sets


def paper_grpo(
    c: mlc.ConfigDict, dataset: str = "gsm_symbolic", steps: int = 200, evals: str = ""
) -> mlc.ConfigDict:
    """The TLT reference scripts' GRPO settings for 7B-70B models on GPUs (the paper's setup): 8 samples per
    prompt, temperature 0.9, low_var_kl 0.001 to the initial policy, lr 1e-6, responses up to 32K tokens,
    bfloat16 compute with float32 master weights.

    dataset: "parquet" for VeRL-layout parquet files (DAPO-Math-17k, MATH, GSM8K as VeRL writes them; chat
    prompts, `reward_model.ground_truth`) scored as VeRL scores them, by each row's `data_source`
    (task.reward="verl": tasks.verl_routing), pass --config.task.path=/data/train.parquet
    (a glob or a comma list); "jsonl" for a local question/answer file (--config.task.path=/data/x.jsonl); or
    a reasoning-gym dataset name (generated offline). Every task key can then be set on the command line
    (`tasks.datasets.task_config`), e.g. --config.task.layout=math or --config.task.prompt=r1.
    evals: benchmark sets (`eval_sets`: "math500@PATH+aime24@PATH@samples=32"), evaluated before training,
    every 10 steps and at the end, 16 samples at T = 0.6 unless a set or --config.eval.samples /
    temperature / top_p / top_k say otherwise (mean@k, pass@k, maj@k, best@k).
    """
    c.num_steps = steps
    c.checkpoint_every = 10
    c.keep_checkpoints = 3
    c.model.dtype = "bfloat16"
    c.trainer.master_dtype = "float32"  # AdamW at lr 1e-6 needs float32 master weights
    if dataset in ("parquet", "jsonl"):
        layout = "verl" if dataset == "parquet" else "qa"
        reward = "verl" if dataset == "parquet" else "answer"  # VeRL's routing by the rows' data_source
        c.task = mlc.ConfigDict(task_config(dataset, path="", layout=layout, reward=reward))
        c.task.path = config_dict.placeholder(str)  # required: the run is refused until it is given
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
    c.spec.threshold = 32  # the paper's switch: SD once at most 32 rows run (with a drafter on)

    c.rl.prompts_per_step = 64  # the paper's 7B step: 64 prompts x 8 samples = 512 rollouts
    c.rl.samples_per_prompt = 8
    c.rl.mini_batches = 4  # PPO updates per step (mini-batches of 16 prompts)
    c.rl.advantage = "grpo"
    c.rl.loss_agg = "token_mean"
    c.rl.clip_low = 0.2
    c.rl.clip_high = 0.2
    c.rl.kl_coef = 0.001
    c.rl.lr = 1e-6
    c.rl.warmup_steps = 0
    c.rl.weight_decay = 0.01
    c.rl.grad_clip = 1.0

    if evals:
        c.eval.sets, c.eval.every, c.eval.prompts = eval_sets(evals), 10, 0
        c.eval.samples, c.eval.temperature = 16, 0.6

    c.trainer.micro_batch_size = 8  # one group per micro-batch (its 8 rows split over the data axis)
    c.trainer.seq_bucket = 512
    c.trainer.logits_chunk = 1024  # never materialise [rows, 32K, vocab] logits
    # what makes the 32K-token update fit 72 GiB (memory plan, issue 35): layers scanned and recomputed (remat
    # dots_with_no_batch_dims_saveable needed 235 GiB of temporaries at 32K), masters / AdamW sharded over
    # every device, the MLP in 2,048-token chunks
    c.trainer.scan_layers = True  # compile time nearly flat in depth; remat holds under scan
    c.trainer.remat = "nothing_saveable"
    c.trainer.fsdp = True
    c.trainer.mlp_chunk = 2048
    return c


def dapo_algorithm(
    c: mlc.ConfigDict, samples: int = 16, overlong_buffer: int = 4096, eval_samples: int = 32
) -> mlc.ConfigDict:
    """DAPO's algorithm as VeRL's recipe runs it (recipe/dapo/run_dapo_qwen2.5_32b.sh, test_dapo_7b_math.sh;
    Yu et al. 2025): `samples` per prompt at T 1.0, clip-higher 0.2 / 0.28 with dual-clip 10, token-mean
    loss, GRPO advantages over VeRL's unbiased std, no KL anywhere, no entropy bonus, dynamic sampling on
    the verdict (`acc`, up to 10 generation batches of 3x the step's prompts), overlong shaping over the
    last `overlong_buffer` tokens (penalty 1), rewards routed by the rows' data_source on VeRL's scale (DAPO's
    check -1 / +1), and evaluations at T 1.0 / top-p 0.7 with `eval_samples` samples (the DAPO paper's
    avg@32 on AIME). Sizes, the optimizer and the response cap are the caller's (configs/recipes/)."""
    rl = c.rl
    rl.samples_per_prompt = samples
    rl.advantage, rl.adv_std, rl.loss_agg = "grpo", "unbiased", "token_mean"
    rl.clip_low, rl.clip_high, rl.clip_ratio_c = 0.2, 0.28, 10.0
    rl.kl_coef, rl.reward_kl_coef, rl.entropy_coeff = 0.0, 0.0, 0.0
    rl.dynamic_sampling, rl.filter_metric, rl.max_num_gen_batches = True, "acc", 10
    rl.gen_prompts_per_batch = 3 * rl.prompts_per_step
    rl.overlong_buffer, rl.overlong_penalty = overlong_buffer, 1.0
    c.rollout.temperature, c.rollout.top_p, c.rollout.top_k = 1.0, 1.0, 0
    if c.task.get("kind") in ("parquet", "jsonl"):
        c.task.reward, c.task.reward_scale = "verl", "verl"
    c.eval.samples, c.eval.temperature, c.eval.top_p = eval_samples, 1.0, 0.7
    c.eval.before_train = True
    return c


# the arguments of the paper configs (configs/qwen2_5_{7b,32b}.py): `paper_grpo`'s, runlocal, `paper_tlt`'s
PAPER_ARGS: dict[str, Any] = dict(
    dataset="gsm_symbolic",
    steps=200,
    evals="",
    runlocal=False,
    drafter="auto",
    drafter_path="",
    spot="idle_devices",
    bandit="beg_mab",
)
# BEG-MAB's arms in the paper configs: plain and one EAGLE tree per running-batch bucket of the paper's
# grouping (bs 1 -> 48 tokens to verify, 2-4 -> 32, 5-20 -> 16, >= 21 -> 8; `selector_config`'s
# PAPER_BUCKET_BOUNDS / PAPER_BUCKET_TARGETS), as depth_topk_tokens-to-verify strategies
PAPER_STRATEGIES = ("8_4_48", "6_4_32", "4_4_16", "3_4_8")


def paper_tlt(
    c: mlc.ConfigDict,
    drafter: str = "auto",
    drafter_path: str = "",
    spot: str = "idle_devices",
    bandit: str = "beg_mab",
) -> mlc.ConfigDict:
    """TLT on, as the paper runs it (issue 36, item 5): the rollouts draft with a warmed EAGLE drafter
    (`drafter_path`, a warm-up workdir, or --config.drafter.init_from, an EAGLE export) and with the
    model-free n-gram drafter until one is given ("auto", `rl.speculation.resolve_drafter`); the spot trainer
    trains the EAGLE drafter on the data groups whose rows have all finished (`idle_devices`; a fresh
    drafter when none was warmed); BEG-MAB picks each chunk's mode among plain and one EAGLE tree per
    running-batch bucket (the paper's grouping by tokens to verify). drafter="none": the plain baseline (no
    drafter, nothing to train or choose)."""
    c.drafter.kind = drafter
    c.drafter.path = drafter_path
    plain = drafter == "none"
    c.spot.mode = "off" if plain else spot
    c.bandit.algorithm = "off" if plain else bandit
    c.bandit.arms = ("plain", *PAPER_STRATEGIES)
    c.bandit.bucket_bounds = tuple(b for b in PAPER_BUCKET_BOUNDS if b < MAX_RUNNING)
    c.bandit.all_arms = False  # BEG: per bucket only the tree of its tokens-to-verify target (and plain)
    c.bandit.bucket_targets = PAPER_BUCKET_TARGETS
    return c


def shrink_for_cpu(c: mlc.ConfigDict, architecture: str = "llama") -> mlc.ConfigDict:
    """The `runlocal` switch of cluster configs: same algorithm settings (group size, loss, KL, clipping), but
    a tiny random model of the same architecture (float32, ByteTokenizer), the counting task, short responses,
    2 steps on whatever devices exist, every row at once (no KV budget), the spot trainer between tail chunks
    when the config trains it on idle devices (one CPU device has no idle data groups). It checks the
    pipeline on a laptop, not the learning."""
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
    c.rollout.kv_budget_gib = 0.0  # every row at once: 16 rows of a tiny model
    if c.spot.mode == "idle_devices":  # one CPU device has no idle data groups: train between tail chunks
        c.spot.mode = "between_chunks"
    return c


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
    """`EngineConfig` from `config.rollout` and `spec_config_from` (hidden states recorded whenever the spot
    trainer runs)."""
    spot = config_schema.section(config, "spot")
    rollout = config_schema.section(config, "rollout")
    return rollout.engine_config(spec_config_from(config, drafter_kind), record_hidden=spot.mode != "off")


def spec_config_from(config: mlc.ConfigDict, drafter_kind: str | None = None) -> SpecConfig:
    """`SpecConfig` from `config.spec` and the drafter kind (default `config.drafter.kind`; SD on for "ngram"
    and "eagle", off for "none"; "auto" counts as ngram until the learner resolves it)."""
    spec = config_schema.section(config, "spec")
    return spec if drafter_kind is None else config_schema.spec_for_kind(spec, drafter_kind)


def sampling_from(config: mlc.ConfigDict) -> SamplingParams:
    """`SamplingParams` (temperature / top-k / top-p) from `config.rollout`."""
    return config_schema.section(config, "rollout").sampling()


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
    """A `RolloutEngine` for `model` with `engine_config_from(config, drafter_kind)` (`engine_for`)."""
    ec = engine_config_from(config, drafter_kind)
    return engine_for(ec, model, tokenizer, mesh, drafter=drafter, draft_vocab=draft_vocab)


def engine_for(
    ec: EngineConfig,
    model: Transformer,
    tokenizer: TextCodec,
    mesh: Mesh | None = None,
    *,
    drafter: Drafter | None = None,
    draft_vocab: Any | None = None,
) -> RolloutEngine:
    """A `RolloutEngine` for `model` that stops at the tokenizer's EOS / end-of-turn ids; speculative when
    `ec.spec` is on (an EAGLE spec needs the EAGLE `drafter` model and its `draft_vocab`)."""
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
