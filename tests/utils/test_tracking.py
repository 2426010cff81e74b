"""Tests for tlt_jax.utils.tracking: jsonl round-trip and resume, wandb mode resolution and offline runs (no
network), console lines, fan-out and the rollout progress bar."""

import io
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tlt_jax.utils.tracking import (
    ConsoleTracker,
    JsonlTracker,
    MultiTracker,
    RolloutProgress,
    Tracker,
    WandbTracker,
    format_step_line,
    interpreter,
    make_trackers,
    read_metrics,
    resolve_wandb_mode,
    shorten,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_jsonl_roundtrip_flushes_each_line(tmp_path):
    t = JsonlTracker(tmp_path)
    assert isinstance(t, Tracker)
    t.log(0, {"reward/mean": np.float32(0.5), "length/max": jnp.int32(7), "ok": True})
    assert read_metrics(t.path) == [
        {"step": 0, "reward/mean": 0.5, "length/max": 7, "ok": True}
    ]  # before close
    t.log(1, {"reward/mean": 0.25})
    t.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
    with pytest.raises(RuntimeError, match="closed"):
        t.log(2, {})


def test_jsonl_rejects_bad_metrics(tmp_path):
    t = JsonlTracker(tmp_path)
    with pytest.raises(ValueError, match="'step' key"):
        t.log(0, {"step": 1})
    with pytest.raises(TypeError, match="'lengths' must be a scalar"):
        t.log(0, {"lengths": np.arange(3)})
    t.close()


def test_jsonl_truncate_on_resume_drops_rerun_steps_and_torn_line(tmp_path):
    t = JsonlTracker(tmp_path)
    for step in range(5):
        t.log(step, {"x": step})
    t.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "x"')  # the process died mid-write
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]

    resumed = JsonlTracker(tmp_path)  # restarted from the step-3 checkpoint
    assert resumed.truncate_from(3) == 3  # steps 3, 4 and the torn line
    resumed.log(3, {"x": 30})
    resumed.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["x"]) for r in rows] == [(0, 0), (1, 1), (2, 2), (3, 30)]


def test_read_metrics_names_a_corrupt_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        read_metrics(path)


def test_log_config_writes_config_json(tmp_path):
    cfg = ml_collections.ConfigDict({"lr": 1e-3, "wandb": {"mode": "offline"}})
    t = JsonlTracker(tmp_path)
    t.log_config(cfg)
    t.close()
    assert json.loads((tmp_path / "config.json").read_text()) == {"lr": 1e-3, "wandb": {"mode": "offline"}}


def test_resolve_wandb_mode_explicit_then_env_then_offline():
    assert resolve_wandb_mode("disabled", {"WANDB_MODE": "online"}) == "disabled"
    assert resolve_wandb_mode(None, {"WANDB_MODE": "online"}) == "online"
    assert resolve_wandb_mode("", {"WANDB_MODE": "disabled"}) == "disabled"
    assert resolve_wandb_mode(None, {}) == "offline"
    with pytest.raises(ValueError, match="config.wandb.mode is 'ofline'"):
        resolve_wandb_mode("ofline", {})
    with pytest.raises(ValueError, match="WANDB_MODE environment variable is 'nope'"):
        resolve_wandb_mode(None, {"WANDB_MODE": "nope"})


