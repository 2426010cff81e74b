"""gpu/suite.py: the dry run end to end as a user runs it (CPU: tiny shapes, interpret mode), and
the pieces a GPU run depends on but a dry run cannot reach (bundle assembly, the state kept outside the
repository between device calls and resuming from it, output parsers, the report's sections, the budget,
killing a subprocess that overruns it). The GPU numbers themselves come from a lent GPU (docs/gpu.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

from gpu import (  # noqa: E402
    bundle,
    measure,
    parse,
    regime_phases,
    report,
    rl_step_phases,
    state,
    suite,
)
from tlt_jax.utils.kill_runs import FAST_COMPILE_FLAGS  # noqa: E402

# every phase but the plan's 7B ones, which tests/experiments/test_gpu_plan.py dry-runs (in `make test`)
LEGACY = tuple(p for p in suite.PHASES if p not in ("rl_step_7b", "regime_7b", "update_7b"))


@pytest.mark.slow
@pytest.mark.experiments
def test_dry_run_end_to_end(tmp_path: pathlib.Path) -> None:
    """Every phase (but the 7B ones: test_gpu_plan.py) runs through the same code as on a GPU and reports ok
    (e2e and compile: skipped while their scripts do not exist, verify_cost while bench_verify_cost.py has no
    --breakdown); JSON, PNGs, report and RESULT lines appear and hold sane numbers."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "gpu.suite", "--dry-run", "--phases", ",".join(LEGACY), "--out", str(out)],
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
    assert list(phases) == list(LEGACY)
    missing = {
        "e2e": not (ROOT / "experiments" / "paper" / "e2e_speedup.py").exists(),
        "compile": not (ROOT / "experiments" / "bench" / "compile_time.py").exists(),
        "verify_cost": "--breakdown"
        not in parse.script_flags(ROOT / "experiments" / "bench" / "bench_verify_cost.py"),
    }
    for name, res in phases.items():
        want = "skipped" if missing.get(name) else "ok"
        assert res["status"] == want, (name, res["error"][-1500:])
        assert any(line.startswith(f"RESULT gpu_suite.{name} status={want}") for line in results)
    assert phases["env"]["metrics"]["bandwidth_gb_s"] > 0.1
    kt = phases["kernel_tests"]["metrics"]
    assert kt["passed"] >= 3 and kt["failed"] == 0 and kt["errors"] == 0 and kt["compiled"] == 0
    ta = phases["tree_attention"]["details"]
    assert ta["lowering"] == "interpret" and ta["rows"] and ta["max_err"] < 1e-4
    assert ta["tuning"]["candidates"] and (out / "state" / "tuned_block_sizes.json").exists()
    assert phases["rollout_tests"]["metrics"]["passed"] >= 1
    model = phases["model"]["details"]
    assert "model incomplete" in model["refusal"] and [c["carried"] for c in model["calls"]] == ["a", "b", ""]
    dec = phases["decode"]["details"]["float32"]
    assert dec["rows"][0]["ours_tok_s"] > 0 and dec["meta"]["model"] == "tiny random Llama"
    assert dec["meta"]["hf_device"] == "cpu" and 0 < dec["rows"][0]["hf_tok_s"] < 1e7  # HF ran, same weights
    assert dec["meta"]["hf_fast"].startswith("skipped on CPU")  # the fast path says why it did not run
    assert phases["decode"]["metrics"]["float32_ours_tok_s_bs1"] > 0
    assert phases["drafter"]["metrics"]["train_steps"] == 2 and phases["drafter"]["details"]["loss_curve"]
    assert (out / "state" / "drafter_tiny" / "drafter").is_dir()
    assert set(summary["targets"]) == {"kernel", "decode", "decode_fast", "sd", "identity", "rl_step"} | set(
        regime_phases.regime_targets({})
    )
    named = phases["gpu_tests"]["details"]["named"]  # the two make test skips: skipped on a CPU too
    assert set(named) == set(rl_step_phases.SKIPPED_ON_CPU) and set(named.values()) == {"skipped"}
    for png in ("tree_attention.png", "decode.png", "drafter.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert "## GPU suite" in (out / "report.md").read_text()
    assert len([p for p in out.iterdir() if p.is_file()]) <= report.MAX_FILES  # the device tool's cap


def test_bundle_parts_round_trip_and_refusals(tmp_path: pathlib.Path) -> None:
    """Split, reassemble (byte-exact, sha256 checked), no-op when current; refuse missing or corrupt parts."""
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(300_001))
    bundle_dir = tmp_path / "bundle"
    manifest = bundle.write_parts(src, bundle_dir, wheel_bytes=50_000)
    parts = manifest["model"]["parts"]
    assert parts[0]["size"] + 50_000 in (parts[1]["size"], parts[1]["size"] - 1)  # balanced with the wheels
    dest = tmp_path / "dest" / "model.gguf"
    assert bundle.assemble_model(bundle_dir, dest)["assembled"]
    assert dest.read_bytes() == src.read_bytes()
    assert not bundle.assemble_model(bundle_dir, dest)["assembled"]
    dest.unlink()
    part2 = bundle_dir / "b" / "model.part2"
    data = part2.read_bytes()
    part2.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(bundle.BundleError, match="corrupt"):
        bundle.assemble_model(bundle_dir, dest)
    assert not dest.exists() and not list(dest.parent.glob("*.part"))
    part2.unlink()
    with pytest.raises(bundle.BundleError, match="model incomplete"):
        bundle.assemble_model(bundle_dir, dest)
    with pytest.raises(bundle.BundleError, match="no bundle"):
        bundle.assemble_model(tmp_path / "nowhere", dest)


