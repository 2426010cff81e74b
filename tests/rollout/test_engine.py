"""Plain-decoding rollout engine: vs full forward, compaction, buckets, sharding, compile counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax import sharding as shd
from tlt_jax.models.config import tiny_config
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout import interface
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig, EngineLike
from tlt_jax.rollout.sampling import SamplingParams

EOS = 3
PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 44]]


@pytest.fixture(scope="module")
def model():
    return Transformer(tiny_config("llama"), nnx.Rngs(0))


def _engine(model, mesh=None, **kw):
    cfg = dict(max_new_tokens=24, max_cache_len=96, chunk_steps=8, min_cache_bucket=16)
    cfg.update(kw)
    return RolloutEngine(model, EngineConfig(**cfg), eos_ids=[EOS], mesh=mesh)


class CompileCounter:
    """Counts programs lowered for XLA through jax.monitoring (the ground truth, not our own cache; it also
    fires when the persistent compilation cache then supplies the binary)."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            self.count += 1


_COUNTER = CompileCounter()


def test_greedy_matches_full_forward_reference(model):
    eng = _engine(model)
    out = eng.generate(PROMPTS, n=1, key=jax.random.key(0), sampling=SamplingParams(temperature=0.0))
    width = 40  # one compiled full causal forward; padding after position t cannot change t's logits
    full = jax.jit(lambda toks: jax.nn.log_softmax(model(toks, jnp.arange(width)[None]).logits[0], -1))

    def full_logp(seq: list[int]) -> np.ndarray:  # sliced on the host: no program per length
        return np.asarray(full(jnp.asarray([seq + [0] * (width - len(seq))])))[: len(seq)]

    for i, p in enumerate(PROMPTS):
        seq = list(p)
        for _ in range(24):
            seq.append(int(np.argmax(full_logp(seq)[-1])))
            if seq[-1] == EOS:
                break
        assert out.response(i) == seq[len(p) :]
        ref_lp = full_logp(seq)
        want = np.asarray([ref_lp[len(p) - 1 + j, seq[len(p) + j]] for j in range(len(seq) - len(p))])
        np.testing.assert_allclose(out.logprobs[i, : out.lengths[i]], want, atol=1e-4)
        assert out.finish_reason[i] == ("eos" if seq[-1] == EOS else "length")


def test_no_recompilation_after_warmup(model):
    eng = _engine(model)
    sp = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
    eng.generate(PROMPTS, n=4, key=jax.random.key(1), sampling=sp)
    programs, before = eng.compile_count, _COUNTER.count
    eng.generate(PROMPTS, n=4, key=jax.random.key(2), sampling=sp)
    assert eng.compile_count == programs
    assert _COUNTER.count == before, "XLA compiled a new program after warm-up"


def test_compaction_and_buckets_do_not_change_samples(model):
    """Per-sequence PRNG streams: compaction into smaller buckets leaves every sample unchanged."""
    sp = SamplingParams(temperature=1.0)
    a = _engine(model, compact=True).generate(PROMPTS, n=4, key=jax.random.key(3), sampling=sp)
    b = _engine(model, compact=False, chunk_steps=5).generate(
        PROMPTS, n=4, key=jax.random.key(3), sampling=sp
    )
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    buckets = [c.batch_bucket for c in a.stats.chunks]
    assert buckets == sorted(buckets, reverse=True)
    if a.stats.running_per_step[-1] <= 8:
        assert buckets[-1] < buckets[0], "live rows were never compacted into a smaller bucket"
    assert len(a.stats.running_per_step) == a.lengths.max() - 1  # first token comes from prefill
    # attention reads the live part only: the cache bucket stays well under the preallocated maximum
    assert max(c.cache_bucket for c in a.stats.chunks) <= 64 < 96 + 32


def test_n_samples_grouped_by_prompt(model):
    out = _engine(model).generate(PROMPTS[:2], n=3, key=jax.random.key(4), sampling=SamplingParams(1.0))
    np.testing.assert_array_equal(out.prompt_index, [0, 0, 0, 1, 1, 1])
    assert out.prompt_tokens[4] == PROMPTS[1]
    assert len({tuple(out.response(i)) for i in range(3)}) > 1, "samples of one prompt should differ"


