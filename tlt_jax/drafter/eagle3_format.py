"""EAGLE-3 drafters in the layout SGLang's and vLLM's EAGLE-3 loaders read, both ways (export and import).

The checkpoint names both loaders take (each read at a named commit through the repository search tool):
SGLang `LlamaForCausalLMEagle3` (python/sglang/srt/models/llama_eagle3.py, sgl-project/sglang@d737979c) and
vLLM `Eagle3LlamaForCausalLM` (vllm/model_executor/models/llama_eagle3.py, vllm-project/vllm@583507d1, which
renames `midlayer.` to `layers.0.`):

    fc.weight                                   [H, 3H]   no bias (vLLM bias=False; SGLang config "bias")
    midlayer.self_attn.{q,k,v}_proj.weight      [.., 2H]  q/k/v read [input_layernorm(embed) ; hidden_norm(f)]
    midlayer.self_attn.o_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight, norm.weight
    lm_head.weight                              [Vd, H]   the drafter's own head over its draft vocabulary
    d2t [Vd] int64 (target id = draft id + d2t), t2d [V] bool   (SGLang's hot_token_id; vLLM's
                                                                  draft_id_to_target_id; t2d is skipped)

config.json: architectures ["LlamaForCausalLMEagle3"], num_hidden_layers 1 (SGLang refuses others),
draft_vocab_size, tie_word_embeddings false (SGLang: a tied draft would use the embedding as its head),
the decoder's dims, and `eagle_config.eagle_aux_hidden_state_layer_ids`: the target layers whose OUTPUTS the
drafter reads (SGLang captures the stream entering layer id + 1: our capture points minus one), written only
when they differ from the default (2, L // 2, L - 3) both loaders use without it. Our capture point 0 (the
embedding itself) has no id there and is refused.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from tlt_jax.drafter.eagle_format import (
    HF_CONFIG_FILE,
    TLT_SECTION,
    WEIGHTS_FILE,
    EagleExport,
    cast_tree,
    draft_vocab_from_maps,
)
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.eagle3 import Eagle3Drafter, default_aux_layers
from tlt_jax.models.hf_export import decoder_fields
from tlt_jax.utils.export_io import write_atomically

ARCHITECTURE = "LlamaForCausalLMEagle3"
_L = "midlayer."


def expected_eagle3_tensors(cfg: ModelConfig, draft_vocab_size: int) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of an EAGLE-3 checkpoint for a target of `cfg` (the loaders' names, docstring)."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    return {
        "fc.weight": (h, 3 * h),
        _L + "self_attn.q_proj.weight": (cfg.num_heads * d, 2 * h),
        _L + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, 2 * h),
        _L + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, 2 * h),
        _L + "self_attn.o_proj.weight": (h, cfg.num_heads * d),
        _L + "mlp.gate_proj.weight": (f, h),
        _L + "mlp.up_proj.weight": (f, h),
        _L + "mlp.down_proj.weight": (h, f),
        _L + "input_layernorm.weight": (h,),
        _L + "hidden_norm.weight": (h,),
        _L + "post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (draft_vocab_size, h),
    }


def to_eagle3(
    params: Mapping[str, Any],
    cfg: ModelConfig,
    aux_layers: tuple[int, ...],
    draft_vocab: np.ndarray | None,
    dtype: str = "float32",
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Our EAGLE-3 drafter's params (`nnx.to_pure_dict`) for a target of `cfg` -> (tensors, config.json)."""
    if len(aux_layers) != 3 or min(aux_layers) < 1:
        raise ValueError(
            f"aux layers {tuple(aux_layers)}: SGLang's and vLLM's EAGLE-3 read three target layers' outputs "
            "(capture points >= 1; 0, the embedding, has no layer id)"
        )
    dt = np.dtype(dtype)
    kv, g, d, h = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    lay = params["layer"]
    qkv = np.asarray(lay["attn"]["qkv"]).reshape(kv, g + 2, d, 2 * h)
    gu = np.asarray(lay["mlp"]["gate_up"]).reshape(cfg.intermediate_size, 2, h)
    vd = int(np.asarray(params["lm_head"]).shape[0])
    ids = np.arange(vd, dtype=np.int64) if draft_vocab is None else np.asarray(draft_vocab, np.int64)
    if ids.shape != (vd,):
        raise ValueError(f"draft vocabulary of {ids.size} ids for a head over {vd} tokens")
    t2d = np.zeros((cfg.vocab_size,), bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": params["fc"],
        _L + "self_attn.q_proj.weight": qkv[:, :g].reshape(kv * g * d, 2 * h),
        _L + "self_attn.k_proj.weight": qkv[:, g].reshape(kv * d, 2 * h),
        _L + "self_attn.v_proj.weight": qkv[:, g + 1].reshape(kv * d, 2 * h),
        _L + "self_attn.o_proj.weight": lay["attn"]["o_proj"],
        _L + "mlp.gate_proj.weight": gu[:, 0],
        _L + "mlp.up_proj.weight": gu[:, 1],
        _L + "mlp.down_proj.weight": lay["mlp"]["down"],
        _L + "input_layernorm.weight": lay["input_norm"]["weight"],
        _L + "hidden_norm.weight": lay["hidden_norm"]["weight"],
        _L + "post_attention_layernorm.weight": lay["post_attn_norm"]["weight"],
        "norm.weight": params["norm"]["weight"],
        "lm_head.weight": params["lm_head"],
    }
    out = {k: np.ascontiguousarray(np.asarray(v, np.float32).astype(dt)) for k, v in tensors.items()}
    out["d2t"] = ids - np.arange(vd, dtype=np.int64)
    out["t2d"] = t2d
    config = {
        "architectures": [ARCHITECTURE],
        **decoder_fields(cfg.replace(num_layers=1, tie_embeddings=False, architecture="llama"), dtype),
        "draft_vocab_size": vd,
        "target_hidden_size": h,
        "eagle_config": {"use_aux_hidden_state": True},
    }
    if cfg.num_layers < 3 or tuple(aux_layers) != default_aux_layers(cfg.num_layers):
        # SGLang's reading (layer outputs, captured at id + 1); left out for the default capture points,
        # which both loaders apply when the config names none (vLLM's reading of the ids: not checked here)
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [int(i) - 1 for i in aux_layers]
    return out, config


