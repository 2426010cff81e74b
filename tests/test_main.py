"""`python -m tlt_jax.main` end to end on the smoke config, in subprocesses (a real CLI, real signals):
overrides reach config.json, bad keys fail clearly, a run SIGKILLed in the middle of a checkpoint save resumes
from the last complete checkpoint and reproduces the uninterrupted run, and SIGTERM saves and exits cleanly.

All runs share the tests' persistent XLA compilation cache (.cache/jax_test_cache), so only the first run of
a fresh clone pays for compiling.
"""

from __future__ import annotations

import json
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tlt_jax.main import exit_status
from tlt_jax.utils.checkpoint import Checkpointer
from tlt_jax.utils.kill_runs import job_env, leftovers
from tlt_jax.utils.tracking import read_metrics
from tlt_jax.utils.watchdog import EXIT_STALLED, EXIT_STOPPED

ROOT = pathlib.Path(__file__).resolve().parents[1]
LR = "0.004"  # a nested override every run uses (it must reach config.json)
# Metrics that depend only on the computation, not on timing.
DETERMINISTIC = (
    "reward/mean",
    "accuracy",
    "length/mean",
    "length/max",
    "loss/pg",
    "optim/grad_norm",
    "policy/entropy",
    "rl/adv_abs_mean",
    "data/position",
    "logprob/engine_gap",
)

# Runs main with orbax's final rename of checkpoint step KILL_STEP replaced by SIGKILL: every file of that
# step is written into `<step>.orbax-checkpoint-tmp`, but the step is never committed.
KILL_IN_SAVE = """
import os, signal, sys
from orbax.checkpoint._src.path import atomicity

_finalize = atomicity.AtomicRenameTemporaryPath.finalize

async def finalize(self):
    if os.path.basename(str(self._final_path)) == os.environ["KILL_STEP"]:
        os.kill(os.getpid(), signal.SIGKILL)
    return await _finalize(self)

atomicity.AtomicRenameTemporaryPath.finalize = finalize
from absl import app
from tlt_jax import main
sys.argv = ["tlt_jax.main"] + sys.argv[1:]
app.run(main.main, flags_parser=main.parse_flags)
"""


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    """2 fake devices (sharded runs; fast orbax saves), no wandb, the tests' compilation cache (conftest.py),
    as the kill loop's jobs (tests/test_kill_loop.py)."""
    return job_env(ROOT / ".cache" / "jax_test_cache", fast_compile=True)


def run_main(
    env: dict[str, str], workdir: pathlib.Path, *args: str, script: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", script] if script else [sys.executable, "-m", "tlt_jax.main"]
    cmd += ["--config", str(ROOT / "configs" / "smoke.py"), f"--config.rl.lr={LR}", "--workdir", str(workdir)]
    return subprocess.run(
        cmd + list(args), env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"


def metrics(workdir: pathlib.Path) -> list[dict]:
    return read_metrics(workdir / "metrics.jsonl")


def final_params(workdir: pathlib.Path, step: int) -> list[np.ndarray]:
    with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        state, meta = ckpt.restore(step)
    assert meta["step"] == step
    return [np.asarray(x) for x in _leaves(state["params"])]


def _leaves(tree) -> list:
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in _leaves(tree[k])]
    return [tree]


def assert_same_run(a: pathlib.Path, b: pathlib.Path, steps: int = 4) -> None:
    ma, mb = metrics(a), metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == list(range(1, steps + 1))
    for ra, rb in zip(ma, mb, strict=True):
        for k in DETERMINISTIC:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-9), (ra["step"], k)
    for x, y in zip(final_params(a, steps), final_params(b, steps), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def reference_run(env, tmp_path_factory) -> pathlib.Path:
    """The uninterrupted 4-step smoke run every other run is compared with."""
    workdir = tmp_path_factory.mktemp("reference")
    ok(run_main(env, workdir, timeout=600))
    return workdir


def test_cli_runs_end_to_end_and_records_the_resolved_config(reference_run) -> None:
    config = json.loads((reference_run / "config.json").read_text())
    assert config["rl"]["lr"] == float(LR) and config["job"] == "grpo"
    rows = metrics(reference_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss/pg"]) and r["logprob/engine_gap"] < 1e-4 for r in rows)
    assert any(r["optim/grad_norm"] > 0 for r in rows), "no step had a learning signal"
    assert sorted(int(p.name) for p in (reference_run / "checkpoints").iterdir() if p.name.isdigit()) == [
        2,
        4,
    ]
    assert (reference_run / "samples.jsonl").exists()


def test_bad_overrides_fail_with_a_clear_message(env, tmp_path) -> None:
    proc = run_main(env, tmp_path, "--config.rl.lrr=1")
    assert proc.returncode == 2
    assert "unknown config key: 'lrr'" in proc.stderr and 'Did you mean "lr"' in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_main(env, tmp_path, "--config.trainer.micro_batch_size=6")
    assert proc.returncode == 2
    assert "config.trainer.micro_batch_size=6 must divide the mini-batch of 16 rows" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.extended  # make test's kill loop (test_kill_loop.py) kills a save too
def test_sigkill_during_a_checkpoint_save_resumes_from_the_last_complete_one(
    env, reference_run, tmp_path
) -> None:
    """Run 4 steps, SIGKILL inside the save of step 4, rerun the same command: it restores step 2 and runs
    steps 3-4 again, reproducing the uninterrupted run (metrics and weights)."""
    proc = run_main({**env, "KILL_STEP": "4"}, tmp_path, script=KILL_IN_SAVE)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "2").is_dir() and not (ckpts / "4").exists()
    assert any(p.name.startswith("4.") for p in ckpts.iterdir()), "the kill did not hit the save of step 4"
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3, 4]  # step 4 was logged, then the save died
    ok(run_main(env, tmp_path))  # the same command again: restores step 2, reruns 3-4
    assert not any(p.name.startswith("4.") for p in ckpts.iterdir() if not p.name.isdigit())
    assert leftovers(tmp_path) == []
    assert_same_run(reference_run, tmp_path)