def full_forward_hidden(model, width: int = 40):
    """seq -> the target's final hidden states [len(seq), H] from one causal forward (no cache)."""
    fwd = jax.jit(lambda toks: model(toks, jnp.arange(width)[None]).hidden[0])

    def hidden(seq: list[int]) -> np.ndarray:
        return np.asarray(fwd(jnp.asarray([seq + [0] * (width - len(seq))])))[: len(seq)]

    return hidden


def test_recorded_hidden_states_equal_a_full_forward(model):
    """EngineConfig.record_hidden: every position's final hidden state (prompt from the prefill, response
    tokens from the decode steps that fed them), through compaction into smaller buckets and sampled rows
    of different lengths, equals a plain forward over prompt + response[:-1]; the newest token has none."""
    sp, key = SamplingParams(1.0), jax.random.key(6)
    first = _engine(model).generate(PROMPTS, n=3, key=key, sampling=sp)
    # end rows early at tokens this key samples (per-row PRNG streams: the prefixes do not change), so the
    # rows finish at different steps and the live ones are compacted into smaller buckets
    eos = [EOS] + [first.response(i)[2 + 2 * i] for i in range(0, 12, 3)]
    cfg = EngineConfig(
        max_new_tokens=24, max_cache_len=96, chunk_steps=3, min_cache_bucket=16, record_hidden=True
    )
    out = RolloutEngine(model, cfg, eos_ids=eos).generate(PROMPTS, n=3, key=key, sampling=sp)
    assert len(set(out.lengths.tolist())) > 3 and len({c.batch_bucket for c in out.stats.chunks}) > 1
    ref = full_forward_hidden(model)
    for i in range(len(out.lengths)):
        seq = out.prompt_tokens[i] + out.response(i)
        feats = out.features(i)
        assert feats.shape == (len(seq) - 1, model.cfg.hidden_size)
        np.testing.assert_allclose(feats, ref(seq[:-1]), atol=1e-4, rtol=1e-4)
    # off by default: nothing recorded, and asking for features says how to turn it on
    plain = _engine(model).generate(PROMPTS[:1], n=1, key=jax.random.key(6), sampling=SamplingParams(1.0))
    assert plain.hidden is None
    with pytest.raises(ValueError, match="record_hidden=True"):
        plain.features(0)


def test_prompt_longer_than_cache_is_a_clear_error(model):
    eng = _engine(model)
    with pytest.raises(ValueError, match=r"prompt 1 has 80 tokens.*max_cache_len=96"):
        eng.generate([[1, 2], [1] * 80], n=1, key=jax.random.key(0), sampling=SamplingParams(0.0))
    with pytest.raises(ValueError, match="empty"):
        eng.generate([[]], n=1, key=jax.random.key(0), sampling=SamplingParams(0.0))


def test_engine_satisfies_its_clients_protocol(model):
    """The host loop, the harvester, the adaptive policy and the spot trainer type their engine with
    `interface.EngineLike`: the engine has every member it names (a runtime-checkable Protocol)."""
    assert isinstance(_engine(model), EngineLike)
    assert EngineConfig is interface.EngineConfig  # still importable from rollout.engine


@pytest.mark.devices(8)
@pytest.mark.parametrize("data,model_axis", [(8, 1), (4, 2)])
def test_sharded_rollout_equals_single_device(model, data, model_axis):
    """8 fake CPU devices (data-parallel; data x tensor) give the 1-device greedy rollout token for token."""
    sp = SamplingParams(temperature=0.0)
    one = _engine(model).generate(PROMPTS, n=2, key=jax.random.key(5), sampling=sp)
    mesh = shd.make_mesh(data, model_axis)
    eng = _engine(model, mesh=mesh)
    many = eng.generate(PROMPTS, n=2, key=jax.random.key(5), sampling=sp)
    np.testing.assert_array_equal(one.tokens, many.tokens)
    np.testing.assert_array_equal(one.lengths, many.lengths)
    qkv = eng.params["layers"][0]["attn"]["qkv"]
    assert len(qkv.sharding.device_set) == 8
    if model_axis > 1:  # KV heads split over the model axis
        assert qkv.sharding.spec[0] == "model"


