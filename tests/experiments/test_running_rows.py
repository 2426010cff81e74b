"""experiments/paper/running_rows.py: how it reads a rollout's stats (which chunks count as "at the cap", the
per-step rate, the timeline) on hand-made chunk records (no model: milliseconds), and its smoke run (marked
`experiments`: a tiny SmolLM2 rollout in a subprocess, minutes on 2 cores)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

from experiments.paper import running_rows as rr  # noqa: E402
from tlt_jax.rollout.types import ChunkRecord, RolloutStats  # noqa: E402


def chunk(bucket: int, running: tuple[int, ...], seconds: float, cache: int = 128) -> ChunkRecord:
    """A plain chunk record: one token per live row per step."""
    return ChunkRecord(
        mode="plain", batch_bucket=bucket, cache_bucket=cache, steps=len(running), running_start=running[0],
        seconds=seconds, new_tokens=sum(running), running=running,
    )  # fmt: skip


def test_at_cap_is_the_chunks_before_the_first_compaction_and_the_rate_counts_inserts():
    chunks = [chunk(8, (8, 8, 7, 7), 0.4), chunk(8, (8, 6, 6, 5), 0.4, 256), chunk(4, (4, 3), 0.1)]
    assert rr.at_cap(chunks, 8) == chunks[:2]
    assert rr.at_cap(chunks, 4) == []  # leading chunks only: the tail's bucket is not "at the cap"
    a = rr.rate(rr.at_cap(chunks, 8), extra_seconds=0.2)
    assert a["steps"] == 8 and a["seconds"] == pytest.approx(1.0)
    assert a["steps_per_s"] == pytest.approx(8.0)
    # plain decoding: tokens / s / mean running rows is steps / s (the docstring's equivalence)
    assert a["row_step_rate"] == pytest.approx(a["steps_per_s"])
    assert a["cache"] == pytest.approx(192.0)
    assert rr.per_cache_bucket(chunks[:2]) == {128: (4, pytest.approx(0.1)), 256: (4, pytest.approx(0.1))}


def test_timeline_ends_at_zero_rows_after_the_last_step():
    stats = RolloutStats(running_per_step=[4, 4, 2], seconds_per_step=[0.1, 0.1, 0.2])
    secs, rows = rr.timeline(stats)
    assert secs.tolist() == pytest.approx([0.0, 0.1, 0.2, 0.4])
    assert rows.tolist() == [4, 4, 2, 0]


@pytest.mark.slow
@pytest.mark.experiments
def test_running_rows_smoke(smollm_gguf_path, tmp_path):
    """2 prompts x 4 = 8 rows, cap 4, 16 new tokens, one pair: the capped rollout gives the uncapped tokens,
    the RESULT line has every key the issue asks for, the plot is written."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".cache" / "jax_test_cache"))
    args = ["--prompts", "2", "--n", "4", "--cap", "4", "--max-new", "16", "--repeats", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.paper.running_rows", *args, "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), proc.stdout[-2000:]
    res = dict(item.split("=", 1) for item in last.split()[1:])
    assert res["tokens_identical"] == "1"
    for name in ("capped", "uncapped"):
        assert all(float(res[f"{name}_le{k}_s"]) >= 0 for k in (32, 8, 2))
        assert float(res[f"{name}_wall_s"]) > 0
    assert float(res["capped_over_uncapped"]) > 0 and float(res["capped_insert_s"]) > 0
    assert (tmp_path / "running_rows.png").stat().st_size > 0