def test_sigterm_saves_and_exits_cleanly(env, tmp_path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "tlt_jax.main",
        "--config",
        str(ROOT / "configs" / "smoke.py:steps=100000"),
        f"--config.rl.lr={LR}",
        "--config.checkpoint_every=0",
        "--workdir",
        str(tmp_path),
    ]
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not ((tmp_path / "metrics.jsonl").exists() and metrics(tmp_path)):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never logged a step"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_STOPPED, stderr[-3000:]  # stopped, to be requeued: not "done" (0)
    assert "received SIGTERM" in stderr and "job grpo: preempted" in stderr
    last = metrics(tmp_path)[-1]["step"]
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [last]  # checkpoint_every=0: only the preemption save


def test_console_is_plain_and_the_end_says_where_the_outputs_are(env, reference_run, tmp_path) -> None:
    """The same command on a finished run (a copy of the reference run): it restores step 4, trains nothing,
    draws the plot and ends by naming the metrics, checkpoints, plot and config; INFO lines carry no absl
    prefix."""
    import shutil

    workdir = tmp_path / "done"
    shutil.copytree(reference_run, workdir)
    proc = run_main(env, workdir)
    ok(proc)
    lines = proc.stderr.splitlines()
    assert not [x for x in lines if re.match(r"I\d{4} [\d:.]+ +\d+ \w+\.py:\d+\] ", x)]  # Python INFO records
    assert any(x.startswith("restored step 4 from ") for x in lines), proc.stderr[-2000:]
    end = lines[lines.index("job grpo: done") :]
    assert f"  metrics      {workdir / 'metrics.jsonl'} (4 logged steps)" in end
    assert f"  checkpoints  {workdir / 'checkpoints'} (steps 2, 4)" in end
    assert (
        f"  plot         {workdir / 'plots' / 'run.png'}" in end
        and (workdir / "plots" / "run.png").stat().st_size
    )
    assert f"  config       {workdir / 'config.json'}" in end


def test_console_formatter_keeps_the_prefix_for_warnings_only() -> None:
    import logging as logging_std

    from tlt_jax.main import ConsoleFormatter

    def record(level: int, msg: str) -> logging_std.LogRecord:
        return logging_std.LogRecord("absl", level, "/x/learner.py", 7, msg, (), None)

    fmt = ConsoleFormatter()
    assert fmt.format(record(logging_std.INFO, "step 1/10 | reward 0.5")) == "step 1/10 | reward 0.5"
    warning = fmt.format(record(logging_std.WARNING, "acceptance collapsed"))
    assert re.match(r"W\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ learner\.py:7\] acceptance collapsed$", warning), (
        warning
    )


def test_run_summary_names_an_offline_wandb_run_and_how_to_upload_it(tmp_path) -> None:
    from ml_collections import ConfigDict

    from tlt_jax.main import run_summary

    (tmp_path / "wandb_run_id").write_text("abc123\n")
    run = tmp_path / "wandb" / "offline-run-20261124_202516-abc123"
    run.mkdir(parents=True)
    config = ConfigDict({"job": "grpo", "wandb": {"mode": "offline", "project": "p"}})
    text = run_summary(config, str(tmp_path), "preempted")
    assert text.splitlines()[0] == "job grpo: preempted; rerun the same command to resume"
    assert f"  wandb        {run} (offline; upload it with `wandb sync {run}`)" in text
    config.wandb.mode = "disabled"
    assert "  wandb        off (config.wandb.mode or WANDB_MODE is disabled)" in run_summary(
        config, str(tmp_path), "done"
    )


def test_exit_status_tells_done_stopped_stalled_and_failed_apart() -> None:
    """What a scheduler decides from (configs/cluster/slurm_grpo.sh requeues on EXIT_STOPPED only): a run that
    finished exits 0, one stopped on a request 75 (EX_TEMPFAIL), a stalled one 70, a config error 2, a crash
    1 (Python's). The runs: test_cli_runs_end_to_end... (0), test_sigterm_saves_and_exits_cleanly (75),
    test_bad_overrides_fail_with_a_clear_message (2), tests/utils/test_watchdog.py (70)."""
    assert (exit_status("done"), exit_status("preempted")) == (0, EXIT_STOPPED) == (0, 75)
    assert len({0, EXIT_STOPPED, EXIT_STALLED, 2, 1}) == 5
    with pytest.raises(ValueError, match="unknown job status 'stalled'"):
        exit_status("stalled")
