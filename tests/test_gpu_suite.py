"""experiments/gpu_suite.py: the dry run end to end as a user runs it (CPU: tiny shapes, interpret mode), and
the pieces a GPU run depends on but a dry run cannot reach (bundle assembly, output parsers, the budget,
killing a subprocess that overruns it). The GPU numbers themselves come from a lent GPU (docs/gpu.md)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import gpu_bundle  # noqa: E402
import gpu_phases as ph  # noqa: E402
import gpu_report  # noqa: E402
import gpu_suite  # noqa: E402


@pytest.mark.slow
@pytest.mark.experiments
def test_dry_run_end_to_end(tmp_path: pathlib.Path) -> None:
    """Every phase runs through the same code as on a GPU and reports ok (e2e: skipped while its script does
    not exist); JSON, PNGs, report and RESULT lines appear and hold sane numbers."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "experiments/gpu_suite.py", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:  # say which phases failed and why, not just the end of the output
        summary = out / "summary.json"
        phases = json.loads(summary.read_text())["phases"] if summary.exists() else {}
        bad = {
            k: (v["status"], v["error"][-1500:])
            for k, v in phases.items()
            if v["status"] not in ("ok", "skipped")
        }
        pytest.fail(f"dry run exited {proc.returncode}: {bad or proc.stdout[-3000:] + proc.stderr[-2000:]}")
    results = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT gpu_suite")]
    assert (
        results[-1].startswith("RESULT gpu_suite call=all dry_run=1") and "failed=0 timeout=0" in results[-1]
    )
    summary = json.loads((out / "summary.json").read_text())
    phases = summary["phases"]
    assert list(phases) == list(gpu_suite.PHASES)
    e2e_exists = (ROOT / "experiments" / "e2e_speedup.py").exists()
    for name, res in phases.items():
        want = "skipped" if name == "e2e" and not e2e_exists else "ok"
        assert res["status"] == want, (name, res["error"][-1500:])
        assert any(line.startswith(f"RESULT gpu_suite.{name} status={want}") for line in results)
    assert phases["env"]["metrics"]["bandwidth_gb_s"] > 0.1
    kt = phases["kernel_tests"]["metrics"]
    assert kt["passed"] >= 3 and kt["failed"] == 0 and kt["errors"] == 0 and kt["compiled"] == 0
    ta = phases["tree_attention"]["details"]
    assert ta["lowering"] == "interpret" and ta["rows"] and ta["max_err"] < 1e-4
    assert ta["tuning"]["candidates"] and (out / "state" / "tuned_block_sizes.json").exists()
    assert phases["rollout_tests"]["metrics"]["passed"] >= 1
    assert "model incomplete" in phases["model"]["details"]["refusal"]
    dec = phases["decode"]["details"]["float32"]
    assert dec["rows"][0]["ours_tok_s"] > 0 and dec["meta"]["model"] == "tiny random Llama"
    assert dec["meta"]["hf_device"] == "cpu" and 0 < dec["rows"][0]["hf_tok_s"] < 1e7  # HF ran, same weights
    assert phases["decode"]["metrics"]["float32_ours_tok_s_bs1"] > 0
    assert phases["drafter"]["metrics"]["train_steps"] == 2 and phases["drafter"]["details"]["loss_curve"]
    assert (out / "state" / "drafter_tiny" / "drafter").is_dir()
    assert set(summary["targets"]) == {"kernel", "decode", "sd"}
    for png in ("tree_attention.png", "decode.png", "drafter.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert "## GPU suite" in (out / "report.md").read_text()
    assert len([p for p in out.iterdir() if p.is_file()]) <= gpu_report.MAX_FILES  # the device tool's cap


def test_bundle_parts_round_trip_and_refusals(tmp_path: pathlib.Path) -> None:
    """Split, reassemble (byte-exact, sha256 checked), no-op when current; refuse missing or corrupt parts."""
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(300_001))
    bundle = tmp_path / "bundle"
    manifest = gpu_bundle.write_parts(src, bundle, wheel_bytes=50_000)
    parts = manifest["model"]["parts"]
    assert parts[0]["size"] + 50_000 in (parts[1]["size"], parts[1]["size"] - 1)  # balanced with the wheels
    dest = tmp_path / "dest" / "model.gguf"
    assert gpu_bundle.assemble_model(bundle, dest)["assembled"]
    assert dest.read_bytes() == src.read_bytes()
    assert not gpu_bundle.assemble_model(bundle, dest)["assembled"]
    dest.unlink()
    part2 = bundle / "b" / "model.part2"
    data = part2.read_bytes()
    part2.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(gpu_bundle.BundleError, match="corrupt"):
        gpu_bundle.assemble_model(bundle, dest)
    assert not dest.exists() and not list(dest.parent.glob("*.part"))
    part2.unlink()
    with pytest.raises(gpu_bundle.BundleError, match="model incomplete"):
        gpu_bundle.assemble_model(bundle, dest)
    with pytest.raises(gpu_bundle.BundleError, match="no bundle"):
        gpu_bundle.assemble_model(tmp_path / "nowhere", dest)