def test_output_parsers(tmp_path: pathlib.Path) -> None:
    text = "noise\nRESULT a=1 b=x\nmore\nRESULT accept_len_bs1=2.5 sd_speedup_bs1=2.1 best_bs1=7_1_8\n"
    assert parse.parse_result(text) == {"accept_len_bs1": "2.5", "sd_speedup_bs1": "2.1", "best_bs1": "7_1_8"}
    assert parse.parse_result("no result") == {}
    # bench_sd's rows: batch, column, mode, plain tok/s, SD tok/s, speedup, accept, round/step, tokens, s
    row = f"{1:>5} {'tv16':>8} {'eagle_8_2_16':>11} {212.3:>11.1f} {401.9:>9.1f} {1.89:>6.2f}x {2.75:>6.2f} "
    row += f"{1.43:>10.2f} {512:>7} {33:>5.0f}"
    rows = parse.parse_sd_rows("header\n" + row + "  (2 compiles while timed!)\n")
    assert rows == [
        {"batch": 1, "column": "tv16", "strategy": "eagle_8_2_16", "plain_tok_s": 212.3, "sd_tok_s": 401.9,
         "speedup": 1.89, "accept": 2.75, "round_cost": 1.43}
    ]  # fmt: skip
    verbose = (
        "tests/k.py::test_a[x] PASSED [ 10%]\n[gw1] [ 20%] FAILED tests/k.py::test_b\n"
        "tests/k.py::test_c SKIPPED (why) [ 30%]\n"
    )
    counts = parse.parse_pytest_verbose(verbose)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1)
    assert counts["failures"][0]["test"] == "tests/k.py::test_b"
    assert set(measure.SD_FLAGS) <= parse.script_flags(ROOT / "experiments" / "bench" / "bench_sd.py")
    assert set(measure.IDENTITY_FLAGS) <= parse.script_flags(
        ROOT / "experiments" / "checks" / "sd_identity.py"
    )
    script = tmp_path / "s.py"
    script.write_text(
        "ap.add_argument('--quick')\nap.add_argument(\n    \"--breakdown\", action='store_true')\n"
    )
    assert parse.script_flags(script) == {"--quick", "--breakdown"}
    # bench_verify_cost's round breakdown, whatever its phases; other keys are not rows
    text = "RESULT fwd_cost_t2=1.1 round_tv64_draft_steps=1.5 round_tv8_ms=0.5 round_tv8_verify_steps=2\n"
    metrics = {k: parse.as_number(v) for k, v in parse.parse_result(text).items()}
    assert parse.parse_round_breakdown(metrics) == [
        {"column": "tv8", "tv": 8, "round_ms": 0.5, "verify_steps": 2.0},
        {"column": "tv64", "tv": 64, "draft_steps": 1.5},
    ]


