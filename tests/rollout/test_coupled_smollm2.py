"""Samples that do not change when speculative decoding is switched on (SmolLM2, real weights).

Coupled verification (`SpecConfig.acceptance = "coupled"`) computes, at every verified position, the token
plain decoding would draw there with the row's own uniform, and accepts the drafted child equal to it. So a
speculative rollout must reproduce the plain rollout with the same keys token for token, up to float rounding
between a T-token verify pass and a 1-token decode step. Protocol: 8 reasoning prompts x 4 samples = 32
sequences x 96 tokens (EOS ignored, so every sequence is 96 tokens long), temperature 0.9, top-p 0.95;
plain vs ONE speculative rollout whose chunks rotate through an EAGLE chain (2_1_3), an EAGLE tree (1_2_3:
two children of the root) and the n-gram drafter (ngram_2_1_3), so every sequence is drafted by all three
and the switches the bandit makes between chunks are exercised too (the three share one tokens_to_verify-3
program). Criteria: >= 99% of the sequences identical (so with 32 none may differ), and at the first
differing token of any sequence the plain draw's uniform lies within 1e-3 of the CDF boundary between the
two tokens (a rounding flip; an acceptance bug would put it anywhere in [0, 1), so each divergence it caused
would pass this check with probability ~2e-3). The EAGLE drafter is an untrained one over a reduced draft
vocabulary (a trained drafter takes ~20 min to warm up): its drafts are rarely accepted, so the n-gram
drafter (accept ~1.2 on this text) carries most multi-token paths; the tiny-model tests in
test_engine_sd.py cover high acceptance. Cost: ~3 verify tokens per row per round at batch 32, minutes on
2 cores, which is why the three drafters share one rollout rather than running one each (it was 64 sequences
x 128 tokens, cut to 32 x 96 for the suite's time budget: an acceptance bug shows in nearly every sequence a
drafter touched).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax import config_lib
from tlt_jax.models.build import build_model_and_tokenizer
from tlt_jax.models.drafter import Drafter
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FixedMode, RolloutHooks
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams, target_probs
from tlt_jax.tasks import make_task

ROOT = pathlib.Path(__file__).resolve().parents[2]

SAMPLING = SamplingParams(temperature=0.9, top_p=0.95)
NEW, PROMPTS, N = 96, 8, 4
WIDTH = 256  # the teacher-forced forward's padded length (prompt + response fits)


@pytest.fixture(scope="module")
def smollm(smollm_gguf_path):
    cfg = config_lib.load_config_file(ROOT / "configs" / "default.py")
    model, tok = build_model_and_tokenizer(cfg)
    task = make_task(dict(kind="reasoning_gym", name="chain_sum", size=64, seed=1))
    problems, _ = task.batch(0, PROMPTS)
    prompts = [tok.encode_chat(task.messages(p)) for p in problems]
    assert max(map(len, prompts)) + NEW <= WIDTH
    return model, prompts


def first_divergence_is_rounding(model, prompt, key, a_toks, b_toks) -> tuple[int, float]:
    """(position, |u * mass - CDF boundary|) at the first differing token of two responses."""
    j = int(np.argmax(a_toks != b_toks))
    seq = list(prompt) + a_toks[:j].tolist()
    toks = np.zeros((1, WIDTH), np.int32)
    toks[0, : len(seq)] = seq
    logits = model(jnp.asarray(toks), jnp.arange(WIDTH)[None]).logits[0, len(seq) - 1]
    p = np.asarray(target_probs(logits[None], SAMPLING)[0], np.float64)
    u = float(jax.random.uniform(jax.random.fold_in(key, j), (1,), jnp.float32)[0])
    boundary = np.cumsum(p)[min(int(a_toks[j]), int(b_toks[j]))]
    return j, abs(u * p.sum() - boundary)


class RotateModes(RolloutHooks):
    """Each chunk in the next of `modes`, round robin."""

    def __init__(self, modes: list[str]):
        self.modes, self.chunks = modes, 0

    def choose_mode(self, running: int, batch_bucket: int) -> str:
        del running, batch_bucket
        self.chunks += 1
        return self.modes[(self.chunks - 1) % len(self.modes)]


@pytest.mark.slow
@pytest.mark.extended  # the tiny model's coupled test (test_engine_sd.py) is make test's
def test_speculative_rollouts_equal_plain_token_for_token(smollm, xla_optimized):
    model, prompts = smollm
    cache = 1 << int(np.ceil(np.log2(max(map(len, prompts)) + NEW + 8)))
    cfg = EngineConfig(max_new_tokens=NEW, max_cache_len=cache, min_cache_bucket=cache, chunk_steps=8)
    draft_vocab = np.arange(0, model.cfg.vocab_size, 16)  # 3072 of the 49152 tokens: a cheap draft head
    drafter = Drafter(model.cfg, nnx.Rngs(0))
    engine = RolloutEngine(model, cfg, eos_ids=[], drafter=drafter, draft_vocab=draft_vocab)
    modes = [
        engine.add_mode("eagle", "2_1_3"),
        engine.add_mode("eagle", "1_2_3"),
        engine.add_mode("ngram", "2_1_3"),
    ]
    key = jax.random.key(7)
    plain = engine.generate(prompts, n=N, key=key, sampling=SAMPLING, hooks=FixedMode("plain"))
    assert (plain.lengths == NEW).all()
    out = engine.generate(prompts, n=N, key=key, sampling=SAMPLING, hooks=RotateModes(modes))
    assert {c.mode for c in out.stats.chunks} == set(modes)
    ngram_chunks = [c for c in out.stats.chunks if c.mode == modes[2]]
    assert sum(c.accepted_tokens for c in ngram_chunks) > 1.05 * sum(c.verify_rounds for c in ngram_chunks)
    seq_keys = jax.random.split(key, PROMPTS * N)
    same = (out.tokens == plain.tokens).all(axis=1)
    assert same.mean() >= 0.99, int((~same).sum())
    for i in np.nonzero(~same)[0]:
        j, gap = first_divergence_is_rounding(
            model, out.prompt_tokens[i], seq_keys[i], plain.tokens[i], out.tokens[i]
        )
        assert gap < 1e-3, f"sequence {i} diverges at token {j}, {gap:.2e} from a CDF boundary"