def test_output_parsers() -> None:
    text = "noise\nRESULT a=1 b=x\nmore\nRESULT accept_len_bs1=2.5 sd_speedup_bs1=2.1 best_bs1=7_1_8\n"
    assert ph.parse_result(text) == {"accept_len_bs1": "2.5", "sd_speedup_bs1": "2.1", "best_bs1": "7_1_8"}
    assert ph.parse_result("no result") == {}
    # bench_sd's rows: batch, column, mode, plain tok/s, SD tok/s, speedup, accept, round/step, tokens, s
    row = f"{1:>5} {'tv16':>8} {'eagle_8_2_16':>11} {212.3:>11.1f} {401.9:>9.1f} {1.89:>6.2f}x {2.75:>6.2f} "
    row += f"{1.43:>10.2f} {512:>7} {33:>5.0f}"
    rows = ph.parse_sd_rows("header\n" + row + "  (2 compiles while timed!)\n")
    assert rows == [
        {"batch": 1, "column": "tv16", "strategy": "eagle_8_2_16", "plain_tok_s": 212.3, "sd_tok_s": 401.9,
         "speedup": 1.89, "accept": 2.75, "round_cost": 1.43}
    ]  # fmt: skip
    verbose = (
        "tests/k.py::test_a[x] PASSED [ 10%]\n[gw1] [ 20%] FAILED tests/k.py::test_b\n"
        "tests/k.py::test_c SKIPPED (why) [ 30%]\n"
    )
    counts = ph.parse_pytest_verbose(verbose)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1)
    assert counts["failures"][0]["test"] == "tests/k.py::test_b"
    assert set(ph.SD_FLAGS) <= ph.script_flags(ROOT / "experiments" / "bench_sd.py")


def test_latest_checkpoint_step_ignores_temporaries(tmp_path: pathlib.Path) -> None:
    for name in ("200", "400", "600.orbax-checkpoint-tmp-1700000000"):
        (tmp_path / name).mkdir()
    (tmp_path / "800").write_text("a file, not a step")
    assert ph.latest_step(tmp_path) == 400
    assert ph.latest_step(tmp_path / "missing") == 0


def test_targets_verdicts() -> None:
    res = {
        "tree_attention": {"metrics": {"faster_t16_64": 1}},
        "decode": {"metrics": {"bfloat16_ratio_vs_hf_bs1": 3.5, "float32_ratio_vs_hf_bs1": 0.5}},
        "sd": {"metrics": {"sd_speedup_bs1": 1.7}},
    }
    assert gpu_report.targets(res) == {"kernel": "pass", "decode": "pass", "sd": "fail"}
    assert gpu_report.targets({}) == {"kernel": "na", "decode": "na", "sd": "na"}


def _suite(tmp_path: pathlib.Path, budget: float, dry: bool = False) -> gpu_suite.Suite:
    paths = {k: str(tmp_path / k) for k in ("out", "state_dir", "bundle", "site")}
    args = argparse.Namespace(
        dry_run=dry,
        allow_cpu=False,
        extend_drafter=False,
        drafter_config="",
        call="2",
        budget_s=budget,
        limits="",
        **paths,
    )
    return gpu_suite.Suite(args)


def test_budget_keeps_time_for_later_phases(tmp_path: pathlib.Path) -> None:
    suite = _suite(tmp_path, budget=540)
    cap, least = gpu_suite.LIMITS["decode"]
    assert suite.timeout_for("decode", ("drafter",)) == cap  # plenty of time: the phase's own cap
    suite.deadline = time.perf_counter() + 200
    t = suite.timeout_for("decode", ("drafter", "sd"))  # squeezed: leave the later phases their minimum...
    assert least <= t <= 200 - gpu_suite.REPORT_RESERVE_S
    suite.deadline = time.perf_counter() + 50
    assert suite.timeout_for("decode", ("drafter",)) == 0.0  # ... and skip what cannot run its minimum


def test_run_kills_the_process_group_at_the_timeout(tmp_path: pathlib.Path) -> None:
    suite = _suite(tmp_path, budget=60)
    sleep = "[sys.executable, '-c', 'import time; time.sleep(60)']"
    code = f"import subprocess, sys, time; c = subprocess.Popen({sleep})"
    code += "; print('child', c.pid, flush=True); time.sleep(60)"
    t = time.perf_counter()
    proc = suite.run("sleeper", [sys.executable, "-c", code], timeout=3, env={})
    assert proc.timed_out and proc.rc is None and "child" in proc.output
    assert time.perf_counter() - t < 30
    child = int(proc.output.split("child")[1].split()[0])  # its own child went with it (one process group)
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {child} outlived the timeout")
    ok = suite.run("ok", [sys.executable, "-c", "print('RESULT x=1')"], timeout=30, env={"FOO": "1"})
    assert ok.rc == 0 and not ok.timed_out and ph.parse_result(ok.output) == {"x": "1"}
    suite.log.close()
    assert "RESULT x=1" in (tmp_path / "out" / "suite.log").read_text()
