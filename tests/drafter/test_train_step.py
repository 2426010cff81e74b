"""Drafter training: EAGLE alignment, packing with segment isolation, loss decrease, frozen target weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter import train_step as ts
from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer

CFG = tiny_config(vocab_size=64)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer(CFG, nnx.Rngs(0))


@nnx.jit
def _forward(model: Transformer, tokens: jax.Array) -> jax.Array:
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return model(tokens, pos, compute_logits=False).hidden


def make_samples(target: Transformer, lengths, prompt_lens, seed: int = 0) -> list[ts.DrafterSample]:
    """Random token sequences with the tiny target's real hidden states (one batched forward)."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, CFG.vocab_size, size=(len(lengths), 32)).astype(np.int32)
    hidden = np.asarray(_forward(target, jnp.asarray(toks)))  # causal: a prefix's states ignore the rest
    return [
        ts.sample_from_sequence(toks[i, :p].tolist(), toks[i, p:n].tolist(), hidden[i, :n])
        for i, (n, p) in enumerate(zip(lengths, prompt_lens, strict=True))
    ]


per_pair = jax.jit(ts.per_pair_losses)
loss_and_metrics = jax.jit(ts.loss_and_metrics, static_argnums=(1, 5))


def weights(target: Transformer) -> tuple[jax.Array, jax.Array]:
    return target.embed[...], target.head_weight()


def test_pack_layout_truncation_and_leftovers(target):
    samples = make_samples(target, [5, 7, 4, 20, 6], [2, 3, 1, 5, 2])
    batch, packed = ts.pack_samples(samples, seq_len=12, rows=2)
    # first-fit: row0 = s0 (5) + s1 (7) ; row1 = s2 (4) ; s3 (20) does not fit ; s4 (6) -> row1
    assert packed == [0, 1, 2, 4]
    np.testing.assert_array_equal(batch.segment_ids[0], [1] * 5 + [2] * 7)
    np.testing.assert_array_equal(batch.segment_ids[1], [1] * 4 + [2] * 6 + [0, 0])
    np.testing.assert_array_equal(batch.positions[0], list(range(5)) + list(range(7)))
    np.testing.assert_array_equal(batch.tokens[1, 4:10], samples[4].tokens)
    np.testing.assert_allclose(batch.hidden[0, 5:12], samples[1].hidden)
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1])
    # an over-long sample is truncated to seq_len and packed alone
    b2, p2 = ts.pack_samples([samples[3]], seq_len=12, rows=1)
    assert p2 == [0]
    np.testing.assert_array_equal(b2.tokens[0], samples[3].tokens[:12])
    # an epoch covers every sample exactly once
    batches = list(ts.iterate_packed(samples, 12, 2, np.random.default_rng(0)))
    assert sum(int((np.asarray(b.segment_ids) > 0).sum()) for b in batches) == 5 + 7 + 4 + 12 + 6


def test_eagle_alignment(target):
    (s,) = make_samples(target, [9], [4])
    batch, _ = ts.pack_samples([s], seq_len=12, rows=1)
    e = ts.eagle_inputs(ts.to_device(batch))
    np.testing.assert_array_equal(e.next_tokens[0, :8], s.tokens[1:])
    np.testing.assert_allclose(e.hidden_in[0, :9], s.hidden)
    np.testing.assert_allclose(e.hidden_target[0, :8], s.hidden[1:])
    np.testing.assert_array_equal(e.positions[0, :9], np.arange(1, 10))
    # pair t carries loss iff x_{t+1} is a response token: t = 3..7; the last token and padding never do
    np.testing.assert_array_equal(e.valid[0], [0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0])
    assert batch.num_loss_tokens() == 5


