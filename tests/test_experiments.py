"""The benchmark scripts run end to end as a user runs them (a tiny configuration of each; the numbers they
print are checked for shape and sanity, not speed: performance lives in the scripts, not in tests)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, timeout: int = 600) -> dict[str, str]:
    """Run experiments/<script> in a fresh process on one CPU device (no test-session XLA flags, like a user);
    returns its final RESULT line as a dict."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), proc.stdout[-2000:]
    return dict(item.split("=", 1) for item in last.split()[1:])


@pytest.mark.slow
@pytest.mark.experiments
def test_bench_sd_smoke(smollm_gguf_path):
    """bench_sd with an untrained drafter: one prompt, a few tokens, one interleaved plain/SD pair."""
    res = _run(
        "bench_sd.py",
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