def test_latest_checkpoint_step_ignores_temporaries(tmp_path: pathlib.Path) -> None:
    for name in ("200", "400", "600.orbax-checkpoint-tmp-1700000000"):
        (tmp_path / name).mkdir()
    (tmp_path / "800").write_text("a file, not a step")
    assert parse.latest_step(tmp_path) == 400
    assert parse.latest_step(tmp_path / "missing") == 0


def test_targets_verdicts() -> None:
    res = {
        "tree_attention": {"metrics": {"faster_t16_64": 1}},
        "decode": {"metrics": {"bfloat16_ratio_vs_hf_bs1": 3.5, "float32_ratio_vs_hf_bs1": 0.5}},
        "sd": {"metrics": {"sd_speedup_bs1": 1.7}},
    }
    res["decode"]["metrics"]["bfloat16_ratio_vs_hf_fast_bs1"] = 0.8
    res["identity"] = {"metrics": {"float32_identical_frac_min": 1.0, "bfloat16_identical_frac_min": 0.3}}
    want = {"kernel": "pass", "decode": "pass", "decode_fast": "fail", "sd": "fail", "identity": "pass"}
    want |= {"decode_7b": "na", "round_7b": "na", "compile": "na", "rl_step": "na"}  # test_gpu_plan.py
    assert report.targets(res) == want
    assert set(report.targets({}).values()) == {"na"}


def _suite(tmp_path: pathlib.Path, budget: float, dry: bool = False) -> suite.Suite:
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
    return suite.Suite(args)


def test_budget_keeps_time_for_later_phases(tmp_path: pathlib.Path) -> None:
    call_suite = _suite(tmp_path, budget=540)
    cap, least = suite.LIMITS["decode"]
    assert call_suite.timeout_for("decode", ("drafter",)) == cap  # plenty of time: the phase's own cap
    call_suite.deadline = time.perf_counter() + 200
    t = call_suite.timeout_for(
        "decode", ("drafter", "sd")
    )  # squeezed: the later phases keep their minimum...
    assert least <= t <= 200 - suite.REPORT_RESERVE_S
    call_suite.deadline = time.perf_counter() + 50
    assert call_suite.timeout_for("decode", ("drafter",)) == 0.0  # ... and skip what cannot run its minimum


def test_run_kills_the_process_group_at_the_timeout(tmp_path: pathlib.Path) -> None:
    call_suite = _suite(tmp_path, budget=60)
    sleep = "[sys.executable, '-c', 'import time; time.sleep(60)']"
    code = f"import subprocess, sys, time; c = subprocess.Popen({sleep})"
    code += "; print('child', c.pid, flush=True); time.sleep(60)"
    t = time.perf_counter()
    proc = call_suite.run("sleeper", [sys.executable, "-c", code], timeout=3, env={})
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
    ok = call_suite.run("ok", [sys.executable, "-c", "print('RESULT x=1')"], timeout=30, env={"FOO": "1"})
    assert ok.rc == 0 and not ok.timed_out and parse.parse_result(ok.output) == {"x": "1"}
    call_suite.log.close()
    assert "RESULT x=1" in (tmp_path / "out" / "suite.log").read_text()


# ---- state kept outside the repository between device calls -------------------------------------------


def test_state_dir_is_outside_the_repository_and_falls_back(tmp_path, monkeypatch) -> None:
    out = tmp_path / "out"
    monkeypatch.delenv(state.STATE_ENV, raising=False)
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(state, "DEFAULT_STATE", tmp_path / "a_file" / "keep")  # cannot be created
    monkeypatch.setattr(state, "FALLBACK_STATE", tmp_path / "tmp_state")
    state_dir, why = state.choose_state_dir("", False, out)
    assert state_dir == tmp_path / "tmp_state" and "not writable" in why and not state.inside_repo(state_dir)
    monkeypatch.setenv(state.STATE_ENV, str(tmp_path / "env_state"))
    assert state.choose_state_dir("", False, out)[0] == tmp_path / "env_state"
    assert state.choose_state_dir("", True, out)[0] == out / "state"  # a dry run keeps its own
    assert state.choose_state_dir(str(tmp_path / "x"), True, out)[0] == tmp_path / "x"
    assert state.inside_repo(ROOT / "workdirs" / "suite")


