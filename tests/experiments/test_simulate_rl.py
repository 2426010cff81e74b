"""The RL-step model of experiments/models/simulate_rl.py (experiments/models/rl_model.py) on hand-computed
cases: pure arithmetic, no JAX. The validation against an e2e run is the script's own job (`--validate`); its
smoke run is marked `experiments`."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

from experiments.models import measured_costs as mc  # noqa: E402
from experiments.models import project_sd as ps  # noqa: E402
from experiments.models import rl_model as rm  # noqa: E402
from experiments.models import simulate_rl  # noqa: E402

PLAIN = rm.Mode()


def by_batch(costs: dict[int, float], cache_factor: dict[int, float] | None = None) -> rm.StepCost:
    """A step cost that depends on the batch bucket (and optionally the cache bucket)."""
    return lambda mode, batch, cache, kv=0: costs[batch] * (cache_factor or {}).get(cache, 1.0)


def plain_only(running: int, batch: int, cache: int) -> rm.Mode:
    return PLAIN


def test_three_short_rows_and_one_long_compact_to_one_row():
    # lengths 1 finish at prefill; the long row decodes 7 tokens alone, in bucket 1
    tl = rm.simulate_rollout([1, 1, 1, 8], 10, by_batch({1: 0.01, 4: 0.04}), plain_only)
    assert [(c.batch, c.running) for c in tl.chunks] == [(1, (1,) * 7)]
    assert tl.decode_seconds == pytest.approx(0.07)
    assert tl.seconds_at_running(1) == pytest.approx(0.07)


def test_chunk_exits_early_once_half_the_bucket_has_finished():
    # 4 rows decode 2, 2, 2, 9 tokens: 2 steps at batch 4, then the long row's 7 at batch 1
    tl = rm.simulate_rollout([3, 3, 3, 10], 10, by_batch({1: 1.0, 4: 3.0}), plain_only)
    assert [(c.batch, c.running) for c in tl.chunks] == [(4, (4, 4)), (1, (1,) * 7)]
    assert tl.decode_seconds == pytest.approx(2 * 3.0 + 7 * 1.0)
    assert tl.seconds_at_running(2) == pytest.approx(7.0)
    assert [t for t, _ in tl.profile()][:3] == pytest.approx([0.0, 3.0, 6.0])


def test_chunks_of_16_steps_and_growing_cache_buckets():
    # one row, 39 tokens after prefill, 100-token prompt: chunks of 16/16/7 steps; the first fits cache 128
    # (100 + 16 + 1 <= 128), the next need 116 + 17 -> 256
    shape = rm.EngineShape(chunk_steps=16, min_cache_bucket=128, max_cache_len=512)
    cost = by_batch({1: 1.0}, {128: 1.0, 256: 2.0})
    tl = rm.simulate_rollout([40], 100, cost, plain_only, shape=shape)
    assert [(c.steps, c.cache) for c in tl.chunks] == [(16, 128), (16, 256), (7, 256)]
    assert tl.decode_seconds == pytest.approx(16 * 1 + 16 * 2 + 7 * 2)


def test_speculative_tail_emits_accept_tokens_per_round():
    # rows [2, 9]: one plain step at batch 2 (then 1 row <= threshold 1), the last 7 tokens in
    # ceil(7 / 2) = 4 rounds of accept 2 at batch 1
    sd = rm.Mode.speculative("3_1_4", 2.0)
    cost = lambda mode, batch, cache, kv=0: {("plain", 2): 1.0, ("3_1_4", 1): 1.5}[(mode, batch)]
    tl = rm.simulate_rollout([2, 9], 10, cost, rm.threshold_chooser(sd, 1), max_lookahead=sd.lookahead)
    assert [(c.mode, c.batch, c.steps) for c in tl.chunks] == [("plain", 2, 1), ("3_1_4", 1, 4)]
    assert tl.decode_seconds == pytest.approx(1.0 + 4 * 1.5)
    assert tl.mode_seconds("3_1_4") == pytest.approx(6.0)


def test_round_cost_and_accept_length_give_the_speedup():
    assert rm.sd_speedup(3.0, 1.5) == pytest.approx(2.0)
    # the H100 drafter's sampled per-position acceptance at depth 6 -> its accept length 3.39
    assert rm.accept_from_positions([0.73, 0.54, 0.40, 0.30, 0.23, 0.18]) == pytest.approx(3.38)
    # the same in the simulator: a row decoding 12 tokens, plain step 1 s vs rounds of 1.5 s emitting 3
    one = lambda mode, batch, cache, kv=0: 1.5 if mode != "plain" else 1.0
    plain = rm.simulate_rollout([13], 4, one, plain_only).decode_seconds
    sd = rm.simulate_rollout([13], 4, one, lambda r, b, c: rm.Mode.speculative("3_1_4", 3.0))
    assert plain / sd.decode_seconds == pytest.approx(rm.sd_speedup(3.0, 1.5))


def test_idle_device_seconds_and_the_spot_trainer():
    # 2 devices, one done at t = 3 of 10: 7 idle device-seconds; 2-second drafter steps fill 6 of them
    assert rm.idle_device_seconds([3.0, 10.0], 10.0) == pytest.approx(7.0)
    assert rm.spot_seconds_used([3.0, 10.0], 10.0, 2.0) == pytest.approx(6.0)
    assert rm.spot_seconds_used([3.0, 10.0], 10.0, 0.0) == 0.0


def test_devices_finish_at_chunk_ends_and_the_fullest_sets_the_bucket():
    # rows 0-1 on device 0 (19 tokens each), rows 2-3 on device 1 (1 token each): device 1 finishes in the
    # first chunk (16 steps) and idles while device 0 runs 3 more steps, still at bucket 2 per device;
    # a step costs what 2 rows (the per-device bucket) cost
    tl = rm.simulate_rollout([20, 20, 2, 2], 10, by_batch({2: 1.0}), plain_only, devices=2)
    assert [(c.batch, c.steps) for c in tl.chunks] == [(4, 16), (4, 3)]
    assert tl.chunks[0].running[:2] == (4, 2)
    assert tl.device_done == (19.0, 16.0)
    assert rm.idle_device_seconds(tl.device_done, tl.decode_seconds) == pytest.approx(3.0)


def test_converged_bandit_picks_the_faster_mode_per_bucket():
    cost = lambda mode, batch, cache, kv=0: 1.5 if mode != "plain" else 1.0
    good, bad = rm.Mode.speculative("3_1_4", 2.0), rm.Mode.speculative("2_1_3", 1.2)
    assert rm.best_chooser([good, bad], cost)(1, 1, 128) == good  # 2 / 1.5 > 1
    assert rm.best_chooser([bad], cost)(1, 1, 128) == PLAIN  # 1.2 / 1.5 < 1


def test_mode_shapes_follow_the_strategy():
    ng = rm.Mode.speculative("ngram_3_1_4", 1.5)
    assert (ng.tokens_per_step, ng.lookahead) == (4, 4)
    tree = rm.Mode.speculative("8_3_64", 4.0)
    assert (tree.tokens_per_step, tree.lookahead) == (9, 64)  # max(64, 1 + 7 * 3, 9)


def cost_data() -> dict:
    rows = [
        dict(mode="plain", tv=1, batch=1, cache=128, seconds=1.0),
        dict(mode="plain", tv=1, batch=4, cache=128, seconds=4.0),
        dict(mode="plain", tv=1, batch=1, cache=256, seconds=2.0),
        dict(mode="ngram_3_1_4", tv=4, batch=1, cache=256, seconds=3.0),
    ]
    arm = dict(prefill=0.5, chunk_overhead=0.1, rollout_overhead=0.2, threshold=1, modes={})
    ngram = dict(arm, modes={"ngram_3_1_4": dict(accept=2.0, accept_by_batch={"1": 2.0}, rounds=10)})
    engine = dict(chunk_steps=16, min_cache_bucket=128, max_cache_len=512)
    return dict(step_seconds=rows, arms=dict(none=arm, ngram=ngram), engine=engine, devices=1, meta={})


def test_cost_table_lookups():
    t = simulate_rl.CostTable(cost_data())
    assert t("plain", 4, 128) == 4.0
    assert t("plain", 2, 128) == pytest.approx(2.0)  # linear in batch between measured buckets
    assert t("plain", 1, 200) == 2.0  # the smallest measured cache bucket >= 200
    assert t("plain", 1, 1024) == 2.0  # beyond the measured range: the largest
    assert t("tv:4", 1, 256) == 3.0  # by tokens_to_verify: a GPU/7B table's keys
    with pytest.raises(KeyError):
        t("8_3_64", 1, 256)


def test_predicted_rollout_adds_prefill_and_host_overhead():
    t = simulate_rl.CostTable(cost_data())
    rec = dict(lengths=[1, 1, 1, 8], prompt_lengths=[10] * 4)
    tl = simulate_rl.predict_rollout(t, "none", rec, max_new=384)
    assert tl.seconds == pytest.approx(0.5 + 7 * 1.0 + 1 * 0.1 + 0.2)
    sd = simulate_rl.predict_rollout(t, "ngram", rec, max_new=384)  # 7 tokens, accept 2: 4 rounds of 3 s
    assert sd.decode_seconds == pytest.approx(4 * 3.0)


def test_e2e_net_times_leave_out_every_compilation():
    from experiments.lib import step_time

    m = {
        "time/step": 100.0,
        "time/rollout": 30.0,
        "time/compile_rollout": 6.0,  # rollout programs, timed by the engine
        "compile/rollout/chunk_s": 5.5,  # the same compilations as JAX reports them: not counted twice
        "compile/update_s": 15.0,
        "compile/other_s": 0.5,
        "compile/total_s": 21.0,  # a total over kinds, not a kind
        "compile/update_programs": 3.0,
    }
    assert step_time.net(m, "time/rollout") == pytest.approx(24.0)
    assert step_time.net(m, "time/step") == pytest.approx(100.0 - 6.0 - 15.0 - 0.5)


def test_measured_costs_of_one_round_cache_load_with_their_bias(capsys):
    """The 2026-11-26 H200 files (rounds at 4K only) still feed the projection: a round's cost in plain steps
    at 4K is its own call's (2.03 at TV 16), at 32K its 4K ratio to the roofline is held (the fallback),
    and the one BIAS line says so, with the batch buckets not measured."""
    run = ROOT / "docs" / "gpu_runs" / "2026-11-26-h200"
    files = ",".join(str(run / f"call{i}_summary.json") for i in (1, 3, 4))
    gpu = ps.load_gpu_run(ps.GPU_RUN)
    costs, _, spot, step = mc.projection_costs(gpu, files, None, 128, "accept: x")
    bias = [x for x in capsys.readouterr().out.splitlines() if x.startswith("BIAS")]
    assert len(bias) == 1 and "rounds at one cache (4096)" in bias[0] and "biased towards SD" in bias[0]
    assert "rounds not measured at batch [2, 4, 16, 32, 64, 128]" in bias[0] and bias[0].endswith("x")
    assert costs.round_steps(1, 16, 4096) == pytest.approx(15.1527 / 7.4706, abs=1e-4)
    roof = ps.Roofline(ps.QWEN2_5_7B, costs.bw, costs.flops)
    held = roof.round(1, 16, 32768) / roof.round(1, 16, 4096)
    assert costs("8_2_16", 1, 32768) / costs("8_2_16", 1, 4096) == pytest.approx(held)
    assert costs.round_steps(1, 16, 32768) < 1.0  # the bias: a 32K plain step is x5.2 its roofline
    assert (spot, step) == ("measured", pytest.approx(0.016726, abs=1e-6))


@pytest.mark.experiments
def test_validate_smoke(tmp_path):
    """--validate on a synthetic e2e output folder and a cost file: the RESULT line and the plot."""
    data = cost_data()
    (tmp_path / "costs.json").write_text(json.dumps(data))
    rec = dict(lengths=[1, 1, 1, 8], prompt_lengths=[10] * 4, chunks=[])
    lines = [json.dumps(dict(rec, arm=a, step=s)) for a in ("none", "ngram") for s in (1, 2)]
    (tmp_path / "rollouts.jsonl").write_text("\n".join(lines) + "\n")
    m = {"time/step": 20.0, "time/rollout": 8.0, "time/compile_rollout": 0.0}
    (tmp_path / "history.json").write_text(json.dumps({"none": [m, m], "ngram": [m, m]}))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.models.simulate_rl", "--validate", str(tmp_path)]
        + ["--costs", str(tmp_path / "costs.json")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    res = {k: float(v) for k, v in (item.split("=", 1) for item in last.split()[1:])}
    # plain: 0.5 + 7 x 1 + 0.1 + 0.2 = 7.8 s of rollout + 12 s other = 19.8 s; ngram: 4 rounds of 3 s
    # + 0.8 s + 12 s = 24.8 s; both measured 20 s: errors 0.24 (step) and 1 - 19.8 / 24.8 (speedup)
    assert res["step_time_error"] == pytest.approx(0.24, abs=1e-3)
    assert res["speedup_error"] == pytest.approx(1 - 19.8 / 24.8, abs=1e-3)
    assert (tmp_path / "simulate_rl_validate.png").exists()
