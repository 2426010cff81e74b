"""The decoder vs HF transformers (tiny random Llama/Qwen2) and vs itself (cache vs full forward)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.models.config import ModelConfig, tiny_config
from tlt_jax.models.kv_cache import KVCache, StackedKVCache
from tlt_jax.models.layouts import layout_graphdef, stack_layers, unrolled, unstack_layers
from tlt_jax.models.llama import Transformer, causal_mask, from_hf_tensors, tiled

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_model(arch: str, tie: bool):
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=5000.0,
        tie_word_embeddings=tie,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    if arch == "llama":
        hf_cfg = transformers.LlamaConfig(**common, head_dim=16)
        model = transformers.LlamaForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(hf_cfg)
        with torch.no_grad():  # random (non-zero) biases so the bias path is exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.eval()
    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=112,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        tie_embeddings=tie,
        qkv_bias=arch == "qwen2",
        architecture=arch,
    )
    tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return model, from_hf_tensors(cfg, tensors), cfg


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", False)])
def test_parity_prefill_and_16_cached_decode_steps(arch, tie):
    """Prefill logits and 16 cached decode steps match transformers within 1e-4 (fp32)."""
    hf, ours, cfg = _hf_model(arch, tie)
    rng = np.random.default_rng(0)
    b, p, steps = 2, 9, 16
    tokens = rng.integers(0, 128, size=(b, p + steps))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    cache = KVCache.init(cfg, b, 32)
    pos = jnp.broadcast_to(jnp.arange(p + steps), (b, p + steps))
    out = ours(jnp.asarray(tokens[:, :p]), pos[:, :p], cache)
    np.testing.assert_allclose(out.logits, ref[:, :p], atol=1e-4, rtol=0)
    cache = out.cache.advance(p)
    step = jax.jit(lambda m, t, q, c: m(t, q, c, jnp.ones((b, 1, 1), bool)))
    for i in range(p, p + steps):
        out = step(ours, jnp.asarray(tokens[:, i : i + 1]), pos[:, i : i + 1], cache)
        cache = out.cache.advance(1)
        np.testing.assert_allclose(out.logits[:, 0], ref[:, i], atol=1e-4, rtol=0)


def test_cached_decode_equals_full_forward_with_ragged_rows():
    """Rows at different lengths in one batch: per-row cache offsets give the same logits as a full pass."""
    cfg = tiny_config("llama")
    m = Transformer(cfg, nnx.Rngs(3))
    rng = np.random.default_rng(1)
    lens = np.array([3, 7])
    total = 12
    toks = rng.integers(0, cfg.vocab_size, size=(2, total))
    full = [m(jnp.asarray(toks[i : i + 1]), jnp.arange(total)[None]).logits[0] for i in range(2)]
    # prefill right-padded prompts, each row committing its own length
    cache = KVCache.init(cfg, 2, 16)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    out = m(jnp.asarray(toks[:, :7]), pos, cache)
    cache = out.cache.advance(jnp.asarray(lens))
    n = jnp.asarray(lens)
    for _ in range(4):
        t = jnp.asarray(toks)[jnp.arange(2), n][:, None]
        out = m(t, n[:, None], cache, jnp.ones((2, 1, 1), bool))
        for i in range(2):
            np.testing.assert_allclose(out.logits[i, 0], full[i][int(n[i])], atol=1e-5)
        cache = out.cache.advance(1)
        n = n + 1


def test_tree_mask_equals_separate_branches():
    """Two sibling branches verified in one pass under a tree mask give each branch's own logits."""
    cfg = tiny_config("qwen2")
    m = Transformer(cfg, nnx.Rngs(4))
    prefix = jnp.asarray([[5, 9, 17, 2]])
    a, bb = [11, 12], [21, 22]
    # tree: nodes 0:a0 1:a1(parent a0) 2:b0 3:b1(parent b0)
    toks = jnp.asarray([[a[0], a[1], bb[0], bb[1]]])
    mask = jnp.asarray([[[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]], bool)
    pos = jnp.asarray([[4, 5, 4, 5]])
    cache = KVCache.init(cfg, 1, 16)
    cache = m(prefix, jnp.arange(4)[None], cache).cache.advance(4)
    tree = m(toks, pos, cache, mask).logits[0]
    for branch, idx in ((a, [0, 1]), (bb, [2, 3])):
        seq = jnp.concatenate([prefix, jnp.asarray([branch])], axis=1)
        ref = m(seq, jnp.arange(6)[None]).logits[0, 4:]
        np.testing.assert_allclose(tree[jnp.asarray(idx)], ref, atol=1e-5)


def test_bf16_forward_close_to_fp32():
    cfg = tiny_config("llama")
    m32 = Transformer(cfg, nnx.Rngs(0))
    m16 = Transformer(cfg.replace(dtype="bfloat16"), nnx.Rngs(0))
    toks = jnp.asarray([[1, 2, 3, 4, 5]])
    pos = jnp.arange(5)[None]
    l32 = m32(toks, pos).logits
    l16 = m16(toks, pos).logits
    assert l16.dtype == jnp.float32
    np.testing.assert_allclose(l16, l32, atol=5e-2)
    assert causal_mask(1, 5).shape == (1, 5, 5)


def test_causal_impl_equals_the_masked_forward_with_and_without_a_cache():
    """`causal_impl` (the trainer's flash attention) gives the logits of the tree-attention path: a whole
    sequence (no cache), and new tokens on top of ragged cached prefixes (query offset = cache length)."""
    cfg = tiny_config("qwen2")
    m = Transformer(cfg, nnx.Rngs(6))
    fwd = jax.jit(lambda m, t, p, c, impl: m(t, p, c, causal_impl=impl).logits, static_argnums=4)
    toks = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 11)))
    pos = jnp.broadcast_to(jnp.arange(11), (2, 11))
    want = fwd(m, toks, pos, None, None)
    np.testing.assert_allclose(fwd(m, toks, pos, None, "blockwise"), want, atol=1e-5)
    lens = jnp.asarray([3, 6])
    cache = m(toks[:, :6], pos[:, :6], KVCache.init(cfg, 2, 16)).cache.advance(lens)
    new = jnp.stack([toks[0, 3:8], toks[1, 6:11]])
    new_pos = lens[:, None] + jnp.arange(5)
    got = fwd(m, new, new_pos, cache, "blockwise")
    np.testing.assert_allclose(got, fwd(m, new, new_pos, cache, None), atol=1e-5)
    np.testing.assert_allclose(got[1], want[1, 6:], atol=1e-5)
    with pytest.raises(ValueError, match="pass no mask_btt"):
        m(new, new_pos, cache, causal_mask(2, 5), causal_impl="blockwise")
    with pytest.raises(ValueError, match="remat='full'"):
        m(toks, pos, remat="full")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stacked_layout_equals_the_unrolled_stack_and_writes_the_same_cache(arch):
    """The stacked layout (`stack_layers`: the layers as one `lax.scan` over [L]-leading weights and a
    `StackedKVCache`) gives the unrolled stack's logits and writes the same per-layer K/V, with causal
    attention (the trainer's) and with tree attention under a mask (float32, 1e-5); converting back gives
    the same parameters bit for bit, and a model built stacked has [L]-leading weights."""
    cfg = tiny_config(arch, num_layers=3)
    m = Transformer(cfg, nnx.Rngs(7))
    params = nnx.state(m, nnx.Param)
    s = nnx.merge(layout_graphdef(cfg, True), stack_layers(params))
    assert s.stacked and not m.stacked
    fwd = jax.jit(lambda m, t, p, c, impl: m(t, p, c, causal_impl=impl), static_argnums=4)
    toks = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 9)))
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    for cache in (None, KVCache.init(cfg, 2, 16).advance(jnp.asarray([2, 5]))):
        p = pos if cache is None else pos + cache.lengths[:, None]
        stacked_cache = None if cache is None else StackedKVCache.from_cache(cache)
        for impl in ("blockwise", None):
            a, b = fwd(s, toks, p, stacked_cache, impl), fwd(m, toks, p, cache, impl)
            np.testing.assert_allclose(a.logits, b.logits, atol=1e-5)
            if cache is not None:
                for x, y in zip(
                    a.cache.to_cache().k + a.cache.to_cache().v, b.cache.k + b.cache.v, strict=True
                ):
                    np.testing.assert_allclose(x, y, atol=1e-5)
    with pytest.raises(TypeError, match="a stacked model takes a StackedKVCache"):
        s(toks, pos, KVCache.init(cfg, 2, 16))
    back = unstack_layers(nnx.state(s, nnx.Param))
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), back, params))
    assert nnx.state(unrolled(s), nnx.Param)["layers"][2]["mlp"]["down"].shape == (
        cfg.hidden_size,
        cfg.intermediate_size,
    )
    built = nnx.state(Transformer(cfg, nnx.Rngs(0), stacked=True), nnx.Param)
    assert built["layers"]["attn"]["qkv"].shape == (3, *params["layers"][0]["attn"]["qkv"].shape)


def test_tiled_mlp_equals_the_mlp_at_any_length():
    """`tiled` (the update's MLP in token chunks, the last zero-padded) equals the MLP at once, values and
    gradients (float32, 1e-6), at lengths that are and are not multiples of the chunk."""
    mlp = Transformer(tiny_config("qwen2"), nnx.Rngs(2)).layers[0].mlp
    for t in (12, 11):
        x = jnp.asarray(np.random.default_rng(t).normal(size=(2, t, 64)), jnp.float32)
        np.testing.assert_allclose(tiled(mlp, x, 4), mlp(x), atol=1e-6)
        ga, gb = (jax.grad(lambda x, c=c: jnp.sum(jnp.sin(tiled(mlp, x, c))))(x) for c in (4, 0))
        np.testing.assert_allclose(ga, gb, atol=1e-6)