def test_carried_parts_are_stashed_and_a_later_call_resumes(tmp_path: pathlib.Path) -> None:
    """Three calls, each in a fresh repository copy: part a arrives (stashed; the model refused as
    incomplete), part b arrives while a is gone from the repository (assembled from the stash, linked where
    the scripts read it), nothing arrives (a no-op). A part of a newer bundle build drops the stale other."""
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(200_001))
    bundle.write_parts(src, tmp_path / "built", wheel_bytes=10_000)
    state_dir = tmp_path / "state"
    stash = state_dir / "bundle"

    def call(n: int, part: str) -> pathlib.Path:  # the repository copy of call n, carrying `part`
        repo = tmp_path / f"repo{n}"
        if part:
            shutil.copytree(tmp_path / "built" / part, repo / ".gpu_bundle" / part)
        return repo

    repo = call(1, "a")
    assert state.stash_bundle(repo / ".gpu_bundle", stash) == {"a": "stashed", "b": "not here yet"}
    with pytest.raises(bundle.BundleError, match="model incomplete"):
        state.assemble_and_link(stash, state_dir, repo / "models" / "m.gguf")
    repo = call(2, "b")
    notes = state.stash_bundle(repo / ".gpu_bundle", stash)
    assert notes == {"a": "stashed by an earlier call", "b": "stashed"}
    info = state.assemble_and_link(stash, state_dir, repo / "models" / "m.gguf")
    assert info["assembled"] and (repo / "models" / "m.gguf").read_bytes() == src.read_bytes()
    assert (repo / "models" / "m.gguf").resolve() == state_dir / "models" / "m.gguf"
    repo = call(3, "")
    assert state.stash_bundle(repo / ".gpu_bundle", stash) == {
        "a": "stashed by an earlier call",
        "b": "stashed by an earlier call",
    }
    info = state.assemble_and_link(stash, state_dir, repo / "models" / "m.gguf")
    assert not info["assembled"] and (repo / "models" / "m.gguf").read_bytes() == src.read_bytes()
    assert state.stash_bundle(call(4, "b") / ".gpu_bundle", stash)["b"] == "already stashed"
    src.write_bytes(os.urandom(200_001))  # a rebuilt bundle: its part a must not be combined with the old b
    bundle.write_parts(src, tmp_path / "built", wheel_bytes=10_000)
    notes = state.stash_bundle(call(5, "a") / ".gpu_bundle", stash)
    assert notes == {"a": "stashed", "b": "dropped: from another bundle build"} and not (stash / "b").exists()


def test_resume_runs_what_the_lease_has_not_finished(tmp_path: pathlib.Path) -> None:
    call_suite = _suite(tmp_path, budget=100)
    for name, status in (("env", "ok"), ("kernel_tests", "failed"), ("decode", "partial"), ("sd", "timeout")):
        (tmp_path / "state_dir" / "results" / f"{name}.json").write_text(json.dumps({"status": status}))
    todo = suite.pending(call_suite.state)
    assert "env" not in todo and "kernel_tests" not in todo  # done, or failed (a rerun needs a fix first)
    assert {"decode", "sd", "identity", "tree_attention"} <= set(todo)
    assert list(todo) == [p for p in suite.PHASES if p in todo]  # in the suite's order
    args = argparse.Namespace(phases="", resume=True, call="all")
    assert suite.select_phases(args, call_suite) == ("env", *todo)
    call_suite.log.close()


