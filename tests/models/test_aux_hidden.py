"""The target's EAGLE-3 states (`Transformer.aux_layers`): the residual stream entering the chosen layers, as
transformers' `output_hidden_states` gives it, in both layouts, and nothing more computed or returned when a
target has none."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.models.test_llama import _hf_model, torch
from tlt_jax.models.config import tiny_config
from tlt_jax.models.layouts import layout_graphdef, stack_layers
from tlt_jax.models.llama import Transformer, with_aux_layers


def test_aux_states_are_transformers_hidden_states_entering_each_layer():
    """Capture point i is transformers' hidden_states[i] (the stream entering layer i; 0 = the embedding);
    point L is the last layer's output before the final norm (its RMSNorm is the output's `hidden`).
    `drafter_states` is [aux ; final]. Float32, 1e-5."""
    hf, ours, cfg = _hf_model("qwen2", False)
    tokens = np.random.default_rng(0).integers(0, 128, size=(2, 7))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens), output_hidden_states=True).hidden_states
    with_aux_layers(ours, (1, 0, 2))
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    out = ours(jnp.asarray(tokens), pos)
    h = cfg.hidden_size
    assert out.aux_hidden.shape == (2, 7, 3 * h)
    np.testing.assert_allclose(out.aux_hidden[..., :h], ref[1].numpy(), atol=1e-5)
    np.testing.assert_allclose(out.aux_hidden[..., h : 2 * h], ref[0].numpy(), atol=1e-5)
    np.testing.assert_allclose(ours.norm(out.aux_hidden[..., 2 * h :]), out.hidden, atol=1e-5)
    np.testing.assert_allclose(out.drafter_states[..., 3 * h :], out.hidden)
    np.testing.assert_allclose(out.drafter_states[..., : 3 * h], out.aux_hidden)
    with pytest.raises(ValueError, match=r"outside \[0, 2\]"):
        with_aux_layers(ours, (0, 3))


def test_stacked_layout_captures_what_the_unrolled_stack_captures():
    """The trainer's layout (one `lax.scan`) captures the same states, with and without remat."""
    cfg = tiny_config("llama", num_layers=3)
    m = with_aux_layers(Transformer(cfg, nnx.Rngs(7)), (2, 0, 3))
    s = with_aux_layers(
        nnx.merge(layout_graphdef(cfg, True), stack_layers(nnx.state(m, nnx.Param))), (2, 0, 3)
    )
    toks = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 9)))
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    want = m(toks, pos).aux_hidden
    for remat in ("none", "nothing_saveable"):
        got = jax.jit(lambda s, t, p, r=remat: s(t, p, causal_impl="blockwise", remat=r).aux_hidden)(
            s, toks, pos
        )
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_no_aux_layers_no_extra_program_or_bytes():
    """A target without aux layers lowers to the same program as one built before they existed would (the
    default and an explicit empty tuple: one HLO text), and a target with K of them returns exactly
    K * B * T * H * 4 more output bytes (the states are output only when asked for)."""
    cfg = tiny_config("llama", num_layers=3)
    model = Transformer(cfg, nnx.Rngs(0))
    toks = jnp.zeros((2, 5), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))

    def lowered(aux):
        graphdef, params = nnx.split(with_aux_layers(Transformer(cfg, nnx.Rngs(0)), aux), nnx.Param)
        fwd = jax.jit(lambda p, t, q: nnx.merge(graphdef, p)(t, q))
        return fwd.lower(params, toks, pos)

    plain = lowered(())
    graphdef, params = nnx.split(model, nnx.Param)
    default = jax.jit(lambda p, t, q: nnx.merge(graphdef, p)(t, q)).lower(params, toks, pos)
    assert plain.as_text() == default.as_text()

    def out_bytes(low):
        return sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(low.out_info))

    three = lowered((1, 2, 3))
    assert out_bytes(three) - out_bytes(plain) == 3 * 2 * 5 * cfg.hidden_size * 4
