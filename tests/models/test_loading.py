"""Checkpoint loading: real GGUF against transformers, HF directories, tiny GGUFs, and clear errors."""

from __future__ import annotations

import json
import pathlib

import gguf
import numpy as np
import pytest

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.loading import (
    DEFAULT_GGUF_NAME,
    LoadedModel,
    expected_shapes,
    load_gguf,
    load_hf_dir,
    load_model,
    read_gguf,
)
from tlt_jax.models.tokenizer import ByteTokenizer, _byte_alphabet

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

VOCAB = 272  # >= ByteTokenizer's 261 ids


# ------------------------------------------------------------------------------------------- real GGUF
@pytest.fixture(scope="module")
def smol_loaded(smollm_gguf_path) -> LoadedModel:
    return load_gguf(smollm_gguf_path)


@pytest.fixture(scope="module")
def smol_hf_state(smollm_gguf_path) -> dict[str, np.ndarray]:
    """transformers' own GGUF import of the same file (its dequantization and q/k un-permutation)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_gguf_path.parent), gguf_file=smollm_gguf_path.name, dtype=torch.float32
    )
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_gguf_config(smol_loaded):
    c = smol_loaded.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == pytest.approx(1e-5)
    assert c.tie_embeddings and not c.qkv_bias and c.max_position_embeddings == 8192
    assert smol_loaded.tokenizer.vocab_size == 49152


@pytest.mark.slow
@pytest.mark.extended  # ~25 s, 20 of them transformers' own GGUF import; make test: test_smollm2.py's greedy
# "Paris" through this loader (a wrong q/k un-permute or dequantization garbles it) and the tokenizer parity
def test_gguf_tensors_equal_transformers(smol_loaded, smol_hf_state, smollm_gguf_path):
    """Every dequantized tensor equals transformers' state dict, q/k included (proves the un-permute)."""
    ours = smol_loaded.tensors
    assert set(smol_hf_state) - set(ours) == {"lm_head.weight"}  # tied: HF lists the shared head
    assert set(ours) <= set(smol_hf_state)
    for name, value in ours.items():
        assert value.dtype == np.float32, name
        np.testing.assert_allclose(value, smol_hf_state[name], rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(smol_hf_state["lm_head.weight"], ours["model.embed_tokens.weight"])
    # Without the un-permute, q/k would differ: the raw GGUF rows are in llama.cpp's order.
    gf = read_gguf(smollm_gguf_path)
    raw_q = gf.dequantize(next(t for t in gf.tensors if t.name == "blk.3.attn_q.weight"))
    raw_k = gf.dequantize(next(t for t in gf.tensors if t.name == "blk.3.attn_k.weight"))
    assert not np.allclose(raw_q, ours["model.layers.3.self_attn.q_proj.weight"])
    assert not np.allclose(raw_k, ours["model.layers.3.self_attn.k_proj.weight"])
    q = ours["model.layers.3.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(np.sort(raw_q, axis=None), np.sort(q, axis=None))  # same values, reordered


# ------------------------------------------------------------------------------------------- HF dirs
def _tiny_hf(arch: str, tie: bool):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        tie_word_embeddings=tie,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model.eval()


def _save_dir(model, path: pathlib.Path, **save_kw) -> dict[str, np.ndarray]:
    model.save_pretrained(path, **save_kw)
    ByteTokenizer().save(path)
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "arch,tie,sharded",
    [("llama", True, False), ("llama", False, True), ("qwen2", False, False), ("qwen2", True, True)],
)
def test_hf_dir_matches_state_dict(tmp_path, arch, tie, sharded):
    model = _tiny_hf(arch, tie)
    state = _save_dir(model, tmp_path, **({"max_shard_size": "40KB"} if sharded else {}))
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_hf_dir(tmp_path)
    c = loaded.config
    assert c == ModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        tie_embeddings=tie,
        qkv_bias=arch == "qwen2",
        max_position_embeddings=512,
        architecture=arch,
    )
    expected = set(state) - ({"lm_head.weight"} if tie else set())
    assert set(loaded.tensors) == expected == set(expected_shapes(c))
    for name in expected:
        np.testing.assert_array_equal(loaded.tensors[name], state[name], err_msg=name)
    assert loaded.tokenizer.eos_token_ids == ByteTokenizer().eos_token_ids
    assert load_model(tmp_path).config == c  # directory dispatch


def test_hf_dir_bf16_weights(tmp_path):
    """bf16 safetensors (numpy has no bfloat16) are widened exactly to float32; dtype is recorded."""
    model = _tiny_hf("qwen2", False).to(torch.bfloat16)
    state = _save_dir(model, tmp_path)
    loaded = load_hf_dir(tmp_path, dtype="bfloat16")
    assert loaded.config.dtype == "bfloat16"
    for name, value in state.items():
        assert loaded.tensors[name].dtype == np.float32
        np.testing.assert_array_equal(loaded.tensors[name], value, err_msg=name)


