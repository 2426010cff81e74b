"""The drafter as a deployable EAGLE checkpoint (`config.json` + `model.safetensors`), and back.

Layout: EAGLE-1 (EAGLE-2 has the same weights), which is our drafter's architecture (`models/drafter.py`):
SafeAILab/EAGLE `eagle/model/cnets1.py` `Model`; SGLang `LlamaForCausalLMEagle` / `Qwen2ForCausalLMEagle`
(`models/llama_eagle.py`, `qwen2_eagle.py`); vLLM `EagleLlamaForCausalLM` (`models/llama_eagle.py`).

    h_draft = layers.0(fc(concat(embed_tokens(x_{t+1}), h_t)))   no input_layernorm in layer 0; no final norm
    logits  = lm_head(h_draft)                                    the target's head: shared, not stored

Tensors (torch Linear layout [out, in]; H hidden, F intermediate, V vocabulary, Vd draft vocabulary):
    fc.weight [H, 2H]; fc.bias [H], zeros, in the SGLang layout only (below);
    layers.0.self_attn.{q,k,v,o}_proj.weight, with Qwen2 layers.0.self_attn.{q,k,v}_proj.bias;
    layers.0.post_attention_layernorm.weight; layers.0.mlp.{gate,up,down}_proj.weight.
No embed_tokens / lm_head: both engines take them from the served target. A reduced draft vocabulary (Vd of
V tokens, `draft_vocab.py`) is written as `token_map.pt` (the head rows the drafter drafts over, SGLang's
`--speculative-token-map`; `token_map.py`), never as tensors, with draft_vocab_size in config.json. Older
exports stored it as EAGLE-3's d2t [Vd] / t2d [V] tensors (draft index i is target token i + d2t[i]): read.

One layout per engine (`engine`), because their EAGLE-1 loaders differ (read from their source; neither
engine runs here: tests/drafter/test_serving_loaders.py holds their names, keys and rules as data, with the
files and commits read, and checks our exports against them):
- "sglang": `LlamaForCausalLMEagle` / `Qwen2ForCausalLMEagle` (models/llama_eagle.py, qwen2_eagle.py). Its fc
  has a bias, which keeps its random init where the checkpoint lacks one: the export writes zeros (our fc has
  none). Its Qwen2 loader raises on a tensor it does not know and its Llama loader drops it with a warning,
  so d2t/t2d tensors would crash or be lost; the token map keeps the reduced vocabulary instead.
- "vllm": `EagleLlamaForCausalLM` (models/llama_eagle.py; its config prefixes "Eagle" to each of
  `architectures` and takes the first it knows; its Llama layer reads `qkv_bias` for Qwen2's q/k/v biases).
  Its fc has no bias and its loader raises on (or, in some versions, skips) a tensor it does not know: no
  fc.bias, no maps. It has no reduced draft vocabulary (EAGLE-1 drafts over the target's whole head): a
  drafter trained on one is refused unless exported with `full_vocab` (it then drafts over every token,
  and may accept fewer than in training; lossless either way).

Deviations, also named in config.json under "tlt_drafter" so that a loader cannot misread the weights:
- Not EAGLE-3. EAGLE-3's fc reads three target layers' hidden states (3H). Its `midlayer` attends over
  concat(norm(embed), norm(fc out)), so its q_proj has 2H in-features, and it has its own norm and lm_head.
  Our fc reads the target's FINAL normed hidden state beside the token embedding (2H). The names (layers.0
  vs midlayer) and fc's shape differ, so an EAGLE-3 loader fails instead of misreading, and `from_eagle`
  refuses EAGLE-3 checkpoints.
- RoPE position: we place the pair (x_{t+1}, h_t) at t+1, EAGLE at t. Attention depends only on position
  differences, so the outputs agree.
`from_eagle` reads EAGLE-1 checkpoints of other trainers too: a zero or absent fc.bias, embed_tokens /
lm_head ignored. Set `drafter.init_from` to start the rollout drafter and its spot trainer from one
(`rl/speculation.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from tlt_jax.drafter.token_map import TOKEN_MAP_FILE, read_token_map, write_token_map
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import Drafter, drafter_config
from tlt_jax.models.hf_export import decoder_fields
from tlt_jax.utils.export_io import write_atomically

HF_CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TLT_SECTION = "tlt_drafter"  # our description of the layout inside config.json
_SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's: the serving engine shares its own
_EXPORT_HINT = "`python -m tlt_jax.export_drafter --workdir W --out DIR`"
ENGINES = ("sglang", "vllm")  # the serving engines whose EAGLE-1 layout an export takes (module docstring)


@dataclasses.dataclass(frozen=True)
class EagleExport:
    """An export for one engine: model.safetensors' tensors, config.json, and the reduced draft vocabulary
    (sorted target token ids; token_map.pt) or None."""

    tensors: dict[str, np.ndarray]
    config: dict[str, Any]
    draft_vocab: np.ndarray | None
    engine: str


def _vllm_vocab_error(size: int, vocab_size: int) -> ValueError:
    return ValueError(
        f"the drafter drafts over a reduced vocabulary of {size} of {vocab_size} tokens, which vLLM's "
        "EAGLE-1 drafter (EagleLlamaForCausalLM) cannot hold: it drafts over the target's whole LM head "
        "and has no d2t map. Export for SGLang (--engine sglang, which keeps it as token_map.pt), or pass "
        "--full-vocab to serve it with vLLM over the full vocabulary (lossless; fewer drafts may be "
        "accepted)."
    )


def _layer_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every layer tensor of a one-layer EAGLE-1 drafter for `cfg`."""
    h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    p = "layers.0."
    out = {
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (f, h),
        p + "mlp.up_proj.weight": (f, h),
        p + "mlp.down_proj.weight": (h, f),
    }
    if cfg.qkv_bias:
        out |= {p + f"self_attn.{n}_proj.bias": (s,) for n, s in (("q", q), ("k", kv), ("v", kv))}
    return out


