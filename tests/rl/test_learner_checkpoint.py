"""The learner's checkpoint stores the drafter once (in the spot trainer's state when one trains it), still
reads checkpoints of the older layout that stored it twice, and names the leaves of one that fits neither."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest

from tlt_jax import config_lib
from tlt_jax.rl.learner import Learner
from tlt_jax.rl.spot import save_buffer

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def spot_config(spot: str = "after_rollout"):
    """The smoke run with a spot trainer training a fresh EAGLE drafter (the rollouts draft with n-grams)."""
    c = config_lib.load_config_file(CONFIGS / "smoke.py", "steps=2")
    c.drafter.kind = "ngram"
    c.spot.mode = spot
    c.spot.window, c.spot.context, c.spot.ce_tokens = 16, 8, 16
    c.spot.ttt_steps, c.spot.ttt_positions, c.spot.eval_samples = 1, 8, 4
    return c


def leaves(tree) -> list[np.ndarray]:
    """Every leaf as a NumPy array (typed PRNG keys as their key data)."""
    return [
        np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        for x in jax.tree.leaves(tree)
    ]


def assert_same(a, b) -> None:
    xs, ys = leaves(a), leaves(b)
    assert len(xs) == len(ys) > 0
    for x, y in zip(xs, ys, strict=True):
        np.testing.assert_array_equal(x, y)


def test_drafter_stored_once_and_the_older_layout_still_restores(tmp_path) -> None:
    workdir = str(tmp_path / "run")
    first = Learner(spot_config(), workdir)
    try:
        spot, engine = first.spot, first.engine
        # weights the spot trainer moved, pushed into the engine as after a step (cast to its weight dtype)
        spot.state = spot.state.replace(params=jax.tree.map(lambda x: x + 0.5, spot.state.params))
        engine.set_drafter_params(spot.params)
        first.save()  # step 0, this layout
        saved, _ = first.ckpt.restore(0)
        assert not jax.tree.leaves(saved.get("drafter")) and jax.tree.leaves(saved["spot"])
        # step 1 in the older layout: the engine's drafter copy stored beside the spot trainer's state
        save_buffer(spot, workdir, 1, keep=3)
        older = {**first._state(), "drafter": engine.drafter_params}
        first.ckpt.save(1, older, {"step": 1, "data_position": 2, "num_steps": 2})
        want_spot, want_engine = leaves(spot.state), leaves(engine.drafter_params)
    finally:
        first.close()
    second = Learner(spot_config(), workdir)
    try:
        assert (second.step, second.data_position) == (1, 2)
        assert_same(second.spot.state, want_spot)
        assert_same(second.engine.drafter_params, want_engine)  # the same cast of the same weights
    finally:
        second.close()
    # no spot trainer (and no drafter): the current layout's error names the leaves the target lacks
    with pytest.raises(ValueError, match=r"in the checkpoint but not in the target: drafter/"):
        Learner(spot_config(spot="off"), workdir)
