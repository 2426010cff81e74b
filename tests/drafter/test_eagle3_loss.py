"""EAGLE-3 training on packed batches: the teacher-forced chain (training-time test) equals drafting with the
module's KV cache, and the loss is CE only (no feature regression) against the target's distribution over the
draft vocabulary, with gradients through the chain that lower it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tlt_jax.drafter import packing
from tlt_jax.drafter.chain import ChainContext
from tlt_jax.drafter.loss import LossConfig, loss_and_metrics, loss_sums
from tlt_jax.models.config import tiny_config
from tlt_jax.models.eagle3 import Eagle3Drafter
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import Transformer, with_aux_layers

CFG = tiny_config(vocab_size=24, num_layers=3)
VOCAB = np.array([0, 2, 3, 5, 7, 8, 11, 12, 13, 17, 19, 20, 23], np.int32)  # a reduced draft vocabulary


@pytest.fixture(scope="module")
def setup():
    """A 3-layer target with EAGLE-3's default capture points, three packed samples of its [aux ; final]
    states (lengths 13, 11, 15; prompts 4, 3, 5) and a drafter over the 13-token draft vocabulary."""
    target = with_aux_layers(Transformer(CFG, nnx.Rngs(0)), (2, 1, 0))
    toks = np.random.default_rng(1).integers(0, CFG.vocab_size, size=(3, 16)).astype(np.int32)
    fwd = nnx.jit(
        lambda m, x: m(x, jnp.broadcast_to(jnp.arange(16), x.shape), compute_logits=False).drafter_states
    )
    states = np.asarray(fwd(target, jnp.asarray(toks)))
    assert states.shape == (3, 16, 4 * CFG.hidden_size)
    samples = [
        packing.sample_from_sequence(toks[i, :p].tolist(), toks[i, p:n].tolist(), states[i, :n])
        for i, (n, p) in enumerate([(13, 4), (11, 3), (15, 5)])
    ]
    drafter = Eagle3Drafter(CFG, nnx.Rngs(7), draft_vocab_size=VOCAB.size)
    assert drafter.aux_layers == (2, 1, 0)
    batch, packed = packing.pack_samples(samples, seq_len=32, rows=2)
    assert packed == [0, 1, 2]
    return target, drafter, samples, packing.to_device(batch)


@nnx.jit
def _cached_chain(drafter, emb_w, toks, states, t, depth=3):
    """Chain steps 1..depth from pair t of one sample, drafted as the rollout does: the pairs 0..t-1 into the
    drafter's KV cache, then one position at a time, each later step on the drafter's own output."""
    n = states.shape[0]
    cache = drafter.init_cache(1, 32)
    emb = jnp.take(emb_w, toks[1:], axis=0)[None]
    pos = jnp.arange(1, n)[None]
    _, cache = drafter(emb, states[None, : n - 1], pos, cache, jnp.tril(jnp.ones((1, n - 1, n - 1), bool)))
    feats, feat = [], states[t][None, None]
    cache = KVCache(k=cache.k, v=cache.v, lengths=jnp.full((1,), t, jnp.int32))
    for j in range(depth):
        e = jnp.take(emb_w, toks[t + 1 + j], axis=0)[None, None]
        h, cache = drafter(e, feat, jnp.full((1, 1), t + 1 + j), cache, jnp.ones((1, 1, 1), bool))
        cache = KVCache(k=cache.k, v=cache.v, lengths=cache.lengths + 1)
        feats.append(h[0, 0])
        feat = h
    return feats


def test_teacher_forced_chain_equals_cached_drafting(setup):
    target, drafter, samples, batch = setup
    e = packing.eagle_inputs(batch)
    emb = target.embed[...]
    chain = jax.jit(
        lambda idx: ChainContext(
            drafter, emb, e.next_tokens, e.hidden_in, e.positions, e.mask
        ).teacher_forced(e.next_tokens, idx, 3)
    )
    seg = np.asarray(batch.segment_ids)
    checked = 0
    for k, s in enumerate(samples):  # samples 0, 1 share row 0; sample 2 is row 1
        r = 0 if k < 2 else 1
        start = int(np.argmax(seg[r] == (k + 1 if k < 2 else 1)))
        for t in (0, 2, s.length - 6):
            got = chain(jnp.full((2, 1), start + t, jnp.int32))
            want = _cached_chain(drafter, emb, jnp.asarray(s.tokens), jnp.asarray(s.hidden), t)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_allclose(np.asarray(g)[r, 0], w, rtol=2e-4, atol=2e-5)
            checked += 1
    assert checked == 9


def test_loss_is_draft_vocab_ce_without_feature_term_and_training_lowers_it(setup):
    target, drafter, _, batch = setup
    graphdef, params = nnx.split(drafter, nnx.Param)
    emb = target.embed[...]
    head = target.head_weight()[jnp.asarray(VOCAB)]  # the target's distribution over the draft vocabulary
    cfg = LossConfig(w_feat=1.0, w_ce=1.0, ttt_steps=2, ttt_positions=8)
    f = jax.jit(loss_sums, static_argnums=(1, 5))
    total, m = f(params, graphdef, batch, emb, head, cfg)
    assert float(m["feat_sum"]) == 0.0 and float(m["feat_sum_step2"]) == 0.0  # no feature regression
    # step 1's CE by hand: softmax of the target head's draft-vocabulary rows on the final state at t + 1
    e = packing.eagle_inputs(batch)
    h_final = np.asarray(e.hidden_target)[..., -CFG.hidden_size :]
    p = jax.nn.softmax(h_final @ np.asarray(head).T, -1)
    ctx = ChainContext(drafter, emb, e.next_tokens, e.hidden_in, e.positions, e.mask)
    logq = jax.nn.log_softmax(np.asarray(drafter.logits(ctx.h)), -1)
    valid = np.asarray(e.valid)
    np.testing.assert_allclose(float(m["ce_sum"]), float(-np.sum(np.sum(p * logq, -1) * valid)), rtol=1e-5)
    assert float(m["ce_sum_step2"]) > 0 and float(m["count_step2"]) > 0
    with pytest.raises(ValueError, match="head_w has 24 rows, the drafter's head 13"):
        f(params, graphdef, batch, emb, target.head_weight(), cfg)

    # gradients reach every drafter weight; Adam steps lower the loss, step 1's and the chain's
    g = jax.jit(jax.grad(lambda p: loss_sums(p, graphdef, batch, emb, head, cfg)[0]))(params)
    assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g))
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt):
        (loss, metrics), grads = jax.value_and_grad(loss_and_metrics, has_aux=True)(
            params, graphdef, batch, emb, head, cfg
        )
        upd, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, upd), opt, metrics

    _, _, first = step(params, opt)
    for _ in range(30):
        params, opt, metrics = step(params, opt)
    # the CE's floor is the target's entropy (near uniform for a random tiny target): the KL must halve
    ent = float(-np.sum(np.sum(p * np.log(p), -1) * valid) / valid.sum())
    assert float(metrics["ce"]) - ent < 0.5 * (float(first["ce"]) - ent)
    assert float(metrics["ce_step2"]) < float(first["ce_step2"]) - 0.5 * (float(first["ce"]) - ent)
