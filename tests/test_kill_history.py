"""The history drafter through a SIGKILL (tlt_jax/utils/kill_runs.py's machinery, extended tier): the smoke RL
job with config.drafter.kind=history and every step a new epoch of the same two prompts, killed while its
final checkpoint was written (the store held step 3's responses in memory only) and relaunched from
checkpoint 2, ends identical to an uninterrupted run: every checkpoint leaf (the store's kept responses
included: "history/*") and every non-timing metric, among them step 3's history counters (matched tokens,
responses kept)."""

from __future__ import annotations

import pathlib

import pytest

from tlt_jax.utils.checkpoint import Checkpointer
from tlt_jax.utils.kill_runs import committed_steps, compare_runs, job_env, launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 3
HISTORY = ("--config.drafter.kind=history", "--config.task.size=2")


@pytest.mark.extended
def test_a_history_run_killed_in_step_3_ends_as_the_uninterrupted_one(tmp_path) -> None:
    env = job_env(ROOT / ".cache" / "jax_test_cache", fast_compile=True)
    ref, got = tmp_path / "reference", tmp_path / "killed"
    ref.mkdir()
    got.mkdir()
    assert launch(ref, STEPS, env, tmp_path / "ref.log", 0, overrides=HISTORY).returncode == 0
    # killed while checkpoint 3 is written (checkpoint 2 is on disk by then: orbax writes one at a time);
    # step 3's responses were in the store, in memory only
    killed = launch(got, STEPS, env, tmp_path / "kill.log", 1, ("async_write", 3, 0.0), overrides=HISTORY)
    assert killed.kill is not None and killed.kill.writing == [3], killed
    assert committed_steps(got) == [2], committed_steps(got)
    assert launch(got, STEPS, env, tmp_path / "relaunch.log", 2, overrides=HISTORY).returncode == 0
    cmp = compare_runs(ref, got, STEPS)
    assert cmp.ok, cmp
    with Checkpointer(got / "checkpoints", async_save=False) as ckpt:
        leaves = ckpt.layout(STEPS)["leaves"]
    assert {"history/tokens", "history/responses", "history/sizes"} <= set(leaves)
