"""Load Llama/Qwen2 checkpoints (GGUF files or HF safetensors directories) as float32 numpy tensors.

Every loader returns a `LoadedModel`: a `ModelConfig`, the tensors under HF Llama names in HF layouts
(projections are [out, in]), and the model's `Tokenizer`. Converting to the Flax model's parameter tree is the
model code's job; keeping HF names here makes every source directly comparable with transformers' state dict.

A HF directory can also be opened without reading any weight (`open_hf_dir`: config, tensor headers checked
against it, tokenizer) and placed straight onto the devices in the model's dtype and sharding
(`tlt_jax.models.sharded_loading.place_hf_params`): what `build.build_model_and_tokenizer` does, so a 7B
checkpoint never passes through the host as float32. GGUF files (quantised, small) keep the float32 path.

GGUF specifics: tensors are dequantized with `gguf.quants.dequantize` (Q4_1, Q8_0, K-quants, F16, BF16, ...),
and for the llama architecture the q/k projection rows are un-permuted: llama.cpp's converter reorders them so
that its interleaved ("GPT-J") RoPE matches HF's half-split ("NeoX") RoPE. Qwen2 GGUFs are not permuted.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.gguf import GGUFFile, PathLike, missing_path_error, read_gguf
from tlt_jax.models.safetensors_io import SafetensorsDir, TensorInfo
from tlt_jax.models.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_PATH = REPO_ROOT / ".cache" / "models" / DEFAULT_GGUF_NAME

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}

# GGUF tensor name -> HF name ("{i}" is the layer index).
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclasses.dataclass
class LoadedModel:
    """A checkpoint in memory: architecture, float32 tensors under HF Llama names ([out, in]), tokenizer."""

    config: ModelConfig
    tensors: dict[str, np.ndarray]
    tokenizer: Tokenizer


# --------------------------------------------------------------------------------------------- validation
def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor a checkpoint of `config` must hold (and no others)."""
    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (config.q_size, h),
                p + "self_attn.k_proj.weight": (config.kv_size, h),
                p + "self_attn.v_proj.weight": (config.kv_size, h),
                p + "self_attn.o_proj.weight": (h, config.q_size),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        )
        if config.qkv_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (config.q_size,),
                    p + "self_attn.k_proj.bias": (config.kv_size,),
                    p + "self_attn.v_proj.bias": (config.kv_size,),
                }
            )
    return shapes


def validate_tensors(
    config: ModelConfig, tensors: Mapping[str, np.ndarray | TensorInfo], source: Any = "checkpoint"
) -> None:
    """Check that `tensors` holds exactly the tensors `config` needs, each with the right shape.

    Raises ValueError naming the first missing tensor, unexpected tensor, or tensor whose shape differs from
    the one the config implies (with both shapes), so a config/checkpoint mismatch fails at load time instead
    of as a broadcasting error deep inside the model.
    """
    expected = expected_shapes(config)
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(
            f"{source}: missing tensor {missing[0]!r}{more}, required by the config "
            f"({config.architecture}, {config.num_layers} layers, tie_embeddings={config.tie_embeddings}, "
            f"qkv_bias={config.qkv_bias})."
        )
    unexpected = sorted(n for n in tensors if n not in expected)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(
            f"{source}: unexpected tensor {unexpected[0]!r}{more}: the checkpoint does not match a plain "
            "Llama/Qwen2 decoder of this config (wrong num_layers, untied head marked tied, or an "
            "unsupported variant)."
        )
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {got} but the config implies {shape}: the checkpoint "
                "and its config disagree."
            )


