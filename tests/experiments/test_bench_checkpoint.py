"""experiments/paper/bench_checkpoint.py end to end at tiny size (--tiny --quick), as a user runs it."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_checkpoint_smoke(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, like a user
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.paper.bench_checkpoint", "--tiny", "--quick"]
        + ["--dir", str(tmp_path), "--out", str(tmp_path / "out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT full_sync_ms="), proc.stdout[-2000:]
    res = {k: float(v) for k, v in (item.split("=", 1) for item in last.split()[1:])}
    modes = ("full_sync", "async", "selective_async")
    assert all(res[f"{m}_ms"] > 0 and res[f"{m}_durable_ms"] >= res[f"{m}_ms"] for m in modes)
    assert res["selective_mib"] < res["full_mib"]
    # whether an async save returns sooner than a synchronous one is the benchmark's finding (benchmarks.md),
    # not asserted: at smoke size on a loaded CI machine the two are milliseconds apart either way
    report = json.loads((tmp_path / "out" / "bench_checkpoint.json").read_text())
    assert all(len(report["runs"][m]["blocking_ms"]) == 3 for m in modes)
    assert abs(report["medians"]["async"]["blocking_ms"] - res["async_ms"]) <= 0.05  # RESULT: 1 decimal
    assert (tmp_path / "out" / "bench_checkpoint.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("bench_ckpt_")]  # temp dir removed
