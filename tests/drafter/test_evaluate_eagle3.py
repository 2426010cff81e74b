"""The drafter evaluation (tlt_jax/drafter/evaluate.py) with an EAGLE-3 drafter: its greedy and sampled
acceptance against a brute-force chain drafted by the Eagle3Drafter module with its KV cache, as the rollout
drafts (step 1 on the target's [aux x 3 ; final] states through fc, later steps on the drafter's own output,
drafts through its own head over the draft vocabulary and mapped to token ids by it).

The target and samples are test_eagle3_loss.py's (a 3-layer target, EAGLE-3's default capture points, three
packed samples, two sharing a row); the vocabulary is small (8 tokens, 6 in the draft vocabulary) so a
random drafter's drafts match the target's greedy tokens often enough for accepted runs of every length.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.drafter import evaluate as ev
from tlt_jax.drafter import packing
from tlt_jax.models.config import tiny_config
from tlt_jax.models.eagle3 import Eagle3Drafter
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import Transformer, with_aux_layers
from tlt_jax.rollout.sampling import SamplingParams, target_probs

CFG = tiny_config(vocab_size=8, num_layers=3)
VOCAB = np.array([0, 2, 3, 5, 6, 7], np.int32)  # the draft vocabulary: token ids of the head's rows
DEPTH = 3
SP = SamplingParams(temperature=0.9, top_k=6)


@pytest.fixture(scope="module")
def setup():
    """(target, drafter, samples): test_eagle3_loss.py's fixture at an 8-token vocabulary."""
    target = with_aux_layers(Transformer(CFG, nnx.Rngs(0)), (2, 1, 0))
    toks = np.random.default_rng(1).integers(0, CFG.vocab_size, size=(3, 16)).astype(np.int32)
    fwd = nnx.jit(
        lambda m, x: m(x, jnp.broadcast_to(jnp.arange(16), x.shape), compute_logits=False).drafter_states
    )
    states = np.asarray(fwd(target, jnp.asarray(toks)))
    samples = [
        packing.sample_from_sequence(toks[i, :p].tolist(), toks[i, p:n].tolist(), states[i, :n])
        for i, (n, p) in enumerate([(13, 4), (11, 3), (15, 5)])
    ]
    # seed 10: its 18 positions accept runs of 0, 1, 2 and 3 drafts (most seeds: only 0 and 1)
    return target, Eagle3Drafter(CFG, nnx.Rngs(10), draft_vocab_size=VOCAB.size), samples


@nnx.jit
def _chain(drafter, emb_w, vocab, toks, states, t, forced):
    """Steps 1..DEPTH of a chain from pair t of one sample through the drafter's KV cache, as the rollout
    drafts: pairs 0..t-1 in the cache, step 1 on pair t (the target's states), later steps on the drafter's
    own output and, as input token, the previous step's draft (greedy) or the true next token (`forced`).
    Returns (the greedy drafts as token ids [DEPTH], the draft logits [DEPTH, Vd])."""
    n = states.shape[0]
    cache = drafter.init_cache(1, 32)
    emb = jnp.take(emb_w, toks[1:], axis=0)[None]
    _, cache = drafter(
        emb, states[None, : n - 1], jnp.arange(1, n)[None], cache, jnp.tril(jnp.ones((1, n - 1, n - 1), bool))
    )
    cache = KVCache(k=cache.k, v=cache.v, lengths=jnp.full((1,), t, jnp.int32))
    feat, tok, drafts, logits = states[t][None, None], toks[t + 1], [], []
    for j in range(DEPTH):
        e = jnp.take(emb_w, tok, axis=0)[None, None]
        h, cache = drafter(e, feat, jnp.full((1, 1), t + 1 + j), cache, jnp.ones((1, 1, 1), bool))
        cache = KVCache(k=cache.k, v=cache.v, lengths=cache.lengths + 1)
        logits.append(drafter.logits(h[0, 0]))
        drafts.append(vocab[jnp.argmax(logits[-1])])
        feat, tok = h, jnp.where(forced, toks[t + 2 + j], drafts[-1])
    return jnp.stack(drafts), jnp.stack(logits)


def brute_force(target, drafter, samples):
    """Per evaluation position (x_{t+1} a response token, x_{t+DEPTH+1} present): the greedy chain's accepted
    drafts against the target's greedy tokens, and the rejection-sampled chain's per-step 1 - TV(p, q) along
    the true continuation (p over the draft vocabulary's tokens, q the drafter's over its head)."""
    emb, head = target.embed[...], np.asarray(target.head_weight())
    vocab = jnp.asarray(VOCAB)
    accepted, alphas = [], []
    for s in samples:
        final = np.asarray(s.hidden, np.float32)[:, -CFG.hidden_size :]
        greedy = np.argmax(final @ head.T, axis=-1)
        toks, states = jnp.asarray(s.tokens), jnp.asarray(s.hidden, jnp.float32)
        for t in range(s.length):
            if not (t + DEPTH + 1 <= s.length - 1 and s.loss_mask[t + 1]):
                continue
            drafts, _ = _chain(drafter, emb, vocab, toks, states, t, False)
            hit = np.cumprod(np.asarray(drafts) == greedy[t + 1 : t + 1 + DEPTH])
            accepted.append(int(hit.sum()))
            _, logits = _chain(drafter, emb, vocab, toks, states, t, True)
            p = target_probs(jnp.asarray(final[t + 1 : t + 1 + DEPTH] @ head.T), SP)[:, VOCAB]
            q = target_probs(logits, SP)
            alphas.append(np.asarray(jnp.minimum(p, q).sum(-1)))
    return accepted, np.stack(alphas)


def test_eagle3_acceptance_equals_brute_force_chains(setup):
    target, drafter, samples = setup
    want, alpha = brute_force(target, drafter, samples)
    assert set(want) == {0, 1, 2, 3}, want  # runs of every length: the comparison can tell them apart
    graphdef, params = nnx.split(drafter, nnx.Param)
    emb, head = target.embed[...], target.head_weight()
    evaluator = ev.AcceptanceEvaluator(graphdef, DEPTH, 32, 2, sampling=SP, draft_vocab=VOCAB)
    res = evaluator(params, samples, emb, head)  # 2 rows of 32: samples 0 and 1 share one
    assert res.num_positions == len(want)
    assert res.histogram == [want.count(k) for k in range(DEPTH + 1)]
    np.testing.assert_allclose(res.accept_length, np.mean(want) + 1, rtol=1e-6)
    np.testing.assert_allclose(res.per_position, [np.mean(np.asarray(want) >= j) for j in (1, 2, 3)])
    reach = np.cumprod(alpha, axis=-1)
    np.testing.assert_allclose(res.sampled_accept_length, 1 + reach.sum(-1).mean(), rtol=1e-5)
    np.testing.assert_allclose(res.sampled_per_position, reach.mean(0), rtol=1e-5)
    # the head's rows are the draft vocabulary's tokens: without their ids the evaluation is refused
    bare = ev.AcceptanceEvaluator(graphdef, DEPTH, 32, 2)
    with pytest.raises(ValueError, match="draft_vocab"):
        bare(params, samples, emb, head)
