"""The online drafter buffer: one-step offset (current step + previous step's long samples), token bound."""

import numpy as np
import pytest

from tlt_jax.drafter.buffer import DrafterBuffer
from tlt_jax.drafter.train_step import DrafterSample

H = 4


def sample(resp_len: int, prompt_len: int = 3, tag: int = 0) -> DrafterSample:
    """A sample whose first token is `tag` (to identify it) with the given response length."""
    n = prompt_len + resp_len
    tokens = np.full((n,), tag, np.int32)
    mask = np.arange(n) >= prompt_len
    return DrafterSample(tokens=tokens, hidden=np.full((n, H), tag, np.float16), loss_mask=mask)


def tags(buf: DrafterBuffer) -> list[int]:
    return [int(s.tokens[0]) for s in buf.samples()]


def test_one_step_offset():
    buf = DrafterBuffer(max_tokens=10_000)  # long = response length >= the step's median
    buf.add_step([sample(5, tag=1), sample(50, tag=2), sample(10, tag=3), sample(80, tag=4)], step=0)
    assert tags(buf) == [1, 2, 3, 4] and buf.steps() == [0, 0, 0, 0]

    buf.add_step([sample(7, tag=5)], step=1)  # step 1 + step 0's long half (50, 80)
    assert sorted(tags(buf)) == [2, 4, 5]
    assert buf.steps().count(0) == 2 and buf.prev_step == 0
    buf.add_step([sample(9, tag=6)], step=1)  # same step: appended, the previous step is untouched
    assert sorted(tags(buf)) == [2, 4, 5, 6]

    buf.add_step([sample(3, tag=7)], step=2)  # step 0 is gone; step 1's long ones (9 >= median 8) stay
    assert sorted(tags(buf)) == [6, 7]
    assert set(buf.steps()) == {1, 2}

    with pytest.raises(ValueError, match="go back"):
        buf.add_step([sample(3)], step=1)


def test_absolute_long_threshold_and_empty_rotation():
    buf = DrafterBuffer(max_tokens=10_000, long_min_tokens=20)
    buf.add_step([sample(19, tag=1), sample(20, tag=2), sample(100, tag=3)], step=4)
    buf.add_step([], step=5)  # a step whose sequences have not finished yet: only last step's long ones
    assert sorted(tags(buf)) == [2, 3]
    buf.add_step([], step=6)
    assert tags(buf) == []


def test_token_bound_keeps_long_previous_and_newest_current():
    # sizes: prompt 3 + response; budget 100 tokens, previous step guaranteed 50
    buf = DrafterBuffer(max_tokens=100, long_min_tokens=10, prev_share=0.5)
    buf.add_step([sample(27, tag=1), sample(17, tag=2), sample(12, tag=3)], step=0)  # 30 + 20 + 15 = 65
    buf.add_step([sample(7, tag=10 + i) for i in range(8)], step=1)  # 8 x 10 tokens
    # previous long samples: 65 > 50 guaranteed -> current capped at 50 (oldest dropped: 10, 11, 12)
    # then previous gets 100 - 50 = 50: keeps the longest (30 + 20), drops the 15-token one
    assert sorted(tags(buf)) == [1, 2, 13, 14, 15, 16, 17]
    assert buf.num_tokens <= 100 and buf.evicted == 4
    # step 1's samples are short (7 < 10): none survives the rotation; step 0 is gone for good
    buf.add_step([sample(47, tag=30)], step=2)
    assert tags(buf) == [30] and buf.num_tokens == 50


def test_sample_packed_uses_buffer_samples_only():
    buf = DrafterBuffer(max_tokens=10_000, long_min_tokens=1)
    buf.add_step([sample(10, tag=t) for t in (1, 2, 3)], step=0)
    buf.add_step([sample(6, tag=t) for t in (4, 5)], step=1)
    batch, idx = buf.sample_packed(seq_len=32, rows=2, rng=np.random.default_rng(0))
    assert sorted(idx) == [0, 1, 2, 3, 4]  # 2 x 32 slots hold all 13+13+13+9+9 tokens
    seg, toks = np.asarray(batch.segment_ids), np.asarray(batch.tokens)
    got = sorted(int(toks[r][seg[r] == k][0]) for r in range(2) for k in range(1, seg[r].max() + 1))
    assert got == [1, 2, 3, 4, 5]
    assert batch.hidden.dtype == np.float32
    # with the train step's loss-position budget the batch stays within it
    b2, idx2 = buf.sample_packed(seq_len=32, rows=2, rng=np.random.default_rng(1), max_loss_tokens=20)
    assert b2.num_loss_tokens() <= 20 and 1 <= len(idx2) < 5
    with pytest.raises(ValueError, match="empty"):
        DrafterBuffer(10).sample_packed(8, 1, np.random.default_rng(0))
