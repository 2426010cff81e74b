"""Smoke runs of the Table 7 / Table 1 scripts (make test-experiments): their --quick modes end with the
RESULT keys the docs quote and write their plots."""

import pytest

from tests.experiments.test_experiments import _run


@pytest.mark.experiments
def test_drafter_arch_quick(tmp_path):
    res, _ = _run("paper.drafter_arch", "--quick", "--out", str(tmp_path))
    arms = ("eagle", "hass", "eagle3")
    assert {f"{k}_{a}" for k in ("accept", "sampled", "step_ms") for a in arms} | {"best"} == set(res)
    assert all(float(res[f"accept_{a}"]) >= 1.0 for a in arms) and res["best"] in arms
    assert (tmp_path / "drafter_arch.png").exists()


@pytest.mark.experiments
def test_tree_topk_quick(tmp_path):
    res, _ = _run("paper.tree_topk", "--quick", "--out", str(tmp_path))
    assert int(res["best_topk"]) in (1, 4, 6, 8) and float(res["accept_k1"]) >= 1.0
    assert (tmp_path / "tree_topk.png").exists()
