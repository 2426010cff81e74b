"""Drafting chains over packed batches: teacher-forced chain steps vs the Drafter module, the training-time
test loss, and the sampled (rejection) acceptance estimate vs a brute-force computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter import evaluate as ev
from tlt_jax.drafter import packing
from tlt_jax.drafter.chain import ChainContext, shift_left
from tlt_jax.drafter.loss import LossConfig, chain_step_losses, loss_sums, per_pair_losses
from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.rollout.sampling import SamplingParams, target_probs

CFG = tiny_config(vocab_size=24)
PAD = 32


@pytest.fixture(scope="module")
def setup(three_samples):
    target, samples = three_samples(CFG, seed=1)
    drafter = Drafter(CFG, nnx.Rngs(7))
    batch, packed = packing.pack_samples(samples, seq_len=32, rows=2)  # several samples share a row
    assert packed == [0, 1, 2]
    return target, drafter, samples, packing.to_device(batch)


@nnx.jit
def _drafter_fwd(drafter, emb, hid, pos):
    return drafter(emb, hid, pos)[0]  # cache=None, causal mask


def brute_chain(drafter, target, sample, t, depth):
    """Features of teacher-forced chain steps 1..depth from pair t of one sample, by re-running the Drafter
    module on [true pairs 0..t] + [(x_{t+j}, h^_{j-1})] (positions t+1, t+2, ...)."""
    emb = np.asarray(target.embed[...])
    toks, hid = sample.tokens, np.asarray(sample.hidden, np.float32)
    in_tok = [int(toks[s + 1]) for s in range(t + 1)]
    in_h = [hid[s] for s in range(t + 1)]
    feats = []
    for j in range(1, depth + 1):
        m = len(in_tok)
        x_e = np.zeros((PAD, emb.shape[1]), np.float32)
        x_h = np.zeros((PAD, emb.shape[1]), np.float32)
        x_e[:m], x_h[:m] = emb[in_tok], np.stack(in_h)
        pos = np.zeros((PAD,), np.int32)
        pos[:m] = np.arange(1, m + 1)
        h = np.asarray(_drafter_fwd(drafter, x_e[None], x_h[None], pos[None]))[0, m - 1]
        feats.append(h)
        in_tok.append(int(toks[t + j + 1]))
        in_h.append(h)
    return feats


def _locate(batch):
    """(row, index, sample id, t) of every packed position with a segment."""
    seg = np.asarray(batch.segment_ids)
    out = []
    for r in range(seg.shape[0]):
        start = 0
        for i in range(seg.shape[1]):
            if seg[r, i] == 0:
                continue
            if i == 0 or seg[r, i] != seg[r, i - 1]:
                start = i
            out.append((r, i, r * 10 + int(seg[r, i]), i - start))
    return out


def test_teacher_forced_chain_equals_drafter_module(setup):
    target, drafter, samples, batch = setup
    depth = 3
    e = packing.eagle_inputs(batch)
    emb = target.embed[...]

    @jax.jit
    def chain(idx):
        ctx = ChainContext(drafter, emb, e.next_tokens, e.hidden_in, e.positions, e.mask)
        return ctx.teacher_forced(e.next_tokens, idx, depth)

    # every position whose chain stays inside its sample: check a few per row against the module
    by_sample = {}
    for r, i, sid, t in _locate(batch):
        by_sample.setdefault(sid, []).append((r, i, t))
    sample_of = {sid: samples[k] for k, sid in enumerate(sorted(by_sample))}
    checks = []
    for sid, pos in by_sample.items():
        n = sample_of[sid].length
        checks += [(r, i, sid, t) for r, i, t in pos if t + depth + 1 <= n - 1][:3]
    rows = {r for r, *_ in checks}
    assert rows == {0, 1}
    for r, i, sid, t in checks:
        idx = jnp.full((2, 1), i, jnp.int32)
        got = [np.asarray(f)[r, 0] for f in chain(idx)]
        want = brute_chain(drafter, target, sample_of[sid], t, depth)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)


def test_training_time_test_loss(setup):
    target, drafter, _, batch = setup
    graphdef, params = nnx.split(drafter, nnx.Param)
    emb, head = target.embed[...], target.head_weight()
    f = jax.jit(loss_sums, static_argnums=(1, 5))
    base_total, base = f(params, graphdef, batch, emb, head, LossConfig(1.0, 0.1))
    cfg = LossConfig(1.0, 0.1, ttt_steps=2, ttt_positions=8, ttt_weight=0.5)
    total, m = f(params, graphdef, batch, emb, head, cfg)
    # step 1 is unchanged; each chain step adds its weighted SUM (importance-weighted drawn positions)
    for k in ("feat_sum", "ce_sum", "top1_sum", "num_tokens"):
        np.testing.assert_allclose(m[k], base[k], rtol=1e-6)
    # the same (default) key: the same positions
    t = jax.jit(lambda d: per_pair_losses(d, batch, emb, head, ttt_steps=2, ttt_positions=8))(drafter)
    extra = 0.0
    for j, c in zip((2, 3), t["chain"], strict=True):
        v = np.asarray(c["valid"], np.float32)
        per_pos = np.asarray(c["feat"]) + 0.1 * np.asarray(c["ce"])
        extra += 0.5 ** (j - 1) * float(np.sum(np.asarray(c["weight"]) * v * per_pos))
        np.testing.assert_allclose(
            float(m[f"feat_sum_step{j}"]), float(np.sum(np.asarray(c["feat"]) * v)), rtol=1e-5
        )
        assert float(m[f"ce_sum_step{j}"]) > 0 and float(m[f"count_step{j}"]) == v.sum()
    np.testing.assert_allclose(float(total), float(base_total) + extra, rtol=1e-5)

    # gradients of the chain-step losses alone reach every drafter weight (they flow through the chain)
    def chain_loss(p):
        t = per_pair_losses(nnx.merge(graphdef, p), batch, emb, head, ttt_steps=2, ttt_positions=8)
        return sum(jnp.sum(c["ce"] * c["valid"]) + jnp.sum(c["feat"] * c["valid"]) for c in t["chain"])

    g = jax.jit(jax.grad(chain_loss))(params)
    assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g))

    # the chain losses equal a direct computation at the chosen positions (selection is per row, valid only)
    def direct(d):  # one program, not one per operation
        e = packing.eagle_inputs(batch)
        ctx = ChainContext(d, emb, e.next_tokens, e.hidden_in, e.positions, e.mask)
        return chain_step_losses(ctx, e, head, 2, 8, jax.random.key(3)), e.valid & shift_left(e.valid, False)

    steps, valid = jax.jit(direct)(drafter)
    for c in steps:
        assert c["valid"].shape == (2, 8)
        assert int(c["valid"].sum()) > 0
    assert int(steps[0]["valid"].sum()) <= int(valid.sum())


def test_sampled_acceptance_matches_brute_force(setup):
    target, drafter, samples, batch = setup
    depth = 2
    sp = SamplingParams(temperature=0.9, top_k=10)
    emb, head = target.embed[...], target.head_weight()
    fn = jax.jit(ev.sampled_acceptance, static_argnums=(4, 5, 6))
    alpha, sel = fn(drafter, batch, emb, head, depth, sp)
    alpha, sel = np.asarray(alpha), np.asarray(sel)
    vocab = np.random.default_rng(0).permutation(CFG.vocab_size)[:12]  # a reduced drafter head
    alpha_v = np.asarray(fn(drafter, batch, emb, head, depth, sp, None, jnp.asarray(vocab))[0])
    assert ((alpha >= 0) & (alpha <= 1 + 1e-6)).all()
    head_np = np.asarray(head)
    seen = 0  # brute force at the first 12 selected positions (rows 0 and 1, several samples)
    sample_ids = sorted({sid for _, _, sid, _ in _locate(batch)})
    for r, i, sid, t in _locate(batch):
        if not sel[r, i] or seen >= 12 or (r == 0 and seen >= 6):
            continue
        s = samples[sample_ids.index(sid)]
        feats = brute_chain(drafter, target, s, t, depth)
        for j, h in enumerate(feats, start=1):
            p = target_probs(jnp.asarray(np.asarray(s.hidden[t + j], np.float32) @ head_np.T), sp)
            q = target_probs(jnp.asarray(h @ head_np.T), sp)
            np.testing.assert_allclose(
                alpha[r, i, j - 1], float(jnp.minimum(p, q).sum()), rtol=1e-4, atol=1e-5
            )
            q_v = target_probs(jnp.asarray(h @ head_np[vocab].T), sp)  # q lives on the draft vocabulary
            want_v = float(jnp.minimum(p[vocab], q_v).sum())
            np.testing.assert_allclose(alpha_v[r, i, j - 1], want_v, rtol=1e-4, atol=1e-5)
        seen += 1
    assert seen == 12

    # the evaluator's sampled accept length is 1 + mean over positions of sum_j prod_{l<=j} alpha_l
    graphdef, params = nnx.split(drafter, nnx.Param)
    res = ev.AcceptanceEvaluator(graphdef, depth, 32, 2, sampling=sp)(params, samples, emb, head)
    reach = np.cumprod(alpha, axis=-1)[sel]
    assert res.num_positions == int(sel.sum())
    np.testing.assert_allclose(res.sampled_accept_length, 1 + reach.sum(-1).mean(), rtol=1e-5)
    np.testing.assert_allclose(res.sampled_per_position, reach.mean(0), rtol=1e-5)
    # a draft vocabulary holding every token (in another order) changes nothing
    perm = np.random.default_rng(1).permutation(CFG.vocab_size)
    full = ev.AcceptanceEvaluator(graphdef, depth, 32, 2, sampling=sp, draft_vocab=perm)(
        params, samples, emb, head
    )
    np.testing.assert_allclose(full.sampled_accept_length, res.sampled_accept_length, rtol=1e-5)
    # greedy settings report no sampled estimate
    greedy = ev.AcceptanceEvaluator(graphdef, depth, 32, 2, sampling=SamplingParams(temperature=0.0))
    assert greedy(params, samples, emb, head).sampled_accept_length is None
