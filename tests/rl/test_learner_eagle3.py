"""EAGLE-3 in the RL loop (drafter.arch=eagle3): a warmed EAGLE-3 drafter (its own head over a reduced draft
vocabulary, three layers' states) drafts under a fixed-table selector while the spot trainer trains it
between chunks on the recorded [aux ; final] states, and a run stopped after step 1 and resumed from its
checkpoint continues exactly as the uninterrupted run."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from tlt_jax import config_lib
from tlt_jax.drafter.draft_vocab import FILENAME as VOCAB_FILE
from tlt_jax.models.config import tiny_config
from tlt_jax.models.eagle3 import Eagle3Drafter, config_drafter_spec, drafter_spec
from tlt_jax.rl import config as rl_config
from tlt_jax.rl.learner import Learner
from tlt_jax.rl.speculation import ResolvedDrafter
from tlt_jax.rl.spot import engine_drafter
from tlt_jax.utils.drafter_checkpoint import DrafterCheckpointer

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
AUX = (0, 1, 2)  # the tiny policy has 2 layers: the embedding, after layer 0, after layer 1


def save_eagle3(directory: pathlib.Path, target_cfg, vocab: np.ndarray) -> pathlib.Path:
    """An EAGLE-3 drafter checkpoint as the warm-up writes it: trainable weights, the target's config and the
    drafter's spec in meta, its draft vocabulary beside them."""
    drafter = Eagle3Drafter(target_cfg, nnx.Rngs(3), draft_vocab_size=len(vocab), aux_layers=AUX)
    with DrafterCheckpointer(directory / "drafter", max_to_keep=1, own_head=True) as ckpt:
        ckpt.save(
            1,
            nnx.to_pure_dict(nnx.state(drafter, nnx.Param)),
            meta={"target": dataclasses.asdict(target_cfg), "drafter": drafter_spec(drafter)},
        )
    np.save(directory / "drafter" / VOCAB_FILE, vocab)
    return directory


def _config(warm: pathlib.Path, steps: int):
    """The smoke config with the warmed EAGLE-3 drafting at <= 8 running rows (a fixed table; n-gram above)
    and the spot trainer training it between chunks, checkpointing every step."""
    c = config_lib.load_config_file(CONFIGS / "smoke.py", f"steps={steps}")
    c.checkpoint_every = 1
    c.drafter.kind, c.drafter.path, c.drafter.arch = "eagle", str(warm), "eagle3"
    c.spot.mode, c.spot.threshold = "between_chunks", 1024
    c.spot.window, c.spot.context, c.spot.ce_tokens = 16, 8, 16
    c.spot.ttt_steps, c.spot.ttt_positions, c.spot.eval_samples = 1, 8, 4
    c.bandit.algorithm, c.bandit.arms = "fixed", ("plain", "3_1_4", "ngram_3_1_4")
    c.bandit.bucket_bounds = (4, 8)
    c.bandit.fixed_table = ("3_1_4", "3_1_4", "ngram_3_1_4")
    return c


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> pathlib.Path:
    cfg = tiny_config(**{**dict(config_lib.tiny_random_model("llama")), "dtype": "float32"})
    vocab = np.arange(0, cfg.vocab_size, 2, dtype=np.int32)  # 132 of the 264 tokens
    return save_eagle3(tmp_path_factory.mktemp("warm"), cfg, vocab)


def _run(warm: pathlib.Path, workdir: pathlib.Path, steps: int, *, save: bool = False):
    """`steps` RL steps of a Learner on `workdir` (resuming what is there): (metrics, spot params, learner
    facts checked inside)."""
    learner = Learner(_config(warm, 2), str(workdir))
    try:
        assert learner.engine.aux_layers == AUX and learner.spot is not None
        start = learner.step
        metrics = [learner.train_step() for _ in range(steps)]
        samples = learner.spot.buffer.samples()
        width = {s.hidden.shape[1] for s in samples}
        if save:
            learner.save()
        return metrics, nnx.to_pure_dict(learner.spot.state.params), start, width
    finally:
        learner.close()  # the process ends here: nothing carries over but the workdir


