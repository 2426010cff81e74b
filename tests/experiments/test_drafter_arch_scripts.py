"""The Table 7 script (Table 1's: test_tree_topk.py): its --quick smoke run (make test-experiments) ends
with the RESULT keys the docs quote and writes its plot; Table 7's projection arithmetic and its RL arms'
configs are checked by hand (unmarked, sub-second: make test)."""

import json
import math

import numpy as np
import pytest

from experiments.models import measured_costs as mc
from experiments.models.roofline import QWEN2_5_7B, Roofline
from experiments.paper import drafter_arch, drafter_arch_rl
from tests.experiments.test_experiments import _run

ARMS = ("eagle", "hass", "eagle3")


@pytest.mark.experiments
def test_drafter_arch_quick(tmp_path):
    """Warm-ups and 2 RL steps of the three arms on the tiny target: every key, RL accept >= 1, a spot cost
    per update, the spot-trained drafters' held-out acceptance, the projected speedup = RL accept / the 7B
    round's cost, EAGLE-3's round heavier at one head width."""
    res, _ = _run("paper.drafter_arch", "--quick", "--out", str(tmp_path), timeout=1200)
    per_arm = ("accept", "sampled", "step_ms", "rl_accept", "rl_greedy", "rl_sampled", "spot_ms")
    per_arm += ("round_steps", "speedup")
    assert {f"{k}_{a}" for k in per_arm for a in ARMS} | {"best", "best_rl", "rl_steps"} == set(res)
    assert all(float(res[f"accept_{a}"]) >= 1.0 for a in ARMS) and res["best"] in ARMS
    for a in ARMS:
        assert float(res[f"rl_accept_{a}"]) >= 1.0 and float(res[f"spot_ms_{a}"]) > 0.0
        assert float(res[f"rl_greedy_{a}"]) >= 1.0 and float(res[f"rl_sampled_{a}"]) >= 1.0
        assert float(res[f"speedup_{a}"]) == pytest.approx(
            float(res[f"rl_accept_{a}"]) / float(res[f"round_steps_{a}"]), rel=2e-3
        )
    assert res["round_steps_eagle"] == res["round_steps_hass"] < res["round_steps_eagle3"]
    assert res["best_rl"] in ARMS and int(res["rl_steps"]) == 2
    assert all((tmp_path / "rl" / a / "checkpoints").is_dir() for a in ARMS)
    curves = json.loads((tmp_path / "rl_curves.json").read_text())
    assert all(len(curves[a]["accept"]) == 2 and math.isfinite(curves[a]["spot_ms"][-1]) for a in ARMS)
    assert (tmp_path / "drafter_arch.png").exists()


def test_projection_by_hand():
    """Every arm's round is the H200 call's measured b1/TV4 round (an EAGLE-1 pass over the 152K vocabulary)
    with its own drafter's bytes at a 32K head swapped in: EAGLE / HASS fc 2H, EAGLE-3 fc 3H and q/k/v over
    2H; three passes of a depth-3 chain at batch 1 (bandwidth-bound), at that round's measured / roofline
    ratio."""
    accept = {"eagle": 2.0, "hass": 2.5, "eagle3": 3.0}
    vd, cache = 32_000, 4096
    proj, lines = drafter_arch_rl.project(accept, "3_1_4", drafter_arch_rl.MEASURED, cache, vd)
    m = mc.load(drafter_arch_rl.MEASURED)
    base, plain = m["round_steps"][1, 4, cache], m["plain"][1, cache]  # measured: plain steps, seconds
    q = QWEN2_5_7B
    hd, heads, kv = q.hidden, q.heads * q.head_dim, q.kv_heads * q.head_dim
    eagle3 = 3 * hd * hd + 2 * hd * (heads + 2 * kv) + heads * hd + 3 * hd * q.intermediate + vd * hd + 4 * hd
    eagle1_full = 2 * hd * hd + q.layer_params + q.vocab * hd
    eagle1 = 2 * hd * hd + q.layer_params + vd * hd
    ratio = base * plain / Roofline(q, m["bw"], m["flops"]).round(1, 4, cache)
    for arm, params in (("eagle", eagle1), ("hass", eagle1), ("eagle3", eagle3)):
        extra_s = 3 * (params - eagle1_full) * q.bytes_per_param / m["bw"]
        want = base + extra_s * ratio / plain
        assert proj[arm]["round_steps"] == pytest.approx(want, rel=1e-4), arm
        assert not math.isclose(want, base, rel_tol=1e-2)  # the swap is visible at this precision
        assert proj[arm]["speedup"] == pytest.approx(accept[arm] / proj[arm]["round_steps"], rel=1e-12)
    assert proj["eagle3"]["round_steps"] > proj["eagle"]["round_steps"]  # one head width: EAGLE-3 heavier
    assert "ASSUMED: every arm at a 32000-token draft head" in lines[-1] and f"{base:.3f} plain" in lines[-1]


def test_rl_arms_differ_only_in_the_drafter(tmp_path):
    """The three RL configs are configs/tlt.py:quick with SD and the spot trainer on for the whole rollout,
    equal but for the warmed drafter, its arch and the loss its warm-up trained (HASS's top-K, the chain)."""
    losses = {}
    for a in ARMS:
        train = drafter_arch.arm_config("tlt", a, None).train
        losses[a] = (int(train.ttt_steps), int(train.topk))
    cfgs = drafter_arch_rl.rl_configs({a: tmp_path / a for a in ARMS}, losses, 3, quick=False, full=False)
    flat = {a: dict(_flatten(c.to_dict())) for a, c in cfgs.items()}
    differ = {k for k in flat["eagle"] if len({repr(flat[a][k]) for a in ARMS}) > 1}
    assert differ == {"drafter.path", "drafter.arch", "spot.ttt_steps", "spot.topk"}
    assert [flat[a]["spot.topk"] for a in ARMS] == [0, drafter_arch.HASS_TOPK, 0]
    assert [flat[a]["spot.ttt_steps"] for a in ARMS] == [0, 2, 2]
    e = flat["eagle"]
    rows = e["rl.prompts_per_step"] * e["rl.samples_per_prompt"]
    assert e["spec.threshold"] >= rows and e["spot.threshold"] >= rows and e["spot.mode"] == "between_chunks"
    assert e["bandit.algorithm"] == "off" and e["num_steps"] == 3 and e["drafter.kind"] == "eagle"
    assert np.isnan(drafter_arch_rl.spot_step_ms({"spot/steps": 0.0}))


def _flatten(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v