def test_new_phases_read_their_scripts_results(tmp_path, monkeypatch) -> None:
    """compile_time.py (run with the lease's XLA cache unset: it keeps an empty one of its own under --out)
    and bench_verify_cost.py --breakdown (`round_*` keys become the breakdown) as the phases run them; the
    stand-ins print what the real scripts print (those run for minutes on the real model). Without the
    script or the flag, the phase says why it did not run."""
    exp = tmp_path / "exp"
    (exp / "bench").mkdir(parents=True)
    monkeypatch.setattr(measure, "EXP", exp)
    call_suite = _suite(tmp_path, budget=100)
    assert measure.phase_compile(call_suite, 30).status == "skipped"
    (exp / "bench" / "bench_verify_cost.py").write_text('ap.add_argument("--quick")\n')
    res = measure.phase_verify_cost(call_suite, 30)
    assert res.status == "skipped" and "--breakdown" in res.error
    (exp / "bench" / "compile_time.py").write_text(
        'import os, sys\n# ap.add_argument("--quick") ap.add_argument("--out")\n'
        'assert "JAX_COMPILATION_CACHE_DIR" not in os.environ and sys.argv[1] == "--quick", sys.argv\n'
        "print('RESULT compile_first_s=12.5 compile_rerun_s=0.5 rerun_ratio=0.04')\n"
    )
    res = measure.phase_compile(call_suite, 30)
    assert res.status == "ok" and res.metrics == {
        "compile_first_s": 12.5,
        "compile_rerun_s": 0.5,
        "rerun_ratio": 0.04,
    }
    (exp / "bench" / "compile_time.py").write_text(  # cut during its rerun: the first run's seconds are kept
        'import json, pathlib, sys, time\n# ap.add_argument("--quick") ap.add_argument("--out")\n'
        'run1 = pathlib.Path(sys.argv[3]) / "run1"\nrun1.mkdir(parents=True)\n'
        'rows = [{"step": 1, "compile/total_s": 100.0}, {"step": 2, "compile/total_s": 20.5}]\n'
        '(run1 / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))\n'
        "print('first run done', flush=True)\ntime.sleep(60)\n"
    )
    res = measure.phase_compile(call_suite, 2)
    assert res.status == "partial" and res.metrics == {"compile_first_s": 120.5}, res
    (exp / "bench" / "bench_verify_cost.py").write_text(
        'import sys\n# ap.add_argument("--breakdown") ap.add_argument("--random-drafter")\n'
        'assert sys.argv[1:] == ["--quick", "--breakdown", "--random-drafter"], sys.argv\n'
        "print('RESULT plain_step_ms=1.3 round_tv4_steps=1.4 round_tv4_ms=1.8 round_tv4_draft_steps=0.3 '\n"
        "      'round_tv4_verify_steps=1.1 kernels_tv4_draft=12 round_s8_3_64_steps=4.1')\n"
    )
    res = measure.phase_verify_cost(call_suite, 30)
    assert res.status == "ok" and res.metrics["kernels_tv4_draft"] == 12
    tv4 = {
        "column": "tv4",
        "tv": 4,
        "round_steps": 1.4,
        "round_ms": 1.8,
        "draft_steps": 0.3,
        "verify_steps": 1.1,
    }
    assert res.details["rounds"] == [tv4, {"column": "s8_3_64", "tv": 64, "round_steps": 4.1}]
    call_suite.log.close()
    md = report.report_md({"verify_cost": dataclasses.asdict(res)}, {}, "cpu")
    assert "| column | TV | draft_steps | verify_steps | round_steps | round_ms |" in md
    assert "| tv4 | 4 | 0.3 | 1.1 | 1.4 | 1.8 |" in md and "a plain step 1.3 ms" in md


def test_report_sections() -> None:
    """The report's identical fraction, split-K kernel table and tuning, compile times and decode against both
    HF paths, from results shaped as the phases write them."""
    strategy = {"mode": "3_1_4", "identical_frac": 0.75, "diverged": 2, "first_divergence": [40, 90]}
    strategy |= {"gaps": [1e-4, 2e-2], "rounding_flips": 1, "accept_len": 2.5}
    identity = {"bfloat16": {"meta": {"temperature": 0.9, "top_p": 1.0}, "chain": strategy}}
    identity["bfloat16"]["results"] = {"sequences": 8, "new": 128, "identical_frac_plain_rerun": 1.0}
    rows = [
        {"model": "smollm2", "B": 1, "T": 16, "ref_ms": 0.1, "kernel_ms": 0.05, "ratio": 0.5, "max_err": 1e-3}
    ]
    tuning = {"candidates": [
        {"block_sizes": {"kv_splits": 4, "block_k": 64, "block_q": 64, "num_warps": None, "num_stages": 2},
         "geomean_ms": float("inf"), "error": "JaxRuntimeError: scf.for"},
    ]}  # fmt: skip
    ta = {"rows": rows, "block_sizes": {"kv_splits": 2}, "tuning": tuning, "dtype": "bfloat16"}
    dec_row = {
        "batch": 1,
        "ours_tok_s": 770.0,
        "hf_tok_s": 35.0,
        "hf_fast_tok_s": 350.0,
        "roofline_frac": 0.1,
    }
    results = {
        "identity": {"details": {**identity, "drafter": "untrained"}},
        "tree_attention": {"details": ta},
        "compile": {"metrics": {"compile_first_s": 12.5, "compile_rerun_s": 0.5}},
        "decode": {"details": {"bfloat16": {"rows": [dec_row | {"hf_fast_warmup_s": 40.0}], "meta": {}}}},
    }
    md = report.report_md(results, {}, "an H100")
    assert "| chain | 3_1_4 | 0.75 | 2 | 90 | 1/2 | 2.5 |" in md  # median first divergence, flips/checked
    assert "| smollm2 | 1 | 16 | 2 | 0.1 | 0.05 | 0.5 | 0.001 |" in md  # split-K of the table's blocks
    assert "| 4 | 64 | 64 | - | 2 | inf | JaxRuntimeError: scf.for |" in md  # the split-K candidate failed
    assert "compile_first_s 12.5, compile_rerun_s 0.5" in md
    assert "| 1 | 770 | 35 | 350 | 22 | 2.2 | 0.1 | 40 |" in md


