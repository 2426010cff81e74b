"""HASS's harmonised objective distillation (`LossConfig.topk`): the CE over the target's top-K tokens beside
the soft CE, for EAGLE-1 (the target's head) and EAGLE-3 (its own head over the draft vocabulary), at step 1
and at the chain steps of the training-time test (HASS's context alignment)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.drafter.test_eagle3_loss import VOCAB
from tests.drafter.test_eagle3_loss import setup as eagle3_setup  # noqa: F401 (a fixture)
from tlt_jax.drafter import packing
from tlt_jax.drafter.chain import ChainContext, draft_logits
from tlt_jax.drafter.loss import LossConfig, loss_sums, normalize_metrics
from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter

CFG = tiny_config(vocab_size=24)


@pytest.fixture(scope="module")
def eagle1(three_samples):
    target, samples = three_samples(CFG, seed=1)
    batch, _ = packing.pack_samples(samples, seq_len=32, rows=2)
    return target, Drafter(CFG, nnx.Rngs(7)), packing.to_device(batch), target.head_weight()


@pytest.fixture(scope="module")
def eagle3(eagle3_setup):  # noqa: F811
    target, drafter, _, batch = eagle3_setup
    return target, drafter, batch, target.head_weight()[jnp.asarray(VOCAB)]


@pytest.mark.parametrize("which", ["eagle1", "eagle3"])
def test_topk_distillation_by_hand_and_with_the_chain(which, request):
    target, drafter, batch, head = request.getfixturevalue(which)
    graphdef, params = nnx.split(drafter, nnx.Param)
    emb, k, w = target.embed[...], 4, 0.7
    f = jax.jit(loss_sums, static_argnums=(1, 5))
    base_total, base = f(params, graphdef, batch, emb, head, LossConfig(1.0, 0.5))
    total, m = f(params, graphdef, batch, emb, head, LossConfig(1.0, 0.5, topk=k, w_topk=w))
    assert "topk_sum" not in base and "ce_topk" in normalize_metrics(m)
    # step 1 by hand: -sum over the target's top-k tokens of p log q, at every valid pair
    e = packing.eagle_inputs(batch)
    final = np.asarray(e.hidden_target)[..., -CFG.hidden_size :]
    p = np.asarray(jax.nn.softmax(final @ np.asarray(head).T, -1), np.float64)
    ctx = ChainContext(drafter, emb, e.next_tokens, e.hidden_in, e.positions, e.mask)
    logq = np.asarray(jax.nn.log_softmax(draft_logits(drafter, ctx.h, head), -1), np.float64)
    top = np.argsort(-p, axis=-1)[..., :k]
    want = -np.sum(np.take_along_axis(p, top, -1) * np.take_along_axis(logq, top, -1), -1)
    want = float(np.sum(want * np.asarray(e.valid)))
    np.testing.assert_allclose(float(m["topk_sum"]), want, rtol=1e-5)
    np.testing.assert_allclose(float(total), float(base_total) + w * want, rtol=1e-5)
    # k = the whole vocabulary is the soft CE itself
    _, full = f(params, graphdef, batch, emb, head, LossConfig(1.0, 0.5, topk=head.shape[0]))
    np.testing.assert_allclose(float(full["topk_sum"]), float(full["ce_sum"]), rtol=1e-5)
    # with the training-time test the chain steps carry the term too, and its gradient reaches every weight
    cfg = LossConfig(1.0, 0.5, ttt_steps=2, ttt_positions=8, topk=k, w_topk=w)
    chain_only = LossConfig(1.0, 0.5, ttt_steps=2, ttt_positions=8)
    with_k, _ = f(params, graphdef, batch, emb, head, cfg)
    without, _ = f(params, graphdef, batch, emb, head, chain_only)
    assert float(with_k) - float(without) > w * want * (1 + 1e-3)  # step 1's term plus the chain's
    g = jax.jit(jax.grad(lambda q: loss_sums(q, graphdef, batch, emb, head, cfg)[0]))(params)
    assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g))
