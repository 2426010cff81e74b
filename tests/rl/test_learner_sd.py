"""TLT in the RL loop: GRPO steps with speculative rollouts (n-gram and a small EAGLE drafter) on the smoke
config, the drafter section's errors, the acceptance-collapse alarm, and a resumed spot-trained run."""

from __future__ import annotations

import dataclasses
import logging
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from tlt_jax import config_lib
from tlt_jax.config_sections import DrafterSection
from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.rl.learner import Learner
from tlt_jax.rl.speculation import RolloutMonitor, resolve_drafter
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FixedMode
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.utils.drafter_checkpoint import DrafterCheckpointer

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def smoke(arg: str | None = None):
    return config_lib.load_config_file(CONFIGS / "smoke.py", arg)


def save_drafter(directory: pathlib.Path, target_cfg, seed: int = 3) -> pathlib.Path:
    """A drafter checkpoint as the warm-up writes it (trainable weights + the target's config in meta)."""
    drafter = Drafter(target_cfg, nnx.Rngs(seed))
    with DrafterCheckpointer(directory / "drafter", max_to_keep=1) as ckpt:
        ckpt.save(
            1,
            nnx.to_pure_dict(nnx.state(drafter, nnx.Param)),
            meta={"target": dataclasses.asdict(target_cfg)},
        )
    return directory


def leaves(tree) -> list[np.ndarray]:
    """Every leaf as a NumPy array (typed PRNG keys as their key data)."""
    out = []
    for x in jax.tree.leaves(tree):
        out.append(
            np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        )
    return out


@pytest.mark.slow
def test_grpo_steps_with_ngram_and_eagle_drafters_equal_plain(tmp_path) -> None:
    """Three smoke runs (plain, n-gram, a saved EAGLE drafter), SD for the whole rollout: coupled verification
    gives every run the same samples, so rewards and losses agree; the SD runs log the speculation metrics and
    compile nothing after their first step."""
    base = smoke("steps=3")
    policy_cfg = config_lib.tiny_random_model("llama")
    cfg = tiny_config(**{**dict(policy_cfg), "dtype": base.model.dtype})
    drafter_dir = save_drafter(tmp_path / "warm", cfg)
    runs = {}
    for kind in ("none", "ngram", "eagle"):
        c = smoke("steps=3")
        c.drafter.kind, c.drafter.path = kind, str(drafter_dir)
        learner = Learner(c, str(tmp_path / kind))
        try:
            metrics = [learner.train_step()]
            programs = learner.engine.compile_count
            metrics += [learner.train_step(), learner.train_step()]
            assert learner.engine.compile_count == programs, f"{kind}: recompiled across RL steps"
        finally:
            learner.close()
        runs[kind] = metrics
    for kind in ("ngram", "eagle"):
        for a, b in zip(runs["none"], runs[kind], strict=True):
            assert a["reward/mean"] == b["reward/mean"] and a["length/mean"] == b["length/mean"], kind
            np.testing.assert_allclose(a["loss/pg"], b["loss/pg"], rtol=1e-4, atol=1e-6)
        last = runs[kind][-1]
        assert last["spec/verify_rounds"] > 0 and last["rollout/sd_share"] > 0.5
        assert {
            "spec/accept_len",
            "spec/accept_collapse",
            "rollout/sd_tok_per_s",
            "rollout/time_running_le2",
        } <= set(last)
    assert "spec/accept_len" not in runs["none"][-1]


def test_drafter_section_errors(tmp_path) -> None:
    policy = tiny_config("llama")
    section = DrafterSection(kind="eagle", path=str(tmp_path / "missing"), min_accept_len=1.0)
    with pytest.raises(
        FileNotFoundError, match=r"holds no drafter checkpoint: create it with `\S*python\S* -m tlt_jax.main"
    ):
        resolve_drafter(section, policy)
    other = save_drafter(tmp_path / "wide", policy.replace(hidden_size=96, intermediate_size=160))
    section = dataclasses.replace(section, path=str(other))
    with pytest.raises(
        ValueError, match=r"does not fit the policy \(drafter vs policy: hidden_size 96 vs 64"
    ):
        resolve_drafter(section, policy)
    section = dataclasses.replace(section, kind="auto", path=str(tmp_path / "missing"))
    auto = resolve_drafter(section, policy)
    assert auto.kind == "ngram" and "configs/drafter_warmup.py:tlt" in auto.note
    section = dataclasses.replace(section, path=str(save_drafter(tmp_path / "ok", policy)))
    assert resolve_drafter(section, policy).kind == "eagle"


