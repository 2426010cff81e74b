"""EAGLE-3 drafts in the engine's speculative rounds: greedy chains and trees equal plain decoding (float32),
and sampled rollouts keep the target's distribution (chi-square, as tests/rollout/test_engine_sd.py does for
EAGLE-1), with the drafter's own head over a reduced draft vocabulary.

The drafter is an EAGLE-3 "mirror" of the tiny targets of test_engine_sd.py (attention scaled up, so it
dominates each layer's output): its q/k/v read only the embedding half of [input_norm(e) ; hidden_norm(f)]
with the target's first-layer weights, its MLP, final norm and head (the head's draft-vocabulary rows) are the
target's, so it predicts the target closely; fc (the fused three layers' states) is small noise, which sets
the acceptance."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.rollout.test_engine_sd import (
    EOS,
    NUM_SAMPLES,
    PASS_P,
    PROMPTS,
    SAMPLE_CFG,
    SAMPLING,
    V,
    _sample,
    chi_square_pvalue,
)
from tlt_jax.models.config import tiny_config
from tlt_jax.models.eagle3 import Eagle3Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FixedMode
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams, target_probs

GREEDY = SamplingParams(temperature=0.0)
CFG = tiny_config(num_layers=2, tie_embeddings=False)  # test_engine_sd.py's target: EOS splits the batch


def mirror3(target: Transformer, vocab: np.ndarray, noise: float, aux: tuple[int, ...]) -> Eagle3Drafter:
    """An EAGLE-3 drafter that copies the target's first layer (module docstring), head over `vocab`."""
    d = Eagle3Drafter(target.cfg, nnx.Rngs(5), draft_vocab_size=len(vocab), aux_layers=aux)
    src = target.layers[0]
    w = src.attn.qkv[...]
    d.layer.attn.qkv[...] = jnp.concatenate([w, jnp.zeros_like(w)], axis=1)
    if src.attn.qkv_bias is not None:
        d.layer.attn.qkv_bias[...] = src.attn.qkv_bias[...]
    d.layer.attn.o_proj[...] = src.attn.o_proj[...]
    nnx.update(d.layer.input_norm, nnx.state(src.input_norm))
    nnx.update(d.layer.mlp, nnx.state(src.mlp))
    nnx.update(d.layer.post_attn_norm, nnx.state(src.post_attn_norm))
    nnx.update(d.norm, nnx.state(target.norm))
    d.lm_head[...] = target.head_weight()[jnp.asarray(vocab)]
    d.fc[...] = noise * jax.random.normal(jax.random.key(1), d.fc.shape)
    return d


def test_greedy_eagle3_chain_and_tree_equal_plain(mirror):
    """Prompts of different lengths, 2 samples each, EOS inside accepted paths, the budget cutting the last
    round: EAGLE-3 chain (3_1_4) and tree (3_2_6) rollouts over a 96-token draft vocabulary emit plain
    decoding's tokens, lengths and log-probs, accepting drafts; the engine's target returns the three
    layers' states only because the drafter reads them."""
    target = mirror.target(CFG)
    vocab = np.sort(np.random.default_rng(0).permutation(CFG.vocab_size)[:96])
    engine = RolloutEngine(
        target,
        EngineConfig(max_new_tokens=40, max_cache_len=96, chunk_steps=8, compact=False),
        eos_ids=[EOS],
        drafter=mirror3(target, vocab, 0.02, (2, 1, 0)),
        draft_vocab=vocab,
    )
    assert engine.aux_layers == (2, 1, 0) and target.aux_layers == ()  # the caller's target is untouched
    plain = engine.generate(PROMPTS, n=2, key=jax.random.key(0), sampling=GREEDY, hooks=FixedMode("plain"))
    assert "eos" in plain.finish_reason and "length" in plain.finish_reason
    for strat in ("3_1_4", "3_2_6"):
        mode = engine.add_mode("eagle", strat)
        out = engine.generate(PROMPTS, n=2, key=jax.random.key(0), sampling=GREEDY, hooks=FixedMode(mode))
        np.testing.assert_array_equal(out.tokens, plain.tokens)
        np.testing.assert_array_equal(out.lengths, plain.lengths)
        assert out.finish_reason == plain.finish_reason
        np.testing.assert_allclose(out.logprobs, plain.logprobs, atol=1e-5)
        assert out.stats.mean_accept_length > 1.2, (strat, out.stats.mean_accept_length)
    full_head = RolloutEngine(  # a head over 96 tokens without their ids: refused
        target, EngineConfig(max_new_tokens=4), eos_ids=[EOS], drafter=mirror3(target, vocab, 0.0, (2, 1, 0))
    )
    mode = full_head.add_mode("eagle", "3_1_4")
    with pytest.raises(ValueError, match="needs its draft vocabulary"):
        full_head.generate(PROMPTS[:1], n=1, key=jax.random.key(0), sampling=GREEDY, hooks=FixedMode(mode))


