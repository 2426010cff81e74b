"""Packing with segment ids: layout, EAGLE alignment, and the acceptance test that a packed batch trains
exactly like its samples one by one (same loss, same gradients, under the SUM-loss convention)."""

import jax
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter import packing
from tlt_jax.drafter.loss import LossConfig, loss_sums, per_pair_losses
from tlt_jax.drafter.trainer import drafter_grads, mean_grads
from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer

CFG = tiny_config(vocab_size=64)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer(CFG, nnx.Rngs(0))


def test_pack_layout_truncation_and_leftovers(target, random_samples):
    samples = random_samples(target, [5, 7, 4, 20, 6], [2, 3, 1, 5, 2])
    batch, packed = packing.pack_samples(samples, seq_len=12, rows=2)
    # first-fit: row0 = s0 (5) + s1 (7) ; row1 = s2 (4) ; s3 (20) does not fit ; s4 (6) -> row1
    assert packed == [0, 1, 2, 4]
    np.testing.assert_array_equal(batch.segment_ids[0], [1] * 5 + [2] * 7)
    np.testing.assert_array_equal(batch.segment_ids[1], [1] * 4 + [2] * 6 + [0, 0])
    np.testing.assert_array_equal(batch.positions[0], list(range(5)) + list(range(7)))
    np.testing.assert_array_equal(batch.tokens[1, 4:10], samples[4].tokens)
    np.testing.assert_allclose(batch.hidden[0, 5:12], samples[1].hidden)
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1])
    # an over-long sample is truncated to seq_len and packed alone
    b2, p2 = packing.pack_samples([samples[3]], seq_len=12, rows=1)
    assert p2 == [0]
    np.testing.assert_array_equal(b2.tokens[0], samples[3].tokens[:12])
    # an epoch covers every sample exactly once
    batches = list(packing.iterate_packed(samples, 12, 2, np.random.default_rng(0)))
    assert sum(int((np.asarray(b.segment_ids) > 0).sum()) for b in batches) == 5 + 7 + 4 + 12 + 6
    # the step plan of the warm-up: epochs of the same batches, reshuffled per epoch, a pure function of step
    plan = packing.batch_plan(samples, 12, 2, seed=3)
    first = [plan(s) for s in range(len(batches))]
    assert sorted(i for b in first for i in b) == list(range(5))
    assert packing.batch_plan(samples, 12, 2, seed=3)(len(batches) + 1) == plan(len(batches) + 1)


def test_eagle_alignment(target, random_samples):
    (s,) = random_samples(target, [9], [4])
    batch, _ = packing.pack_samples([s], seq_len=12, rows=1)
    e = packing.eagle_inputs(packing.to_device(batch))
    np.testing.assert_array_equal(e.next_tokens[0, :8], s.tokens[1:])
    np.testing.assert_allclose(e.hidden_in[0, :9], s.hidden)
    np.testing.assert_allclose(e.hidden_target[0, :8], s.hidden[1:])
    np.testing.assert_array_equal(e.positions[0, :9], np.arange(1, 10))
    # pair t carries loss iff x_{t+1} is a response token: t = 3..7; the last token and padding never do
    np.testing.assert_array_equal(e.valid[0], [0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0])
    assert batch.num_loss_tokens() == 5


per_pair = jax.jit(per_pair_losses)
sums_fn = jax.jit(loss_sums, static_argnums=(1, 5))
grads_fn = jax.jit(drafter_grads, static_argnums=(0, 1))