def test_acceptance_collapse_alarm_fires_on_a_broken_drafter_push(mirror, caplog) -> None:
    """A drafter that predicts the target well keeps the step's accept length above the floor; pushing
    broken weights (the fusion layer zeroed) drops it to ~1.0, and the monitor raises the alarm."""
    cfg = tiny_config(num_layers=2, tie_embeddings=False)
    target = mirror.target(cfg)
    target.lm_head[...] = target.lm_head[...] * 30.0  # a confident target: its samples are predictable
    good = mirror.drafter(target, noise=0.03)
    engine = RolloutEngine(
        target, EngineConfig(max_new_tokens=32, max_cache_len=96, chunk_steps=8), eos_ids=[], drafter=good
    )
    mode = engine.add_mode("eagle", "3_2_6")
    monitor = RolloutMonitor(min_accept=1.3)
    prompts, sp = [[9, 9, 2], [81, 65, 35, 40]], SamplingParams(temperature=0.7)
    engine.generate(prompts, n=4, key=jax.random.key(0), sampling=sp, hooks=[FixedMode(mode), monitor])
    healthy = monitor.metrics(step=1)
    assert healthy["spec/accept_len"] > 1.5 and healthy["spec/accept_collapse"] == 0.0, healthy
    broken = nnx.state(good, nnx.Param)
    broken["fc"] = jax.tree.map(lambda x: x * 0.0, broken["fc"])
    engine.set_drafter_params(broken)
    with caplog.at_level(logging.WARNING):
        engine.generate(prompts, n=4, key=jax.random.key(0), sampling=sp, hooks=[FixedMode(mode), monitor])
        collapsed = monitor.metrics(step=2)
    assert collapsed["spec/accept_collapse"] == 1.0 and collapsed["spec/accept_len"] < 1.3, collapsed
    assert "acceptance collapsed" in caplog.text and "drafter push" in caplog.text


@pytest.mark.slow
def test_spot_trained_run_resumes_identically(tmp_path) -> None:
    """TLT on the smoke config: a saved EAGLE drafter drafts (a fixed-table selector: EAGLE at <= 4 running
    rows, n-gram above) while the spot trainer trains it between chunks and pushes it after every step, and
    DAPO's dynamic sampling refills the step (groups whose reward does not vary dropped, at most 2 generation
    batches of 2 prompts, each through the same engine and spot trainer). 4 steps in one go vs 2 steps, a
    new Learner on the same workdir (restoring the policy, the drafter's train state and data buffer, the
    selector, the data position), then 2 more: the same drafter weights, generation batches, metrics."""
    cfg = tiny_config(**{**dict(config_lib.tiny_random_model("llama")), "dtype": "float32"})
    drafter_dir = save_drafter(tmp_path / "warm", cfg)

    def config():
        c = smoke("steps=4")
        c.checkpoint_every = 2
        c.drafter.kind, c.drafter.path = "eagle", str(drafter_dir)
        c.spot.mode, c.spot.threshold = "between_chunks", 1024
        c.spot.window, c.spot.context, c.spot.ce_tokens = 16, 8, 16
        c.spot.ttt_steps, c.spot.ttt_positions, c.spot.eval_samples = 1, 8, 4
        c.bandit.algorithm, c.bandit.arms = "fixed", ("plain", "3_1_4", "ngram_3_1_4")
        c.bandit.bucket_bounds = (4, 8)
        c.bandit.fixed_table = ("3_1_4", "ngram_3_1_4", "ngram_3_1_4")
        c.rl.dynamic_sampling, c.rl.filter_metric, c.rl.max_num_gen_batches = True, "score", 2
        c.rl.train_short_steps = True  # a step short of varied groups trains on what it kept (no VeRL error)
        return c

    whole = Learner(config(), str(tmp_path / "whole"))
    try:
        ref = [whole.train_step() for _ in range(4)]
        ref_state = whole.spot.state
    finally:
        whole.close()
    first = Learner(config(), str(tmp_path / "parts"))
    try:
        part = [first.train_step() for _ in range(2)]
        first.save()
    finally:
        first.close()
    second = Learner(config(), str(tmp_path / "parts"))
    try:
        assert second.step == 2 and len(second.spot.buffer) > 0
        part += [second.train_step() for _ in range(2)]
        got_state = second.spot.state
    finally:
        second.close()
    assert ref[-1]["spot/drafter_step"] > 0 and ref[-1]["spec/verify_rounds"] > 0
    batches = [m["dynamic_sampling/gen_batches"] for m in ref]
    assert max(batches) == 2  # refilled (the smoke policy's groups often score alike)
    np.testing.assert_array_equal([m["data/position"] for m in ref], np.cumsum(np.asarray(batches) * 2))
    for a, b in zip(ref, part, strict=True):
        # the selector's choices per bucket and arm (a fixed table: deterministic); what it learned is not
        # compared: rewards are timings, and a restarted engine's first chunks compile (skipped as rewards)
        choices = {k for k in a if k.startswith("bandit/") and k.endswith("/chosen")}
        refill = {k for k in a if k.startswith("dynamic_sampling/")} | {"data/position", "rl/kept_frac"}
        keys = {"reward/mean", "spot/steps", "spot/loss", "buffer/tokens"} | choices | refill
        for k in sorted(keys & set(a)):
            assert a[k] == pytest.approx(b[k], rel=1e-5), k
    for x, y in zip(leaves(ref_state), leaves(got_state), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
