"""The online drafter buffer: per-sample windows, one-step offset, token budget, packing, state round-trip."""

import numpy as np
import pytest

from tlt_jax.drafter.buffer import BUFFER_FILE, DrafterBuffer, window_sample
from tlt_jax.drafter.packing import DrafterSample

H = 4


def sample(resp_len: int, prompt_len: int = 3, tag: int = 0) -> DrafterSample:
    """A sample whose tokens are all `tag` (to identify it, windowed or not) and whose hidden state rows are
    their positions (so a window's offset can be read back)."""
    n = prompt_len + resp_len
    tokens = np.full((n,), tag, np.int32)
    hidden = np.repeat(np.arange(n, dtype=np.float16)[:, None], H, axis=1)
    return DrafterSample(tokens=tokens, hidden=hidden, loss_mask=np.arange(n) >= prompt_len)


def tags(buf: DrafterBuffer) -> list[int]:
    return [int(s.tokens[0]) for s in buf.samples()]


def test_window_is_a_contiguous_cut_with_context():
    long = sample(1000, prompt_len=20, tag=7)
    w = window_sample(long, window=64, context=8, rng=np.random.default_rng(0))
    assert w.length == 72 and w.num_response == 64
    start = int(w.hidden[0, 0])  # the original position of the first kept token
    np.testing.assert_array_equal(w.hidden, long.hidden[start : start + 72])
    np.testing.assert_array_equal(w.loss_mask, [False] * 8 + [True] * 64)  # context carries no loss
    assert 20 - 8 <= start <= 20 + 1000 - 64 - 8
    assert not np.shares_memory(w.hidden, long.hidden)  # a view would keep the whole sample alive
    assert w.hidden.dtype == np.float16
    # a response that fits: the window starts at the response, the context is the prompt's last tokens
    short = window_sample(sample(30, prompt_len=20), window=64, context=8, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(short.hidden[:, 0], np.arange(12, 50))
    assert short.num_response == 30
    # context longer than the prompt: the whole prompt
    assert window_sample(sample(5, prompt_len=3), 64, 8, np.random.default_rng(0)).length == 8
    with pytest.raises(ValueError, match="no response"):
        window_sample(sample(0), 64, 8, np.random.default_rng(0))


def test_window_start_is_uniform_and_seeded():
    def starts(seed: int) -> list[int]:
        buf = DrafterBuffer(max_tokens=100_000, window=64, context=8, seed=seed)
        buf.add([sample(1000, prompt_len=20) for _ in range(200)], step=0)
        return [int(s.hidden[0, 0]) + 8 - 20 for s in buf.samples()]  # window start within the response

    a = starts(0)
    assert a == starts(0) and a != starts(1)  # deterministic given the seed (and the order of `add`s)
    assert min(a) >= 0 and max(a) <= 1000 - 64
    assert min(a) < 100 and max(a) > 836 and 400 < np.mean(a) < 536  # spread over the whole response


def test_one_step_offset():
    buf = DrafterBuffer(max_tokens=10_000, window=64, context=4)
    buf.add([sample(5, tag=1), sample(50, tag=2)], step=0)
    buf.add([sample(10, tag=3), sample(80, tag=4)], step=0)  # streamed: several calls per step
    assert tags(buf) == [1, 2, 3, 4] and buf.steps() == [0, 0, 0, 0]

    buf.add([sample(7, tag=5)], step=1)  # step 1 + ALL of step 0 (long ones included), longest first
    assert tags(buf) == [5, 4, 2, 3, 1] and buf.prev_step == 0
    assert buf.steps() == [1, 0, 0, 0, 0]
    buf.add([sample(9, tag=6)], step=1)  # same step: appended, the previous step is untouched
    assert tags(buf) == [5, 6, 4, 2, 3, 1]

    buf.add([sample(3, tag=7)], step=2)  # step 0 is gone; step 1 is the previous step now
    assert tags(buf) == [7, 6, 5] and set(buf.steps()) == {1, 2}
    buf.add([], step=4)  # a gap: step 2's data is two steps old, dropped with the rest
    assert tags(buf) == [] and buf.prev_step is None
    with pytest.raises(ValueError, match="go back"):
        buf.add([sample(3)], step=3)
    buf.add([DrafterSample(np.zeros(4, np.int32), np.zeros((4, H), np.float16), np.zeros(4, bool))], step=4)
    assert len(buf) == 0 and buf.skipped == 1  # nothing to train on


def test_token_budget_keeps_long_previous_and_newest_current():
    # windows of <= 20 response tokens + 3 context; budget 100 tokens, previous step guaranteed 50
    buf = DrafterBuffer(max_tokens=100, window=20, context=3, prev_share=0.5)
    buf.add([sample(500, tag=1), sample(17, tag=2), sample(12, tag=3), sample(9, tag=4)], step=0)
    assert [s.length for s in buf.samples()] == [23, 20, 15, 12]  # 70 tokens: all fit
    buf.add([sample(7, tag=10 + i) for i in range(8)], step=1)  # 8 x 10 tokens
    # previous: 70 > 50 guaranteed -> current capped at 50 (the oldest three of 8 dropped); previous then
    # gets 100 - 50 = 50 and keeps its LONGEST responses (500 -> a 23-token window, 17 -> 20)
    assert tags(buf) == [13, 14, 15, 16, 17, 1, 2]
    assert buf.num_tokens == 93 <= 100 and buf.evicted == 5
    assert buf.stats()["buffer/samples_prev"] == 2 and buf.nbytes > 0
    buf.add([sample(60, tag=30)], step=2)  # a window of 20 + 3 context
    assert tags(buf)[0] == 30 and buf.samples()[0].length == 23
    assert buf.num_tokens <= 100
    with pytest.raises(ValueError, match="below one sample"):
        DrafterBuffer(max_tokens=10, window=20, context=3)


def test_sample_packed_uses_buffer_samples_only():
    buf = DrafterBuffer(max_tokens=10_000, window=16, context=4)
    buf.add([sample(10, tag=t) for t in (1, 2, 3)], step=0)
    buf.add([sample(40, tag=t) for t in (4, 5)], step=1)  # windowed to 4 + 16 tokens
    batch, idx = buf.sample_packed(seq_len=32, rows=4, rng=np.random.default_rng(0))
    assert sorted(idx) == [0, 1, 2, 3, 4]  # 4 x 32 slots hold 20+20+13+13+13 tokens
    seg, toks = np.asarray(batch.segment_ids), np.asarray(batch.tokens)
    got = sorted(int(toks[r][seg[r] == k][0]) for r in range(4) for k in range(1, seg[r].max() + 1))
    assert got == [1, 2, 3, 4, 5]
    assert batch.hidden.dtype == np.float32 and batch.num_loss_tokens() == 16 + 16 + 3 * 10
    # positions restart per sample
    pos = np.asarray(batch.positions)
    assert all(pos[r][seg[r] == k][0] == 0 for r in range(4) for k in range(1, seg[r].max() + 1))
    # within the train step's loss-position budget
    b2, idx2 = buf.sample_packed(seq_len=32, rows=4, rng=np.random.default_rng(1), max_loss_tokens=20)
    assert b2.num_loss_tokens() <= 20 and 1 <= len(idx2) < 5
    with pytest.raises(ValueError, match="fits max_loss_tokens"):
        buf.sample_packed(seq_len=32, rows=3, rng=np.random.default_rng(1), max_loss_tokens=5)
    with pytest.raises(ValueError, match="empty"):
        DrafterBuffer(1000).sample_packed(8, 1, np.random.default_rng(0))


def test_state_round_trip_is_exact(tmp_path):
    def fill(buf: DrafterBuffer) -> None:
        buf.add([sample(300, tag=1), sample(12, tag=2), sample(150, tag=3)], step=0)
        buf.add([sample(90, tag=4)], step=1)

    buf = DrafterBuffer(max_tokens=400, window=64, context=8, seed=5)
    fill(buf)
    path = buf.save(tmp_path / "buf")
    assert path.name == BUFFER_FILE and not list(path.parent.glob("*.tmp*"))
    restored = DrafterBuffer(max_tokens=400, window=64, context=8, seed=5)
    restored.load(tmp_path / "buf")
    assert restored.stats() == buf.stats() and restored.steps() == buf.steps()
    assert (restored.step, restored.prev_step) == (1, 0)
    for a, b in zip(restored.samples(), buf.samples(), strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        assert a.hidden.dtype == b.hidden.dtype == np.float16
        np.testing.assert_array_equal(a.hidden, b.hidden)
    # it goes on exactly like the original: same windows for new samples, same rotation and evictions
    for bf in (buf, restored):
        bf.add([sample(500, tag=8), sample(70, tag=9)], step=2)
    assert restored.stats() == buf.stats() and tags(restored) == tags(buf)
    for a, b in zip(restored.samples(), buf.samples(), strict=True):
        np.testing.assert_array_equal(a.hidden, b.hidden)
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    np.testing.assert_array_equal(
        buf.sample_packed(128, 2, rng_a)[0].tokens, restored.sample_packed(128, 2, rng_b)[0].tokens
    )
    # an empty buffer round-trips too; other settings refuse the state
    empty = DrafterBuffer(max_tokens=1000)
    again = DrafterBuffer(max_tokens=1000)
    again.load_state_dict(empty.state_dict())
    assert len(again) == 0 and again.step is None
    with pytest.raises(ValueError, match="saved with"):
        DrafterBuffer(max_tokens=400, window=32, context=8, seed=5).load(tmp_path / "buf")
