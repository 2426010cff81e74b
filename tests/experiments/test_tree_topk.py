"""Smoke run of the Table 1 script (make test-experiments): its --quick mode sweeps top-k at two depths, ends
with the RESULT keys the docs quote and writes its plot."""

import pytest

from tests.experiments.test_experiments import _run


@pytest.mark.experiments
def test_tree_topk_quick_sweeps_depth_and_topk(tmp_path):
    res, out = _run("paper.tree_topk", "--quick", "--out", str(tmp_path))
    cells = {k.removeprefix("accept_") for k in res if k.startswith("accept_")}
    # depth 2 fills the 8 verified tokens from k 4 on, depth 3 from k 4 too (1 + 3k >= 8); the chain always
    assert cells == {"d2_k1", "d2_k4", "d2_k6", "d2_k8", "d3_k1", "d3_k4", "d3_k6", "d3_k8"}, res
    assert {f"speedup_{c}" for c in cells} <= set(res)
    assert f"d{res['best_depth']}_k{res['best_topk']}" in cells
    assert f"d{res['best_depth_accept']}_k{res['best_topk_accept']}" in cells
    assert all(float(res[f"accept_{c}"]) >= 1.0 for c in cells)
    assert "top-k [2] left out" in out
    assert (tmp_path / "tree_topk.png").exists()
