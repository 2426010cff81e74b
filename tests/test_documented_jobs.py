"""Every job README.md or the Makefile runs, end to end at smoke size (`tests/documented_jobs.py`): a
documented command that crashes fails `make test`. The warm-up runs first and the GRPO jobs that use a warmed
drafter (`drafter=auto`, `drafter=eagle`) read its workdir, as `make warmup` then `make run` do.

Each job goes through `tlt_jax.main.run` (validation, the workdir check, config.json, the job, its plot) with
its config file's own sections; only `documented_jobs.shrink` differs from the command."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests import documented_jobs as dj
from tlt_jax import main
from tlt_jax.rl.speculation import has_drafter
from tlt_jax.tasks import write_parquet
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


@pytest.fixture(scope="module")
def dapo_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """README.md's two write_parquet commands (train and test files of math_dapo rows), at smoke size."""
    d = tmp_path_factory.mktemp("dapo_data")
    common = ["--dataset", "chain_sum", "--dataset-kwargs", dj.EASY, "--data-source", "math_dapo"]
    write_parquet.main([*common, "--size", "16", "--out", str(d / "train.parquet")])
    write_parquet.main([*common, "--size", "4", "--seed", "1", "--out", str(d / "test.parquet")])
    return {"train": str(d / "train.parquet"), "test": str(d / "test.parquet")}


def test_readme_dapo_job_refills_scores_and_votes(dapo_files: dict[str, str], tmp_path: pathlib.Path) -> None:
    """README.md's CPU DAPO command at smoke size (`documented_jobs.DAPO_CPU`): its step-0 evaluation votes
    over 2 samples of the test file (maj@2), its step refills up to max_num_gen_batches=3 generation batches
    (a random model answers nothing right: every group is filtered, the step trains on masked fillers and
    says so), and each reward is DAPO's check (-1 for a wrong answer) plus the overlong shaping of VeRL's DAPO
    reward manager, from the rows' data_source."""
    config = dj.shrink(dj.DAPO_CPU.load(**dapo_files))
    assert (config.task.reward, config.rl.filter_metric, config.rl.overlong_buffer) == ("verl", "acc", 4)
    assert main.run(config, str(tmp_path)) == "done"
    rows = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1]
    ev, step = rows[0], rows[1]
    # maj@k on the benchmark set: 2 prompts x 2 samples, none right, so every estimator is 0 (a vote that
    # counted unanswered samples as agreeing, or a pass@k over the wrong samples, would not be)
    for k in ("mean@2", "pass@1", "pass@2", "maj@1", "maj@2"):
        assert ev[f"eval/bench/{k}"] == 0.0, (k, ev)
    # refill: 3 batches of 2 prompts x 2 samples generated, no group kept, the 2 groups trained as fillers
    ds = {k.split("/", 1)[1]: v for k, v in step.items() if k.startswith("dynamic_sampling/")}
    assert ds["gen_batches"] == 3 and ds["generated_groups"] == 6, ds
    assert ds["kept_groups"] == 0 and ds["short_groups"] == 2 and ds["generated_accuracy"] == 0.0, ds
    # reward: DAPO's -1 for every (wrong) answer plus the overlong shaping over the last 4 of 8 tokens
    assert step["reward/mean"] == pytest.approx(-1.0 + step["reward/overlong_mean"], abs=1e-6), step
    assert -1.0 <= step["reward/overlong_mean"] < 0.0 and step["reward/overlong_frac"] > 0, step