@pytest.mark.devices(2)
def test_compaction_stays_within_shards_and_reports_idle_devices(model):
    """2 data shards of 8 rows: shard 0's sequences (prompts 0 and 1) end early, shard 1's run on. Compaction
    keeps every row on its device, so shard 0 becomes idle (reported to the hooks) instead of taking over
    half of shard 1's rows; the tokens equal the one-device rollout."""
    from tlt_jax.rollout.hooks import ChunkView, RolloutHooks

    class Views(RolloutHooks):
        def __init__(self) -> None:
            self.views: list[ChunkView] = []

        def on_chunk(self, view: ChunkView) -> None:
            self.views.append(view)

    sp, key = SamplingParams(temperature=1.0), jax.random.key(9)
    free = _engine(model).generate(PROMPTS, n=4, key=key, sampling=sp)  # no EOS among these samples' tokens
    late = {t for i in range(8, 16) for t in free.response(i)}
    # each of shard 0's rows ends at its first token (after the first) that shard 1's rows never sample
    eos = sorted({next(t for t in free.response(i)[1:] if t not in late) for i in range(8)})
    one = RolloutEngine(model, EngineConfig(max_new_tokens=24, max_cache_len=96, chunk_steps=2), eos_ids=eos)
    ref = one.generate(PROMPTS, n=4, key=key, sampling=sp)
    two = RolloutEngine(
        model,
        EngineConfig(max_new_tokens=24, max_cache_len=96, chunk_steps=2),
        eos_ids=eos,
        mesh=shd.make_mesh(2, 1, jax.devices()[:2]),
    )
    hook = Views()
    out = two.generate(PROMPTS, n=4, key=key, sampling=sp, hooks=hook)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    assert out.lengths[:8].max() < out.lengths[8:].min()
    idle = [v for v in hook.views if v.idle_shards == (0,)]
    assert idle, [v.live_per_shard for v in hook.views]
    assert all(v.live_per_shard[1] == 8 for v in idle), "shard 1's rows were moved or finished early"
    # 8 live rows in the fullest shard keep 2 x 8 rows (global compaction would have packed them into 2 x 4)
    assert all(v.record.batch_bucket == 16 for v in hook.views)


def test_engine_config_names_a_bad_attention_implementation() -> None:
    """An unknown `attn_impl` fails when the config is built, naming the choices, not at the first trace."""
    with pytest.raises(ValueError, match=r"attn_impl='flash'.*'pallas_tpu'.*rollout\.attn_impl"):
        EngineConfig(attn_impl="flash")
    assert EngineConfig(attn_impl="pallas_tpu").attn_impl == "pallas_tpu"


def test_stop_strings_cut_at_the_first_prefix_that_contains_one(model):
    """Stop strings, checked incrementally between chunks of 2 steps: each response is the shortest prefix of
    the unstopped response (same key: same samples) whose text contains a stop string, ended "stop"; two-
    character strings taken from the middle of responses, so they straddle chunk boundaries."""
    from tlt_jax.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    sp, key = SamplingParams(temperature=1.0), jax.random.key(5)
    free = _engine(model, chunk_steps=2).generate(PROMPTS, n=2, key=key, sampling=sp)
    stops = tuple({tok.decode(free.response(i)[10:12]) for i in (0, 3)})  # tokens 10, 11: two chunks
    assert all(len(s) == 2 for s in stops)
    cfg = EngineConfig(
        max_new_tokens=24, max_cache_len=96, chunk_steps=2, min_cache_bucket=16, stop_strings=stops
    )
    out = RolloutEngine(model, cfg, eos_ids=[EOS], tokenizer=tok).generate(PROMPTS, n=2, key=key, sampling=sp)
    for i in range(len(free.lengths)):
        full = free.response(i)
        cut = next(
            (c for c in range(1, len(full) + 1) if any(s in tok.decode(full[:c]) for s in stops)), None
        )
        if cut is None:
            assert out.response(i) == full and out.finish_reason[i] == free.finish_reason[i]
        else:
            assert out.response(i) == full[:cut] and out.finish_reason[i] == "stop", i
    assert out.finish_reason.count("stop") >= 2
