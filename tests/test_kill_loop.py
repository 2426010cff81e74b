"""A kill anywhere, then the same run (experiments/checks/kill_loop.py, short version): the smoke RL job with
SD, the spot trainer and a fixed selector, SIGKILLed in a rollout, during a checkpoint's background write and
in a checkpoint's blocking part, relaunched each time, ends bit-identical to an uninterrupted run, with each
step logged once and nothing half-written left. The comparison itself is shown to catch a changed leaf, a
duplicated metrics line and leftovers.

The jobs share the tests' persistent compilation cache (.cache/jax_test_cache, as tests/test_main.py's).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

from tlt_jax.utils.checkpoint import TRASH, Checkpointer
from tlt_jax.utils.kill_runs import QUICK_PLAN, compare_runs, job_env, kill_loop, launch, leftovers

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 3


@pytest.mark.slow
def test_a_run_killed_three_times_ends_as_the_uninterrupted_one(tmp_path) -> None:
    env = job_env(ROOT / ".cache" / "jax_test_cache", fast_compile=True)
    ref = tmp_path / "reference"
    ref.mkdir()
    assert launch(ref, STEPS, env, tmp_path / "reference.log", 0).returncode == 0
    got = tmp_path / "killed"
    got.mkdir()
    runs = kill_loop(got, STEPS, QUICK_PLAN, env, tmp_path, delays={}, say=lambda _: None)
    kills = [r.kill for r in runs if r.kill]
    # killed where aimed: a rollout of step 2, the background write of checkpoint 2, the blocking save of 3
    assert [(k.landed, k.step) for k in kills] == [("rollout", 2), ("async_write", 3), ("checkpoint", 3)], (
        runs
    )
    assert kills[1].writing == [2]
    assert runs[-1].kill is None and runs[-1].returncode == 0
    cmp = compare_runs(ref, got, STEPS)
    assert cmp.ok, cmp

    # the comparison catches a changed leaf (one ulp of a policy weight) and a duplicated metrics line
    with Checkpointer(got / "checkpoints", async_save=False) as ckpt:
        state, meta = ckpt.restore(STEPS)
    path, leaf = jax.tree_util.tree_flatten_with_path(state["params"])[0][0]
    leaf = np.array(leaf)
    leaf.flat[0] = np.nextafter(leaf.flat[0], np.inf)
    state["params"] = jax.tree_util.tree_map_with_path(lambda p, x: leaf if p == path else x, state["params"])
    shutil.rmtree(got / "checkpoints" / str(STEPS))
    with Checkpointer(got / "checkpoints", async_save=False) as ckpt:
        ckpt.save(STEPS, state, meta)
    with open(got / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": STEPS}) + "\n")
    (got / "spot_buffer" / "9").mkdir()
    cmp = compare_runs(ref, got, STEPS)
    assert not cmp.identical and not cmp.steps_once and cmp.leftovers == ["spot_buffer/9 (no checkpoint)"]
    changed = [d for d in cmp.differences if d.startswith("checkpoint leaf")]
    assert len(changed) == 1 and changed[0].startswith("checkpoint leaf params/"), cmp.differences


def test_leftovers_names_what_a_crash_leaves_half_written(tmp_path) -> None:
    ckpts, buffers = tmp_path / "checkpoints", tmp_path / "spot_buffer"
    for step in (2, 4):
        (ckpts / str(step)).mkdir(parents=True)
        (buffers / str(step)).mkdir(parents=True)
    for name in ("_CHECKPOINT_METADATA", "commit_success.txt"):
        (ckpts / "2" / name).touch()
    (ckpts / "4" / "_CHECKPOINT_METADATA").touch()  # no commit file: half-deleted or never committed
    (ckpts / "6.orbax-checkpoint-tmp").mkdir()
    (buffers / "6").mkdir()
    (buffers / "6" / "drafter_buffer.npz.tmp.npz").touch()
    (tmp_path / "metrics.jsonl.tmp").touch()
    (tmp_path / "metrics.jsonl").touch()
    (ckpts / TRASH / "0").mkdir(parents=True)  # a retired step not yet removed
    assert leftovers(tmp_path) == [
        "checkpoints/.deleted",
        "checkpoints/6.orbax-checkpoint-tmp",
        "metrics.jsonl.tmp",
        "spot_buffer/6/drafter_buffer.npz.tmp.npz",
        "checkpoints/4 (not committed)",
        "spot_buffer/6 (no checkpoint)",
    ]
    shutil.rmtree(buffers / "2")
    assert "checkpoints/2 (no spot buffer)" in leftovers(tmp_path)
