"""The RL loop's evaluations decoded with speculation by an EAGLE-3 drafter (tlt_jax/rl/eval_decoding.py,
tlt_jax/rl/evaluation.py): test_evaluation.py's SD checks for drafter.arch=eagle3.

A float32 mirror target (its head scaled up: a peaked next token) and test_engine_eagle3.py's EAGLE-3 mirror
of it over a 128-token draft vocabulary, three capture points. The engine holds a fresh (untrained) EAGLE-3
drafter, as the learner's engine does when the spot trainer owns the weights; the evaluation drafts with
the weights `EvalDecoding.weights()` returns (the learner's: `Learner.weights`), here the mirror's. With
coupled acceptance the evaluation's speculative rollout and its paired plain pass (same keys) emit the same
responses (EAGLE-1's semantics: plain_match 1), drafts are accepted, and a selector over EAGLE-3 chain and
tree arms is played as learned and taught nothing.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from tests.rl.test_evaluation import peaked_target, sd_eval_engine, toy_eval_sets
from tests.rollout.test_engine_eagle3 import mirror3
from tlt_jax.models.eagle3 import Eagle3Drafter
from tlt_jax.models.tokenizer import ByteTokenizer
from tlt_jax.rl.eval_decoding import EvalDecoding
from tlt_jax.rl.evaluation import SetEval
from tlt_jax.rollout.adaptive import build_policy
from tlt_jax.rollout.hooks import ChunkView, RolloutHooks
from tlt_jax.rollout.selector_config import BanditSection

AUX = (2, 1, 0)
VD = 128  # draft vocabulary of the 264-token byte vocabulary


class Modes(RolloutHooks):
    """A watcher (it chooses nothing): every chunk's mode."""

    def __init__(self) -> None:
        self.modes: list[str] = []

    def on_chunk(self, view: ChunkView) -> None:
        self.modes.append(view.record.mode)


@pytest.fixture(scope="module")
def eagle3_eval(mirror, tmp_path_factory):
    """(engine, mirror drafter params, run(weights, selector) -> the set's eval/* metrics): the SD eval of
    test_evaluation.py's `sd_eval` (SD on for the whole rollout, coupled acceptance, 2 problems x 4 samples at
    T 0.7, top-p 0.95) with EAGLE-3 drafts."""
    target = peaked_target(mirror)
    vocab = np.sort(np.random.default_rng(0).permutation(target.cfg.vocab_size)[:VD])
    tokenizer = ByteTokenizer()
    drafter = Eagle3Drafter(target.cfg, nnx.Rngs(9), draft_vocab_size=len(vocab), aux_layers=AUX)
    engine = sd_eval_engine(target, drafter=drafter, draft_vocab=vocab)
    assert engine.aux_layers == AUX
    trained = nnx.state(mirror3(target, vocab, 0.02, AUX), nnx.Param)
    sets = toy_eval_sets(tmp_path_factory.mktemp("bench"))

    def run(dparams, selector=None, watchers=()) -> dict[str, float]:
        decoding = EvalDecoding(engine, lambda: (None, dparams), selector, plain_baseline=True)
        return SetEval(sets, tokenizer, decoding, jax.random.key(3), rows=16).run(watchers)

    return engine, trained, run


def test_eagle3_eval_decodes_plain_tokens_with_the_learners_drafter(eagle3_eval) -> None:
    """The eval drafts with the weights it is given (the mirror accepts, the engine's fresh drafter hardly
    does) and, either way, emits its paired plain pass's responses."""
    _, trained, run = eagle3_eval
    m = run(trained)
    assert m["eval/toy/plain_match"] == 1.0 and m["eval/toy/sd_share"] == 1.0
    assert m["eval/toy/accept_len"] > 1.15, m  # measured 1.24 (T 0.7, a 128-token draft vocabulary)
    assert m["eval/toy/sd_speedup"] > 0 and {"maj@4", "best@4", "pass@4", "mean@4"} <= {
        k.split("/")[-1] for k in m
    }
    fresh = run(None)  # the engine's own (untrained) EAGLE-3 drafter
    assert fresh["eval/toy/plain_match"] == 1.0 and fresh["eval/toy/sd_share"] == 1.0
    assert fresh["eval/toy/accept_len"] < m["eval/toy/accept_len"] - 0.1, (fresh, m)  # measured 1.02
    for k in ("mean@4", "pass@4", "length_mean"):  # the same responses: the same scores
        assert fresh[f"eval/toy/{k}"] == m[f"eval/toy/{k}"], k


def test_eagle3_eval_plays_the_selectors_eagle3_arms_and_teaches_it_nothing(eagle3_eval) -> None:
    """A selector over plain and EAGLE-3 chain / tree arms that rates the tree best: the eval plays it in
    every chunk (plain match, drafts accepted) and leaves the selector's state and key as they were."""
    engine, trained, run = eagle3_eval
    arms = ("plain", "3_1_4", "2_2_6")
    section = BanditSection(algorithm="beg_mab", arms=arms, bucket_bounds=(4,), window=8)
    selector = build_policy(section, engine, seed=0)
    for arm, reward in (("plain", 5.0), ("3_1_4", 9.0), ("2_2_6", 20.0)):
        for running in (2, 8):
            for _ in range(3):
                selector.policy.observe(arm, running, reward, 2.0)
    before = jax.device_get(selector.policy.state_dict())
    modes = Modes()
    m = run(trained, selector, [modes])
    assert m["eval/toy/sd_share"] == 1.0 and m["eval/toy/plain_match"] == 1.0
    assert set(modes.modes) == {"2_2_6", "plain"}, modes.modes  # the tree, and the paired plain pass
    assert m["eval/toy/accept_len"] > 1.15, m
    after = jax.device_get(selector.policy.state_dict())
    jax.tree.map(np.testing.assert_array_equal, before["state"], after["state"])
    np.testing.assert_array_equal(jax.random.key_data(before["key"]), jax.random.key_data(after["key"]))