def expected_tensors(cfg: ModelConfig, engine: str = "sglang") -> dict[str, tuple[int, ...]]:
    """HF name -> shape of the drafter-owned tensors of an export for target `cfg` and `engine` (fc.bias in
    SGLang's layout only)."""
    h = cfg.hidden_size
    bias = {"fc.bias": (h,)} if engine == "sglang" else {}
    return {"fc.weight": (h, 2 * h), **bias, **_layer_names(cfg)}


def eagle_config(
    cfg: ModelConfig, dtype: str, draft_vocab_size: int | None = None, engine: str = "sglang"
) -> dict[str, Any]:
    """config.json of the export: a one-layer Llama/Qwen2 config as EAGLE-1 drafter repos publish it."""
    family = "Qwen2" if cfg.architecture == "qwen2" else "Llama"
    out: dict[str, Any] = {
        "architectures": [f"{family}ForCausalLMEagle", "EagleLlamaForCausalLM"],
        **decoder_fields(cfg, dtype),
        "num_hidden_layers": 1,
        "attention_bias": False,
        "qkv_bias": cfg.qkv_bias,
    }
    if draft_vocab_size is not None:
        out["draft_vocab_size"] = int(draft_vocab_size)
    head = "the target's, not stored" + ("; rows arange(draft_vocab_size) + d2t" if draft_vocab_size else "")
    out[TLT_SECTION] = {
        "layout": "eagle1",
        "engine": engine,
        "fc_input": "concat(embed_tokens(x_{t+1}), h_t), 2*hidden_size; h_t: the target's final normed "
        "hidden state (NOT EAGLE-3's concat of three target layers)",
        "fc_bias": "zeros (our fc has none)" if engine == "sglang" else "none (vLLM's fc has none)",
        "layer0_input_layernorm": False,
        "final_norm": False,
        "lm_head": head,
    }
    if draft_vocab_size:
        out[TLT_SECTION]["token_map"] = f"{TOKEN_MAP_FILE}: the head rows (SGLang --speculative-token-map)"
    return out


def _vocab_ids(draft_vocab: np.ndarray, vocab_size: int) -> np.ndarray:
    """A draft vocabulary's token ids, deduplicated and sorted as the engine does, checked."""
    ids = np.unique(np.asarray(draft_vocab, np.int64))
    if ids.size == 0 or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"draft vocabulary: need token ids in [0, {vocab_size}), got {ids.size} ids")
    return ids


def _vocab_maps(draft_vocab: np.ndarray, vocab_size: int) -> dict[str, np.ndarray]:
    """EAGLE-3's maps of a draft vocabulary (what `from_eagle` reads)."""
    ids = _vocab_ids(draft_vocab, vocab_size)
    t2d = np.zeros(vocab_size, bool)
    t2d[ids] = True
    return {"d2t": ids - np.arange(ids.size, dtype=np.int64), "t2d": t2d}


