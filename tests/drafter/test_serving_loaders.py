"""The exported EAGLE drafter against what SGLang's and vLLM's EAGLE-1 loaders read, without either engine.

The tensor names and config keys come from the loaders' own source: tests/recorded/serving_loaders.json
quotes, unchanged and grouped by class, the lines of each file (repository, path, commit) that create the
drafter's parameters, fuse q/k/v and gate/up, drop the first layer's input norm and read config.json keys;
`source_facts` derives from those lines the checkpoint names the class loads and the keys it reads without
a default. The rest is data below, our reading of the same files: the drafter class a config resolves to,
the biases and shapes, and what `load_weights` does with a tensor it has no parameter for. `load` replays
them on an export's files, so a name, shape or key our export gets wrong fails here. Neither engine ran.

vLLM (EagleLlamaForCausalLM):
  vllm-project/vllm vllm/model_executor/models/llama_eagle.py @ e1c4a55214c63e19e83f82ad6c552d82148bae0b
      fc = Linear(2H, H, bias=False); layer 0's input_layernorm is Identity; load_weights maps q/k/v ->
      qkv_proj and gate/up -> gate_up_proj, skips embed_tokens (the target's, no pipeline parallelism), and
      looks every other name up in params_dict: a name it has no parameter for raises KeyError.
      (@ 00da92319af4b2ad2cde8525b7b609c779bdc52f, a version with the speculators remap, skips such names
      silently instead: either way an extra tensor never loads.) EagleLlamaForCausalLM prefixes "model."
      to every name without "lm_head" and has no lm_head or d2t: EAGLE-1 drafts over the target's head.
  vllm/model_executor/models/llama.py @ e06c9ba2a6ea923a84add30f5dafaea126429b81 (LlamaDecoderLayer):
      attention_bias = config.attention_bias or config.bias (q/k/v and o_proj); `qkv_bias`, when present,
      decides q/k/v's bias alone; mlp bias from mlp_bias; head_dim = config.head_dim.
  vllm/transformers_utils/configs/eagle.py @ 23c5aa92d517802488a0c77a5f58cd0a2019c5a3 (EAGLEConfig,
      method "eagle"): every `architectures` name that does not start with "Eagle" gets it prefixed.
  vllm/model_executor/models/registry.py @ bf8e76246223e2c5e9c4df0c72e24250e9f1db36: the EAGLE-1 drafter
      classes are EagleLlamaForCausalLM, EagleLlama4ForCausalLM, EagleMiniCPMForCausalLM; the first name of
      `architectures` it knows is used.
SGLang (LlamaForCausalLMEagle, Qwen2ForCausalLMEagle):
  sgl-project/sglang python/sglang/srt/models/llama_eagle.py @ 3b64d5dee0756de843b5f022966f69c995cd15ea and
  qwen2_eagle.py @ 088a7eafdf9c119c5376056db011e29e187bd498: fc = Linear(2H, H) (bias=True); layer 0
      without input_layernorm; load_weights skips names containing "lm_head" and prefixes "model." to the
      others; the EntryClass names are the architectures; embed and head are the target's
      (set_embed_and_head).
  python/sglang/srt/models/llama.py @ bf7a0e237e8d5b2ce5402f5d2fafce31e012dbdf: attention bias (q/k/v and
      o_proj) = config.attention_bias or config.bias; head_dim = config.head_dim; load_weights skips a
      ".bias" it has no parameter for and warns "Parameter ... not found in params_dict" for any other
      unknown name (dropped).
  python/sglang/srt/models/qwen2.py @ 0005b7e1e2523e7ed40a5f6a43a62e2306e95c55: Qwen2Attention has q/k/v
      biases always and no o_proj bias, head_dim = hidden_size // num_attention_heads, Qwen2MLP refuses
      hidden_act other than silu; load_weights skips a ".bias" it lacks and raises KeyError on any other
      unknown name (params_dict[name]).
  python/sglang/srt/speculative/eagle_worker.py @ fba8eccd7ebe41bbdbf70ab3b6a2df1835f8b532: with
      --speculative-token-map, `torch.load(path, weights_only=True)` gives the hot token ids: the target head
      rows the EAGLE-1 drafter drafts over (hot_vocab_size = their number).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re
from collections.abc import Callable, Mapping

import numpy as np
import pytest

from tests.drafter.test_eagle_format import params_of, random_drafter
from tlt_jax.drafter import eagle_format as ef
from tlt_jax.drafter.token_map import read_token_map
from tlt_jax.export_drafter import main as export_main
from tlt_jax.models.config import tiny_config

VOCAB = np.array([0, 3, 4, 17, 40, 41, 99, 127])  # a reduced draft vocabulary of tiny_config's 128 tokens


QUOTES = json.loads((pathlib.Path(__file__).parents[1] / "recorded" / "serving_loaders.json").read_text())
LINEAR = (
    "QKVParallelLinear",
    "RowParallelLinear",
    "MergedColumnParallelLinear",
    "RMSNorm",
    "torch.nn.Linear",
)


@dataclasses.dataclass(frozen=True)
class SourceFacts:
    """What an engine's drafter class loads and reads, derived from its quoted source lines."""

    weights: frozenset[str]  # checkpoint names of its weights (fused q/k/v and gate/up split back)
    fc_bias: bool  # its fc Linear has a bias (torch.nn.Linear's default unless bias=False)
    required_keys: frozenset[str]  # config.json keys read as config.<key> (no default)
    optional_keys: frozenset[str]  # keys read by getattr / hasattr (with a default)


