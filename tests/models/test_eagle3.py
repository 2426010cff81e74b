"""The EAGLE-3 drafter's architecture: what it owns (fc over 3H, a layer whose q/k/v read 2H, hidden_norm, a
final norm and its own head over Vd tokens; never the target's embedding) and what it computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.models.config import tiny_config
from tlt_jax.models.eagle3 import Eagle3Drafter, default_aux_layers, make_drafter
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import causal_mask, rope_cos_sin


def _rms(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(w)


def test_parameters_and_default_layers():
    cfg = tiny_config("qwen2", num_layers=8)
    d = Eagle3Drafter(cfg, nnx.Rngs(0), draft_vocab_size=40)
    assert d.aux_layers == default_aux_layers(8) == (2, 4, 5)
    p = nnx.to_pure_dict(nnx.state(d, nnx.Param))
    h = cfg.hidden_size
    assert set(p) == {"fc", "layer", "norm", "lm_head"}  # no embedding: the target's is shared
    assert p["fc"].shape == (h, 3 * h) and p["lm_head"].shape == (40, h)
    assert p["layer"]["attn"]["qkv"].shape[1] == 2 * h
    assert "qkv_bias" not in p["layer"]["attn"]  # a Qwen2 target's EAGLE-3 has no biases (SGLang, vLLM)
    assert set(p["layer"]) == {"input_norm", "hidden_norm", "attn", "post_attn_norm", "mlp"}
    with pytest.raises(ValueError, match="need a target of >= 3 layers"):
        Eagle3Drafter(tiny_config(), nnx.Rngs(0))
    with pytest.raises(ValueError, match="drafter.arch='eagle2'"):
        make_drafter("eagle2", cfg, nnx.Rngs(0))


def test_forward_from_parts_and_cache_path_equal():
    """Output = f + attn([input_norm(e) ; hidden_norm(f)]) then the MLP residual, f = fc(first 3H of the
    states) (the final-state part is ignored), logits = lm_head(norm(h)); an own feature (width H) skips fc;
    the cached path (T=1 steps after a prefill) equals the full causal forward."""
    cfg = tiny_config("llama", num_layers=4)
    d = Eagle3Drafter(cfg, nnx.Rngs(3), draft_vocab_size=50, aux_layers=(1, 2, 4))
    b, t, h = 2, 6, cfg.hidden_size
    k = jax.random.split(jax.random.key(0), 3)
    emb = 3.0 * jax.random.normal(k[0], (b, t, h))
    states = 2.0 * jax.random.normal(k[1], (b, t, 4 * h))
    pos = jnp.broadcast_to(jnp.arange(1, t + 1), (b, t))
    out, _ = d(emb, states, pos)
    eps = cfg.rms_norm_eps
    f = np.asarray(states)[..., : 3 * h] @ np.asarray(d.fc[...]).T
    x = np.concatenate(
        [_rms(emb, d.layer.input_norm.weight[...], eps), _rms(f, d.layer.hidden_norm.weight[...], eps)], -1
    )
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
    a, _, _ = d.layer.attn(
        jnp.asarray(x, jnp.float32),
        cos,
        sin,
        None,
        None,
        jnp.zeros((b,), jnp.int32),
        causal_mask(b, t),
        "reference",
    )
    r = f + np.asarray(a)
    want = r + np.asarray(d.layer.mlp(d.layer.post_attn_norm(jnp.asarray(r, jnp.float32))))
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    logits = np.asarray(d.logits(out))
    np.testing.assert_allclose(
        logits, _rms(want, d.norm.weight[...], eps) @ np.asarray(d.lm_head[...]).T, atol=1e-3
    )
    # an own feature (width H) is used as f directly
    own, _ = d(emb, jnp.asarray(f, jnp.float32), pos)
    np.testing.assert_allclose(own, out, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="features of width"):
        d(emb, states[..., : 2 * h], pos)
    # the cache path, one token at a time, equals the full forward
    cache = d.init_cache(b, 16)
    for i in range(t):
        o, cache = d(
            emb[:, i : i + 1], states[:, i : i + 1], pos[:, i : i + 1], cache, jnp.ones((b, 1, 1), bool)
        )
        cache = KVCache(k=cache.k, v=cache.v, lengths=cache.lengths + 1)
        np.testing.assert_allclose(o[:, 0], out[:, i], rtol=1e-4, atol=1e-4)
