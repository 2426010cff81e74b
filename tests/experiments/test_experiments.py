"""The benchmark scripts run end to end as a user runs them (a tiny configuration of each; the numbers they
print are checked for shape and sanity, not speed: performance lives in the scripts, not in tests). The
subprocesses share the test session's persistent compilation cache (.cache/jax_test_cache), so reruns skip
most XLA compilation. Marked `experiments`: `make test-experiments` runs them, CI's `make test` does not."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

from experiments.lib import harness  # noqa: E402


def _run(script: str, *args: str, timeout: int = 600) -> tuple[dict[str, str], str]:
    """Run `python -m experiments.<script>` (script: "<group>.<name>") on one CPU device from the repository
    root, as a user runs it; returns (its RESULT line as a dict, its stdout)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".cache" / "jax_test_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    proc = subprocess.run(
        [sys.executable, "-m", f"experiments.{script}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), proc.stdout[-2000:]
    return dict(item.split("=", 1) for item in last.split()[1:]), proc.stdout


@pytest.mark.slow
@pytest.mark.experiments
def test_bench_sd_smoke(smollm_gguf_path):
    """bench_sd with an untrained drafter: one prompt, a few tokens, one interleaved plain/SD pair."""
    res, _ = _run(
        "bench.bench_sd",
        "--random-drafter",
        "--batches",
        "1",
        "--strategies",
        "2_1_3,2_1_3:fp32",
        "--prompts",
        "1",
        "--new",
        "4",
        "--ngram",
        "",
        "--reps",
        "1",
    )
    speedups = {}
    for name, col in (("2_1_3", "s2_1_3"), ("2_1_3:fp32", "s2_1_3_fp32")):
        assert float(res[f"accept_bs1_{col}"]) >= 1.0  # accepted drafts + the bonus token
        assert float(res[f"round_cost_bs1_{col}"]) > 0
        speedups[name] = float(res[f"speedup_bs1_{col}"])
        assert speedups[name] > 0
    # The headline is the faster of the two (which one wins is timing, so it is not asserted here).
    assert speedups[res["best_bs1"]] == max(speedups.values())
    assert float(res["sd_speedup_bs1"]) == speedups[res["best_bs1"]]
    assert float(res["plain_tok_s_bs1"]) > 0


@pytest.mark.slow
@pytest.mark.experiments
def test_program_layouts_tiny(tmp_path):
    """Three strategies, two of them with tokens_to_verify 4: the shared layout compiles one program per TV
    group (2), the naive one per strategy (3), the single layout one; the merged program costs less memory
    than the two it replaces."""
    res, out = _run(
        "paper.program_layouts",
        "--tiny",
        "--batches",
        "1",
        "--strategies",
        "3_1_4,ngram_3_1_4,2_1_3",
        "--single",
        "3_1_4",
        "--out",
        str(tmp_path),
    )
    assert (res["programs_single"], res["programs_naive"], res["programs_shared"]) == ("1", "3", "2")
    mib = {k: float(res[f"mib_{k}"]) for k in ("single", "naive", "shared")}
    assert 0 < mib["single"] < mib["shared"] < mib["naive"], mib
    assert all(float(res[f"compile_s_{k}"]) > 0 for k in mib)
    assert "ngram_3_1_4+3_1_4" in out or "3_1_4+ngram_3_1_4" in out  # the printed TV-4 group
    assert (tmp_path / "program_layouts.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.experiments
def test_sd_heatmaps_smoke(smollm_gguf_path, tmp_path):
    """One measured cell (batch 1, 2_1_3) fills Table 4 and Fig 13's depth-2 row; depth 3 > TV - 1 stays
    empty. A random drafter accepts almost nothing: only the shape and sanity of the numbers are checked."""
    res, _ = _run(
        "paper.sd_heatmaps",
        "--random-drafter",
        "--batches",
        "1",
        "--tv",
        "3",
        "--depths",
        "2,3",
        "--prompts",
        "1",
        "--new",
        "4",
        "--reps",
        "1",
        "--out",
        str(tmp_path),
    )
    assert res["best_t4"] == "2_1_3@bs1" and res["best_f13"] == "2_1_3"
    assert "f13_d3_tv3" not in res  # depth 3 cannot be drafted with 2 draft slots: an empty cell
    assert res["t4_bs1_tv3"] == res["f13_d2_tv3"] == res["best_t4_speedup"]  # one measurement, reused
    assert 0 < float(res["t4_bs1_tv3"]) < 10
    assert float(res["best_f13_accept"]) >= 1.0  # accepted drafts + the bonus token
    for png in ("table4_heatmap.png", "fig13_heatmap.png"):
        assert (tmp_path / png).stat().st_size > 0


@pytest.mark.slow
@pytest.mark.experiments
def test_case_study_smoke(smollm_gguf_path, tmp_path):
    """4 requests x 8 tokens, two fixed arms switched on from the first chunk (threshold >= batch), one
    learning rollout per selector, two measured keys: every rollout samples the plain tokens (float32: no
    rounding flip at this size), the best fixed arm is the fastest of the fixed ones, and the headline
    ratios agree."""
    res, out = _run(
        "paper.case_study",
        "--random-drafter",
        "--requests",
        "4",
        "--samples",
        "2",
        "--max-new",
        "8",
        "--arms",
        "3_1_4,ngram_3_1_4",
        "--threshold",
        "4",
        "--learn",
        "1",
        "--keys",
        "2",
        "--no-fresh",
        "--out",
        str(tmp_path),
    )
    # coupled verification in float32: every rollout has plain's tokens. A rounding flip needs a uniform
    # within float32 rounding of a CDF boundary (~1e-6 per token): over these few hundred tokens, none
    assert res["same_tokens"] == "1" and res["flips"] == "0"
    assert "diverge for real" in out and "A REAL DIVERGENCE" not in out
    fixed = {k: float(res[f"{k}_vs_plain"]) for k in ("3_1_4", "ngram_3_1_4")}
    assert res["best_fixed"] in ("3_1_4@thr4", "ngram_3_1_4@thr4")
    assert float(res["best_fixed_vs_plain"]) == max(fixed.values())
    assert float(res["best_fixed_sd_share"]) > 0.5  # speculative from the first chunk
    assert float(res["best_fixed_accept"]) >= 1.0
    ratios = {k: float(res[k]) for k in ("adaptive_vs_plain", "adaptive_vs_best_fixed", "adaptive_vs_ema")}
    assert all(0 < v < 100 for v in ratios.values()), ratios
    # adaptive_vs_plain = (plain / best fixed) x (best fixed / adaptive), up to the 3-decimal rounding
    derived = float(res["best_fixed_vs_plain"]) * ratios["adaptive_vs_best_fixed"]
    assert math.isclose(derived, ratios["adaptive_vs_plain"], rel_tol=5e-3, abs_tol=2e-3)
    # two measured keys: the headline is their geometric mean, between the two keys' ratios
    assert res["keys"] == "2" and out.count("key 1: response lengths") == 1
    lo, hi = float(res["adaptive_vs_plain_min"]), float(res["adaptive_vs_plain_max"])
    assert lo - 2e-3 <= ratios["adaptive_vs_plain"] <= hi + 2e-3
    assert (tmp_path / "case_study.png").stat().st_size > 0


@pytest.mark.experiments
def test_bench_sampling_smoke(tmp_path):
    """bench_sampling on a 4,096-token vocabulary: both versions keep the same sets up to one boundary token
    per row (the script checks) and report positive times and their ratio."""
    res, _ = _run("bench.bench_sampling", "--quick", "--vocab", "4096", "--reps", "1", "--out", str(tmp_path))
    assert set(res) == {"speedup_b1", "speedup_b64", "ms_ours_b64", "ms_sort_b64"}
    assert all(float(v) > 0 for v in res.values())
    assert (tmp_path / "bench_sampling.png").exists()


@pytest.mark.slow
@pytest.mark.experiments
def test_first_execution_smoke(smollm_gguf_path):
    """Two prompts x 2, 24 tokens, plain and one EAGLE chain: the passes decode alike, passes 2-3 compile
    nothing (asserted in the script), and every chunk is either a first execution or a rerun."""
    res, out = _run(
        "checks.first_execution",
        "--random-drafter",
        "--prompts",
        "2",
        "--max-new",
        "24",
        "--modes",
        "plain,2_1_3",
    )
    assert int(res["compiled_chunks"]) >= 2 and int(res["chunks"]) >= int(res["compiled_chunks"])
    assert 0 < float(res["first_exec_ratio_median"]) < 100 and out.count(" compiled ") == int(
        res["compiled_chunks"]
    )


@pytest.mark.slow
@pytest.mark.experiments
def test_sd_identity_smoke(smollm_gguf_path, tmp_path):
    """Two prompts x 2 samples x 16 tokens in float32 on CPU: the plain rerun reproduces plain decoding, every
    strategy reports its identical fraction, and any sequence that diverges does so at a rounding flip (the
    plain draw's uniform within 1e-3 of a CDF boundary), the token-identity test's criterion."""
    js = tmp_path / "identity.json"
    args = ("--prompts", "2", "--samples", "2", "--max-new", "16", "--json", str(js))
    res, out = _run("checks.sd_identity", *args)
    assert res["dtype"] == "float32" and int(res["sequences"]) == 4 and int(res["new"]) == 16
    assert float(res["identical_frac_plain_rerun"]) == 1.0
    details = json.loads(js.read_text())
    for name in ("chain", "tree", "ngram"):
        frac = float(res[f"identical_frac_{name}"])
        assert 0 <= frac <= 1 and int(res[f"diverged_{name}"]) == round((1 - frac) * 4)
        assert int(res[f"rounding_flips_{name}"]) == int(res[f"diverged_{name}"]), details[name]
        assert float(res[f"accept_len_{name}"]) >= 1.0
    assert float(res["identical_frac_min"]) == min(
        float(res[f"identical_frac_{n}"]) for n in details["meta"]["modes"]
    )
    assert details["meta"]["modes"]["ngram"] == "ngram_3_1_4" and " chain " in out


def test_harness_common_flags_result_line_and_json(tmp_path, capsys):
    """The harness's common flags and the RESULT line: floats in the script's format (per key where given),
    everything else as written; --json writes the dict under "results", a bare --json into --out, and a
    file a script already wrote (its own details) keeps its keys."""
    ap = harness.parser("doc", quick="small", out=str(tmp_path / "out"))
    args = ap.parse_args(["--quick", "--json"])
    assert args.quick and harness.json_path(args) == tmp_path / "out" / "result.json"
    values = {"speedup": 1.23456, "ms": 2.5, "best": "3_1_4", "chunks": 7, "nan": float("nan")}
    line = harness.result(values, args, fmt=".2f", formats={"speedup": ".1f"})
    assert line == "RESULT speedup=1.2 ms=2.50 best=3_1_4 chunks=7 nan=nan"
    assert capsys.readouterr().out.strip().splitlines()[-1] == line
    data = json.loads((tmp_path / "out" / "result.json").read_text())
    assert data["results"]["best"] == "3_1_4" and data["results"]["chunks"] == 7
    details = tmp_path / "details.json"
    details.write_text(json.dumps({"rows": [1, 2]}))
    args = harness.parser("doc", quick=None).parse_args(["--json", str(details)])
    assert not hasattr(args, "quick") and args.out is None
    harness.result({"x": 0.5}, args)
    assert json.loads(details.read_text()) == {"rows": [1, 2], "results": {"x": 0.5}}
    assert harness.format_result({"a": 0.123456}, fmt="") == "RESULT a=0.123456"
    # no --json: nothing written; an --out that is a .json file puts a bare --json's file beside it
    args = harness.parser("doc", quick=None, out=str(tmp_path / "costs.json")).parse_args(["--json"])
    assert harness.json_path(args) == tmp_path / "costs_result.json"
    assert harness.json_path(harness.parser("doc", quick=None).parse_args([])) is None
    args = harness.parser("doc", quick=None).parse_args([])
    assert harness.out_dir(args, "x").is_dir() and pathlib.Path(args.out).name.startswith("x_")


GROUPS = ("paper", "bench", "models", "checks")  # experiments/lib/ holds no script


def test_every_script_uses_the_harness_and_no_sys_path():
    """Every script in experiments/ (a module with a `__main__` block) builds its command line with the
    harness and prints its RESULT line through it; no module edits sys.path (they run as modules)."""
    scripts = []
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        text = path.read_text()
        assert "sys.path" not in text and 'print("RESULT' not in text, path.name
        if 'if __name__ == "__main__":' in text:
            scripts.append(path.name)
            assert path.parent.name in GROUPS, f"{path}: a script outside {GROUPS}"
            assert "harness.parser(" in text or "h.parser(" in text, path.name
            # the RESULT line: the script's own, or a sibling module's it imports (case_study_runs.report)
            siblings = re.findall(r"^from experiments\.(\w+)\.(\w+) import", text, flags=re.M)
            texts = [text] + [(ROOT / "experiments" / g / f"{m}.py").read_text() for g, m in siblings]
            assert any(".result(" in t for t in texts), path.name
    assert len(scripts) >= 20, scripts
