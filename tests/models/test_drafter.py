"""The EAGLE-1 drafter's architecture: what it owns (fc + one decoder layer, no input norm, never the target's
embedding or LM head) and what it computes (fc over concat(embed(x_{t+1}), h_t), then the layer)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter, drafter_config
from tlt_jax.models.llama import Transformer, causal_mask, rope_cos_sin


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_parameters_are_fc_and_one_layer_without_input_norm(arch):
    cfg = tiny_config(arch, tie_embeddings=False)
    target = Transformer(cfg, nnx.Rngs(0))
    drafter = Drafter(cfg, nnx.Rngs(1))
    assert drafter_config(cfg).num_layers == 1 and drafter.cfg.num_layers == 1
    params = nnx.to_pure_dict(nnx.state(drafter, nnx.Param))
    assert set(params) == {"fc", "layer"}  # no embedding, no LM head: the target's are passed in
    h = cfg.hidden_size
    assert params["fc"].shape == (h, 2 * h)  # Linear(2H -> H), no bias
    assert drafter.layer.input_norm is None and "input_norm" not in params["layer"]
    # the layer is the target family's decoder layer minus its input norm (same leaves, same shapes)
    tgt_layer = nnx.to_pure_dict(nnx.state(target.layers[0], nnx.Param))
    del tgt_layer["input_norm"]
    shapes = lambda d: jax.tree.map(lambda a: a.shape, d)  # noqa: E731
    assert shapes(params["layer"]) == shapes(tgt_layer)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    assert n_params == 2 * h * h + sum(x.size for x in jax.tree.leaves(tgt_layer))


def test_forward_is_fc_of_concat_then_layer_without_input_norm():
    """The drafter's output equals the composition written out from its parts: x = fc @ [embed; hidden],
    x + attn(x) (no input norm), then the post-attention MLP residual. Inputs at a large scale, so an input
    RMSNorm would change the attention input; swapping the concat order changes x."""
    cfg = tiny_config("llama", tie_embeddings=False)
    drafter = Drafter(cfg, nnx.Rngs(1))
    b, t, h = 2, 5, cfg.hidden_size
    k1, k2 = jax.random.split(jax.random.key(0))
    emb = 3.0 * jax.random.normal(k1, (b, t, h))
    hid = 5.0 * jax.random.normal(k2, (b, t, h))
    pos = jnp.broadcast_to(jnp.arange(1, t + 1), (b, t))
    out, cache = drafter(emb, hid, pos)
    assert cache is None and out.shape == (b, t, h)

    fc = np.asarray(drafter.fc[...])
    x = jnp.asarray(np.concatenate([np.asarray(emb), np.asarray(hid)], -1) @ fc.T)
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
    layer = drafter.layer
    a, _, _ = layer.attn(x, cos, sin, None, None, jnp.zeros((b,), jnp.int32), causal_mask(b, t), "reference")
    y = x + a
    want = y + layer.mlp(layer.post_attn_norm(y))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)

    swapped, _ = drafter(hid, emb, pos)  # the order of the concat matters
    assert float(jnp.abs(swapped - out).max()) > 1e-2
