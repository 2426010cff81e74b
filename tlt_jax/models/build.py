"""The model section of a config -> (model, tokenizer): a checkpoint, a named architecture with random
weights, or a tiny random architecture.

Shared by every job (GRPO, the drafter warm-up, sampling) and below them all: it reads only `config.model`,
`config.seed` and (to refuse text jobs on random weights) `config.job`, so the packages that build models
never import the config library.

    path                    -> weights, config and tokenizer of a .gguf file or HF directory
    arch (+ path)           -> the same, checked against the named shapes (`tlt_jax.models.presets`)
    arch + init=random      -> the named shapes with random weights born on the devices, no tokenizer
                               (timing and memory only; `random` may override fields, e.g. num_layers)
    random                  -> a tiny architecture (ModelConfig fields) with random weights + ByteTokenizer
"""

from __future__ import annotations

import dataclasses
import os

import ml_collections as mlc
from flax import nnx

from tlt_jax.kernels.small_m_linear import LINEAR_IMPLS
from tlt_jax.models import presets
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.llama import Transformer
from tlt_jax.models.random_init import NoTextTokenizer, ShardFn, random_model
from tlt_jax.models.tokenizer import ByteTokenizer, Tokenizer
from tlt_jax.tasks.synthetic import TokenIdCodec, is_token_task, token_codec

DTYPES = ("float32", "bfloat16")
INITS = ("auto", "checkpoint", "random")  # auto: checkpoint with a path, random for a tiny architecture
# jobs that need meaningful text: GRPO scores decoded responses, the warm-up generates data from text prompts
TEXT_JOBS = {
    "grpo": "its rewards are scored on decoded responses",
    "drafter_warmup": "its training data is generated from text prompts",
}
# what build_model_and_tokenizer returns: a real tokenizer, or ids and stop tokens only (random weights)
TextCodec = Tokenizer | NoTextTokenizer | TokenIdCodec  # the last: a token task's ids (tasks.synthetic)


def _linear_impl(config: mlc.ConfigDict) -> str:
    """`config.model.linear_impl`; "auto" for config files written before the field existed."""
    return config.model.get("linear_impl", "auto")


def _arch_init(config: mlc.ConfigDict) -> tuple[str, str]:
    """(config.model.arch, config.model.init), with the defaults of config files older than the fields."""
    return config.model.get("arch", "") or "", config.model.get("init", "auto")


def _weights_hint(arch: str) -> str:
    name = presets.HF_NAMES.get(arch, "the checkpoint").split("/")[-1]
    return f"--config.model.path=/path/to/{name}"


def _arch_problems(config: mlc.ConfigDict, arch: str, init: str, text_jobs: bool) -> list[str]:
    """Problems of a named architecture: weights from a path, or init=random (and then no text job)."""
    path, random = config.model.path, dict(config.model.random)
    if arch not in presets.ARCHS:
        return [f"config.model.arch={arch!r}: use one of {sorted(presets.ARCHS)} (or '' for none)."]
    if init != "random":
        out = []
        if not path:
            out.append(
                "set exactly one of config.model.path (a .gguf file or HF model dir) and config.model.random "
                f"(a tiny architecture), or config.model.init=random with config.model.arch; got path=None, "
                f"arch={arch!r}: its weights with {_weights_hint(arch)}, random weights (timing and memory "
                "only) with --config.model.init=random."
            )
        if random:
            out.append(
                "config.model.random overrides a named architecture's fields only with "
                "config.model.init=random: empty it (the checkpoint fixes the shapes)."
            )
        return out
    out = []
    if path:
        out.append(
            f"config.model.init=random draws random weights but config.model.path={path!r} is set: unset "
            "the path, or load it with --config.model.init=auto."
        )
    job = config.get("job")
    if text_jobs and job in TEXT_JOBS and not is_token_task(config.get("task")):  # ids: no text needed
        out.append(
            f"config.job={job!r} needs meaningful text ({TEXT_JOBS[job]}), but config.model.init=random "
            f"gives {arch} random weights and no tokenizer: train on real weights ({_weights_hint(arch)}); "
            "random weights are for timing and memory (config_lib.build_model, "
            "experiments/models/memory_plans.py)."
        )
    return out


