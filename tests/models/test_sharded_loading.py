"""HF safetensors placed straight into sharded device arrays (`sharded_loading`) equal the float32 path
(`load_hf_dir` + `from_hf_tensors`): every parameter bit for bit, its sharding, and the logits; each device
shard is read once and only its rows."""

from __future__ import annotations

import pathlib

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from tlt_jax import config_lib
from tlt_jax import sharding as shd
from tlt_jax.models.llama import from_hf_tensors
from tlt_jax.models.loading import load_hf_dir, open_hf_dir
from tlt_jax.models.safetensors_io import SafetensorsDir, write_safetensors
from tlt_jax.models.sharded_loading import layer_param_slice, param_slice, place_hf_params
from tlt_jax.models.tokenizer import ByteTokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def _save_tiny(path: pathlib.Path, arch: str, tie: bool, torch_dtype: torch.dtype = torch.float32) -> None:
    """A tiny random Llama / Qwen2 (qkv biases drawn non-zero) saved as 2+ safetensors shards + index."""
    common = dict(
        vocab_size=272,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        rope_theta=5000.0,
    )
    torch.manual_seed(1)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    shard = "200KB" if torch_dtype == torch.float32 else "100KB"
    model.to(torch_dtype).save_pretrained(path, max_shard_size=shard)
    ByteTokenizer().save(path)
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) >= 2


def _mesh_shard_fn():
    mesh = shd.make_mesh(data=2, model=4)  # qkv rows split mid-KV-group: the partial-group path is exercised
    return mesh, lambda params: shd.param_shardings(params, mesh)


def _forward(model: nnx.Module, tokens: np.ndarray) -> np.ndarray:
    graphdef, state = nnx.split(model)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    run = jax.jit(lambda s, t, p: nnx.merge(graphdef, s)(t, p).logits)
    return np.asarray(run(state, tokens, positions))


@pytest.mark.parametrize(
    "arch,tie,stored,dtype",
    [
        ("llama", False, torch.float32, "float32"),
        ("qwen2", True, torch.float32, "bfloat16"),  # float32 -> bf16 rounding equals jnp's
        ("qwen2", False, torch.bfloat16, "float32"),  # bf16 widened exactly
    ],
)
def test_sharded_load_equals_float32_path(tmp_path, arch, tie, stored, dtype):
    _save_tiny(tmp_path, arch, tie, stored)
    mesh, shard_fn = _mesh_shard_fn()
    ckpt = open_hf_dir(tmp_path, dtype=dtype)
    new = place_hf_params(ckpt.config, ckpt.source, shard_fn)
    old_loaded = load_hf_dir(tmp_path, dtype=dtype)
    assert old_loaded.config == ckpt.config
    old = from_hf_tensors(old_loaded.config, old_loaded.tensors)
    new_state, old_state = nnx.state(new, nnx.Param), nnx.state(old, nnx.Param)
    want_shardings = shard_fn(old_state)
    flat_new = dict(nnx.to_flat_state(new_state))
    flat_sh = dict(nnx.to_flat_state(want_shardings))
    for path, var in nnx.to_flat_state(old_state):
        got = flat_new[path].get_value()
        assert got.dtype == np.dtype(dtype), path
        assert got.sharding.is_equivalent_to(flat_sh[path].get_value(), got.ndim), path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(var.get_value()), err_msg=str(path))
    # the float32 path's model on the same shardings runs the same program: logits equal exactly
    nnx.update(old, jax.device_put(old_state, want_shardings))
    tokens = np.random.default_rng(0).integers(0, 272, (2, 8)).astype(np.int32)
    np.testing.assert_array_equal(_forward(new, tokens), _forward(old, tokens))


def test_each_row_range_is_read_once(tmp_path, monkeypatch):
    """On a 2 x 4 mesh each parameter's distinct row ranges are read once (the data axis' replicas, the
    column shards of o_proj/down and the two halves of a KV group that a 4-way qkv split cuts share a
    read): the bytes read equal the checkpoint's. The vocab-sharded embedding is read a quarter at a time."""
    _save_tiny(tmp_path, "llama", False)
    ckpt = open_hf_dir(tmp_path)
    reads: list[tuple[str, int]] = []
    real_read = SafetensorsDir.read

    def spy(self: SafetensorsDir, name: str, rows: slice = slice(None)) -> np.ndarray:
        out = real_read(self, name, rows)
        reads.append((name, out.nbytes))
        return out

    monkeypatch.setattr(SafetensorsDir, "read", spy)
    place_hf_params(ckpt.config, ckpt.source, _mesh_shard_fn()[1])
    assert [b for n, b in reads if n == "model.embed_tokens.weight"] == [272 * 64 * 4 // 4] * 4
    total = sum(int(np.prod(i.shape)) * i.dtype.itemsize for i in ckpt.source.infos.values())
    assert sum(b for _, b in reads) == total


def test_stacked_layers_read_layer_by_layer(tmp_path):
    """A scanned decoder's stacked parameter ([num_layers, ...], no layer index in its path) is the stack
    of the per-layer slices."""
    _save_tiny(tmp_path, "qwen2", False)
    ckpt = open_hf_dir(tmp_path)
    for tail, rows in ((("attn", "qkv"), slice(16, 80)), (("attn", "qkv_bias"), slice(0, 128))):
        index = (slice(0, 2), rows) + ((slice(8, 40),) if tail[-1] == "qkv" else ())
        got = param_slice(ckpt.source, ckpt.config, ("layers", *tail), index)
        want = [layer_param_slice(ckpt.source, ckpt.config, i, tail, index[1:]) for i in range(2)]
        np.testing.assert_array_equal(got, np.stack(want))
    with pytest.raises(KeyError, match="no HF tensor maps to parameter rotary"):
        param_slice(ckpt.source, ckpt.config, ("rotary",), (slice(None),))


def test_writer_round_trips_with_safetensors(tmp_path):
    """`write_safetensors` (streamed, bf16 included) reads back equal through the safetensors package and
    through `SafetensorsDir` row ranges."""
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.normal(size=(5, 3)).astype(ml_dtypes.bfloat16),
        "b": rng.normal(size=(7,)).astype(np.float32),
        "c": rng.normal(size=(2, 3, 4)).astype(np.float16),
    }
    write_safetensors(tmp_path / "model.safetensors", {k: (v.shape, v.dtype) for k, v in tensors.items()},
                      tensors.__getitem__)  # fmt: skip
    theirs = safetensors_numpy.load_file(tmp_path / "model.safetensors")
    src = SafetensorsDir(tmp_path)
    for k, v in tensors.items():
        np.testing.assert_array_equal(theirs[k].astype(np.float32), v.astype(np.float32))
        np.testing.assert_array_equal(src.read(k, slice(1, 2)), v[1:2])
        assert src.read(k).dtype == v.dtype


def test_build_model_places_a_hf_dir_on_the_mesh(tmp_path):
    """`config_lib.build_model` on a HF directory: the model is born in the mesh's parameter layout."""
    _save_tiny(tmp_path, "qwen2", False)
    c = config_lib.load_config_file(CONFIGS / "qwen2_5_7b.py")
    c.model.arch, c.model.init, c.model.random = "", "auto", {}
    c.model.path, c.model.dtype = str(tmp_path), "float32"
    mesh, shard_fn = _mesh_shard_fn()
    model, tok = config_lib.build_model(c, mesh)
    qkv = model.layers[0].attn.qkv.get_value()
    assert qkv.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, shd.P("model", None)), 2)
    assert tok.vocab_size == ByteTokenizer().vocab_size