def _check_tokenizer(config: ModelConfig, tokenizer: Tokenizer, source: Any) -> None:
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{config.vocab_size}: ids past the embedding table would crash. Use the tokenizer that ships "
            "with the model."
        )


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (per head, interleaved pairs -> first half / second half)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(
    meta: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    n_tokens: int,
    dtype: str,
    path: pathlib.Path,
) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}."
        )

    def field(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def req(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ValueError(f"{path}: GGUF metadata key '{arch}.{key}' is missing: the file is incomplete.")
        return meta[f"{arch}.{key}"]

    scaling = field("rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in tensor_shapes:
        raise ValueError(f"{path}: RoPE scaling ({scaling or 'rope_freqs'}) is not supported by ModelConfig.")
    hidden, heads = int(req("embedding_length")), int(req("attention.head_count"))
    head_dim = int(field("attention.key_length", hidden // heads))
    rot = field("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError(f"{path}: partial RoPE (rope dim {rot} != head_dim {head_dim}) is not supported.")
    vocab = field("vocab_size")
    if vocab is None:
        vocab = tensor_shapes["token_embd.weight"][0] if "token_embd.weight" in tensor_shapes else n_tokens
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")),
        num_heads=heads,
        num_kv_heads=int(field("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(field("rope.freq_base", 10000.0)),
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensor_shapes,
        qkv_bias=arch == "qwen2",
        max_position_embeddings=int(field("context_length", 8192)),
        architecture=arch,
        dtype=dtype,
    )


def _gguf_to_hf_name(name: str, path: pathlib.Path) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"{path}: unexpected GGUF tensor {name!r}: not part of a plain Llama/Qwen2 decoder.")


def load_gguf(path: PathLike | GGUFFile, dtype: str = "float32") -> LoadedModel:
    """Load a llama/qwen2 GGUF file: config from `{arch}.*` metadata, dequantized float32 tensors, tokenizer.

    Accepts a path or an already parsed `GGUFFile`. `dtype` is the compute dtype recorded in the config; the
    returned tensors are always float32 (HF names and layouts; llama q/k rows un-permuted).
    """
    gf = path if isinstance(path, GGUFFile) else read_gguf(path)
    shapes = {t.name: t.shape for t in gf.tensors}
    n_tokens = len(gf.metadata.get("tokenizer.ggml.tokens") or ())
    config = _gguf_config(gf.metadata, shapes, n_tokens, dtype, gf.path)  # first: unsupported arch fails fast
    tokenizer = tokenizer_from_gguf(gf)
    tensors: dict[str, np.ndarray] = {}
    for info in gf.tensors:
        hf_name = _gguf_to_hf_name(info.name, gf.path)
        tensors[hf_name] = gf.dequantize(info)
    validate_tensors(config, tensors, source=gf.path)
    if config.architecture == "llama":  # llama.cpp permutes q/k rows for llama only (not qwen2)
        for name in list(tensors):
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                tensors[name] = _unpermute_rows(tensors[name], config.num_heads)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                tensors[name] = _unpermute_rows(tensors[name], config.num_kv_heads)
    _check_tokenizer(config, tokenizer, gf.path)
    return LoadedModel(config=config, tensors=tensors, tokenizer=tokenizer)


# --------------------------------------------------------------------------------------------- HF dir
def _hf_config(cfg: dict[str, Any], dtype: str, path: pathlib.Path) -> ModelConfig:
    archs = cfg.get("architectures") or []
    if archs:
        arch = _HF_ARCHITECTURES.get(archs[0])
        name = archs[0]
    else:
        name = cfg.get("model_type")
        arch = name if name in SUPPORTED_ARCHITECTURES else None
    if arch is None:
        raise ValueError(
            f"{path}: architecture {name!r} is not supported; supported: {', '.join(_HF_ARCHITECTURES)} "
            f"(model_type {', '.join(SUPPORTED_ARCHITECTURES)})."
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu').")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError(f"{path}: attention_bias/mlp_bias on a Llama model is not supported.")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{path}: sliding-window attention (use_sliding_window=true) is not supported.")
    rope = cfg.get("rope_parameters") or {}  # transformers >= 5
    scaling = cfg.get("rope_scaling") or {}  # transformers 4
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"{path}: RoPE scaling type {rope_type!r} is not supported (only plain RoPE).")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            architecture=arch,
            dtype=dtype,
        )
    except KeyError as e:
        raise ValueError(f"{path}: config.json lacks the required key {e.args[0]!r}.") from None


@dataclasses.dataclass
class HfCheckpoint:
    """A HF safetensors directory opened but not read: its config, its tensors by name (headers only: read
    on demand, see `safetensors_io`), and its tokenizer."""

    config: ModelConfig
    source: SafetensorsDir
    tokenizer: Tokenizer


def open_hf_dir(path: PathLike, dtype: str = "float32") -> HfCheckpoint:
    """Open a HF LlamaForCausalLM/Qwen2ForCausalLM directory (config.json, safetensors, tokenizer files),
    reading no weights: the config, every tensor's name and shape checked against it, and the tokenizer.

    Reads the headers of model.safetensors or of the shards listed in model.safetensors.index.json. The
    tokenizer is required (tokenizer.json; see `tokenizer_from_hf_dir`). A tied checkpoint that still stores
    lm_head.weight has it dropped, and old rotary_emb.inv_freq buffers are ignored.
    """
    d = pathlib.Path(path)
    if not d.is_dir():
        raise missing_path_error(d, "Model directory")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} does not exist: a HF model directory needs its config.json.")
    config = _hf_config(json.loads(cfg_file.read_text()), dtype, d)
    source = SafetensorsDir(d)
    for name in list(source.infos):
        if name.endswith("rotary_emb.inv_freq") or (config.tie_embeddings and name == "lm_head.weight"):
            del source.infos[name]
    validate_tensors(config, source.infos, source=d)
    tokenizer = tokenizer_from_hf_dir(d)
    _check_tokenizer(config, tokenizer, d)
    return HfCheckpoint(config=config, source=source, tokenizer=tokenizer)


def load_hf_dir(path: PathLike, dtype: str = "float32") -> LoadedModel:
    """Load a HF directory (see `open_hf_dir`) with every tensor read into host memory as float32 (bf16 and
    f16 widened exactly). `dtype` is the compute dtype recorded in the config. For large models place the
    weights straight onto the devices instead (`sharded_loading.place_hf_params`)."""
    ckpt = open_hf_dir(path, dtype)
    tensors = {name: ckpt.source.read_float32(name) for name in ckpt.source.infos}
    return LoadedModel(config=ckpt.config, tensors=tensors, tokenizer=ckpt.tokenizer)


def load_model(path: PathLike = DEFAULT_GGUF_PATH, dtype: str = "float32") -> LoadedModel:
    """Load a checkpoint: a `.gguf` file via `load_gguf`, a directory via `load_hf_dir`."""
    p = pathlib.Path(path)
    if p.is_dir():
        return load_hf_dir(p, dtype=dtype)
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"{p} is neither a .gguf file nor a HF model directory: cannot load it.")
        return load_gguf(p, dtype=dtype)
    raise missing_path_error(p, "Model path")