def _our_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Path ('layer/attn/qkv') -> shape of our drafter's params for `cfg` (fused qkv and gate_up)."""
    h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    out = {
        "fc": (h, 2 * h),
        "layer/attn/qkv": (q + 2 * kv, h),
        "layer/attn/o_proj": (h, q),
        "layer/post_attn_norm/weight": (h,),
        "layer/mlp/gate_up": (2 * f, h),
        "layer/mlp/down": (h, f),
    }
    if cfg.qkv_bias:
        out["layer/attn/qkv_bias"] = (q + 2 * kv,)
    return out


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = np.asarray(v)
    return out


def to_eagle(
    params: Mapping[str, Any],
    cfg: ModelConfig,
    draft_vocab: np.ndarray | None = None,
    dtype: str | None = None,
    engine: str = "sglang",
) -> EagleExport:
    """Our drafter's params (`nnx.to_pure_dict(nnx.state(drafter, nnx.Param))`, or what a checkpoint stores)
    for target `cfg` -> the export for `engine` (HF-named tensors, config.json, the draft vocabulary).
    `dtype`: the export's float dtype (default: fc's). A reduced vocabulary for vLLM is a ValueError."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: use one of {ENGINES}")
    cfg = drafter_config(cfg)
    flat = _flat(params)
    want = _our_shapes(cfg)
    if set(flat) != set(want):
        raise ValueError(
            f"drafter params {sorted(flat)} are not a {cfg.architecture} drafter's {sorted(want)}"
        )
    _check_shapes(flat, want, "the drafter's weights", f"a drafter for the target {_dims(cfg)}")
    h, kv, d, g = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    dt = jnp.dtype(dtype or flat["fc"].dtype)
    qkv = flat["layer/attn/qkv"].reshape(kv, g + 2, d, h)
    gu = flat["layer/mlp/gate_up"].reshape(cfg.intermediate_size, 2, h)
    p = "layers.0."
    out = {
        "fc.weight": flat["fc"],
        p + "self_attn.q_proj.weight": qkv[:, :g].reshape(-1, h),
        p + "self_attn.k_proj.weight": qkv[:, g].reshape(-1, h),
        p + "self_attn.v_proj.weight": qkv[:, g + 1].reshape(-1, h),
        p + "self_attn.o_proj.weight": flat["layer/attn/o_proj"],
        p + "post_attention_layernorm.weight": flat["layer/post_attn_norm/weight"],
        p + "mlp.gate_proj.weight": gu[:, 0],
        p + "mlp.up_proj.weight": gu[:, 1],
        p + "mlp.down_proj.weight": flat["layer/mlp/down"],
    }
    if cfg.qkv_bias:
        b = flat["layer/attn/qkv_bias"].reshape(kv, g + 2, d)
        out[p + "self_attn.q_proj.bias"] = b[:, :g].reshape(-1)
        out[p + "self_attn.k_proj.bias"] = b[:, g].reshape(-1)
        out[p + "self_attn.v_proj.bias"] = b[:, g + 1].reshape(-1)
    if engine == "sglang":
        out["fc.bias"] = np.zeros((h,), dt)
    out = {k: np.ascontiguousarray(v.astype(dt)) for k, v in out.items()}
    vocab = None if draft_vocab is None else _vocab_ids(draft_vocab, cfg.vocab_size)
    if vocab is not None and engine == "vllm":
        raise _vllm_vocab_error(vocab.size, cfg.vocab_size)
    config = eagle_config(cfg, dt.name, None if vocab is None else vocab.size, engine)
    return EagleExport(out, config, vocab, engine)


def for_engine(
    tensors: Mapping[str, np.ndarray], hf_config: Mapping[str, Any], engine: str, full_vocab: bool = False
) -> EagleExport:
    """An EAGLE-1 directory's contents (`read_eagle_dir`: ours, for either engine) in `engine`'s layout:
    fc.bias written as zeros or dropped, the reduced vocabulary kept as the token map, or left out with
    `full_vocab` (a reduced vocabulary for vLLM without it is a ValueError naming the flag)."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: use one of {ENGINES}")
    _check_layout(tensors, hf_config, "the drafter")
    vocab_size = int(hf_config["vocab_size"])
    vocab = None if full_vocab else draft_vocab_from_maps(tensors, vocab_size, "the drafter")
    if vocab is not None and engine == "vllm":
        raise _vllm_vocab_error(vocab.size, vocab_size)
    out = {k: np.asarray(v) for k, v in tensors.items() if k not in ("fc.bias", "d2t", "t2d", *_SHARED)}
    if engine == "sglang":
        out["fc.bias"] = np.zeros(out["fc.weight"].shape[:1], out["fc.weight"].dtype)
    config = json.loads(json.dumps(dict(hf_config)))
    config.pop("draft_vocab_size", None)
    section = dict(config.get(TLT_SECTION) or {})
    section.pop("token_map", None)
    if vocab is not None:
        config["draft_vocab_size"] = int(vocab.size)
        section["token_map"] = f"{TOKEN_MAP_FILE}: the head rows (SGLang --speculative-token-map)"
    section["engine"] = engine
    section["fc_bias"] = "zeros (our fc has none)" if engine == "sglang" else "none (vLLM's fc has none)"
    config[TLT_SECTION] = section
    return EagleExport(out, config, vocab, engine)