def eagle3_export(
    params: Mapping[str, Any], cfg: ModelConfig, aux_layers: tuple[int, ...], draft_vocab: np.ndarray | None
) -> EagleExport:
    """`to_eagle3` as an `EagleExport` (one directory both SGLang and vLLM read: d2t / t2d in the weights,
    no token_map.pt), with the `tlt_drafter` section our exports carry."""
    tensors, config = to_eagle3(params, cfg, aux_layers, draft_vocab)
    config[TLT_SECTION] = {"layout": "eagle3", "aux_capture_points": list(aux_layers)}
    return EagleExport(tensors=tensors, config=config, draft_vocab=None, engine="sglang+vllm")


def write_eagle3_dir(
    out: str | os.PathLike, tensors: Mapping[str, np.ndarray], config: Mapping[str, Any]
) -> None:
    """config.json + model.safetensors, atomically (a crash never leaves half an export)."""

    def fill(tmp: pathlib.Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        save_file(dict(tensors), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / HF_CONFIG_FILE).write_text(json.dumps(dict(config), indent=2))

    write_atomically(out, True, fill)


def _aux_from_config(config: Mapping[str, Any], policy: ModelConfig) -> tuple[int, ...]:
    ec = config.get("eagle_config") or {}
    ids = ec.get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:  # the loaders' default: SGLang/vLLM capture (2, L // 2, L - 3)
        return default_aux_layers(policy.num_layers)
    return tuple(int(i) + 1 for i in ids)


def from_eagle3(
    tensors: Mapping[str, np.ndarray],
    config: Mapping[str, Any],
    policy: ModelConfig,
    where: str = "the drafter",
) -> tuple[dict[str, Any], np.ndarray | None, tuple[int, ...]]:
    """An EAGLE-3 checkpoint -> (our params as a pure dict, its draft vocabulary or None, capture points).
    Raises a ValueError naming what does not fit the policy (layers, dims, a missing or misshapen tensor)."""
    tensors = {k.replace("layers.0.", _L): v for k, v in tensors.items()}  # vLLM's own naming
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{where} has {config['num_hidden_layers']} decoder layers: EAGLE-3 has one")
    if config.get("tie_word_embeddings"):
        raise ValueError(f"{where} ties its head to the embedding: ours owns lm_head [draft_vocab, H]")
    extra = sorted(k for k in tensors if k.endswith(".bias"))
    if extra:
        raise ValueError(f"{where} has biases {extra}: SGLang's / vLLM's EAGLE-3 (and ours) have none")
    vd = int(config.get("draft_vocab_size") or policy.vocab_size)
    want = expected_eagle3_tensors(policy, vd)
    for name, shape in want.items():
        if name not in tensors:
            raise ValueError(f"{where} lacks {name}: not an EAGLE-3 checkpoint of SGLang's / vLLM's layout")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{where}: {name} is {tuple(tensors[name].shape)}, the policy needs {shape} (hidden "
                f"{policy.hidden_size}, {policy.num_heads} heads / {policy.num_kv_heads} KV x "
                f"{policy.head_dim}, MLP {policy.intermediate_size}): it was trained for another target"
            )
    t = {k: np.asarray(v, np.float32) for k, v in tensors.items() if k in want}
    kv, g, d, h = (
        policy.num_kv_heads,
        policy.num_heads // policy.num_kv_heads,
        policy.head_dim,
        policy.hidden_size,
    )
    q = t[_L + "self_attn.q_proj.weight"].reshape(kv, g, d, 2 * h)
    k = t[_L + "self_attn.k_proj.weight"].reshape(kv, 1, d, 2 * h)
    v = t[_L + "self_attn.v_proj.weight"].reshape(kv, 1, d, 2 * h)
    gate_up = np.stack([t[_L + "mlp.gate_proj.weight"], t[_L + "mlp.up_proj.weight"]], axis=1)
    params = {
        "fc": t["fc.weight"],
        "layer": {
            "input_norm": {"weight": t[_L + "input_layernorm.weight"]},
            "hidden_norm": {"weight": t[_L + "hidden_norm.weight"]},
            "attn": {
                "qkv": np.concatenate([q, k, v], axis=1).reshape(-1, 2 * h),
                "o_proj": t[_L + "self_attn.o_proj.weight"],
            },
            "post_attn_norm": {"weight": t[_L + "post_attention_layernorm.weight"]},
            "mlp": {"gate_up": gate_up.reshape(-1, h), "down": t[_L + "mlp.down_proj.weight"]},
        },
        "norm": {"weight": t["norm.weight"]},
        "lm_head": t["lm_head.weight"],
    }
    vocab = draft_vocab_from_maps(tensors, policy.vocab_size, where)
    if vocab is None and vd != policy.vocab_size:
        raise ValueError(f"{where}: a head over {vd} tokens without d2t (which target tokens they are)")
    return params, vocab, _aux_from_config(config, policy)


def load_eagle3_drafter(
    path: str | os.PathLike, policy: ModelConfig
) -> tuple[Eagle3Drafter, np.ndarray | None]:
    """The EAGLE-3 drafter of a directory in that layout for a policy of `policy`, and its draft vocabulary
    (the rollout drafter / spot trainer start, `config.drafter.init_from` with drafter.arch=eagle3)."""
    d = pathlib.Path(path)
    tensors, config = load_file(str(d / WEIGHTS_FILE)), json.loads((d / HF_CONFIG_FILE).read_text())
    params, vocab, aux = from_eagle3(tensors, config, policy, where=f"the EAGLE-3 drafter in {d}")
    size = int(params["lm_head"].shape[0])
    drafter = nnx.eval_shape(
        lambda: Eagle3Drafter(policy, nnx.Rngs(0), draft_vocab_size=size, aux_layers=aux)
    )
    state = nnx.state(drafter, nnx.Param)
    dt = jnp.dtype(policy.dtype)
    nnx.replace_by_pure_dict(state, cast_tree(params, dt))
    nnx.update(drafter, state)
    return drafter, vocab


def is_eagle3_dir(path: str | os.PathLike) -> bool:
    """Whether a drafter directory's config.json names an EAGLE-3 architecture."""
    cfg = pathlib.Path(path) / HF_CONFIG_FILE
    if not cfg.is_file():
        return False
    archs = " ".join(json.loads(cfg.read_text()).get("architectures") or [])
    return "Eagle3" in archs