# ------------------------------------------------------------------------------------------- tiny GGUFs
def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation (what load_gguf must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model, arch: str, path: pathlib.Path, quantize_mlp: bool = True) -> None:
    """Convert a tiny HF model to GGUF the way llama.cpp does (names, q/k permute for llama, metadata)."""
    cfg = model.config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    spelling = _byte_alphabet()
    tokens = [spelling[b] for b in range(256)] + ["<bos>", "<eos>"]
    tokens += [f"<unused{i}>" for i in range(VOCAB - 258)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * (VOCAB - 256))
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer_names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for name, value in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{layer_names[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                value = _llama_cpp_permute(value, cfg.num_attention_heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                value = _llama_cpp_permute(value, cfg.num_key_value_heads)
        else:
            gname = names[name]
        if quantize_mlp and "ffn_" in gname and gname.endswith(".weight") and "norm" not in gname:
            q = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif "attn_output" in gname:
            w.add_tensor(gname, value.astype(np.float16))
        else:
            w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", False)])
def test_tiny_gguf_round_trip(tmp_path, arch, tie):
    """F32, F16 and Q8_0 tensors dequantize; llama q/k rows are un-permuted, qwen2's are left alone."""
    model = _tiny_hf(arch, tie)
    path = tmp_path / "tiny.gguf"
    _write_gguf(model, arch, path)
    loaded = load_model(path)  # file dispatch
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    assert loaded.config.architecture == arch and loaded.config.tie_embeddings == tie
    assert loaded.config.qkv_bias == (arch == "qwen2") and loaded.config.rope_theta == 5000.0
    assert set(loaded.tensors) == set(state) - ({"lm_head.weight"} if tie else set())
    for name, value in loaded.tensors.items():
        if ".mlp." in name:  # Q8_0: per-32-block absmax/127 steps
            step = np.abs(state[name]).max() / 127
            np.testing.assert_allclose(value, state[name], rtol=0, atol=step, err_msg=name)
        elif "o_proj" in name:  # F16
            np.testing.assert_allclose(value, state[name], rtol=1e-3, atol=1e-6, err_msg=name)
        else:  # F32, including the (un-permuted) q/k projections
            np.testing.assert_array_equal(value, state[name], err_msg=name)
    assert loaded.tokenizer.encode("hi") == [104, 105]
    assert all(v.flags.writeable and v.dtype == np.float32 for v in loaded.tensors.values())


def test_tiny_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([_byte_alphabet()[b] for b in range(256)] + ["<eos>"])
    w.add_token_types([1] * 256 + [3])
    w.add_eos_token_id(256)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported; supported: llama, qwen2"):
        load_gguf(path)


# ------------------------------------------------------------------------------------------- errors
def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.gguf does not exist"):
        load_model(tmp_path / "nothing.gguf")
    with pytest.raises(FileNotFoundError, match=f"{DEFAULT_GGUF_NAME} does not exist. Run `make setup`"):
        load_gguf(tmp_path / DEFAULT_GGUF_NAME)
    with pytest.raises(FileNotFoundError, match="no_dir does not exist"):
        load_hf_dir(tmp_path / "no_dir")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_dir(tmp_path)


@pytest.fixture()
def tiny_dir(tmp_path) -> pathlib.Path:
    _save_dir(_tiny_hf("llama", False), tmp_path)
    return tmp_path


def _edit_config(d: pathlib.Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_in_config_json(tiny_dir):
    _edit_config(tiny_dir, architectures=["MistralForCausalLM"], model_type="mistral")
    msg = "architecture 'MistralForCausalLM' is not supported; supported: LlamaForCausalLM, Qwen2ForCausalLM"
    with pytest.raises(ValueError, match=msg):
        load_hf_dir(tiny_dir)


def test_rope_scaling_is_rejected(tiny_dir):
    _edit_config(tiny_dir, rope_parameters={"rope_theta": 5000.0, "rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="RoPE scaling type 'llama3' is not supported"):
        load_hf_dir(tiny_dir)


def test_wrong_shape_missing_and_unexpected_tensors(tiny_dir):
    weights = safetensors_numpy.load_file(tiny_dir / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    bad = dict(weights, **{name: np.zeros((95, 64), np.float32)})
    safetensors_numpy.save_file(bad, tiny_dir / "model.safetensors")
    msg = r"'model.layers.1.mlp.up_proj.weight' has shape \(95, 64\) but the config implies \(96, 64\)"
    with pytest.raises(ValueError, match=msg):
        load_hf_dir(tiny_dir)
    without = {k: v for k, v in weights.items() if k != name}
    safetensors_numpy.save_file(without, tiny_dir / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_hf_dir(tiny_dir)
    extra = dict(weights, **{"model.layers.2.mlp.up_proj.weight": weights[name]})
    safetensors_numpy.save_file(extra, tiny_dir / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.2.mlp.up_proj.weight'"):
        load_hf_dir(tiny_dir)


def test_tokenizer_larger_than_model_vocab(tiny_dir):
    _edit_config(tiny_dir, vocab_size=200)
    weights = safetensors_numpy.load_file(tiny_dir / "model.safetensors")
    heads = ("model.embed_tokens.weight", "lm_head.weight")
    weights = {k: (v[:200] if k in heads else v) for k, v in weights.items()}
    safetensors_numpy.save_file(weights, tiny_dir / "model.safetensors")
    with pytest.raises(ValueError, match="tokenizer has 261 tokens but the model's vocab_size is 200"):
        load_hf_dir(tiny_dir)


def test_missing_tokenizer_and_weights(tiny_dir):
    (tiny_dir / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json does not exist"):
        load_hf_dir(tiny_dir)
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_hf_dir(tiny_dir)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_model(path)
    txt = tmp_path / "weights.bin"
    txt.write_bytes(b"x")
    with pytest.raises(ValueError, match="neither a .gguf file nor a HF model directory"):
        load_model(txt)
