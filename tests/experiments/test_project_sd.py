"""The roofline and acceptance arithmetic of experiments/models/project_sd.py on hand-computed cases (no JAX),
and the simulator's projection helpers; the scripts' smoke runs are marked `experiments`."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

from experiments.models import project_sd as ps  # noqa: E402
from experiments.models import rl_model as rm  # noqa: E402
from experiments.models import roofline as rf  # noqa: E402
from experiments.models import simulate_rl  # noqa: E402

# one layer, hidden 4, one head of 4, intermediate 8, vocab 10: 4 * (2*4 + 2*4) + 3 * 4 * 8 = 160 weights
# per layer, + 40 for the LM head = 200 read per step (400 bytes); KV 1 layer x 2 x 4 x 2 bytes = 16 / token
TOY = rf.ModelShape("toy", layers=1, hidden=4, heads=1, kv_heads=1, head_dim=4, intermediate=8, vocab=10)


def test_model_shape_counts():
    assert (TOY.layer_params, TOY.step_params, TOY.kv_bytes_per_token) == (160, 200, 16)
    assert TOY.drafter_params() == 2 * 16 + 160 + 40
    m = rf.QWEN2_5_7B  # + the embedding table; the published count adds ~0.3M biases and norms
    assert m.step_params + m.vocab * m.hidden == pytest.approx(7_615_616_512, rel=1e-3)
    assert m.kv_bytes_per_token == 28 * 2 * 4 * 128 * 2


def test_roofline_memory_and_compute_bound():
    roof = rf.Roofline(TOY, bw=1000.0, flops=1e9)
    # batch 2 at cache 8: 400 weight bytes + 2 x 8 x 16 KV bytes at 1000 B/s
    assert roof.plain(2, 8) == pytest.approx((400 + 256) / 1000)
    assert roof.plain(2, 8, kv=5) == pytest.approx((400 + 5 * 16) / 1000)  # paged: only live KV
    slow = rf.Roofline(TOY, bw=1e12, flops=100.0)
    # 2 x 200 x 2 rows + attention 4 x 1 token x 16 KV tokens x 4 (heads x head_dim) x 1 layer
    assert slow.plain(2, 8) == pytest.approx((800 + 256) / 100.0)
    # TV 4 -> strategy 3_1_4: the target pass over 4 tokens + 3 drafter passes of 232 weights each
    assert roof.round(1, 4, 8) == pytest.approx((400 + 128) / 1000 + 3 * 464 / 1000)
    assert roof("3_1_4", 1, 8) == roof("tv:4", 1, 8) == roof.round(1, 4, 8)
    fixed = rf.Roofline(TOY, bw=1000.0, flops=1e9, fixed_plain=0.5, fixed_round={4: 1.0, 8: 3.0})
    assert fixed.plain(2, 8) == pytest.approx(roof.plain(2, 8) + 0.5)
    assert fixed.round(1, 6, 8) == pytest.approx(roof.round(1, 6, 8) + 2.0)  # interpolated in TV


def test_strategy_mapping_is_bench_sds():
    assert [rf.strategy_for(tv) for tv in (3, 4, 8, 16, 32, 64)] == [
        (2, 1),
        (3, 1),
        (7, 1),
        (8, 2),
        (8, 3),
        (8, 3),
    ]


def test_accept_scaling_along_a_measured_tv_curve():
    curve = ps.tv_curve({4: 2.0, 16: 3.0})  # accept - 1: 1 at TV 4, 2 at TV 16, log-linear between
    assert curve(8) == pytest.approx(1.5)
    assert ps.scaled_accept(4.0, 4, curve, 4) == pytest.approx(4.0)  # the anchor itself
    assert ps.scaled_accept(4.0, 4, curve, 16) == pytest.approx(1 + 3 * 2)
    assert curve(64) == pytest.approx(2.0)  # flat beyond the measured TVs


def test_check_cells_projects_accept_over_round_cost():
    cells = {(1, "tv4"): dict(accept=2.0, round=1.25, speedup=1.6, tv=4)}
    [(b, col, proj, meas, err)] = ps.check_cells(cells, lambda b, c: c["round"])
    assert (b, col, proj, meas, err) == (1, "tv4", pytest.approx(1.6), 1.6, pytest.approx(0.0))
    assert ps.check_cells(cells, lambda b, c: 2.0)[0][4] == pytest.approx(1.0 / 1.6 - 1)


def test_long_tail_lengths_and_the_tlt_chooser():
    x = simulate_rl.long_tail(1000, 0, median=100.0, sigma=1.0, cap=300)
    assert x.min() >= 1 and x.max() == 300 and 80 <= np.median(x) <= 120
    assert (x == 300).mean() == pytest.approx(0.136, abs=0.04)  # P(z > ln 3) = 0.136
    cost = lambda mode, batch, cache, kv=0: 1.5 if mode != "plain" else 1.0
    sd = rm.Mode.speculative("3_1_4", 2.0)
    choose = simulate_rl.tlt_chooser([sd], cost, threshold=32)
    assert choose(33, 64, 1024) == rm.Mode() and choose(32, 32, 1024) == sd


@pytest.mark.experiments
def test_project_sd_and_simulate_rl_projection_smoke(tmp_path):
    """Both scripts' default runs (the H100 run's numbers, docs/gpu_runs/) on CPU: RESULT lines and plots."""
    assert (ps.GPU_RUN / "call3_summary.json").exists()  # the default --gpu-run, in the repository
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    for script, args in (("models.project_sd", []), ("models.simulate_rl", ["--steps", "1"])):
        proc = subprocess.run(
            [sys.executable, "-m", f"experiments.{script}", "--out", str(tmp_path), *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        last = proc.stdout.strip().splitlines()[-1]
        assert last.startswith("RESULT "), proc.stdout[-2000:]
        assert "PROJECTION" in proc.stdout
    res = dict(item.split("=", 1) for item in last.split()[1:])
    assert 1.0 < float(res["e2e_speedup_paper"]) < float(res["rollout_speedup_paper"])
    assert (tmp_path / "table4_projection.png").exists() and (
        tmp_path / "simulate_rl_projection.png"
    ).exists()


@pytest.mark.slow
@pytest.mark.experiments
def test_step_costs_bench_shapes_smoke(smollm_gguf_path, tmp_path):
    """step_costs.py --bench-shapes at a tiny size: SmolLM2 plain steps and rounds (random drafter, n-gram),
    the JSON project_sd.py --cpu-costs reads."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".cache" / "jax_test_cache"))
    out = tmp_path / "costs.json"
    args = ["--bench-shapes", "--batches", "1", "--tv", "4", "--new", "8", "--prompts", "1", "--reps", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.models.step_costs", *args, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("RESULT plain_b1_ms=")
    data = json.loads(out.read_text())
    modes = {r["mode"]: r for r in data["step_seconds"]}
    assert set(modes) == {"plain", "3_1_4", "ngram_4_1_5"}
    assert all(r["seconds"] > 0 and r["batch"] == 1 for r in modes.values())
    assert data["columns"]["tv4"] == {"mode": "3_1_4", "tv": 4}


def two_cache_summary(path: pathlib.Path) -> pathlib.Path:
    """A GPU call's summary.json, hand-built: plain steps at batch 1 and 8 at 4K and 32K; a TV-16 round at
    batch 1 at 4K and 32K, each with the plain step its own call measured beside it (4K: 7.5 ms, not the
    decode cell's 8 ms: a round's cost in plain steps is its own call's)."""
    decode = [{"batch": b, "cache": c, "step_ms": ms} for (b, c), ms in PLAIN_MS.items()]
    rounds = [
        {"batch": 1, "tv": 16, "cache": 4096, "round_ms": 12.0, "plain_step_ms": 7.5},  # 1.6 plain steps
        {"batch": 1, "tv": 16, "cache": 32768, "round_ms": 25.0, "plain_step_ms": 20.0},  # 1.25
    ]
    meta = {"model": "Qwen2.5-7B shapes, random bf16 weights", "device": "H200", "draft_vocab": 8192}
    env = {"bandwidth_gb_s": 4000.0, "bf16_matmul_tflops": 700.0, "device": "H200"}
    details = {"meta": meta, "decode": decode, "round": rounds}
    path.write_text(json.dumps({"phases": {"regime_7b": {"details": details}, "env": {"metrics": env}}}))
    return path


PLAIN_MS = {(1, 4096): 8.0, (8, 4096): 9.0, (1, 32768): 20.0, (8, 32768): 24.0}


def test_measured_rounds_by_cache_length(tmp_path, capsys):
    """Rounds at two caches: the round's cost in plain steps is the measured one at 4K and 32K (its own
    call's ratio, in seconds at the decode cell's step), interpolated in log2 cache at 16K (hand-computed
    from the roofline and the two cells), flat beyond; Table 2 at both caches; the bias line says so."""
    from experiments.models import measured_costs as mc

    m = mc.load(two_cache_summary(tmp_path / "summary.json"))
    costs = mc.measured_costs(m)
    assert m["round_cache"] == [4096, 32768] and m["round_steps"][1, 16, 4096] == pytest.approx(1.6)
    assert costs.round_steps(1, 16, 4096) == pytest.approx(1.6)
    assert costs.round_steps(1, 16, 32768) == pytest.approx(1.25)
    assert costs.round(1, 16, 4096) == pytest.approx(1.6 * 8e-3)  # not the 12 ms of a slower call
    roof = rf.Roofline(rf.QWEN2_5_7B, 4000e9, 700e12, 8192)  # the rounds' draft vocabulary
    k4, k32 = 1.6 * 8e-3 / roof.round(1, 16, 4096), 1.25 * 20e-3 / roof.round(1, 16, 32768)
    s4, s32 = 8e-3 / roof.plain(1, 4096), 20e-3 / roof.plain(1, 32768)
    w = 2 / 3  # log2 16K = 14: two thirds of the way from 12 to 15
    want = roof.round(1, 16, 16384) * (k4 + w * (k32 - k4)) / (roof.plain(1, 16384) * (s4 + w * (s32 - s4)))
    assert costs.round_steps(1, 16, 16384) == pytest.approx(want)
    assert 1.25 < want < 1.6
    assert costs.round(1, 16, 65536) == pytest.approx(roof.round(1, 16, 65536) * k32)  # flat beyond
    line = mc.bias(m, costs, [1, 2, 8], "accept: hand-made")
    assert "rounds at 2 caches [4096, 32768], interpolated in log2 cache" in line
    assert "rounds not measured at batch [2, 8]" in line and "plain steps not measured at batch [2]" in line
    assert line.endswith("; accept: hand-made") and "\n" not in line
    gpu = ps.load_gpu_run(ps.GPU_RUN)
    res, _ = ps.print_measured(gpu, str(tmp_path / "summary.json"), 4096)
    out = capsys.readouterr().out
    assert out.count("BIAS still in this projection: rounds at 2 caches") == 1
    assert res["measured_t2_plain_tok_s"] == pytest.approx(125.0)
    assert res["measured_t2_plain_tok_s_c32768"] == pytest.approx(50.0)
    assert {"measured_t2_speedup_ours", "measured_t2_speedup_ours_c32768"} <= set(res)
    (tmp_path / "bad.json").write_text(json.dumps({"round": [{"batch": 1, "tv": 4, "round_ms": 1.0}]}))
    with pytest.raises(ValueError, match="without its cache bucket"):
        mc.load(tmp_path / "bad.json")
