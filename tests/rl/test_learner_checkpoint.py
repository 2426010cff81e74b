"""The learner's checkpoint stores the drafter once (in the spot trainer's state when one trains it) and no
frozen policy layer, still reads checkpoints of the older layouts and of the other layout of the decoder
layers (stacked / unrolled), and names the leaves of one that fits none; the spot trainer's buffer folders go
with their checkpoint steps."""

from __future__ import annotations

import os
import pathlib
import types

import jax
import numpy as np
import pytest

from tlt_jax import config_lib
from tlt_jax.models.layouts import stack_layers
from tlt_jax.rl.checkpointing import CHECKPOINT_DIR
from tlt_jax.rl.learner import Learner
from tlt_jax.rl.spot import BUFFER_DIR, buffer_dir, buffer_root, save_buffer
from tlt_jax.utils.checkpoint import Checkpointer, item_bytes

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
        # weights the spot trainer moved; the engine holds no copy (the learner passes them to each rollout)
        spot.state = spot.state.replace(params=jax.tree.map(lambda x: x + 0.5, spot.state.params))
        assert engine.drafter_params is None
        first.save()  # step 0, this layout
        saved, _ = first.ckpt.restore(0)
        assert not jax.tree.leaves(saved.get("drafter")) and jax.tree.leaves(saved["spot"])
        # step 1 in the older layout: the engine's cast drafter copy stored beside the spot trainer's state
        save_buffer(spot, workdir, 1)
        older = {**first._state(), "drafter": engine.snapshot_drafter(spot.params)}
        first.ckpt.save(1, older, {"step": 1, "data_position": 2, "num_steps": 2})
        want_spot = leaves(spot.state)
    finally:
        first.close()
    second = Learner(spot_config(), workdir)
    try:
        assert (second.step, second.data_position) == (1, 2)
        assert_same(second.spot.state, want_spot)
        assert second.engine.drafter_params is None  # the older layout's second copy is dropped
    finally:
        second.close()
    # no spot trainer (and no drafter): the current layout's error names the leaves the target lacks
    with pytest.raises(ValueError, match=r"in the checkpoint but not in the target: drafter/"):
        Learner(spot_config(spot="off"), workdir)


def test_frozen_layers_are_not_stored_and_come_back_from_the_model(tmp_path) -> None:
    """train_layers > 0: the frozen layers are left out of the checkpoint (a fingerprint instead); a resume
    takes the trained layers from the checkpoint and the frozen ones from its model, and refuses a model whose
    frozen layers differ from the saved run's."""
    workdir = str(tmp_path / "run")
    c = spot_config(spot="off")
    c.trainer.train_layers = 1  # the top one of the tiny model's 2 layers (the embedding frozen)
    first = Learner(c, workdir)
    try:
        trainer = first.trainer
        trainer.params = jax.tree.map(lambda t, x: x + 0.5 if t else x, trainer.trainable, trainer.params)
        want = leaves(trainer.params)
        full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.params))
        first.save()
        layout = first.ckpt.layout(0)
    finally:
        first.close()
    stored = layout["leaves"]
    assert not any(p.startswith(("params/embed", "params/layers/0/")) for p in stored)
    assert any(p.startswith("params/layers/1/") for p in stored) and "frozen/embed/value" in stored
    assert item_bytes(layout)["params"] < full / 2
    c.seed = 1  # another random model: its frozen layers are not the saved run's
    with pytest.raises(ValueError, match=r"frozen parameters .* differ from the saved run's at \['embed'\]"):
        Learner(c, workdir)
    c.seed = 0
    second = Learner(c, workdir)
    try:
        assert second.step == 0
        assert_same(second.trainer.params, want)
        # step 1 in the older layout (every parameter stored, no fingerprint) still restores
        older = {k: v for k, v in second._state().items() if k != "frozen"}
        older["params"] = second.trainer.params
        second.ckpt.save(1, older, {"step": 1, "data_position": 2, "num_steps": 2})
    finally:
        second.close()
    third = Learner(c, workdir)
    try:
        assert third.step == 1
        assert_same(third.trainer.params, want)
    finally:
        third.close()


def test_checkpoints_restore_across_the_layers_layout(tmp_path) -> None:
    """A checkpoint written with the layers unrolled (scan_layers=False) resumes a run that stores them
    stacked (scan_layers=True: [L, ...] per weight, params and AdamW moments converted exactly), and that
    run's stacked checkpoint resumes an unrolled run again, bit for bit."""
    workdir = str(tmp_path / "run")
    c = spot_config(spot="off")
    c.trainer.train_layers, c.trainer.scan_layers = 0, False
    moved = lambda x: x + 0.5 if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x  # noqa: E731
    first = Learner(c, workdir)
    try:
        trainer = first.trainer
        trainer.params, trainer.opt_state = jax.tree.map(moved, (trainer.params, trainer.opt_state))
        want = (leaves(trainer.params), leaves(trainer.opt_state))
        want_stacked = leaves(stack_layers(trainer.params))
        first.save()
    finally:
        first.close()
    c.trainer.scan_layers = True
    second = Learner(c, workdir)
    try:
        assert second.step == 0 and second.trainer.stacked
        assert_same(second.trainer.params, want_stacked)
        second.step = 1
        second.save()
        second.ckpt.wait()
        stored = second.ckpt.layout(1)["leaves"]
    finally:
        second.close()
    layers = second.trainer.rollout_params()["layers"]
    assert stored["params/layers/attn/qkv/value"]["shape"] == [len(layers), *layers[0]["attn"]["qkv"].shape]
    c.trainer.scan_layers = False
    third = Learner(c, workdir)
    try:
        assert third.step == 1
        assert_same(third.trainer.params, want[0])
        assert_same(third.trainer.opt_state, want[1])
    finally:
        third.close()


def test_spot_buffers_go_with_their_checkpoints_also_after_a_resume(tmp_path) -> None:
    """A buffer folder is removed once (and only once) retention has removed its checkpoint step."""
    workdir = str(tmp_path)
    spot = types.SimpleNamespace(buffer=types.SimpleNamespace(save=lambda d: os.makedirs(d, exist_ok=True)))
    state = {"w": np.zeros(4, np.float32)}

    def on_disk(ckpt: Checkpointer) -> tuple[list[int], list[int]]:
        buffers = sorted(int(d) for d in os.listdir(os.path.join(workdir, BUFFER_DIR)))
        return ckpt.all_steps(), buffers

    def run(steps: range, keep: int) -> list[int]:
        ckpt = Checkpointer(
            os.path.join(workdir, CHECKPOINT_DIR), max_to_keep=keep, followers=(buffer_root(workdir),)
        )
        try:
            for step in steps:
                before = ckpt.all_steps()
                save_buffer(spot, workdir, step)  # as Learner.save: the buffer, then the checkpoint
                ckpt.save(step, state)
                kept, buffers = on_disk(ckpt)
                assert set(kept) <= set(buffers)  # never a checkpoint without its buffer
                assert set(buffers) <= {*before, step}  # no buffer of a step deleted before this save
        finally:
            ckpt.close()  # waits for the last save, whose retention deletes a step: its buffer goes too
        kept, buffers = on_disk(ckpt)
        assert kept == buffers
        return kept

    assert run(range(1, 6), keep=2) == [4, 5]
    os.makedirs(buffer_dir(workdir, 6))  # a process killed after the buffer, before its checkpoint
    assert run(range(6, 8), keep=1) == [7]  # resumed with a smaller retention: step 6 again, then 7