def test_packed_batch_trains_like_its_samples_one_by_one(target, random_samples):
    """The acceptance test of packing: 5 samples packed several to a row give the SUM loss and SUM-loss
    gradient of the 5 samples each alone in a batch (same static shape), so the mean loss and the mean
    gradient (sums / loss tokens) are those of training on them one by one, token-weighted. The chain steps
    of the training-time test are included (every eligible position drawn: exact, weight 1)."""
    samples = random_samples(target, [10, 14, 7, 12, 9], [3, 5, 2, 4, 3], seed=1)
    graphdef, params = nnx.split(Drafter(CFG, nnx.Rngs(1)), nnx.Param)
    emb, head = target.embed[...], target.head_weight()
    cfg = LossConfig(w_feat=0.7, w_ce=0.3, max_loss_tokens=48, ttt_steps=2, ttt_positions=32, ttt_weight=0.5)
    key = jax.random.key(0)

    packed, idx = packing.pack_samples(samples, seq_len=32, rows=2, max_loss_tokens=48)
    assert idx == list(range(5)) and int(np.asarray(packed.segment_ids).max()) >= 3  # several per row
    g_packed, m_packed = grads_fn(graphdef, cfg, params, packing.to_device(packed), key, emb, head)
    alone = [packing.to_device(packing.pack_samples([s], seq_len=32, rows=2)[0]) for s in samples]
    per_sample = [grads_fn(graphdef, cfg, params, b, key, emb, head) for b in alone]

    n = sum(float(m["num_tokens"]) for _, m in per_sample)
    assert float(m_packed["num_tokens"]) == n == sum(s.num_response for s in samples)
    for k in ("loss_sum", "feat_sum", "ce_sum", "feat_sum_step2", "ce_sum_step3", "count_step3"):
        np.testing.assert_allclose(float(m_packed[k]), sum(float(m[k]) for _, m in per_sample), rtol=1e-5)
    assert float(m_packed["count_step3"]) > 0
    g_sum = jax.tree.map(lambda *g: sum(g), *[g for g, _ in per_sample])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6), g_packed, g_sum)
    mean_packed, mean_alone = mean_grads(g_packed, n), mean_grads(g_sum, n)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7), mean_packed, mean_alone)

    # the test can fail: under ONE causal mask per row (the reference's packing) later samples of a row
    # attend to earlier ones, and the gradient changes
    leaky = packed.replace(segment_ids=(np.asarray(packed.segment_ids) > 0).astype(np.int32))
    g_leak, _ = grads_fn(graphdef, cfg, params, packing.to_device(leaky), key, emb, head)
    leaves = zip(jax.tree.leaves(g_leak), jax.tree.leaves(g_sum), strict=True)
    diff = max(float(np.abs(a - b).max()) for a, b in leaves)
    assert diff > 1e-3


def test_per_pair_losses_are_isolated_per_segment(target, random_samples):
    """Per-pair values of every sample are the same packed or alone; merging the segments changes them."""
    samples = random_samples(target, [10, 14, 7, 12, 9], [3, 5, 2, 4, 3], seed=1)
    drafter = Drafter(CFG, nnx.Rngs(1))
    emb, head = target.embed[...], target.head_weight()
    packed, _ = packing.pack_samples(samples, seq_len=32, rows=2)
    separate, _ = packing.pack_samples(samples, seq_len=14, rows=5)  # one sample per row
    assert (np.asarray(separate.segment_ids) <= 1).all()

    def per_sample_feat(batch):
        t = per_pair(drafter, packing.to_device(batch), emb, head)
        seg, feat, valid = np.asarray(batch.segment_ids), np.asarray(t["feat"]), np.asarray(t["valid"])
        return [
            feat[r][(seg[r] == k) & valid[r]] for r in range(seg.shape[0]) for k in range(1, seg[r].max() + 1)
        ]

    got, want = per_sample_feat(packed), per_sample_feat(separate)
    key = lambda a: (len(a), round(float(a.sum()), 3))  # noqa: E731
    for a, b in zip(sorted(got, key=key), sorted(want, key=key), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    leaky = packed.replace(segment_ids=(np.asarray(packed.segment_ids) > 0).astype(np.int32))
    t_leak = per_pair(drafter, packing.to_device(leaky), emb, head)
    t_ok = per_pair(drafter, packing.to_device(packed), emb, head)
    later = (np.asarray(packed.segment_ids) > 1) & np.asarray(t_ok["valid"])
    assert np.abs(np.asarray(t_leak["feat"])[later] - np.asarray(t_ok["feat"])[later]).max() > 1e-4


def test_loss_budget_in_the_packer(target, random_samples):
    samples = random_samples(target, [10, 14, 7, 12, 9], [3, 5, 2, 4, 3], seed=4)
    plan = packing.epoch_plan(
        [s.length for s in samples], 32, 2, None, [packing.loss_pairs(s, 32) for s in samples], 16
    )
    assert sorted(i for b in plan for i in b) == list(range(5))
    assert all(sum(samples[i].num_response for i in b) <= 16 for b in plan) and len(plan) >= 3
    batch, idx = packing.pack_samples(samples, 32, 2, max_loss_tokens=16)
    assert batch.num_loss_tokens() <= 16 and 0 < len(idx) < 5
    # auto: the loss share of the packed tokens (35 / 52) of rows * seq_len, + 15%, rounded up to 64; None
    # (every position) once that reaches the whole batch
    assert packing.loss_token_budget(samples, 32, 16, -1) == 448
    assert packing.loss_token_budget(samples, 32, 2, -1) is None
    assert packing.loss_token_budget(samples, 32, 2, 0) is None
    assert packing.loss_token_budget(samples, 32, 2, 20) == 20
    with pytest.raises(ValueError, match="more than max_loss_tokens"):
        packing.epoch_plan([s.length for s in samples], 32, 2, None, [10] * 5, 8)