# ---- the package's shape ------------------------------------------------------------------------------

# gpu/'s modules, bottom first: each imports (at any depth, TYPE_CHECKING included) only from lower layers
GPU_LAYERS = [
    {"bundle", "call_plan", "parse", "markdown_tables", "regime_common", "stack", "rl_step_plan"},
    {"state", "env", "regime_train", "rl_step_run"},
    {"runner", "regime_7b"},
    {"measure", "regime_phases", "rl_step_phases"},
    {"phases"},
    {"report"},
    {"suite"},
]


def gpu_imports(path: pathlib.Path) -> set[str]:
    """The gpu modules a file imports (`import gpu.x`, `from gpu import x`, `from gpu.x import y`), read with
    ast at any depth (inside functions and `if TYPE_CHECKING:` too)."""
    import ast

    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("gpu.")}
        elif isinstance(node, ast.ImportFrom) and node.module == "gpu":
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpu."):
            out.add(node.module.split(".")[1])
    return out - {path.stem}


def test_gpu_modules_import_one_way() -> None:
    """No circle of imports in gpu/: every module sits in one layer of GPU_LAYERS and imports only from the
    layers below it (one direction each; the shared pieces at the bottom: the plan, the parsers, markdown)."""
    layer = {m: i for i, ms in enumerate(GPU_LAYERS) for m in ms}
    files = {p.stem: p for p in (ROOT / "gpu").glob("*.py") if p.stem != "__init__"}
    assert set(files) == set(layer), f"gpu modules without a layer (or gone): {set(files) ^ set(layer)}"
    bad = [
        f"{m} (layer {layer[m]}) imports {d} (layer {layer[d]})"
        for m, path in files.items()
        for d in sorted(gpu_imports(path))
        if layer[d] >= layer[m]
    ]
    assert not bad, "gpu imports that do not point down:\n" + "\n".join(bad)


@pytest.mark.slow
@pytest.mark.experiments
def test_rl_step_worker_plans_the_programs_of_its_config(tmp_path: pathlib.Path) -> None:
    """gpu/rl_step_run.py with the whole plan after a tiny run (the GPU's parts; the make-test dry run takes
    the resident state only): the update's apply, accumulation and log-prob programs and the rollout's
    programs with the composed spot tick, each need = arguments + footprint + what lives beside it."""
    js, wd = tmp_path / "rl.json", tmp_path / "w"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = FAST_COMPILE_FLAGS
    cmd = [sys.executable, "-m", "gpu.rl_step_run", "--json", str(js), "--plan", "update,rollout", "--"]
    cmd += [f"--config={rl_step_phases.CONFIG}:layers=1,steps=1,tiny", f"--workdir={wd}"]
    cmd += [f"--config.compilation_cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    plan = json.loads(js.read_text())["plan"]
    kinds = {(p["kind"], p["program"].split()[0]) for p in plan["programs"]}
    assert {("update", "update_apply"), ("update", "update_accum"), ("update", "logprobs")} <= kinds
    assert {("rollout", "prompt"), ("rollout", "plain"), ("rollout", "sd"), ("rollout", "spot")} <= kinds
    assert all(p["need"] == p["args"] + p["footprint"] + p["outside"] > 0 for p in plan["programs"])
    assert plan["need_max"] == max(p["need"] for p in plan["programs"]) and not plan["skipped"]
