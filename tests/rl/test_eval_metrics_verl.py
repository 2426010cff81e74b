"""Eval metrics against VeRL 0.9.1's verl/trainer/ppo/metric_utils.py (loaded from the installed wheel): the
majority vote's convention (calc_maj_val over the scorer's `pred`: "[INVALID]" is a vote, equivalent strings
are not merged, ties go to the first answer, the voted answer's value is its first sample's) and mean@k of
VeRL's acc (process_validation_metrics), on 150 problems of generated responses scored by DAPO's check.

VeRL estimates maj@j and best@j for j < k by a bootstrap (1,000 draws with replacement, seed 42); ours are
exact expectations over the j-subsets (tlt_jax.rl.eval_metrics), so the comparison is at j = k, where both
are the statistic of all k samples, and on VeRL's convention for each vote.
"""

from __future__ import annotations

import pathlib
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.tasks.test_verl_oracle import responses
from tests.verl_oracle import verl_function, verl_line
from tlt_jax.rl.eval_metrics import maj_at_k, sample_metrics
from tlt_jax.tasks import make_task
from tlt_jax.tasks.datasets import task_config

METRICS = "verl.trainer.ppo.metric_utils"


def dapo_task(tmp_path: pathlib.Path, **keys: object):
    row = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "Q?"}]}
    row["reward_model"] = {"style": "rule", "ground_truth": "34"}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "d.parquet")
    return make_task(task_config("parquet", path=str(tmp_path / "d.parquet"), reward="verl", **keys))


def test_maj_and_mean_at_k_follow_verls_convention(tmp_path) -> None:
    """150 problems x k samples (k 2..8) of generated responses: maj@k == calc_maj_val over VeRL's own
    (pred, acc) of each sample, mean@k == process_validation_metrics' mean@k of acc."""
    where = verl_line(METRICS, "maj_vote = max(vote2cnt, key=vote2cnt.get)")
    calc_maj_val = verl_function(METRICS, "calc_maj_val")
    process = verl_function(METRICS, "process_validation_metrics")
    compute = verl_function("verl.utils.reward_score", "default_compute_score")
    task = dapo_task(tmp_path)
    problem = task.problem(0)
    rng = random.Random(4)
    pool = responses(seed=21, count=600) + ["Answer: 34", "Answer: 34.", "\\boxed{34}", "no idea"] * 50
    for i in range(150):
        k = rng.randint(2, 8)
        texts = [rng.choice(pool) for _ in range(k)]
        verl = [compute("math_dapo", t, "34") for t in texts]
        ours = [task.score(problem, t) for t in texts]
        votes = [task.vote(r) for r in ours]
        acc = [r.acc_value for r in ours]
        assert votes == [v["pred"] for v in verl], where  # the same strings vote, "[INVALID]" included
        want = calc_maj_val([{"pred": v["pred"], "val": float(v["acc"])} for v in verl], "pred", "val")
        assert maj_at_k(votes, acc, k) == pytest.approx(want), (where, texts)
        got = sample_metrics(np.asarray([acc]), np.asarray([[r.reward for r in ours]]), [votes],
                             np.ones((k,)), np.zeros((k,), bool))  # fmt: skip
        if i < 20:  # VeRL's function bootstraps every j (1,000 draws each): its mean@k on 20 problems
            vm = process(["math_dapo"] * k, ["u"] * k, {"acc": [float(v["acc"]) for v in verl]})
            assert got[f"mean@{k}"] == pytest.approx(vm["math_dapo"]["acc"][f"mean@{k}"])


def test_unanswered_samples_vote_in_verl_mode_and_abstain_in_ours(tmp_path) -> None:
    """5 unanswered + 3 right: VeRL's vote elects "[INVALID]" (maj@8 0 over all 8; its bootstrap estimate is
    0.238); task.maj_votes="normalized" (tlt_jax's) lets the unanswered abstain (1.0)."""
    where = verl_line(METRICS, "maj_val = vote2vals[maj_vote][0]")
    texts = ["I am not sure"] * 5 + ["Answer: 34"] * 3
    verl, ours = dapo_task(tmp_path), dapo_task(tmp_path, maj_votes="normalized")
    for task, want in ((verl, 0.0), (ours, 1.0)):
        results = [task.score(task.problem(0), t) for t in texts]
        assert maj_at_k([task.vote(r) for r in results], [r.acc_value for r in results], 8) == want, where
    assert verl.vote(verl.score(verl.problem(0), texts[0])) == "[INVALID]"
    # equivalent strings: VeRL's pred is the Minerva-normalised answer, "34" and "34.0" stay two answers
    two = [verl.score(verl.problem(0), t) for t in ("Answer: 34.0", "Answer: 34.0", "Answer: 34")]
    assert [verl.vote(r) for r in two] == ["34.0", "34.0", "34"]
    assert maj_at_k([verl.vote(r) for r in two], [r.acc_value for r in two], 3) == 0.0
    assert maj_at_k([ours.vote(r) for r in two], [r.acc_value for r in two], 3) == 0.0  # merged, first wrong