def _assigned(lines: list[str]) -> list[tuple[str, str]]:
    """(attribute, constructor) of each `self.<attribute> = <constructor>(` in the lines."""
    return re.findall(r"self\.(\w+) = ([\w.]+)\(", "\n".join(lines))


@functools.cache
def source_facts(engine: str, cls: str) -> SourceFacts:
    """The drafter class's weights and config keys from its quoted lines: the decoder layer's Linear / RMSNorm
    modules and those of the attention and MLP classes it builds (at layer 0), the EAGLE model's fc, minus
    the modules the EAGLE layer deletes, with every fused name (the load_weights mapping's tuples) replaced
    by the checkpoint names mapped onto it."""
    spec = QUOTES["classes"][engine][cls]
    eagle, base = (QUOTES["sources"][spec[k]]["quotes"] for k in ("eagle", "base"))
    text = "\n".join(line for src in (eagle, base) for lines in src.values() for line in lines)
    layer = base[spec["layer"]]
    aliases = dict(re.findall(r"(\w+): type\[nn\.Module\] = (\w+)", "\n".join(layer)))
    names = ["layers.0." + a for a, ctor in _assigned(layer) if ctor in LINEAR]
    for attr, ctor in _assigned(layer):
        for inner, c in _assigned(base.get(aliases.get(ctor, ctor), [])):
            names += [f"layers.0.{attr}.{inner}"] * (c in LINEAR)
    fc = [(a, c) for a, c in _assigned(eagle[spec["model"]]) if c in LINEAR]
    names += [a for a, _ in fc]
    deleted = {"layers.0." + a for a in re.findall(r"del self\.(\w+)", "\n".join(eagle[spec["layer"]]))}
    fused: dict[str, list[str]] = {}
    for param, shard in re.findall(r'\("\.?(\w+)", "\.?(\w+)", [^)]+\)', text):
        fused.setdefault(param, []).append(shard)
    weights = set()
    for name in set(names) - deleted:
        head, last = name.rsplit(".", 1) if "." in name else ("", name)
        weights |= {f"{head}.{x}".lstrip(".") + ".weight" for x in fused.get(last, [last])}
    fc_line = next(line for line in eagle[spec["model"]] if "self.fc = " in line)
    optional = set(re.findall(r"(?:getattr|hasattr)\(\s*(?:self\.)?config,\s*\"(\w+)\"", text))
    required = set(re.findall(r"\bconfig\.(\w+)", text)) - optional
    return SourceFacts(
        frozenset(weights), "bias=False" not in fc_line, frozenset(required), frozenset(optional)
    )


def _flag(config: Mapping, *keys: str) -> bool:
    return any(bool(config.get(k, False)) for k in keys)


@dataclasses.dataclass(frozen=True)
class Loader:
    """One engine's EAGLE-1 drafter class, as its source reads a checkpoint (module docstring)."""

    engine: str
    cls: str
    qkv_bias: Callable[[Mapping], bool]  # q/k/v biases, from config.json
    o_bias: Callable[[Mapping], bool]
    head_dim: Callable[[Mapping], int]
    on_unknown: str  # "raise" (KeyError) or "drop" (a warning): a tensor it has no parameter for
    skip: Callable[[str], bool]  # names it skips before the lookup (the target's embedding / head)
    skip_missing_bias: bool  # a ".bias" it has no parameter for is skipped silently
    config_keys: tuple[str, ...]  # besides those its quoted source reads (`source_facts`)


KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "rms_norm_eps",
    "hidden_act",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "tie_word_embeddings",
    "torch_dtype",
    "model_type",
)
VLLM_LLAMA = Loader(
    "vllm",
    "EagleLlamaForCausalLM",
    qkv_bias=lambda c: c["qkv_bias"] if "qkv_bias" in c else _flag(c, "attention_bias", "bias"),
    o_bias=lambda c: _flag(c, "attention_bias", "bias"),
    head_dim=lambda c: c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
    on_unknown="raise",
    skip=lambda n: "embed_tokens." in n,
    skip_missing_bias=False,
    config_keys=(*KEYS, "head_dim", "attention_bias", "qkv_bias"),
)
SGLANG_LLAMA = Loader(
    "sglang",
    "LlamaForCausalLMEagle",
    qkv_bias=lambda c: _flag(c, "attention_bias", "bias"),
    o_bias=lambda c: _flag(c, "attention_bias", "bias"),
    head_dim=lambda c: c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
    on_unknown="drop",
    skip=lambda n: "lm_head" in n,
    skip_missing_bias=True,
    config_keys=(*KEYS, "head_dim", "attention_bias"),
)
SGLANG_QWEN2 = Loader(
    "sglang",
    "Qwen2ForCausalLMEagle",
    qkv_bias=lambda c: True,
    o_bias=lambda c: False,
    head_dim=lambda c: c["hidden_size"] // c["num_attention_heads"],
    on_unknown="raise",
    skip=lambda n: "lm_head" in n,
    skip_missing_bias=True,
    config_keys=KEYS,
)
CLASSES = {
    "vllm": {"EagleLlamaForCausalLM": VLLM_LLAMA},
    "sglang": {loader.cls: loader for loader in (SGLANG_LLAMA, SGLANG_QWEN2)},
}
VLLM_REGISTRY = {"EagleLlamaForCausalLM", "EagleLlama4ForCausalLM", "EagleMiniCPMForCausalLM"}


def resolve(engine: str, config: Mapping) -> Loader:
    """The drafter class the engine picks from config.json's `architectures` (vLLM prefixes "Eagle")."""
    names = list(config["architectures"])
    if engine == "vllm":
        names = [n if n.startswith("Eagle") else f"Eagle{n}" for n in names]
    registry = VLLM_REGISTRY if engine == "vllm" else set(CLASSES[engine])
    known = next((n for n in names if n in registry), None)
    assert known in CLASSES[engine], (
        f"{engine} resolves {names} to {known}, not an EAGLE-1 Llama/Qwen2 drafter"
    )
    return CLASSES[engine][known]


def parameters(loader: Loader, c: Mapping) -> dict[str, tuple[int, ...]]:
    """The checkpoint names and shapes the loader's drafter class creates from config.json `c`: the weights
    its quoted source creates (`source_facts`), their shapes and the q/k/v/o biases by our reading."""
    h, f, d = c["hidden_size"], c["intermediate_size"], loader.head_dim(c)
    q, kv, p = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, "layers.0."
    shapes = {"fc": (h, 2 * h), "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
    shapes |= {"post_attention_layernorm": (h,), "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
    facts = source_facts(loader.engine, loader.cls)
    out = {name: shapes[name.split(".")[-2]] for name in facts.weights}
    out |= {"fc.bias": (h,)} if facts.fc_bias else {}
    if loader.qkv_bias(c):
        out |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,)}
        out |= {p + "self_attn.v_proj.bias": (kv,)}
    if loader.o_bias(c):
        out[p + "self_attn.o_proj.bias"] = (h,)
    return out


def load(engine: str, directory: pathlib.Path) -> tuple[Loader, dict[str, np.ndarray], list[str]]:
    """Replay the engine's loader on an export directory: (its class, the tensors it loads by name, the
    names it drops). Raises KeyError where the engine would."""
    config = json.loads((directory / "config.json").read_text())
    facts = source_facts(engine, resolve(engine, config).cls)
    read = (*facts.required_keys, *resolve(engine, config).config_keys)
    missing_keys = sorted({k for k in read if k not in config})
    assert not missing_keys and config["num_hidden_layers"] == 1, missing_keys
    loader = resolve(engine, config)
    params = parameters(loader, config)
    from safetensors.numpy import load_file

    loaded, dropped = {}, []
    for name, x in load_file(str(directory / "model.safetensors")).items():
        if loader.skip(name):
            continue
        if name in params:
            assert x.shape == params[name], f"{engine} {name}: {x.shape} vs its parameter {params[name]}"
            loaded[name] = x
        elif loader.skip_missing_bias and name.endswith(".bias"):
            dropped.append(name)
        elif loader.on_unknown == "raise":
            raise KeyError(f"{loader.cls}: {name}")
        else:
            dropped.append(name)
    assert set(loaded) == set(params), f"{engine}: parameters left at their init: {set(params) - set(loaded)}"
    return loader, loaded, dropped


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_each_engine_loads_every_tensor_of_its_export(tmp_path, arch, engine) -> None:
    """Every parameter of the engine's drafter class is in the export at its shape, nothing is dropped,
    config.json has every key the class reads at the drafter's values; SGLang's fc.bias is zeros."""
    cfg = tiny_config(arch)
    export = ef.to_eagle(params_of(random_drafter(cfg, 1)), cfg, engine=engine)
    out = ef.write_eagle_dir(tmp_path / engine, export)
    loader, loaded, dropped = load(engine, out)
    assert dropped == [] and loader.cls == {"vllm": "EagleLlamaForCausalLM"}.get(
        engine, "Qwen2ForCausalLMEagle" if arch == "qwen2" else "LlamaForCausalLMEagle"
    )
    # the source's one layer: fc, q/k/v/o, the post-attention norm, gate/up/down (no input norm at layer 0);
    # the optional keys our bias and head_dim rules consult are keys its source reads
    facts = source_facts(engine, loader.cls)
    assert len(facts.weights) == 9 and not any("input_layernorm" in n for n in facts.weights)
    assert set(loader.config_keys) - set(KEYS) <= facts.optional_keys, facts.optional_keys
    conf = export.config
    assert (conf["hidden_size"], conf["num_attention_heads"], conf["num_key_value_heads"]) == (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
    )
    assert loader.head_dim(conf) == cfg.head_dim and conf["hidden_act"] == "silu"
    assert conf["tlt_drafter"]["engine"] == engine
    if engine == "sglang":
        assert not np.any(loaded["fc.bias"])