@pytest.fixture(scope="module")
def sampling3():
    """test_engine_sd.py's sampling target (V = 32, temperature 0.9, top-k 20, top-p 0.95) with attention
    dominating its layer, an EAGLE-3 mirror over a 24-of-32-token draft vocabulary, an engine with its three
    modes, a prompt and the target's exact joint of the first three response tokens."""
    target = Transformer(SAMPLE_CFG, nnx.Rngs(0))
    emb = target.embed[...]
    target.embed[...] = emb / jnp.sqrt(jnp.mean(emb * emb, axis=-1, keepdims=True))
    target.lm_head[...] = target.lm_head[...] * 12.0
    target.layers[0].attn.o_proj[...] = target.layers[0].attn.o_proj[...] * 10.0
    target.embed[...] = target.embed[...] * 0.02  # attention dominates: the mirror's residual is f, not e
    vocab = np.sort(np.random.default_rng(1).permutation(V)[:24])
    graph, params = nnx.split(target)
    forward = jax.jit(
        lambda p, toks: nnx.merge(graph, p)(toks, jnp.broadcast_to(jnp.arange(16), toks.shape)).logits
    )
    prompt = [3, 5, 7, 1]
    engine = RolloutEngine(
        target,
        EngineConfig(max_new_tokens=3, max_cache_len=32, chunk_steps=4, min_cache_bucket=16, compact=False),
        eos_ids=[],
        drafter=mirror3(target, vocab, 0.02, (0, 1, 1)),
        draft_vocab=vocab,
    )
    p = len(prompt)
    seqs = np.zeros((V * V, 16), np.int32)
    seqs[:, : p + 2] = [[*prompt, a, b] for a in range(V) for b in range(V)]
    probs = np.asarray(target_probs(forward(params, jnp.asarray(seqs)), SAMPLING), np.float64)
    joint = probs[0, p - 1][:, None, None] * probs[::V, p][:, :, None] * probs[:, p + 1].reshape(V, V, V)
    return engine, prompt, joint / joint.sum()


# (strategy, acceptance, minimum mean accept length, seed). make test keeps the rejection chain, the one path
# that reads EAGLE-3's own draft distribution q (over its draft vocabulary, zero elsewhere); the target-only
# walk and coupled verification never read q (their drafts come from the same head, held equal to plain
# decoding by the greedy test above) and run in make test-extended.
LOSSLESS = [
    pytest.param("2_1_3", "rejection", 1.2, 30, id="chain_rejection", marks=pytest.mark.slow),
    pytest.param("2_3_6", "target_only", 1.05, 31, id="tree", marks=pytest.mark.extended),
    pytest.param("2_3_6", "coupled", 1.05, 32, id="tree_coupled", marks=pytest.mark.extended),
]


@pytest.mark.parametrize("strategy,acceptance,min_accept,seed", LOSSLESS)
def test_eagle3_sampling_is_lossless(sampling3, xla_optimized, strategy, acceptance, min_accept, seed):
    """32,768 samples of the first three response tokens, chi-square against the target's exact joint
    (p > 1e-3, the protocol of test_engine_sd.py, whose biased rule shows the pipeline's power), with EAGLE-3
    drafts that are accepted."""
    engine, prompt, joint = sampling3
    mode = engine.add_mode("eagle", strategy, acceptance=acceptance, label=acceptance)
    out = _sample(engine, prompt, mode, seed)
    assert len(out.tokens) == NUM_SAMPLES
    pval = chi_square_pvalue(out.tokens, joint)
    assert pval > PASS_P, f"chi-square p={pval:.2e}"
    assert out.stats.mean_accept_length > min_accept, out.stats.mean_accept_length
