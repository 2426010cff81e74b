"""The reduced drafter vocabulary: most frequent tokens of the warm-up data, saved next to the drafter."""

import numpy as np
import pytest

from tlt_jax.drafter import draft_vocab as dv


def test_frequent_tokens_orders_by_count_then_id_and_keeps_always():
    data = [np.array([5, 5, 5, 1, 1, 7, 9]), np.array([[7, 7], [2, 2]])]
    # counts: 5:3, 7:3, 1:2, 2:2, 9:1 -> top 3 = 5, 7 (tie: lower id first), then 1 (tie with 2: lower id)
    np.testing.assert_array_equal(dv.frequent_tokens(data, 3, vocab_size=10), [1, 5, 7])
    np.testing.assert_array_equal(dv.frequent_tokens(data, 3, vocab_size=10, always=[0]), [0, 1, 5, 7])
    with pytest.raises(ValueError, match="outside"):
        dv.frequent_tokens([np.array([10])], 2, vocab_size=10)
    with pytest.raises(ValueError, match="size 0"):
        dv.frequent_tokens(data, 0, vocab_size=10)


def test_build_from_warmup_data_and_load(tmp_path):
    assert dv.load_draft_vocab(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="run the drafter warm-up first"):
        dv.build_from_warmup(tmp_path, 2, vocab_size=16)
    (tmp_path / "data").mkdir()
    np.savez(tmp_path / "data" / "train_000.npz", tokens=np.array([3, 3, 4, 4, 4, 8], np.int32))
    np.savez(tmp_path / "data" / "eval_000.npz", tokens=np.array([9, 9, 9, 9], np.int32))  # not counted
    out = dv.build_from_warmup(tmp_path, 2, vocab_size=16, always=[0])
    assert out == tmp_path / "drafter" / dv.FILENAME
    np.testing.assert_array_equal(dv.load_draft_vocab(tmp_path), [0, 3, 4])
    np.testing.assert_array_equal(dv.load_draft_vocab(tmp_path / "drafter"), [0, 3, 4])
