"""Our Llama/Qwen2 parameters as a HF checkpoint: the inverse of `llama.hf_to_params`, the config.json that
transformers / vLLM / SGLang read, and safetensors shards with their index.

Our layout (tlt_jax/models/llama.py) fuses q/k/v into one projection whose rows are ordered per KV group,
[Hkv, G + 2, D] (a group's G query heads, then its key head, then its value head), and gate/up into one whose
rows are ordered [F, 2]; every weight is already [out, in] as in HF. The inverse splits them back into
q_proj/k_proj/v_proj and gate_proj/up_proj; a tied model has no lm_head.weight (tie_word_embeddings).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from tlt_jax.models.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 5 * 1024**3  # transformers' default max_shard_size ("5GB")
_FAMILY = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter paths ('layers/0/attn/qkv') and their shapes for `cfg`."""
    h, f, kvd = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    rows = cfg.q_size + 2 * kvd
    out: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "norm/weight": (h,)}
    if not cfg.tie_embeddings:
        out["lm_head"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"layers/{i}/"
        out |= {
            p + "input_norm/weight": (h,),
            p + "attn/qkv": (rows, h),
            p + "attn/o_proj": (h, cfg.q_size),
            p + "post_attn_norm/weight": (h,),
            p + "mlp/gate_up": (2 * f, h),
            p + "mlp/down": (h, f),
        }
        if cfg.qkv_bias:
            out[p + "attn/qkv_bias"] = (rows,)
    return out


def check_params(cfg: ModelConfig, flat: Mapping[str, Any], where: str) -> None:
    """`flat` holds exactly `cfg`'s parameters at their shapes, else a ValueError naming what differs."""
    want = param_shapes(cfg)
    missing, extra = sorted(set(want) - set(flat)), sorted(set(flat) - set(want))
    bad = [
        f"{k} {np.shape(flat[k])} != {want[k]}" for k in want if k in flat and np.shape(flat[k]) != want[k]
    ]
    parts = ([f"missing {missing[:4]}"] if missing else []) + ([f"unexpected {extra[:4]}"] if extra else [])
    if parts or bad:
        raise ValueError(
            f"{where} does not hold a {cfg.architecture} model with {cfg.num_layers} layers, hidden "
            f"{cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads} x {cfg.head_dim}: "
            + "; ".join(parts + bad[:4])
        )


def params_to_hf(cfg: ModelConfig, flat: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our parameters by path (`param_shapes`) -> HF Llama/Qwen2-named tensors, dtypes kept (the exact inverse
    of `llama.hf_to_params`)."""
    check_params(cfg, flat, "the parameters")
    h, kv, d, g = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    out = {"model.embed_tokens.weight": flat["embed"], "model.norm.weight": flat["norm/weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = flat["lm_head"]
    for i in range(cfg.num_layers):
        src, p = f"layers/{i}/", f"model.layers.{i}."
        qkv = np.asarray(flat[src + "attn/qkv"]).reshape(kv, g + 2, d, h)
        gu = np.asarray(flat[src + "mlp/gate_up"]).reshape(cfg.intermediate_size, 2, h)
        out |= {
            p + "input_layernorm.weight": flat[src + "input_norm/weight"],
            p + "self_attn.q_proj.weight": qkv[:, :g].reshape(-1, h),
            p + "self_attn.k_proj.weight": qkv[:, g].reshape(-1, h),
            p + "self_attn.v_proj.weight": qkv[:, g + 1].reshape(-1, h),
            p + "self_attn.o_proj.weight": flat[src + "attn/o_proj"],
            p + "post_attention_layernorm.weight": flat[src + "post_attn_norm/weight"],
            p + "mlp.gate_proj.weight": gu[:, 0],
            p + "mlp.up_proj.weight": gu[:, 1],
            p + "mlp.down_proj.weight": flat[src + "mlp/down"],
        }
        if cfg.qkv_bias:
            b = np.asarray(flat[src + "attn/qkv_bias"]).reshape(kv, g + 2, d)
            out |= {
                p + "self_attn.q_proj.bias": b[:, :g].reshape(-1),
                p + "self_attn.k_proj.bias": b[:, g].reshape(-1),
                p + "self_attn.v_proj.bias": b[:, g + 1].reshape(-1),
            }
    return {k: np.asarray(v) for k, v in out.items()}


def decoder_fields(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    """The HF config.json fields of a Llama/Qwen2 decoder of `cfg`'s shape (the policy's export and, with one
    layer, the EAGLE drafter's)."""
    return {
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype,
    }


def hf_config(cfg: ModelConfig, dtype: str, bos: int | None, eos: list[int]) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM / Qwen2ForCausalLM with `cfg`'s architecture."""
    out: dict[str, Any] = {
        "architectures": [_FAMILY[cfg.architecture]],
        **decoder_fields(cfg, dtype),
        "bos_token_id": bos,
        "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
        "use_cache": True,
    }
    if cfg.architecture == "llama":
        out |= {"attention_bias": False, "mlp_bias": False}
    else:
        out |= {"use_sliding_window": False, "sliding_window": None}
    return out


def write_shards(
    directory: str | pathlib.Path, tensors: Mapping[str, np.ndarray], max_bytes: int = SHARD_BYTES
) -> dict[str, Any]:
    """`tensors` as model-0000k-of-0000n.safetensors files of at most `max_bytes` each (a larger tensor gets
    its own) plus model.safetensors.index.json (written even for one shard); returns the index."""
    d = pathlib.Path(directory)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].nbytes
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(tensors[name])
        size += n
    weight_map, umask = {}, os.umask(0)
    os.umask(umask)
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(d / file), metadata={"format": "pt"})
        os.chmod(d / file, 0o666 & ~umask)  # safetensors creates it owner-only: as the other files instead
        weight_map |= dict.fromkeys(shard, file)
    total = int(sum(t.nbytes for t in tensors.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return index