def test_packed_loss_equals_separate_losses(target):
    samples = make_samples(target, [10, 14, 7, 12, 9], [3, 5, 2, 4, 3], seed=1)
    drafter = Drafter(CFG, nnx.Rngs(1))
    graphdef, params = nnx.split(drafter, nnx.Param)
    emb, head = weights(target)
    cfg = ts.LossConfig(w_feat=1.0, w_ce=0.1)

    packed, idx = ts.pack_samples(samples, seq_len=32, rows=2)
    assert idx == list(range(5)) and int(np.asarray(packed.segment_ids).max()) >= 3  # several per row
    separate, _ = ts.pack_samples(samples, seq_len=14, rows=5)  # one sample per row
    assert (np.asarray(separate.segment_ids) <= 1).all()
    loss_p, m_p = loss_and_metrics(params, graphdef, ts.to_device(packed), emb, head, cfg)
    loss_s, m_s = loss_and_metrics(params, graphdef, ts.to_device(separate), emb, head, cfg)
    assert float(m_p["num_tokens"]) == float(m_s["num_tokens"]) == sum(s.num_response for s in samples)
    np.testing.assert_allclose(loss_p, loss_s, rtol=1e-5)
    np.testing.assert_allclose(m_p["ce"], m_s["ce"], rtol=1e-5)

    # per-pair values of every sample match too; under ONE causal mask per row (the reference's packing)
    # the later samples of a row attend to earlier ones and their losses change: the test can fail.
    def per_sample_feat(batch):
        t = per_pair(drafter, ts.to_device(batch), emb, head)
        seg, feat, valid = np.asarray(batch.segment_ids), np.asarray(t["feat"]), np.asarray(t["valid"])
        return [
            feat[r][(seg[r] == k) & valid[r]] for r in range(seg.shape[0]) for k in range(1, seg[r].max() + 1)
        ]

    got, want = per_sample_feat(packed), per_sample_feat(separate)
    key = lambda a: (len(a), round(float(a.sum()), 3))  # noqa: E731
    for a, b in zip(sorted(got, key=key), sorted(want, key=key), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    leaky = packed.replace(segment_ids=(np.asarray(packed.segment_ids) > 0).astype(np.int32))
    t_leak = per_pair(drafter, ts.to_device(leaky), emb, head)
    t_ok = per_pair(drafter, ts.to_device(packed), emb, head)
    later = (np.asarray(packed.segment_ids) > 1) & np.asarray(t_ok["valid"])
    assert np.abs(np.asarray(t_leak["feat"])[later] - np.asarray(t_ok["feat"])[later]).max() > 1e-4


def test_loss_is_smooth_l1_plus_soft_ce_against_a_numpy_reference(target):
    """The EAGLE loss written out in NumPy from the drafter's outputs on each sample alone: w_feat * SmoothL1
    (beta) of the predicted vs true next feature, averaged over the hidden axis, plus w_ce * the soft
    cross-entropy of the drafter's next-token distribution against the target's, both averaged over the
    response pairs of all samples. Non-default weights and beta, so each one has to be used as stated."""
    samples = make_samples(target, [10, 14, 7], [3, 5, 2], seed=5)
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

    packed = ts.to_device(ts.pack_samples(samples, seq_len=32, rows=1)[0])  # all three in one row
    cfg = ts.LossConfig(w_feat=w_feat, w_ce=w_ce, smooth_l1_beta=beta)
    loss, m = loss_and_metrics(params, graphdef, packed, emb, head, cfg)
    np.testing.assert_allclose(float(m["feat_loss"]), feat, rtol=1e-4)
    np.testing.assert_allclose(float(m["ce"]), ce, rtol=1e-4)
    np.testing.assert_allclose(float(loss), w_feat * feat + w_ce * ce, rtol=1e-4)


def test_loss_position_gather_and_ce_subset(target):
    samples = make_samples(target, [10, 14, 7, 12, 9], [3, 5, 2, 4, 3], seed=4)
    params_graph = nnx.split(Drafter(CFG, nnx.Rngs(2)), nnx.Param)
    emb, head = weights(target)
    n_loss = sum(s.num_response for s in samples)  # 35
    # the packer keeps every batch within the loss-position budget
    plan = ts.epoch_plan(
        [s.length for s in samples], 32, 2, None, [ts.loss_pairs(s, 32) for s in samples], 16
    )
    assert sorted(i for b in plan for i in b) == list(range(5))
    assert all(sum(samples[i].num_response for i in b) <= 16 for b in plan) and len(plan) >= 3
    batch, idx = ts.pack_samples(samples, 32, 2, max_loss_tokens=16)
    assert batch.num_loss_tokens() <= 16 and 0 < len(idx) < 5

    packed = ts.to_device(ts.pack_samples(samples, 32, 2)[0])
    base = ts.LossConfig(w_feat=1.0, w_ce=0.1)

    def run(cfg):
        return loss_and_metrics(params_graph[1], params_graph[0], packed, emb, head, cfg)[1]

    full = run(base)
    gathered = run(ts.LossConfig(1.0, 0.1, max_loss_tokens=40))  # >= 35 loss pairs: exact
    for k in ("loss", "feat_loss", "ce", "top1_acc", "num_tokens"):
        np.testing.assert_allclose(gathered[k], full[k], rtol=1e-5)
    assert float(gathered["dropped_tokens"]) == 0
    every = run(ts.LossConfig(1.0, 0.1, max_loss_tokens=40, ce_tokens=40))  # CE sample covers every pair
    np.testing.assert_allclose(every["ce"], full["ce"], rtol=1e-5)
    part = run(ts.LossConfig(1.0, 0.1, max_loss_tokens=40, ce_tokens=8))  # a subset: same feature loss
    np.testing.assert_allclose(part["feat_loss"], full["feat_loss"], rtol=1e-5)
    assert abs(float(part["ce"]) - float(full["ce"])) > 1e-6
    short = run(ts.LossConfig(1.0, 0.1, max_loss_tokens=30))  # an undersized budget is reported
    assert float(short["dropped_tokens"]) == n_loss - 30
    noisy = run(ts.LossConfig(1.0, 0.1, feature_noise=0.5))  # EAGLE's input-feature noise changes the loss
    assert abs(float(noisy["feat_loss"]) - float(full["feat_loss"])) > 1e-6


def test_loss_decreases_and_only_drafter_trains(target):
    samples = make_samples(target, [24, 30, 20, 28], [6, 8, 5, 7], seed=2)
    batch = ts.to_device(ts.pack_samples(samples, seq_len=64, rows=2)[0])
    emb, head = weights(target)
    emb_before, head_before = np.asarray(emb).copy(), np.asarray(head).copy()
    tx, _ = ts.optimizer_from_config(
        {"lr": 1e-2, "steps": 20, "warmup": 2, "weight_decay": 0.01, "clip_norm": 1.0}
    )
    graphdef, state = ts.init_train_state(Drafter(CFG, nnx.Rngs(3)), tx)
    params_before = jax.tree.map(np.asarray, state.params)
    cfg = ts.LossConfig(w_feat=1.0, w_ce=0.1)

    # gradients: non-zero for every drafter leaf, exactly zero for the target's embedding and head
    def f(p, e, h):
        return ts.loss_and_metrics(p, graphdef, batch, e, h, cfg)[0]

    g_p, g_e, g_h = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(state.params, emb, head)
    assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g_p))
    assert float(jnp.abs(g_e).max()) == 0.0 and float(jnp.abs(g_h).max()) == 0.0

    step = ts.make_train_step(graphdef, tx, cfg)
    losses = []
    for _ in range(20):
        state, m = step(state, batch, emb, head)
        losses.append(float(m["loss"]))
    assert int(state.step) == 20
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.8 * losses[0], losses
    np.testing.assert_array_equal(np.asarray(emb), emb_before)
    np.testing.assert_array_equal(np.asarray(head), head_before)
    changed = jax.tree.map(lambda a, b: not np.allclose(a, np.asarray(b)), params_before, state.params)
    assert all(jax.tree.leaves(changed))
    # the optimizer state covers the drafter's params only (no target-sized moments)
    n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
    n_par = sum(x.size for x in jax.tree.leaves(state.params))
    assert n_opt <= 2 * n_par + 8


def test_schedule_warmup_and_decay():
    s = ts.make_schedule(1e-3, total_steps=100, warmup_steps=10, end_lr_ratio=0.1)
    assert float(s(0)) == 0.0
    np.testing.assert_allclose(float(s(5)), 5e-4, rtol=1e-5)
    np.testing.assert_allclose(float(s(10)), 1e-3, rtol=1e-5)
    np.testing.assert_allclose(float(s(100)), 1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="schedule"):
        ts.make_schedule(1e-3, 10, 1, schedule="linear")