def test_eagle3_drafts_spot_trains_and_resumes_identically(warm, tmp_path) -> None:
    """Two GRPO steps: EAGLE-3 drafts are verified (the drafter's own head over 132 tokens), the recorded
    states are [three layers ; final] = 4H per token, the spot trainer's updates are CE only. The same run
    stopped after step 1 (its Learner closed, as a killed process's workdir) and resumed from the checkpoint
    (policy, EAGLE-3 train state, data buffer, selector) gives the uninterrupted run's step 2: metrics and
    drafter weights."""
    ref, ref_params, _, width = _run(warm, tmp_path / "whole", 2)
    h = tiny_config(**{**dict(config_lib.tiny_random_model("llama"))}).hidden_size
    assert width == {4 * h}
    assert ref[-1]["spot/drafter_step"] > 0 and ref[-1]["spec/verify_rounds"] > 0
    assert np.isfinite(ref[-1]["spot/loss"]) and ref[-1]["spot/feat_loss"] == 0.0
    part, _, _, _ = _run(warm, tmp_path / "parts", 1, save=True)
    more, got_params, start, _ = _run(warm, tmp_path / "parts", 1)
    assert start == 1
    for a, b in zip(ref, part + more, strict=True):
        for k in sorted(
            {"reward/mean", "spot/steps", "spot/loss", "buffer/tokens", "spec/verify_rounds"} & set(a)
        ):
            assert a[k] == pytest.approx(b[k], rel=1e-5), k
    for x, y in zip(jax.tree.leaves(ref_params), jax.tree.leaves(got_params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_arch_mismatch_and_a_fresh_eagle3_for_the_spot_trainer(tmp_path) -> None:
    """A warmed drafter of another arch than config.drafter.arch is refused, naming both; without a warmed
    drafter the spot trainer starts an EAGLE-3 over the full vocabulary at the configured capture points."""
    cfg = tiny_config(num_layers=4)
    c = config_lib.load_config_file(CONFIGS / "smoke.py", "steps=1")
    c.spot.mode = "between_chunks"
    c.drafter.arch, c.drafter.aux_layers = "eagle3", (1, 2, 4)
    job = rl_config.validate_grpo(c)
    fresh = engine_drafter(ResolvedDrafter("ngram"), job.spot, cfg, 0, job.drafter)
    assert (
        fresh.arch == "eagle3" and fresh.aux_layers == (1, 2, 4) and fresh.draft_vocab_size == cfg.vocab_size
    )
    warm = Eagle3Drafter(cfg, nnx.Rngs(0), aux_layers=(1, 2, 4))
    eagle1 = dataclasses.replace(job.drafter, arch="eagle", aux_layers=())
    with pytest.raises(ValueError, match="is 'eagle3', config.drafter.arch is 'eagle'"):
        engine_drafter(ResolvedDrafter("eagle", warm, path="W"), job.spot, cfg, 0, eagle1)
    c.drafter.arch = "eagle4"
    with pytest.raises(ValueError, match="config.drafter.arch='eagle4'"):
        rl_config.validate_grpo(c)


def test_make_run_config_family_takes_eagle3() -> None:
    """`configs/tlt.py:drafter_arch=eagle3` (make run's config) validates; its plans read SmolLM2's EAGLE-3
    capture points (30 layers: 2, 15, 27)."""
    c = config_lib.load_config_file(CONFIGS / "tlt.py", "drafter_arch=eagle3,drafter=ngram")
    job = rl_config.validate_grpo(c)
    assert job.drafter.arch == "eagle3"
    smollm = tiny_config(num_layers=30)
    assert config_drafter_spec(c, smollm) == {"arch": "eagle3", "aux_layers": [2, 15, 27]}
    assert engine_drafter(ResolvedDrafter("ngram"), job.spot, smollm, 0, job.drafter).aux_layers == (
        2,
        15,
        27,
    )


def test_periodic_export_writes_an_eagle3_drafter_in_the_serving_layout(tmp_path) -> None:
    """`export_every` writes an EAGLE-3 drafter in the layout SGLang and vLLM read (eagle3_format), which
    loads back as the same drafter with its capture points and draft vocabulary."""
    from tlt_jax.drafter.eagle3_format import load_eagle3_drafter
    from tlt_jax.drafter.eagle_format import fill_eagle_dir
    from tlt_jax.rl.exports import drafter_exports

    cfg = tiny_config(num_layers=8)
    vocab = np.arange(0, cfg.vocab_size, 4)
    drafter = Eagle3Drafter(cfg, nnx.Rngs(0), draft_vocab_size=len(vocab))
    params = jax.device_get(nnx.to_pure_dict(nnx.state(drafter, nnx.Param)))
    exports = drafter_exports(params, cfg, vocab, drafter.aux_layers)
    assert set(exports) == {"drafter"}
    fill_eagle_dir(tmp_path / "d", exports["drafter"])
    back, got_vocab = load_eagle3_drafter(tmp_path / "d", cfg)
    assert back.aux_layers == drafter.aux_layers == (2, 4, 5)
    np.testing.assert_array_equal(got_vocab, vocab)
    for a, b in zip(jax.tree.leaves(nnx.state(back, nnx.Param)), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_run_that_cannot_export_its_eagle3_drafter_fails_at_start(warm, tmp_path) -> None:
    """Capture point 0 (the embedding) has no id SGLang reads: with export_every the learner refuses at
    start, naming both fixes, instead of failing at its first export after hours of training."""
    c = _config(warm, 2)
    c.export_every = 1
    with pytest.raises(ValueError, match=r"export_every=1 exports the drafter, but its aux layers \(0, 1, 2"):
        Learner(c, str(tmp_path / "w"))
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_a_public_eagle3_checkpoint_starts_the_run(tmp_path) -> None:
    """drafter.init_from naming a directory in SGLang's / vLLM's EAGLE-3 layout (a synthetic one for a 4-layer
    policy, SGLang's capture ids [0, 1, 2]: the streams entering layers 1-3) starts a run: the engine captures
    those layers, the spot trainer starts from the checkpoint's weights, and two GRPO steps draft with it and
    train it (step 1 records the states the spot trainer's first updates read)."""
    from tests.drafter.test_eagle3_format import public_checkpoint
    from tlt_jax.drafter.eagle3_format import load_eagle3_drafter

    policy = tiny_config("llama", vocab_size=264, num_layers=4, dtype="float32")
    vocab = np.arange(0, policy.vocab_size, 2)
    public_checkpoint(
        tmp_path / "pub",
        policy=policy,
        vocab=vocab,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    )
    c = _config(tmp_path, 2)
    c.model.random = config_lib.tiny_random_model("llama", num_layers=4)
    c.drafter.path, c.drafter.init_from = "", str(tmp_path / "pub")
    learner = Learner(c, str(tmp_path / "w"))
    try:
        assert learner.engine.aux_layers == (1, 2, 3)
        want, _ = load_eagle3_drafter(tmp_path / "pub", policy)
        start = nnx.to_pure_dict(learner.spot.state.params)
        for a, b in zip(
            jax.tree.leaves(start), jax.tree.leaves(nnx.to_pure_dict(nnx.state(want, nnx.Param))), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        m = [learner.train_step() for _ in range(2)]
        assert m[0]["spec/verify_rounds"] > 0 and m[1]["spot/drafter_step"] > 0
    finally:
        learner.close()