def _dims(cfg: ModelConfig) -> str:
    return (
        f"(hidden {cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads} x {cfg.head_dim}, "
        f"intermediate {cfg.intermediate_size})"
    )


def _check_shapes(
    tensors: Mapping[str, np.ndarray], want: Mapping[str, tuple[int, ...]], where: str, policy: str
) -> None:
    """Raise naming both shapes of every tensor whose shape is not the one `want` gives."""
    bad = [f"{k} {tuple(tensors[k].shape)} vs {v}" for k, v in want.items() if tuple(tensors[k].shape) != v]
    if bad:
        raise ValueError(
            f"{where} does not fit {policy} (drafter vs expected shape: {'; '.join(bad)}): a drafter is "
            "trained for one target model (hidden size, heads, intermediate size)."
        )


# ----------------------------------------------------------------------------------------------------------
# Import


def _config_dims(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The policy-relevant dims of an EAGLE config.json, named as ModelConfig names them."""
    heads = int(hf_config.get("num_attention_heads", 0))
    rope = hf_config.get("rope_parameters") or {}
    return {
        "hidden_size": int(hf_config.get("hidden_size", 0)),
        "intermediate_size": int(hf_config.get("intermediate_size", 0)),
        "num_heads": heads,
        "num_kv_heads": int(hf_config.get("num_key_value_heads") or heads),
        "head_dim": int(hf_config.get("head_dim") or int(hf_config.get("hidden_size", 0)) // max(heads, 1)),
        "vocab_size": int(hf_config.get("vocab_size", 0)),
        "rope_theta": float(rope.get("rope_theta") or hf_config.get("rope_theta") or 10000.0),
    }


def _check_layout(tensors: Mapping[str, np.ndarray], hf_config: Mapping[str, Any], where: str) -> None:
    """Refuse what our EAGLE-1 drafter cannot hold: EAGLE-3, more layers, extra norms, a nonzero fc bias."""
    archs = " ".join(hf_config.get("architectures") or [])
    if "Eagle3" in archs or any(k.startswith("midlayer.") for k in tensors):
        raise ValueError(
            f"{where} is an EAGLE-3 drafter (fc over three target layers, `midlayer`, its own head): ours is "
            "EAGLE-1 (fc over the token embedding and the final hidden state); use an EAGLE-1/2 drafter."
        )
    if int(hf_config.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{where} has {hf_config['num_hidden_layers']} decoder layers: our drafter has one.")
    if "layers.0.input_layernorm.weight" in tensors:
        raise ValueError(f"{where} normalises its layer input (layers.0.input_layernorm): ours does not.")
    bias = tensors.get("fc.bias")
    if bias is not None and np.any(np.asarray(bias, np.float32) != 0):
        raise ValueError(
            f"{where} has a nonzero fc.bias (EAGLE's default bias=True): our drafter's fc has no bias, so "
            "its outputs would change; use a drafter trained with bias=False (or one exported by us)."
        )


def draft_vocab_from_maps(
    tensors: Mapping[str, np.ndarray], vocab_size: int, where: str
) -> np.ndarray | None:
    """The reduced draft vocabulary (sorted target ids) of an export's d2t/t2d, or None without them."""
    if "d2t" not in tensors:
        return None
    d2t = np.asarray(tensors["d2t"], np.int64)
    ids = np.arange(d2t.size, dtype=np.int64) + d2t
    if ids.size == 0 or np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"{where}: d2t maps to token ids outside the policy's vocabulary of {vocab_size}")
    t2d = tensors.get("t2d")
    if t2d is not None and (
        t2d.shape != (vocab_size,) or int(np.sum(t2d)) != ids.size or not np.all(t2d[ids])
    ):
        raise ValueError(
            f"{where}: t2d {t2d.shape} does not mark the {ids.size} tokens of d2t in {vocab_size}"
        )
    return ids.astype(np.int32)


