"""The EAGLE loss: a NumPy reference, the SUM convention (sums and counts that add over batches), the
loss-position gather and the importance-weighted subsamples (CE pairs, training-time-test positions)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter import packing
from tlt_jax.drafter.loss import LossConfig, loss_and_metrics, loss_sums, normalize_metrics, per_pair_losses
from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer

CFG = tiny_config(vocab_size=64)
loss_and_metrics = jax.jit(loss_and_metrics, static_argnums=(1, 5))
loss_sums = jax.jit(loss_sums, static_argnums=(1, 5))


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer(CFG, nnx.Rngs(0))


def weights(target: Transformer) -> tuple[jax.Array, jax.Array]:
    return target.embed[...], target.head_weight()


def test_loss_is_smooth_l1_plus_soft_ce_against_a_numpy_reference(target, random_samples):
    """The EAGLE loss written out in NumPy from the drafter's outputs on each sample alone: w_feat * SmoothL1
    (beta) of the predicted vs true next feature, averaged over the hidden axis, plus w_ce * the soft
    cross-entropy of the drafter's next-token distribution against the target's, both averaged over the
    response pairs of all samples. Non-default weights and beta, so each one has to be used as stated."""
    samples = random_samples(target, [10, 14, 7], [3, 5, 2], seed=5)
    drafter = Drafter(CFG, nnx.Rngs(4))
    graphdef, params = nnx.split(drafter, nnx.Param)
    emb, head = weights(target)
    w_feat, w_ce, beta = 0.7, 0.3, 0.5
    feats, ces = [], []
    for s in samples:
        tok, hid, n = np.asarray(s.tokens), np.asarray(s.hidden, np.float32), len(s.tokens)
        # pair t = (x_{t+1}, h_t) at position t + 1 predicts h_{t+1}; it carries loss iff x_{t+1} is a
        # response token
        h_draft, _ = drafter(
            jnp.asarray(np.asarray(emb)[tok[1:]])[None], jnp.asarray(hid[:-1])[None], jnp.arange(1, n)[None]
        )
        h_draft, h_true = np.asarray(h_draft[0], np.float64), hid[1:].astype(np.float64)
        keep = np.asarray(s.loss_mask[1:], bool)
        d = np.abs(h_draft - h_true)
        feats.append(np.where(d < beta, 0.5 * d**2 / beta, d - 0.5 * beta).mean(-1)[keep])
        w = np.asarray(head, np.float64)
        t_logits, d_logits = h_true @ w.T, h_draft @ w.T
        p = np.exp(t_logits - t_logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        log_q = d_logits - d_logits.max(-1, keepdims=True)
        log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
        ces.append(-(p * log_q).sum(-1)[keep])
    feat, ce = np.concatenate(feats).mean(), np.concatenate(ces).mean()
    assert len(np.concatenate(feats)) == sum(s.num_response for s in samples)

    packed = packing.to_device(packing.pack_samples(samples, seq_len=32, rows=1)[0])  # all three in one row
    cfg = LossConfig(w_feat=w_feat, w_ce=w_ce, smooth_l1_beta=beta)
    loss, m = loss_and_metrics(params, graphdef, packed, emb, head, cfg)
    np.testing.assert_allclose(float(m["feat_loss"]), feat, rtol=1e-4)
    np.testing.assert_allclose(float(m["ce"]), ce, rtol=1e-4)
    np.testing.assert_allclose(float(loss), w_feat * feat + w_ce * ce, rtol=1e-4)
    # the SUM form: loss_sum = sum over loss pairs, num_tokens = their count
    _, sums = loss_sums(params, graphdef, packed, emb, head, cfg)
    n = len(np.concatenate(feats))
    assert float(sums["num_tokens"]) == n
    np.testing.assert_allclose(float(sums["loss_sum"]), n * (w_feat * feat + w_ce * ce), rtol=1e-4)


def test_loss_position_gather_and_ce_subset(target, random_samples):
    samples = random_samples(target, [10, 14, 7, 12, 9], [3, 5, 2, 4, 3], seed=4)
    graphdef, params = nnx.split(Drafter(CFG, nnx.Rngs(2)), nnx.Param)
    emb, head = weights(target)
    n_loss = sum(s.num_response for s in samples)  # 35
    packed = packing.to_device(packing.pack_samples(samples, 32, 2)[0])

    def run(cfg, key=0):
        return loss_sums(params, graphdef, packed, emb, head, cfg, jax.random.key(key))[1]

    full = run(LossConfig(1.0, 0.1))
    assert float(full["num_tokens"]) == n_loss == float(full["ce_count"])
    gathered = run(LossConfig(1.0, 0.1, max_loss_tokens=40))  # >= 35 loss pairs: exact
    for k in ("loss_sum", "feat_sum", "ce_sum", "top1_sum", "num_tokens"):
        np.testing.assert_allclose(gathered[k], full[k], rtol=1e-5)
    assert float(gathered["dropped_tokens"]) == 0
    every = run(LossConfig(1.0, 0.1, max_loss_tokens=40, ce_tokens=40))  # the CE draw covers every pair
    np.testing.assert_allclose(every["loss_sum"], full["loss_sum"], rtol=1e-5)
    # a subset: the same feature sum; the CE over 8 drawn pairs, counted 35 / 8 times each in the loss
    part = run(LossConfig(1.0, 0.1, max_loss_tokens=40, ce_tokens=8))
    np.testing.assert_allclose(part["feat_sum"], full["feat_sum"], rtol=1e-5)
    assert float(part["ce_count"]) == 8
    want = float(part["feat_sum"]) + 0.1 * n_loss / 8 * float(part["ce_sum"])
    np.testing.assert_allclose(float(part["loss_sum"]), want, rtol=1e-5)
    # ... an unbiased estimate: its mean over many draws approaches the full CE sum
    draws = [
        float(run(LossConfig(0.0, 1.0, max_loss_tokens=40, ce_tokens=8), key)["loss_sum"])
        for key in range(200)
    ]
    assert abs(np.mean(draws) - float(full["ce_sum"])) < 3 * np.std(draws) / np.sqrt(len(draws))
    assert np.std(draws) > 0
    short = run(LossConfig(1.0, 0.1, max_loss_tokens=30))  # an undersized budget is reported
    assert float(short["dropped_tokens"]) == n_loss - 30 and float(short["num_tokens"]) == 30
    noisy = run(LossConfig(1.0, 0.1, feature_noise=0.5))  # EAGLE's input-feature noise changes the loss
    assert abs(float(noisy["feat_sum"]) - float(full["feat_sum"])) > 1e-6
    # normalised metrics are the sums over their counts
    m = normalize_metrics(part)
    np.testing.assert_allclose(m["loss"], float(part["loss_sum"]) / n_loss, rtol=1e-6)
    np.testing.assert_allclose(m["ce"], float(part["ce_sum"]) / 8, rtol=1e-6)
    np.testing.assert_allclose(m["feat_loss"], float(part["feat_sum"]) / n_loss, rtol=1e-6)


def test_training_time_test_positions_are_importance_weighted(target, random_samples):
    """Chain steps at P random eligible positions per row count each drawn position (eligible / drawn) times:
    exact (weight 1) when every eligible position is drawn, unbiased otherwise."""
    samples = random_samples(target, [24, 30, 20, 28], [6, 8, 5, 7], seed=2)
    graphdef, params = nnx.split(Drafter(CFG, nnx.Rngs(5)), nnx.Param)
    emb, head = weights(target)
    batch = packing.to_device(packing.pack_samples(samples, 64, 2)[0])
    drafter = nnx.merge(graphdef, params)
    t = jax.jit(per_pair_losses, static_argnums=(4, 5, 6, 8, 9, 10))(
        drafter, batch, emb, head, 1.0, None, None, jax.random.key(0), 0.0, 2, 8
    )
    e = packing.eagle_inputs(batch)
    eligible = np.asarray(e.valid[:, :-1] & e.valid[:, 1:]).sum(1)  # both pairs of step 2 in the sample
    for c in t["chain"]:
        np.testing.assert_allclose(np.asarray(c["weight"])[:, 0], eligible / 8)
    cfg_all = LossConfig(0.0, 1.0, ttt_steps=1, ttt_positions=64)
    cfg_part = LossConfig(0.0, 1.0, ttt_steps=1, ttt_positions=8)
    base = float(loss_sums(params, graphdef, batch, emb, head, LossConfig(0.0, 1.0))[0])

    def chain_sum(cfg, key):
        return float(loss_sums(params, graphdef, batch, emb, head, cfg, jax.random.key(key))[0]) - base

    exact = chain_sum(cfg_all, 0)
    assert chain_sum(cfg_all, 1) == pytest.approx(exact, rel=1e-5)  # every position drawn: no randomness
    draws = [chain_sum(cfg_part, k) for k in range(200)]
    assert np.std(draws) > 0
    assert abs(np.mean(draws) - exact) < 3 * np.std(draws) / np.sqrt(len(draws))


def test_only_the_drafter_gets_gradients(target, random_samples):
    samples = random_samples(target, [24, 30, 20, 28], [6, 8, 5, 7], seed=2)
    batch = packing.to_device(packing.pack_samples(samples, seq_len=64, rows=2)[0])
    emb, head = weights(target)
    graphdef, params = nnx.split(Drafter(CFG, nnx.Rngs(3)), nnx.Param)
    cfg = LossConfig(w_feat=1.0, w_ce=0.1, ttt_steps=1)

    def f(p, e, h):
        return loss_sums(p, graphdef, batch, e, h, cfg)[0]

    g_p, g_e, g_h = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(params, emb, head)
    assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g_p))
    assert float(jnp.abs(g_e).max()) == 0.0 and float(jnp.abs(g_h).max()) == 0.0
