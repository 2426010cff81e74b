"""Continuous batching (`rollout.admission`): a capped rollout gives every row the tokens of an uncapped one.

Each row's randomness derives from (rollout key, sequence id, token position) only, so the cap (rows queued
and inserted into free slots as others finish), the data axis and speculative decoding change the schedule,
never the samples: float32, 32 rows (4 prompts x 8), temperature 0.9, cap 8 per shard vs no cap, with the
n-gram drafter and with the EAGLE drafter, and plain with a cap of 4 per shard over two data shards; tokens
identical, log-probs and recorded hidden states equal to float rounding (the rows run in batches of other
sizes: a row's dot products may round differently).
"""

import jax
import numpy as np
import pytest

from tlt_jax import sharding as shd
from tlt_jax.models.config import tiny_config
from tlt_jax.rollout import admission
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.strategy import SpecConfig

CFG = tiny_config(num_layers=2, tie_embeddings=False)
EOS = 18
PROMPTS = [[9, 9, 2], [81, 65, 35, 40, 6, 10, 3, 23, 104, 83], [5, 7], [1, 2, 3, 4, 5, 6]]
SAMPLING = SamplingParams(temperature=0.9)
TOL = dict(atol=2e-5, rtol=2e-5)  # float32 rounding of a row computed in another batch size


@pytest.fixture(scope="module")
def target(mirror):
    return mirror.target(CFG)


@pytest.fixture(scope="module")
def drafter(target, mirror):
    return mirror.drafter(target, noise=0.03)


def _engine(target, drafter, kind: str, cap: int, data: int = 1) -> RolloutEngine:
    spec = (
        SpecConfig()
        if kind == "none"
        else SpecConfig(enabled=True, drafter=kind, strategy="3_1_4", threshold=6)
    )
    cfg = EngineConfig(
        max_new_tokens=32, max_cache_len=96, chunk_steps=4, min_cache_bucket=16, record_hidden=True,
        hidden_window=16, spec=spec, max_running_rows=cap,
    )  # fmt: skip
    mesh = shd.make_mesh(data, 1, jax.devices()[:data])
    return RolloutEngine(target, cfg, eos_ids=[EOS], mesh=mesh, drafter=drafter if kind == "eagle" else None)


def _rollout(engine: RolloutEngine):
    return engine.generate(PROMPTS, n=8, key=jax.random.key(7), sampling=SAMPLING)


def _same(capped, free) -> None:
    np.testing.assert_array_equal(capped.lengths, free.lengths)
    np.testing.assert_array_equal(capped.tokens, free.tokens)
    np.testing.assert_allclose(capped.logprobs, free.logprobs, **TOL)
    for i in range(len(free.lengths)):
        np.testing.assert_allclose(capped.features(i), free.features(i), **TOL)


@pytest.mark.parametrize(
    "kind", [pytest.param("ngram", marks=pytest.mark.extended), "eagle"]
)  # plain: the two-shard test below
def test_capped_rollout_gives_the_uncapped_tokens(target, drafter, kind):
    free = _rollout(_engine(target, drafter, kind, cap=0))
    eng = _engine(target, drafter, kind, cap=8)
    capped = _rollout(eng)
    _same(capped, free)
    assert len(set(free.lengths.tolist())) > 3, "lengths should vary: rows finish at different steps"
    # the cap held and rows were inserted: never more than 8 running, prefill of 8 then inserts
    assert max(capped.stats.running_per_step) <= 8 < max(free.stats.running_per_step)
    assert capped.stats.phase_seconds.get("insert", 0) > 0
    if kind != "none":  # SD ran, and only once the queue had emptied (the queue is pressure)
        assert any(c.mode != "plain" for c in capped.stats.chunks)


@pytest.mark.extended  # one shard's capped rollout is make test's
def test_capped_rollout_over_two_data_shards(target, drafter):
    """Cap 4 per shard on a 2-device data axis: inserts land in each shard's own free slots."""
    free = _rollout(_engine(target, drafter, "none", cap=0))
    capped = _rollout(_engine(target, drafter, "none", cap=4, data=2))
    _same(capped, free)
    assert max(capped.stats.running_per_step) <= 8


def test_rows_that_end_at_their_first_token(target, drafter):
    """max_new_tokens=1: every inserted row is done at its prefill; the queue still drains."""
    key = jax.random.key(7)
    free = _engine(target, drafter, "none", cap=0).generate(
        PROMPTS, n=8, key=key, sampling=SAMPLING, max_new_tokens=1
    )
    capped = _engine(target, drafter, "none", cap=4).generate(
        PROMPTS, n=8, key=key, sampling=SAMPLING, max_new_tokens=1
    )
    np.testing.assert_array_equal(capped.tokens, free.tokens)
    assert (capped.lengths == 1).all()


def test_insert_plan_fills_free_slots_in_sequence_order():
    queue = admission.RowQueue(next=4, total=9)
    slot_seq = np.array([0, 1, -1, -1, 2, 3, -1, -1])  # 2 shards x 4 slots
    done = np.array([True, False, True, True, False, True, True, True])
    plan = admission.plan_insert(slot_seq, done, 2, queue)
    # shard 0: slots 0, 2, 3 free -> sequences 4, 5, 6; shard 1: slots 1, 2, 3 -> 7, 8 (queue ends)
    np.testing.assert_array_equal(plan.seq_ids, [4, 5, 6, -1, 7, 8, -1, -1])
    np.testing.assert_array_equal(plan.slots, [0, 2, 3, 4, 1, 2, 4, 4])
    assert plan.count == 5 and len(queue) == 0
    assert admission.plan_insert(slot_seq, done, 2, queue) is None


def test_cap_from_kv_budget_and_top_bucket():
    """Qwen2.5-7B's KV (28 layers x 2 x 4 heads x 128 x bf16 = 56 KiB per token), model axis 4, the EAGLE
    layer: 14.5 KiB per token per device; at the top bucket 35,328 that is 0.49 GiB per row, so a 40 GiB
    budget holds 81 rows: the cap is 64 (a power of two)."""
    qwen = tiny_config(num_layers=28, num_kv_heads=4, num_heads=28, head_dim=128, hidden_size=3584,
                       dtype="bfloat16")  # fmt: skip
    per_token = admission.kv_bytes_per_token(qwen, model_axis=4, drafter_layers=1)
    assert per_token == 29 * 2 * 1 * 128 * 2
    cap, line = admission.running_rows_cap(0, 40.0, per_token, 35_328)
    assert cap == 64 and "kv_budget_gib=40.0" in line
    assert admission.running_rows_cap(16, 40.0, per_token, 35_328)[0] == 16
    assert admission.running_rows_cap(0, 0.0, per_token, 35_328)[0] == 0
    with pytest.raises(ValueError, match="holds no row"):
        admission.running_rows_cap(0, 0.1, per_token, 35_328)


def test_top_cache_bucket_is_bounded_by_max_cache_len(target):
    cfg = EngineConfig(max_new_tokens=32768, max_cache_len=34816, min_cache_bucket=1024)
    eng = RolloutEngine(target, cfg, eos_ids=[EOS])
    eng.add_mode("ngram", "8_6_48")
    top = eng.top_cache_bucket()
    assert 34816 + 48 <= top <= 1.25 * 34816 and top % 512 == 0
    assert eng.cache_bucket(10**9) == top and eng.cache_bucket(3000) == 4096
