"""configs/cluster/slurm_grpo.sh: valid bash, its default config validates, and run as SLURM would run it,
with a fake `srun` and `scontrol` on the PATH (no cluster needed): the extra arguments reach `tlt_jax.main`,
the default workdir is the same for two submissions of one job name, the task/CPU accounting fits the
#SBATCH allocation in both layouts, a SIGTERM to the batch shell reaches srun and requeues the job, and
DRY_RUN=1 prints the srun line and the mesh the run's own code builds for nodes x GPUs devices, starting
nothing."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq

from tlt_jax import config_lib
from tlt_jax.rl.config import validate_grpo

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "configs" / "cluster" / "slurm_grpo.sh"
RECIPE = ["--config.rl.clip_high=0.28", "--config.rl.dynamic_sampling=True", "--config.num_steps=200"]
# a fake srun: its arguments one per line (then the task environment the script set), then it runs until
# a SIGTERM, which it records
FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_LOG/srun.$$.args"
echo "TLT_JAX_LOCAL_DEVICE_IDS=${TLT_JAX_LOCAL_DEVICE_IDS:-}" > "$FAKE_LOG/srun.$$.env"
if [ "${FAKE_SRUN_WAIT:-0}" = 1 ]; then
  trap 'echo TERM > "$FAKE_LOG/srun.term"; exit 0' TERM
  echo started > "$FAKE_LOG/srun.started"
  while true; do sleep 0.05; done
fi
"""
FAKE_SCONTROL = """#!/bin/bash
printf '%s ' "$@" >> "$FAKE_LOG/scontrol"
"""


def sbatch_options() -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", SCRIPT.read_text(), re.M))


def test_script_is_valid_bash_and_names_what_it_needs() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    for var in ("MODEL", "DATA", "WORKDIR", "LAYOUT", "DRY_RUN", "TLT_JAX_LOCAL_DEVICE_IDS", "SLURM_PROCID"):
        assert var in text, f"{var} is not explained in {SCRIPT.name}"


def test_allocation_fits_both_layouts_and_survives_requeue() -> None:
    """Per node the #SBATCH lines reserve one task per GPU (LAYOUT=gpu's tasks) and CPUs for all of them
    (LAYOUT=node's one task takes them all); --requeue with a TERM to the batch shell ahead of the time limit;
    a log path SLURM can open before the script runs (its folder exists at submission)."""
    opts = sbatch_options()
    assert opts["ntasks-per-node"] == opts["gpus-per-node"] == "8" and int(opts["cpus-per-task"]) >= 1
    assert "requeue" in opts and opts["open-mode"] == "append"
    sig, _, lead = opts["signal"].partition("@")
    assert sig == "B:TERM" and 120 <= int(lead) <= 65535  # SLURM may send it up to 60 s early
    assert "/" not in opts["output"], "--output's folder must exist before the job starts"
    workdir = re.search(r"WORKDIR=\$\{WORKDIR:-([^}]+)\}", SCRIPT.read_text()).group(1)
    assert "%j" in opts["output"] and "SLURM_JOB_ID" not in workdir


def test_its_default_config_with_its_overrides_validates(tmp_path: pathlib.Path) -> None:
    default = re.search(r"CONFIG=\$\{CONFIG:-([^}]+)\}", SCRIPT.read_text()).group(1)
    path, _, arg = default.partition(":")
    c = config_lib.load_config_file(ROOT / path, arg)
    assert c.task.kind == "parquet" and c.task.reward == "verl"
    assert (c.rl.prompts_per_step, c.rl.samples_per_prompt, c.rollout.max_new_tokens) == (64, 8, 32768)
    assert (c.rl.lr, c.rl.kl_coef, c.rollout.temperature, c.spec.threshold) == (1e-6, 0.001, 0.9, 32)
    c.multiprocess = True
    c.model.path, c.task.path = str(tmp_path / "Qwen2.5-7B"), str(tmp_path / "train.parquet")
    validate_grpo(c, check_paths=False)


