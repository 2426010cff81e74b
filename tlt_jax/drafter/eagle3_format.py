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
the decoder's dims, and the capture points, which the two loaders read from DIFFERENT keys in DIFFERENT
conventions (read in SGLang 0.5.23's and vLLM 0.34.0's (commit 62d4bc3c7) PyPI wheels, and SpecForge
@ a6b6b023; tests/drafter/test_eagle3_format.py transcribes both readings):
- SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` only (model_runner_components/
  spec_aux_hidden_state.py `_resolve_eagle_aux_hidden_state`), as layer OUTPUTS: models/llama.py and
  qwen2.py `set_eagle3_layers_to_capture` set `layers_to_capture = [val + 1 for val in layer_ids]` and the
  forward captures the stream entering layer i for i in layers_to_capture (so id = our capture point - 1;
  the same `set_eagle3_layers_to_capture` at sgl-project/sglang@bf7a0e23 python/sglang/srt/models/llama.py).
  SpecForge, which trains EAGLE-3 drafters for SGLang, writes that key the same way (its default
  `[1, num_layers // 2 - 1, num_layers - 4]`, passed to SGLang's `set_eagle3_layers_to_capture`).
- vLLM reads the TOP-LEVEL `eagle_aux_hidden_state_layer_ids` (v1/worker/gpu/spec_decode/eagle/
  eagle3_utils.py `get_eagle3_aux_layers_from_config`; the nested key only sizes fc in llama_eagle3.py), as
  stream ENTRY points: models/llama.py and qwen2.py call `_maybe_add_hidden_state(aux, idx + 1, ...)` after
  layer idx (and with id 0 before layer 0), so id = our capture point (the older form at vllm-project/vllm
  @e06c9ba2 models/llama.py appends `hidden_states + residual` before layer idx: the same). The speculators
  format writes that key.
- Without them both capture (2, L // 2, L - 3), the stream entering those layers.
vLLM's EAGLE-3 decoder layers also read `norm_before_residual` (`getattr(config, "norm_before_residual",
False)`: the residual is the un-normed fc output, as in SGLang's and ours) and newer configs carry
`norm_before_fc` (a norm over the concatenated states before fc); the speculators format defaults both to
True, so the export writes both False and the import refuses a checkpoint with either set.
The export writes both keys (each in its loader's convention), so both capture the same states whatever
their defaults; capture points 0 (the embedding: SGLang would need id -1) and L (SGLang's loop never
reaches layer L) have no id both read, and are refused. The import reads a checkpoint's ids by the key it
carries: the nested key as SGLang does (+ 1: the trainers that write only it, SpecForge, target SGLang),
the top-level key as vLLM does; both present and disagreeing is refused (the two engines would feed the
drafter different layers).
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
from tlt_jax.models.llama import check_aux_layers
from tlt_jax.utils.export_io import write_atomically

NORM_FLAGS = {"norm_before_residual": False, "norm_before_fc": False}  # ours: both off (module docstring)
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
    check_exportable_capture_points(aux_layers, cfg.num_layers)
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
        **NORM_FLAGS,
        **capture_keys(aux_layers),
    }
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


def check_exportable_capture_points(aux_layers: tuple[int, ...], num_layers: int) -> None:
    """Refuse capture points without an id both SGLang and vLLM read the same way (module docstring)."""
    points = tuple(int(i) for i in aux_layers)
    if len(points) != 3 or not all(1 <= i <= num_layers - 1 for i in points):
        raise ValueError(
            f"aux layers {points}: SGLang's and vLLM's EAGLE-3 read three target layers' states at capture "
            f"points in [1, L - 1] = [1, {num_layers - 1}] (0, the embedding, needs SGLang id -1; "
            f"{num_layers}, the last layer's output, is never reached by SGLang's capture loop): train with "
            "drafter.aux_layers inside that range to export"
        )


def capture_keys(aux_layers: tuple[int, ...]) -> dict[str, Any]:
    """config.json keys naming capture points `aux_layers` (the stream entering those target layers) for
    both loaders: vLLM's top-level ids (entry points) and SGLang's `eagle_config` ids (layer outputs)."""
    points = [int(i) for i in aux_layers]
    return {
        "eagle_aux_hidden_state_layer_ids": points,
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in points],
        },
    }


def capture_points(config: Mapping[str, Any], num_layers: int, where: str = "the drafter") -> tuple[int, ...]:
    """The capture points (stream entering those target layers) a checkpoint's config asks for, read in the
    convention of the loader that reads each key (module docstring): the nested `eagle_config` ids as SGLang
    (+ 1), the top-level ids as vLLM (as is), neither: the default both apply. Both, disagreeing: refused."""
    ec = config.get("eagle_config") or {}
    nested = ec.get("eagle_aux_hidden_state_layer_ids")
    top = config.get("eagle_aux_hidden_state_layer_ids") or ec.get("layer_ids")  # vLLM's fallback key
    sglang = tuple(int(i) + 1 for i in nested) if nested else None
    vllm = tuple(int(i) for i in top) if top else None
    if sglang and vllm and sglang != vllm:
        raise ValueError(
            f"{where}: SGLang would feed it the states entering target layers {sglang} (eagle_config ids "
            f"{list(nested)} + 1) but vLLM those entering {vllm} (top-level ids {list(top)}): the config "
            "does not say which it was trained on; keep only the key of the engine it was trained for"
        )
    return sglang or vllm or default_aux_layers(num_layers)


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
    if flags := {k: config[k] for k in NORM_FLAGS if config.get(k)}:
        raise ValueError(
            f"{where} sets {flags}: a drafter variant ours does not compute (residual = the un-normed fc "
            "output, no norm before fc)"
        )
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
    aux = capture_points(config, policy.num_layers, where)
    if len(aux) != 3:
        raise ValueError(f"{where} reads {len(aux)} target layers {aux}: its fc [H, 3H] reads three")
    try:
        check_aux_layers(policy, aux)
    except ValueError as e:
        raise ValueError(f"{where} was trained for another target: {e}") from None
    return params, vocab, aux


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