def test_readme_dapo_recipe_on_one_node_runs_on_a_parquet_file(
    dapo_files: dict[str, str], hf_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """README.md's one-node DAPO command (`documented_jobs.DAPO_NODE`) at smoke size: the recipe's own
    sections on the user's parquet file, read from an HF directory on its data x model 4 mesh (2 x 4 of the
    suite's 8 fake devices), the step's rewards DAPO's check of each row's data_source, and the AIME-style
    set evaluated before and after the step with the recipe's sampling."""
    config = dj.shrink(dj.DAPO_NODE.load(**dapo_files), model_dir=hf_dir)
    assert (config.mesh.model, config.task.path, config.task.reward) == (4, dapo_files["train"], "verl")
    assert main.run(config, str(tmp_path)) == "done"
    rows = read_metrics(tmp_path / METRICS_FILE)
    step = next(r for r in rows if "reward/mean" in r)
    assert step["step"] == 1 and step["reward/mean"] <= -1.0 + 1e-6 + step["reward/overlong_mean"], step
    # one sample per problem (VeRL's val_kwargs.n=1: DAPO's AIME file repeats each problem), before and after
    assert [r["step"] for r in rows if "eval/aime24/mean@1" in r] == [0, 1], rows
    saved = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert saved["task"]["path"] == dapo_files["train"] and saved["mesh"]["model"] == 4


@pytest.mark.extended
def test_readme_dapo_warmup_writes_a_drafter(
    dapo_files: dict[str, str], hf_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """README.md's dapo7b drafter warm-up on the same parquet file, at smoke size (the tiny Qwen2 directory
    as the policy): it writes a drafter the recipe's drafter_path reads."""
    config = dj.shrink(dj.DAPO_WARMUP.load(hf=str(hf_dir), **dapo_files), model_dir=hf_dir)
    assert main.run(config, str(tmp_path)) == "done"
    assert has_drafter(str(tmp_path))


def test_readme_states_the_dapo_jobs_these_tests_run() -> None:
    """The DAPO jobs above are README.md's commands: its $EASY data, its tlt.py:dapo and recipe arguments."""
    readme = (dj.ROOT / "README.md").read_text(encoding="utf-8")
    assert f"EASY='{dj.EASY}'" in readme
    files = {"train": "data/dapo_train.parquet", "test": "data/dapo_test.parquet"}
    assert f"--config {dj.DAPO_CPU.config.format(**files)} " in readme
    assert f"--config {dj.DAPO_NODE.config.format(test='/data/aime-2024.parquet')} " in readme


def test_readme_slurm_command_runs_the_recipe_dry(dapo_files: dict[str, str], tmp_path: pathlib.Path) -> None:
    """README.md's sbatch line for DAPO, as its script runs outside an allocation with DRY_RUN=1: the README's
    CONFIG (its eval file replaced by the test file), MODEL a directory with Qwen2.5-7B's config.json and DATA
    the parquet file: the srun line, then the run's own validation and the recipe's data 2 x model 4 mesh on
    one node's 8 fake devices. `make test-slurm` submits the same script through a real sbatch."""
    readme = (dj.ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(
        r"^CONFIG=(\S+) MODEL=(\S+) \\\n\s+DATA=(\S+) sbatch --job-name=\S+ configs/cluster/slurm_grpo.sh",
        readme,
        re.M,
    )
    assert m, "README.md's DAPO sbatch line changed shape: update this test with it"
    config = m.group(1).replace("/data/aime-2024.parquet", dapo_files["test"])
    model = (
        tmp_path / "Qwen2.5-7B"
    )  # what a login node sees: the HF directory's config.json (no weights read)
    model.mkdir()
    qwen7b = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28)
    (model / "config.json").write_text(
        json.dumps(qwen7b | dict(num_attention_heads=28, num_key_value_heads=4, vocab_size=152064))
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TLT_JAX_", "XLA_", "JAX_"))}
    env |= dict(DRY_RUN="1", CONFIG=config, MODEL=str(model), DATA=dapo_files["train"], PYTHON=sys.executable)
    env |= dict(SLURM_JOB_NAME=f"dry-{tmp_path.name}")
    script = dj.ROOT / "configs" / "cluster" / "slurm_grpo.sh"
    out = subprocess.run(
        ["bash", str(script)], cwd=dj.ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "srun --nodes=1 --ntasks=1 --ntasks-per-node=1" in out.stdout, out.stdout
    assert (
        f"--config {config} " in out.stdout and "mesh data=2 x model=4 over 8 of 8 cpu devices" in out.stdout
    )
    assert not (dj.ROOT / "workdirs" / f"dry-{tmp_path.name}").exists()