def _submit(tmp_path: pathlib.Path, job_id: int, args: list[str], **env: str) -> subprocess.Popen:
    """The script as SLURM runs it in job `job_id` (2 nodes of 8 GPUs and 64 CPUs), fake srun/scontrol first
    on the PATH."""
    bin_dir, log = tmp_path / "bin", tmp_path / f"log{job_id}"
    bin_dir.mkdir(exist_ok=True)
    log.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    slurm = {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8"}
    slurm |= {"SLURM_CPUS_ON_NODE": "64", "SLURM_JOB_NAME": "dapo-7b"}
    full = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TLT_JAX_", "WORKDIR", "LAYOUT"))
    }
    full |= {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(log),
        "MODEL": "/m",
        "DATA": "/d.parquet",
    }
    full |= slurm | env
    return subprocess.Popen(
        ["bash", str(SCRIPT), *args],
        cwd=tmp_path,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _srun_call(tmp_path: pathlib.Path, job_id: int) -> tuple[list[str], str]:
    log = tmp_path / f"log{job_id}"
    (args,) = log.glob("srun.*.args")
    return args.read_text().splitlines(), next(log.glob("srun.*.env")).read_text()


def test_arguments_are_forwarded_and_the_workdir_is_the_job_names(tmp_path: pathlib.Path) -> None:
    """Two submissions of one job name (new job ids) get one workdir, so the second resumes the first; the
    recipe's overrides reach tlt_jax.main after the script's own; each layout's srun fits the allocation."""
    calls = {}
    for job_id, layout in ((101, "node"), (202, "gpu")):
        proc = _submit(tmp_path, job_id, RECIPE, LAYOUT=layout)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        calls[layout] = _srun_call(tmp_path, job_id)
    (node, node_env), (gpu, gpu_env) = calls["node"], calls["gpu"]
    main = node.index("-m") - 1
    assert node[:main] == ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=64", "--kill-on-bad-exit=1"]
    assert gpu[:main] == ["--nodes=2", "--ntasks-per-node=8", "--cpus-per-task=8", "--kill-on-bad-exit=1"]
    assert node[main:][-len(RECIPE) :] == RECIPE, "the extra arguments must come last (they override)"
    for argv in (node, gpu):
        assert argv[argv.index("--workdir") + 1] == "workdirs/dapo-7b"
        assert "--config.multiprocess=True" in argv and "--config.model.path=/m" in argv
    assert (
        node_env.strip() == "TLT_JAX_LOCAL_DEVICE_IDS="
        and gpu_env.strip() == "TLT_JAX_LOCAL_DEVICE_IDS=localid"
    )


def test_sigterm_to_the_batch_shell_reaches_srun_and_requeues(tmp_path: pathlib.Path) -> None:
    """--signal=B:TERM signals only the batch shell: it must forward the TERM to srun (which forwards it to
    the tasks), wait for srun to exit, then requeue the job so it resumes in its workdir."""
    proc = _submit(tmp_path, 303, RECIPE, FAKE_SRUN_WAIT="1")
    log = tmp_path / "log303"
    deadline = time.monotonic() + 20
    while not (log / "srun.started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert (log / "srun.term").read_text().strip() == "TERM"
    assert (log / "scontrol").read_text().split() == ["requeue", "303"]
    assert "forwarding it to srun" in out and "requeueing job 303" in out


def test_dry_run_prints_the_srun_line_and_the_mesh(tmp_path: pathlib.Path) -> None:
    """DRY_RUN=1 on a login node: the srun line, then the run's own validation and mesh on 2 x 8 fake CPU
    devices (the paper config's model axis of 4: data 4 x model 4); nothing is started or written."""
    model, data = tmp_path / "Qwen2.5-7B", tmp_path / "train.parquet"
    model.mkdir()
    verl_row = {"prompt": [[{"role": "user", "content": "1+1?"}]], "reward_model": [{"ground_truth": "2"}]}
    verl_row["data_source"] = ["math_dapo"]  # the recipe scores by it (task.reward="verl")
    pq.write_table(pa.table(verl_row), data)  # VeRL's parquet layout, which the recipe reads
    name = f"dry-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TLT_JAX_", "XLA_", "JAX_"))}
    env |= {"DRY_RUN": "1", "NODES": "2", "MODEL": str(model), "DATA": str(data), "PYTHON": sys.executable}
    env |= {"SLURM_JOB_NAME": name}
    out = subprocess.run(["bash", str(SCRIPT), *RECIPE], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[1].startswith("srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=64")
    assert lines[1].split()[-len(RECIPE) :] == RECIPE
    assert "mesh data=4 x model=4 over 16 of 16 cpu devices" in out.stdout
    assert f"workdir workdirs/{name} starts anew" in out.stdout
    assert not (ROOT / "workdirs" / name).exists()
