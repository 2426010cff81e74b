"""The recorded span of hidden states (`EngineConfig.hidden_span`, `rollout/record.py`): which response
positions a row keeps on the device (a ring up to a per-row end, fed several positions per call as verify
rounds feed them: hand-computed below) and how the host reads them back; a capped rollout with a random span
streams at each row's offset, placed by its sequence key alone (a resumed run records what the first did),
the states a full forward computes there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.models.config import tiny_config
from tlt_jax.rollout.admission import sequence_keys
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FinishedSequences, RolloutHooks
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.record import kept_positions, record_hidden, span_ends
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.types import DecodeState, Rollout, RolloutStats

FEEDS = [[1, 4, 4, 2], [3, 3, 3, 2], [4, 1, 4, 2], [2, 2, 4, 3]]  # tokens fed per call: 11 per row


def _fed_state(w: int, ends: list[int] | None) -> DecodeState:
    """Rows fed 11 response positions through calls of up to 4 (as verify rounds feed them); position p's
    state holds p + 1 (0: a slot never written)."""
    b = len(FEEDS)
    z = jnp.zeros((b,), jnp.int32)
    state = DecodeState(
        cache=None, last_token=z, out_tokens=jnp.zeros((b, 1), jnp.int32), out_logp=jnp.zeros((b, 1)),
        num_generated=z + 1, done=z.astype(bool), seq_keys=jnp.zeros((b, 2), jnp.uint32), max_new=z + 32,
        out_hidden=jnp.zeros((b, w, 1)), hidden_end=None if ends is None else jnp.asarray(ends, jnp.int32),
    )  # fmt: skip
    for call in range(4):
        n_fed = jnp.asarray([f[call] for f in FEEDS], jnp.int32)
        pos = state.num_generated[:, None] - 1 + jnp.arange(4)[None, :]
        state = record_hidden(state, (pos + 1).astype(jnp.float32)[:, :, None], n_fed)
        state = state.replace(num_generated=state.num_generated + n_fed)
    return state


@pytest.mark.parametrize("w", [4, 3])  # 3: a call feeds more positions than the ring holds
def test_the_ring_keeps_each_rows_span(w):
    """Ends W ("first"), 7 (a random span's end), 100 ("last": past the budget) and 9 after 11 fed positions:
    the slots hold positions [0, W), [7 - W, 7), [11 - W, 11) and [9 - W, 9); the host's reading
    (`kept_positions`) finds them, and a stop string that cut the response at 6 tokens keeps positions < 5.
    Without ends ("first") the array equals the ring's with end W."""
    state = _fed_state(w, [w, 7, 100, 9])
    got = np.asarray(state.out_hidden[:, :, 0])
    for row, (end, first) in enumerate([(w, 0), (7, 7 - w), (100, 11 - w), (9, 9 - w)]):
        offset, slots = kept_positions(11, 12, w, end)
        assert offset == first and got[row, slots].tolist() == list(range(first + 1, first + w + 1))
    offset, slots = kept_positions(11, 6, w, 7)
    assert offset == 7 - w and slots.tolist() == [p % w for p in range(7 - w, 5)]
    np.testing.assert_array_equal(np.asarray(_fed_state(w, None).out_hidden[0, :, 0]), got[0])
    assert kept_positions(11, 12, w, None)[0] == 0


def test_span_ends_from_the_rows_keys():
    """ "first": none; "last": the budget; "random": W + s, s in [0, budget - W] from each sequence's key
    alone (permuted rows, permuted ends), spread over the range."""
    keys = jnp.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 256)))
    budget = jnp.full((256,), 32, jnp.int32)
    assert span_ends("first", keys, budget, 5) is None
    assert np.asarray(span_ends("last", keys, budget, 5)).tolist() == [32] * 256
    ends = np.asarray(span_ends("random", keys, budget, 5))
    assert ends.min() >= 5 and ends.max() <= 32 and len(set(ends.tolist())) > 20
    perm = np.random.default_rng(0).permutation(256)
    np.testing.assert_array_equal(np.asarray(span_ends("random", keys[perm], budget, 5)), ends[perm])


class Collect(RolloutHooks):
    def __init__(self):
        self.seqs: list[FinishedSequences] = []

    def on_finished(self, seqs: FinishedSequences) -> None:
        self.seqs.append(seqs)


def test_random_span_equals_a_full_forward_at_its_offsets(mirror):
    """8 rows at temperature 0.9, spans of 5 at random depths of 16-token responses, at most 2 rows running
    (inserts), the states streamed only (keep_hidden=False): each row's span starts where its sequence key
    alone puts it (as a resumed or differently scheduled rollout puts it) and holds the full forward's
    states there."""
    target = mirror.target(tiny_config(num_layers=2, tie_embeddings=False))
    prompts = [[9, 9, 2], [81, 65, 35, 40, 6, 10, 3, 23, 104, 83], [5, 7], [1, 2, 3, 4, 5, 6]]
    cfg = EngineConfig(
        max_new_tokens=16, max_cache_len=32, chunk_steps=8, min_cache_bucket=32, compact=False,
        record_hidden=True, hidden_window=5, hidden_span="random", keep_hidden=False, max_running_rows=2,
    )  # fmt: skip
    streamed, key = Collect(), jax.random.key(7)
    out = RolloutEngine(target, cfg, eos_ids=[18]).generate(
        prompts, n=2, key=key, sampling=SamplingParams(temperature=0.9), hooks=streamed
    )
    assert out.hidden is None and out.prompt_hidden is None and out.stats.phase_seconds["insert"] > 0
    offsets = {int(i): int(o) for s in streamed.seqs for i, o in zip(s.seq_ids, s.hidden_offset, strict=True)}
    states = {int(i): h for s in streamed.seqs for i, h in zip(s.seq_ids, s.hidden, strict=True)}
    ends = np.asarray(span_ends("random", jnp.asarray(sequence_keys(key, 8)), jnp.full((8,), 16), 5))
    fwd = jax.jit(lambda toks: target(toks, jnp.arange(32)[None]).hidden[0])
    inner = 0
    for i in range(8):
        seq = out.prompt_tokens[i] + out.response(i)
        full = np.asarray(fwd(jnp.asarray([seq[:-1] + [0] * (33 - len(seq))])))
        lp, off, fed = len(out.prompt_tokens[i]), offsets[i], int(out.lengths[i]) - 1
        assert off == kept_positions(fed, fed + 1, 5, int(ends[i]))[0] and len(states[i]) == min(5, fed)
        want = full[lp + off : lp + off + min(5, fed)]
        np.testing.assert_allclose(states[i], want, atol=1e-4, rtol=1e-4)
        inner += 0 < off < fed - 5  # a span inside the response: neither its start nor its end
    assert inner > 0 and len(set(offsets.values())) > 3, offsets


def test_a_later_span_is_not_read_as_following_the_prompt():
    h = np.ones((3, 2), np.float32)
    roll = Rollout(
        prompt_tokens=[[1, 2]] * 2, prompt_index=np.zeros(2, np.int64), tokens=np.zeros((2, 8), np.int32),
        logprobs=np.zeros((2, 8)), lengths=np.asarray([8, 4]), finish_reason=["length"] * 2,
        stats=RolloutStats(), prompt_hidden=[h[:2]], hidden=[h, h], hidden_offset=np.asarray([4, 0]),
    )  # fmt: skip
    assert roll.features(1).shape == (5, 2)
    with pytest.raises(ValueError, match="hidden_offset"):
        roll.features(0)