def test_wandb_disabled_is_a_noop(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    t = WandbTracker("p", "n", tmp_path)
    assert t.mode == "disabled" and t.run is None
    t.log(0, {"x": 1.0})
    t.log_config({"a": 1})
    t.close()
    assert os.listdir(tmp_path) == []


@pytest.fixture
def no_network(monkeypatch):
    """Make any in-process connection to a non-local address fail (and record it)."""
    attempts = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def check(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in (
            "127.0.0.1",
            "::1",
            "localhost",
        ):
            attempts.append(address)
            raise OSError(f"test forbids network access to {address}")

    monkeypatch.setattr(socket.socket, "connect", lambda s, a: (check(s, a), real_connect(s, a))[1])
    monkeypatch.setattr(socket.socket, "connect_ex", lambda s, a: (check(s, a), real_connect_ex(s, a))[1])
    return attempts


def test_offline_wandb_writes_under_workdir_and_resumes_the_same_run(tmp_path, no_network):
    cfg = ml_collections.ConfigDict(
        {"lr": 1e-3, "wandb": {"mode": "offline", "project": "tlt", "name": "t1"}}
    )
    first = WandbTracker(
        "tlt", "t1", tmp_path, mode="offline", config=cfg
    )  # explicit mode beats env 'disabled'
    first.log(0, {"reward/mean": 0.5})
    first.log(1, {"reward/mean": np.float32(0.75)})
    first.close()
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    runs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and (runs[0] / f"run-{run_id}.wandb").stat().st_size > 0

    trackers = make_trackers(cfg, tmp_path, resume_step=1)  # the restart continues the same wandb run id
    wandb_tracker = trackers.trackers[-1]
    assert isinstance(wandb_tracker, WandbTracker) and wandb_tracker.run_id == run_id
    assert wandb_tracker.run.id == run_id
    trackers.log(1, {"reward/mean": 1.0})
    trackers.close()
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    assert no_network == []


_WANDB_CHILD = textwrap.dedent(
    """
    import sys
    from tlt_jax.utils.tracking import WandbTracker
    t = WandbTracker("tlt", "strace", sys.argv[1], mode=None)
    t.log(0, {"x": 1.0})
    t.close()
    """
)


def test_offline_wandb_opens_no_network_connection_in_any_process(tmp_path):
    """strace -f sees wandb-core too (a Go child process that in-process socket patches cannot see)."""
    strace = shutil.which("strace")
    if strace is None or subprocess.run([strace, "-qq", "true"], capture_output=True).returncode != 0:
        pytest.skip("strace is not installed or cannot trace here; the in-process check still ran")
    trace = tmp_path / "connect.trace"
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    cmd = [strace, "-f", "-qq", "-e", "trace=connect", "-o", str(trace), sys.executable, "-c", _WANDB_CHILD]
    proc = subprocess.run(cmd + [str(tmp_path / "wd")], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list((tmp_path / "wd" / "wandb").glob("offline-run-*/run-*.wandb"))
    connects = [line for line in trace.read_text().splitlines() if "connect(" in line]
    assert connects, "strace recorded no connect() at all: the trace is not working"
    inet = [c for c in connects if re.search(r"AF_INET6?\b", c) and not re.search(r"127\.0\.0\.1|::1", c)]
    assert inet == [], inet


def test_format_step_line_full_and_partial():
    metrics = {
        "reward/mean": 0.125,
        "accuracy": 0.1,
        "length/p50": 44.5,
        "length/p90": 162.6,
        "length/max": 384,
        "time/step": 132.79,
        "time/rollout": 71.2,
        "time/compile": 42.82,
        "time/spot": 11.0,
        "time/reward": 0.4,
        "time/logprob": 0.001,  # rounds to zero: left out
        "time/update": 6.87,
        "time/other": 0.5,
        "throughput/tok_per_s": 98.6,
        "spec/accept_len": 2.3125,
        "eval/reward": 0.3,
        "eval/accuracy": 0.0625,
        "eval/seconds": 35.21,
    }
    assert format_step_line(12, metrics, num_steps=20) == (
        "step 12/20 | reward 0.125 | acc 10.0% | len p50/p90/max 44/163/384"
        " | time 132.8 s = rollout 71.2 + compile 42.8 + spot 11.0 + reward 0.40 + update 6.87 + other 0.50"
        " | 99 tok/s | accept 2.31 | held-out reward 0.300 acc 6.2% (35.2 s)"
    )
    assert format_step_line(3, {}) == "step 3"
    assert format_step_line(4, {"length/p90": 50, "time/step": 4.0, "rollout/share": 0.5, "unknown": 1}) == (
        "step 4 | len p50/p90/max -/50/- | time 4.00 s"
    )
    assert format_step_line(5, {"reward/mean": 0.0004, "accuracy": float("nan")}) == (
        "step 5 | reward 4.00e-04 | acc nan%"
    )
    # speculative modes exist but no chunk of this step speculated: say so instead of dropping the field
    assert (
        format_step_line(6, {"spec/modes": 2, "spec/verify_rounds": 0}) == "step 6 | accept - (no SD chunk)"
    )
    assert format_step_line(7, {"spec/modes": 0, "spec/verify_rounds": 0}) == "step 7"  # plain decoding only
    refill = {"dynamic_sampling/gen_batches": 3, "dynamic_sampling/kept_groups": 5}
    refill |= {"dynamic_sampling/generated_groups": 24, "dynamic_sampling/short_groups": 3}
    assert format_step_line(8, refill) == "step 8 | 3 gen batches, kept 5/24 groups (3 short)"
    # phases of older metrics (no breakdown) still show, after the known parts
    assert format_step_line(8, {"time/rollout": 6.0, "time/train": 2.0}) == (
        "step 8 | time 8.00 s = rollout 6.00 + train 2.00"
    )


def test_shorten_cuts_the_middle():
    question = "Find the final answer to the following arithmetic problem: 5 + 4 - 5 ="
    assert shorten(question, 200) == question
    assert shorten(question, 31) == "Find the final …em: 5 + 4 - 5 ="  # 15 + "…" + 15 characters
    assert shorten(question, 2) == "…" + question[-1]


def test_interpreter_is_this_python_relative_inside_the_working_directory(tmp_path, monkeypatch):
    assert os.path.samefile(interpreter(), sys.executable)
    monkeypatch.chdir(tmp_path)  # outside the repository: the absolute path
    assert interpreter() == os.path.abspath(sys.executable)
    monkeypatch.chdir(pathlib.Path(sys.executable).parents[2])  # the folder holding .venv (or the prefix)
    assert not os.path.isabs(interpreter()) and interpreter().endswith(os.path.basename(sys.executable))


def test_console_tracker_prints_every_n_steps():
    lines = []
    t = ConsoleTracker(every=2, print_fn=lines.append, num_steps=4)
    for step in range(4):
        t.log(step, {"reward/mean": step / 4})
    t.log_config({"a": 1})
    t.close()
    assert lines == ["step 0/4 | reward 0", "step 2/4 | reward 0.500"]


def test_multi_tracker_fans_out_and_closes_all_despite_errors(tmp_path):
    lines = []

    class Broken:
        closed = False

        def log(self, step, metrics):
            pass

        def log_config(self, config):
            pass

        def close(self):
            Broken.closed = True
            raise OSError("disk gone")

    jsonl = JsonlTracker(tmp_path)
    multi = MultiTracker([Broken(), jsonl, ConsoleTracker(print_fn=lines.append)])
    multi.log(0, {"reward/mean": 1.0})
    with pytest.raises(OSError, match="disk gone"):
        multi.close()
    assert Broken.closed and jsonl._file is None
    assert lines == ["step 0 | reward 1"] and read_metrics(jsonl.path) == [{"step": 0, "reward/mean": 1.0}]


def test_rollout_progress_disabled_writes_nothing_but_counts():
    out = io.StringIO()
    bar = RolloutProgress(total=4, file=out, disable=True)
    bar.update(running=4, finished=0, new_tokens=8)
    bar.update(running=2, finished=2, new_tokens=6)
    bar.close()
    assert out.getvalue() == ""
    assert (bar.running, bar.finished, bar.tokens) == (2, 2, 14) and bar.tok_per_s > 0
    auto = RolloutProgress(total=4, file=io.StringIO())  # disable=None: a StringIO is not a TTY
    auto.update(1, 0, 1)
    auto.close()
    assert auto._bar.disable


def test_rollout_progress_renders_into_a_stream():
    out = io.StringIO()
    with RolloutProgress(total=4, file=out, disable=False, mininterval=0) as bar:
        bar.update(running=4, finished=1, new_tokens=100)
        bar.update(running=3, finished=3, new_tokens=50)
    text = out.getvalue()
    assert "rollout" in text and "3/4" in text
    assert "running 3 | finished 3 | 150 tok |" in text and "tok/s" in text
