"""The spot trainer's idle-device mode with an EAGLE-3 drafter on a data x model mesh (tensor parallelism,
model axis 2, fake CPU devices): test_spot_tensor_parallel.py's checks for drafter.arch=eagle3.

EAGLE-3 brings parameters EAGLE-1 has not: its own `lm_head` [Vd, H] over the draft vocabulary, `fc`
[H, 3H] over the three capture points' states, a `hidden_norm` and q/k/v over [embedding ; feature] (2H).
The engine shards them by their logical axes (a Vd the model axis divides is split over it, an odd one is
replicated), the spot trainer holds them replicated, and the recorded span holds [aux x 3 ; final] = 4H per
token, sharded by rows over "data" and whole over "model". Checked, for an even and an odd Vd: those
shardings, a rollout with the spot trainer equals one without it, and the drafter after the rollout equals
the same updates replayed on one device (float32 rounding, test_spot_tensor_parallel.py's ATOL). And the
engine's EAGLE-3 drafting with its head split over the model axis: greedy chains (and trees, test-extended)
equal plain decoding and accept, chunk by chunk, what one device's do.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tests.drafter.test_spot_tensor_parallel import (
    EOS,
    PROMPTS,
    SP,
    assert_trained_as_on_one_device,
    record_ticks,
)
from tests.drafter.test_spot_trainer import SPOT, assert_tick_gathers_no_split_param
from tests.rollout.test_engine_eagle3 import CFG as CFG3
from tests.rollout.test_engine_eagle3 import GREEDY, mirror3
from tests.rollout.test_engine_sd import EOS as EOS3
from tests.rollout.test_engine_sd import PROMPTS as PROMPTS3
from tlt_jax import sharding as shd
from tlt_jax.drafter.spot_trainer import SpotConfig, SpotTrainer
from tlt_jax.models.config import tiny_config
from tlt_jax.models.eagle3 import Eagle3Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FinishedSequences, FixedMode, RolloutHooks
from tlt_jax.rollout.interface import EngineConfig

AUX = (0, 1, 2)  # the 2-layer target: the embedding, after layer 0, after layer 1


class Spans(RolloutHooks):
    """Keeps the recorded spans of the finished rows (what the spot trainer's buffer receives)."""

    def __init__(self) -> None:
        self.seqs: list[FinishedSequences] = []

    def on_finished(self, seqs: FinishedSequences) -> None:
        self.seqs.append(seqs)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer(tiny_config("qwen2", num_kv_heads=4), nnx.Rngs(0))


def eagle3(model: Transformer, vd: int) -> Eagle3Drafter:
    return Eagle3Drafter(model.cfg, nnx.Rngs(1), draft_vocab_size=vd, aux_layers=AUX)


def recorded_span_shardings(eng: RolloutEngine) -> list[tuple[tuple[int, ...], P]]:
    """(shape, PartitionSpec) of the recorded span (`DecodeState.out_hidden`) in every compiled chunk program
    (the programs' state argument, as compiled)."""
    out = []
    for key, compiled in eng.programs._programs.items():
        if key[0] == "chunk":
            shape = compiled.args_info[0][2].out_hidden.shape
            out.append((tuple(shape), compiled.input_shardings[0][2].out_hidden.spec))
    return out


# make test: a 2 x 2 mesh and a draft vocabulary the model axis splits (cold, alone: ~17 s);
# make test-extended also a 4 x 2 mesh with an odd one (replicated)
CASES = [
    pytest.param(2, 2, 64, id="2x2-vd64", marks=[pytest.mark.slow, pytest.mark.devices(4)]),
    pytest.param(4, 2, 63, id="4x2-vd63", marks=[pytest.mark.extended, pytest.mark.devices(8)]),
]


@pytest.mark.parametrize(("data", "tp", "vd"), CASES)
def test_eagle3_spot_trainer_under_tensor_parallelism(model: Transformer, data: int, tp: int, vd: int):
    h = model.cfg.hidden_size
    vocab = np.sort(np.random.default_rng(vd).permutation(model.cfg.vocab_size)[:vd])
    cfg = EngineConfig(
        max_new_tokens=24, max_cache_len=96, chunk_steps=2, min_cache_bucket=32, record_hidden=True
    )
    mesh = shd.make_mesh(data, tp, jax.devices()[: data * tp])
    eng = RolloutEngine(model, cfg, eos_ids=EOS, mesh=mesh, drafter=eagle3(model, vd), draft_vocab=vocab)
    # the engine's drafter shardings: lm_head [Vd, H] split by rows when the model axis divides Vd, fc and
    # q/k/v (2H wide) as their logical axes say, the norms replicated
    specs = {k: v.sharding.spec for k, v in nnx.to_flat_state(eng.drafter_params)}
    assert specs[("lm_head",)] == (P("model", None) if vd % tp == 0 else P(None, None)), specs
    assert specs[("fc",)] == P(None, None) and specs[("layer", "hidden_norm", "weight")] == P(None)
    assert specs[("layer", "attn", "qkv")] == P("model", None)
    assert eng.drafter_params["fc"].shape == (h, 3 * h)

    reference = eng.generate(PROMPTS, n=1, key=jax.random.key(4), sampling=SP)
    spot = SpotTrainer(SpotConfig(mode="idle_devices", **SPOT), eagle3(model, vd), eng)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(spot.params))
    ticks = record_ticks(spot)
    spans = Spans()
    spot.begin_step(1)
    assert spot.head_w.shape == (vd, h)  # the target's head over the draft vocabulary: the loss's target
    start = jax.device_put(spot.state, jax.devices()[0], may_alias=False)
    out = eng.generate(PROMPTS, n=1, key=jax.random.key(4), sampling=SP, hooks=[spot, spans])
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    np.testing.assert_array_equal(out.lengths, reference.lengths)
    assert ticks and int(spot.state.step) == len(ticks), "no tick trained"
    assert all(idle.any() and not idle.all() for idle, _ in ticks)
    # the recorded span: [aux x 3 ; final] per token, what the spot trainer's micro-batches carry
    assert spans.seqs and all(x.shape[-1] == 4 * h for s in spans.seqs for x in s.hidden)
    assert all(b.hidden.shape[-1] == 4 * h for _, b in ticks)
    # ... held by the decode state as [rows, window, 4H], split by rows over "data", whole over "model"
    spans_in_programs = recorded_span_shardings(eng)
    assert spans_in_programs and all(
        shape[-1] == 4 * h and spec in (P("data"), P("data", None, None)) for shape, spec in spans_in_programs
    ), spans_in_programs
    assert_trained_as_on_one_device(spot, start, ticks)
    assert_tick_gathers_no_split_param(eng)