def from_eagle(
    tensors: Mapping[str, np.ndarray],
    hf_config: Mapping[str, Any],
    policy: ModelConfig,
    where: str = "the drafter",
) -> tuple[dict[str, Any], np.ndarray | None]:
    """EAGLE-1 tensors + config.json -> (our drafter's params as a pure dict for `Drafter(policy)`, the draft
    vocabulary or None). Raises a ValueError naming both shapes when the drafter does not fit the policy."""
    cfg = drafter_config(policy)
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    _check_layout(tensors, hf_config, where)
    have = _config_dims(hf_config)
    diff = {k: (v, getattr(cfg, k)) for k, v in have.items() if v != getattr(cfg, k)}
    if diff:
        shown = ", ".join(f"{k} {a} vs {b}" for k, (a, b) in diff.items())
        raise ValueError(
            f"{where} does not fit the policy (drafter vs policy: {shown}): an EAGLE drafter is trained for "
            "one target model; use one made for this policy's model, or set config.drafter.kind=ngram."
        )
    want = expected_tensors(cfg)
    want.pop("fc.bias")
    known = set(want) | {"fc.bias", "d2t", "t2d", *_SHARED}
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - known)
    if missing or extra:
        hint = " (q/k/v biases: a Qwen2 drafter)" if any(k.endswith("_proj.bias") for k in extra) else ""
        raise ValueError(
            f"{where} is not an EAGLE-1 drafter for this {cfg.architecture} policy: missing {missing}, "
            f"unexpected {extra}{hint}."
        )
    _check_shapes(tensors, want, where, f"the policy ({cfg.architecture}, hidden {cfg.hidden_size})")
    return _params(tensors, cfg), draft_vocab_from_maps(tensors, cfg.vocab_size, where)


