"""Every job README.md or the Makefile runs, end to end at smoke size (`tests/documented_jobs.py`): a
documented command that crashes fails `make test`. The warm-up runs first and the GRPO jobs that use a warmed
drafter (`drafter=auto`, `drafter=eagle`) read its workdir, as `make warmup` then `make run` do.

Each job goes through `tlt_jax.main.run` (validation, the workdir check, config.json, the job, its plot) with
its config file's own sections; only `documented_jobs.shrink` differs from the command."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests import documented_jobs as dj
from tlt_jax import main
from tlt_jax.rl.speculation import has_drafter
from tlt_jax.utils.plain import plain_dict
from tlt_jax.utils.tracking import CONFIG_FILE, METRICS_FILE, read_metrics


@pytest.fixture(scope="module")
def warmup_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """`make warmup` (configs/drafter_warmup.py:tlt) at smoke size: a drafter for the tlt jobs."""
    workdir = tmp_path_factory.mktemp("drafter_tlt")
    assert main.run(dj.shrink(dj.WARMUP.load()), str(workdir)) == "done"
    return workdir


def test_warmup_job_writes_a_drafter(warmup_dir: pathlib.Path) -> None:
    saved = json.loads((warmup_dir / CONFIG_FILE).read_text())
    assert saved["task"]["dataset_kwargs"] == {
        "min_terms": 2,
        "max_terms": 3,
        "min_digits": 1,
        "max_digits": 2,
    }
    assert has_drafter(str(warmup_dir)), (
        "the warm-up saved no drafter: drafter=auto would fall back to n-gram"
    )


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny Qwen2 HF checkpoint directory (4 KV heads: the paper configs' model axis of 4 divides them)."""
    return dj.save_tiny_hf_dir(tmp_path_factory.mktemp("qwen2_hf"))


# make test runs the TLT jobs and the small configs; the paper-size configs' runlocal jobs (their sections at
# smoke size, as the TLT jobs'), the plain baseline and the eagle arm run in `make test-extended`
JOB_PARAMS = [pytest.param(j, id=j.name, marks=[pytest.mark.extended] if j.extended else []) for j in dj.JOBS]


@pytest.mark.parametrize("job", JOB_PARAMS)
def test_documented_job_runs(
    job: dj.Job, warmup_dir: pathlib.Path, hf_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    config = dj.shrink(job.load(), warmup_dir if job.warmed_drafter else None, hf_dir if job.hf_dir else None)
    assert main.run(config, str(tmp_path)) == "done"
    rows = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in rows if "reward/mean" in r] == [1]
    saved = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert saved["task"] == plain_dict(config.task)