def model_problems(config: mlc.ConfigDict, check_paths: bool = True, *, text_jobs: bool = True) -> list[str]:
    """Problems of `config.model` (its sources: path / arch / random and init; dtype, linear_impl), each
    with its fix. text_jobs: also refuse random weights of a named architecture for a `config.job` that needs
    meaningful text (validation does; the builder does not: building one to time it is fine, and every text
    method of its tokenizer refuses on its own)."""
    out = []
    path, random = config.model.path, dict(config.model.random)
    arch, init = _arch_init(config)
    if init not in INITS:
        out.append(f"config.model.init={init!r}: use one of {INITS}.")
    elif arch:
        out += _arch_problems(config, arch, init, text_jobs)
    elif bool(path) == bool(random):
        out.append(
            "set exactly one of config.model.path (a .gguf file or HF model dir) and config.model.random "
            f"(a tiny architecture); got path={path!r}, random={'set' if random else 'empty'}."
        )
    elif init == "checkpoint" and not path:
        out.append("config.model.init=checkpoint needs config.model.path (a .gguf file or HF model dir).")
    elif init == "random" and path:
        out.append(
            f"config.model.init=random with config.model.path={path!r}: name the shapes with "
            "config.model.arch (random weights) or load the path with --config.model.init=auto."
        )
    if path and check_paths and not os.path.exists(path):
        out.append(
            f"config.model.path={path!r} does not exist: pass --config.model.path=/path/to/model.gguf or "
            "an HF directory (`make setup` fetches SmolLM2 to .cache/models/)."
        )
    if random:
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(random) - fields)
        if unknown:
            out.append(
                f"config.model.random has unknown keys {unknown}; ModelConfig fields: {sorted(fields)}."
            )
    if config.model.dtype not in DTYPES:
        out.append(f"config.model.dtype={config.model.dtype!r}: use one of {DTYPES}.")
    if _linear_impl(config) not in LINEAR_IMPLS:
        out.append(f"config.model.linear_impl={_linear_impl(config)!r}: use one of {LINEAR_IMPLS}.")
    return out


def model_config_from(config: mlc.ConfigDict) -> ModelConfig:
    """The architecture of a named preset (`config.model.arch`, the `random` overrides, dtype, linear_impl),
    without building anything: what the memory plans compile abstractly."""
    arch, _ = _arch_init(config)
    if not arch:
        raise ValueError("model_config_from needs config.model.arch (a named architecture)")
    overrides = dict(config.model.random)
    overrides.update(dtype=config.model.dtype, linear_impl=_linear_impl(config))
    return presets.arch_config(arch, **overrides)


def _checkpoint_model(
    config: mlc.ConfigDict, arch: str, shard_fn: ShardFn | None
) -> tuple[Transformer, Tokenizer]:
    """The model at `config.model.path`: a HF directory is placed tensor by tensor straight into its
    (sharded, with `shard_fn`) device arrays in the model's dtype; a GGUF file (quantised, small) is
    dequantised to float32 on the host and converted there (the engine and the trainer place it)."""
    from tlt_jax.models.llama import from_hf_tensors
    from tlt_jax.models.loading import load_model, open_hf_dir
    from tlt_jax.models.sharded_loading import place_hf_params

    path, dtype = config.model.path, config.model.dtype
    ckpt = open_hf_dir(path, dtype=dtype) if os.path.isdir(path) else load_model(path, dtype=dtype)
    cfg = ckpt.config.replace(linear_impl=_linear_impl(config))
    bad = presets.shape_mismatches(arch, cfg) if arch else []
    if bad:
        raise ValueError(
            f"config.model.path={path!r} is not a {arch}: {'; '.join(bad)}. Fix "
            "config.model.arch (or set it to '' to take the checkpoint's shapes)."
        )
    if os.path.isdir(path):
        return place_hf_params(cfg, ckpt.source, shard_fn), ckpt.tokenizer
    return from_hf_tensors(cfg, ckpt.tensors), ckpt.tokenizer


def build_model_and_tokenizer(
    config: mlc.ConfigDict, shard_fn: ShardFn | None = None
) -> tuple[Transformer, TextCodec]:
    """The policy model and its tokenizer from `config.model` (see the module docstring).

    shard_fn: the parameter layout (`tlt_jax.config_lib.build_model` passes the mesh's) that random-weight
    presets are born in and HF checkpoint directories are read into; GGUF files and tiny models are built
    on the default device (the engine and the trainer place them).
    """
    problems = model_problems(config, check_paths=True, text_jobs=False)
    if problems:
        raise ValueError("invalid config:\n  - " + "\n  - ".join(problems))
    arch, _ = _arch_init(config)
    if config.model.path:
        return _checkpoint_model(config, arch, shard_fn)
    if arch:
        cfg = model_config_from(config)
        eos = [i for i in presets.EOS_TOKEN_IDS if i < cfg.vocab_size] or [cfg.vocab_size - 1]
        fix = f"For text, load real weights: {_weights_hint(arch)}."
        tokenizer = token_codec(config.get("task"), cfg.vocab_size) or NoTextTokenizer(
            cfg.vocab_size, eos, f"config.model.arch={arch!r}", fix
        )
        return random_model(cfg, int(config.seed), shard_fn), tokenizer
    tokenizer = ByteTokenizer()
    cfg = ModelConfig(
        **{**dict(config.model.random), "dtype": config.model.dtype, "linear_impl": _linear_impl(config)}
    )
    if cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"config.model.random.vocab_size={cfg.vocab_size} is smaller than the ByteTokenizer's "
            f"{tokenizer.vocab_size} ids: set it to >= {tokenizer.vocab_size}."
        )
    return Transformer(cfg, nnx.Rngs(params=config.seed)), tokenizer