def test_reduced_vocabulary_is_sglangs_token_map_and_refused_for_vllm(tmp_path) -> None:
    """SGLang: the vocabulary goes to token_map.pt, which torch.load(weights_only=True) reads as SGLang does,
    and no d2t/t2d tensor reaches its strict Qwen2 loader. vLLM: refused, naming --full-vocab; with it, the
    export loads."""
    cfg = tiny_config("qwen2")
    params = params_of(random_drafter(cfg, 2))
    out = ef.write_eagle_dir(tmp_path / "sglang", ef.to_eagle(params, cfg, VOCAB))
    _, loaded, dropped = load("sglang", out)
    assert dropped == [] and "d2t" not in loaded
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == VOCAB.size
    np.testing.assert_array_equal(read_token_map(out / "token_map.pt"), VOCAB)
    torch = pytest.importorskip("torch")  # not on a `make setup-gpu` node
    hot = torch.tensor(torch.load(out / "token_map.pt", weights_only=True), dtype=torch.int64)
    np.testing.assert_array_equal(hot.numpy(), VOCAB)
    with pytest.raises(ValueError, match=r"reduced vocabulary of 8 of 128 tokens.*--full-vocab"):
        ef.to_eagle(params, cfg, VOCAB, engine="vllm")
    with pytest.raises(SystemExit, match=r"--full-vocab"):
        export_main(["--from-dir", str(out), "--out", str(tmp_path / "vllm"), "--engine", "vllm"])
    export_main(["--from-dir", str(out), "--out", str(tmp_path / "vllm"), "--engine", "vllm", "--full-vocab"])
    _, vllm_loaded, _ = load("vllm", tmp_path / "vllm")
    for name, x in vllm_loaded.items():  # the same weights, fc.bias left out
        np.testing.assert_array_equal(x, loaded[name])
    assert not (tmp_path / "vllm" / "token_map.pt").exists()


def test_one_layout_for_both_engines_would_fail(tmp_path) -> None:
    """Why the export has a layout per engine: SGLang's zero fc.bias makes vLLM's loader raise, and the
    former layout (d2t/t2d tensors) crashes SGLang's Qwen2 loader and is dropped by its Llama loader (the
    drafter would then draft over the full vocabulary without a word)."""
    cfg = tiny_config("qwen2")
    sglang = ef.to_eagle(params_of(random_drafter(cfg, 3)), cfg, engine="sglang")
    ef.write_eagle_dir(tmp_path / "both", sglang)
    with pytest.raises(KeyError, match="fc.bias"):
        load("vllm", tmp_path / "both")
    maps = {"d2t": VOCAB - np.arange(VOCAB.size), "t2d": np.isin(np.arange(128), VOCAB)}
    old = dataclasses.replace(sglang, tensors={**sglang.tensors, **maps})
    ef.write_eagle_dir(tmp_path / "old", old)
    with pytest.raises(KeyError, match="d2t"):
        load("sglang", tmp_path / "old")
    llama = tiny_config("llama")
    old_llama = ef.to_eagle(params_of(random_drafter(llama, 3)), llama)
    ef.write_eagle_dir(
        tmp_path / "old_llama", dataclasses.replace(old_llama, tensors={**old_llama.tensors, **maps})
    )
    assert load("sglang", tmp_path / "old_llama")[2] == ["d2t", "t2d"]
    # our own reader still takes the former layout (drafter.init_from of an older export)
    _, vocab = ef.from_eagle(*ef.read_eagle_dir(tmp_path / "old"), cfg)
    np.testing.assert_array_equal(vocab, VOCAB)