def _params(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[str, Any]:
    """HF-named tensors -> our fused layout (qkv rows [Hkv, G + 2, D], gate_up rows [F, 2])."""
    h, kv, d, g = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    p = "layers.0.self_attn."

    def qkv(suffix: str, tail: tuple[int, ...]) -> np.ndarray:
        q = tensors[p + "q_proj." + suffix].reshape(kv, g, d, *tail)
        k = tensors[p + "k_proj." + suffix].reshape(kv, 1, d, *tail)
        v = tensors[p + "v_proj." + suffix].reshape(kv, 1, d, *tail)
        return np.concatenate([q, k, v], axis=1).reshape(-1, *tail)

    attn = {"qkv": qkv("weight", (h,)), "o_proj": tensors[p + "o_proj.weight"]}
    if cfg.qkv_bias:
        attn["qkv_bias"] = qkv("bias", ())
    m = "layers.0.mlp."
    gate, up = tensors[m + "gate_proj.weight"], tensors[m + "up_proj.weight"]
    gate_up = np.stack([gate, up], axis=1).reshape(-1, h)
    layer = {
        "attn": attn,
        "post_attn_norm": {"weight": tensors["layers.0.post_attention_layernorm.weight"]},
        "mlp": {"gate_up": gate_up, "down": tensors[m + "down_proj.weight"]},
    }
    return {"fc": tensors["fc.weight"], "layer": layer}


def build_drafter(params: Mapping[str, Any], policy: ModelConfig) -> Drafter:
    """A `Drafter(policy)` holding `params` (a pure dict, e.g. `from_eagle`'s), cast to the policy's dtype."""
    want = _our_shapes(drafter_config(policy))
    _check_shapes(_flat(params), want, "the drafter's weights", f"the policy {_dims(policy)}")
    drafter = nnx.eval_shape(lambda: Drafter(policy, nnx.Rngs(0)))
    state = nnx.state(drafter, nnx.Param)
    dt = jnp.dtype(policy.dtype)
    nnx.replace_by_pure_dict(state, cast_tree(params, dt))
    nnx.update(drafter, state)
    return drafter


def cast_tree(tree: Mapping[str, Any], dt: jnp.dtype) -> dict[str, Any]:
    """A nested dict of arrays as jax arrays of dtype `dt` (a drafter's imported parameters)."""
    return {k: cast_tree(v, dt) if isinstance(v, Mapping) else jnp.asarray(v, dt) for k, v in tree.items()}


# ----------------------------------------------------------------------------------------------------------
# Directories


def fill_eagle_dir(directory: pathlib.Path, export: EagleExport) -> None:
    """Write `export` into the existing folder `directory`: config.json, model.safetensors, and token_map.pt
    with a reduced vocabulary."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(dict(export.tensors), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    if export.draft_vocab is not None:
        write_token_map(directory / TOKEN_MAP_FILE, export.draft_vocab)
    (directory / HF_CONFIG_FILE).write_text(json.dumps(export.config, indent=2) + "\n")


def write_eagle_dir(out: str | os.PathLike, export: EagleExport, force: bool = False) -> pathlib.Path:
    """Write `export` to `out` atomically (`utils.export_io.write_atomically`: a crash never leaves a
    half-written export; a non-empty `out` is replaced only with `force`)."""
    return write_atomically(out, force, lambda tmp: fill_eagle_dir(tmp, export))


def read_eagle_dir(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(tensors, config.json) of an EAGLE drafter directory, with a clear error for what is missing; a
    token_map.pt comes back as the d2t/t2d maps `from_eagle` reads."""
    d = pathlib.Path(path)
    weights, cfg = d / WEIGHTS_FILE, d / HF_CONFIG_FILE
    if not cfg.is_file() or not weights.is_file():
        bin_hint = ""
        if (d / "pytorch_model.bin").is_file():
            bin_hint = (
                " It has pytorch_model.bin: convert it with `safetensors.torch.save_file(torch.load("
                "'pytorch_model.bin'), 'model.safetensors', metadata={'format': 'pt'})`."
            )
        raise FileNotFoundError(
            f"{d} does not hold an EAGLE drafter ({HF_CONFIG_FILE} + {WEIGHTS_FILE}): export one with "
            f"{_EXPORT_HINT}, or download an EAGLE-1 drafter for this policy's model.{bin_hint}"
        )
    tensors, config = load_file(str(weights)), json.loads(cfg.read_text())
    if (
        d / TOKEN_MAP_FILE
    ).is_file() and "d2t" not in tensors:  # the reduced vocabulary, as from_eagle reads it
        tensors.update(_vocab_maps(read_token_map(d / TOKEN_MAP_FILE), int(config.get("vocab_size", 0))))
    return tensors, config


def load_eagle_drafter(path: str | os.PathLike, policy: ModelConfig) -> tuple[Drafter, np.ndarray | None]:
    """The drafter of an EAGLE-1 directory for a policy with config `policy`, and its draft vocabulary (an
    EAGLE-3 directory is `eagle3_format.load_eagle3_drafter`'s; `rl.speculation` picks by the directory)."""
    tensors, hf_config = read_eagle_dir(path)
    params, vocab = from_eagle(tensors, hf_config, policy, where=f"the EAGLE drafter in {path}")
    return build_drafter(params, policy), vocab


def init_from_problems(section: mlc.ConfigDict, check_paths: bool = True) -> list[str]:
    """Problems of `config.drafter.init_from` (an EAGLE directory the rollout drafter starts from)."""
    src = str(section.get("init_from") or "")
    if not src:
        return []
    out = []
    if section.kind not in ("eagle", "auto"):
        out.append(
            f"config.drafter.init_from={src!r} starts an EAGLE drafter, but config.drafter.kind="
            f"{section.kind!r} drafts without one: set kind=eagle (or auto), or clear init_from."
        )
    if section.get("path"):
        out.append("config.drafter.init_from and config.drafter.path both name a drafter: set only one.")
    d = pathlib.Path(src)
    if check_paths and not ((d / HF_CONFIG_FILE).is_file() and (d / WEIGHTS_FILE).is_file()):
        out.append(
            f"config.drafter.init_from={src!r} holds no {HF_CONFIG_FILE} + {WEIGHTS_FILE}: export a drafter "
            f"with {_EXPORT_HINT}, or point it at an EAGLE-1 drafter directory."
        )
    return out