@pytest.fixture(scope="module")
def drafting_engines(mirror) -> tuple[RolloutEngine, RolloutEngine, object]:
    """test_engine_eagle3.py's greedy setting (its EAGLE-3 mirror over a 96-token draft vocabulary) on one
    device and on a 2 x 2 mesh (the head's 96 rows split over the model axis), and plain decoding's
    rollout."""
    target = mirror.target(CFG3)
    vocab = np.sort(np.random.default_rng(0).permutation(CFG3.vocab_size)[:96])
    cfg = EngineConfig(max_new_tokens=40, max_cache_len=96, chunk_steps=4, compact=False)
    engines = [
        RolloutEngine(
            target,
            cfg,
            eos_ids=[EOS3],
            mesh=shd.make_mesh(d, t, jax.devices()[: d * t]),
            drafter=mirror3(target, vocab, 0.02, (2, 1, 0)),
            draft_vocab=vocab,
        )
        for d, t in ((1, 1), (2, 2))
    ]
    key = jax.random.key(0)
    plain = engines[0].generate(PROMPTS3, n=2, key=key, sampling=GREEDY, hooks=FixedMode("plain"))
    return engines[0], engines[1], plain


@pytest.mark.devices(4)
@pytest.mark.parametrize(
    "strategy",
    ["3_1_4", pytest.param("3_2_6", marks=pytest.mark.extended)],  # chain; tree (test-extended)
)
def test_eagle3_drafts_under_tensor_parallelism_as_on_one_device(drafting_engines, strategy: str):
    """EAGLE-3 drafting with its head split over the model axis: greedy rollouts equal plain decoding, and
    every chunk accepts exactly what the one-device engine's does (the same drafts)."""
    one, tp, plain = drafting_engines
    spec = {k: v.sharding.spec for k, v in nnx.to_flat_state(tp.drafter_params)}[("lm_head",)]
    assert spec == P("model", None), spec
    outs = []
    for eng in (one, tp):
        mode = eng.add_mode("eagle", strategy)
        key = jax.random.key(0)
        outs.append(eng.generate(PROMPTS3, n=2, key=key, sampling=GREEDY, hooks=FixedMode(mode)))
    for out in outs:
        np.testing.assert_array_equal(out.tokens, plain.tokens)
        np.testing.assert_array_equal(out.lengths, plain.lengths)
    assert outs[0].stats.mean_accept_length > 1.2, outs[0].stats.mean_accept_length
    assert [c.accept_hist for c in outs[1].stats.chunks] == [c.accept_hist for c in outs[0].stats.chunks]
