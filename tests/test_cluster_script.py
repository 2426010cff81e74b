"""configs/cluster/slurm_grpo.sh: valid bash, its default config validates, and run as SLURM would run it,
with a fake `srun`, `scancel` and `scontrol` on the PATH (no cluster needed): the extra arguments reach
`tlt_jax.main`, the default workdir is the same for two submissions of one job name, the srun line's task
count is explicit and fits the #SBATCH allocation in both layouts, a SIGTERM to the batch shell goes to the
tasks (`scancel --signal=TERM`), never to srun, the requeue follows the run's exit status and the job's
state, a TERM after srun's exit is harmless, and DRY_RUN=1 prints the srun line and the mesh the run's own
code builds for nodes x GPUs devices, starting nothing. The same script on a real Slurm: tests/slurm
(`make test-slurm`)."""

from __future__ import annotations

import json
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
import pytest

from tlt_jax import config_lib
from tlt_jax.rl.config import validate_grpo

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "configs" / "cluster" / "slurm_grpo.sh"
RECIPE = ["--config.rl.clip_high=0.28", "--config.rl.dynamic_sampling=True", "--config.num_steps=200"]
# a fake srun: its arguments one per line (then the task environment the script set). FAKE_SRUN_WAIT=1: it
# runs (as the tasks) until `scancel --signal=TERM` (the fake below) tells it the tasks got the TERM, then
# exits 75 as tlt_jax.main does after a stop; a TERM to srun itself is recorded (srun would kill the step).
# FAKE_SRUN_RC: its exit status otherwise. FAKE_TERM_AFTER=1: a TERM reaches the batch shell (its parent)
# after srun has exited, while the shell asks for the job's state.
FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_LOG/srun.$$.args"
echo "TLT_JAX_LOCAL_DEVICE_IDS=${TLT_JAX_LOCAL_DEVICE_IDS:-}" > "$FAKE_LOG/srun.$$.env"
if [ "${FAKE_TERM_AFTER:-0}" = 1 ]; then
  ( while [ ! -e "$FAKE_LOG/asked" ]; do sleep 0.02; done; kill -TERM $PPID ) > /dev/null 2>&1 &
fi
if [ "${FAKE_SRUN_WAIT:-0}" = 1 ]; then
  trap 'echo TERM > "$FAKE_LOG/srun.term"' TERM
  echo started > "$FAKE_LOG/srun.started"
  for _ in $(seq 400); do [ -e "$FAKE_LOG/tasks.term" ] && exit 75; sleep 0.05; done
  exit 1  # 20 s without the tasks' TERM
fi
exit "${FAKE_SRUN_RC:-0}"
"""
# FAKE_SCANCEL_RC=1: it fails, as the real one does for a job SLURM is ending ("Invalid job id specified")
FAKE_SCANCEL = """#!/bin/bash
printf '%s ' "$@" >> "$FAKE_LOG/scancel"
touch "$FAKE_LOG/tasks.term"
exit "${FAKE_SCANCEL_RC:-0}"
"""
# `show job`: the state FAKE_STATE / FAKE_RESTARTS (slow with FAKE_TERM_AFTER, so the TERM lands meanwhile)
FAKE_SCONTROL = """#!/bin/bash
if [ "$1" = show ]; then
  touch "$FAKE_LOG/asked"
  if [ "${FAKE_TERM_AFTER:-0}" = 1 ]; then sleep 1; fi
  echo "JobId=$3 JobName=dapo-7b"
  echo "   JobState=${FAKE_STATE:-RUNNING} Reason=None Dependency=(null)"
  echo "   Requeue=1 Restarts=${FAKE_RESTARTS:-0} BatchFlag=1 Reboot=0 ExitCode=0:0"
  exit 0
fi
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
    """The script as SLURM runs it in job `job_id` (2 nodes of 8 GPUs and 64 CPUs, the batch job's own
    SLURM_NTASKS), fake srun/scancel/scontrol first on the PATH."""
    bin_dir, log = tmp_path / "bin", tmp_path / f"log{job_id}"
    bin_dir.mkdir(exist_ok=True)
    log.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    slurm = {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8"}
    slurm |= {"SLURM_CPUS_ON_NODE": "64", "SLURM_JOB_NAME": "dapo-7b", "SLURM_NTASKS": "16"}
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
    # --ntasks explicitly: on SLURM < 23.11 srun keeps the batch job's SLURM_NTASKS (16) over
    # --ntasks-per-node (tests/slurm: "More processors requested than permitted" on 22.05)
    assert node[:main] == [
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=64",
        "--kill-on-bad-exit=0",
    ]
    assert gpu[:main] == [
        "--nodes=2",
        "--ntasks=16",
        "--ntasks-per-node=8",
        "--cpus-per-task=8",
        "--kill-on-bad-exit=0",
    ]
    assert node[main:][-len(RECIPE) :] == RECIPE, "the extra arguments must come last (they override)"
    for argv in (node, gpu):
        assert argv[argv.index("--workdir") + 1] == "workdirs/dapo-7b"
        assert "--config.multiprocess=True" in argv and "--config.model.path=/m" in argv
    assert (
        node_env.strip() == "TLT_JAX_LOCAL_DEVICE_IDS="
        and gpu_env.strip() == "TLT_JAX_LOCAL_DEVICE_IDS=localid"
    )


def test_sigterm_to_the_batch_shell_reaches_the_tasks_not_srun_and_requeues(tmp_path: pathlib.Path) -> None:
    """--signal=B:TERM signals only the batch shell: it must pass the TERM to the tasks (`scancel
    --signal=TERM <job>`: every step's tasks, not the shell), never to srun (srun kills the step on a TERM),
    wait for srun to exit, then, the run having stopped (75) in a job still RUNNING, requeue it."""
    proc = _submit(tmp_path, 303, RECIPE, FAKE_SRUN_WAIT="1")
    log = tmp_path / "log303"
    deadline = time.monotonic() + 20
    while not (log / "srun.started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=40)
    assert proc.returncode == 75, err
    assert not (log / "srun.term").exists(), "srun got the TERM: it would kill the tasks"
    assert (log / "scancel").read_text().split() == ["--signal=TERM", "303"]
    assert (log / "scontrol").read_text().split() == ["requeue", "303"]
    assert "sending it to the tasks" in out and "requeueing job 303" in out


# (srun's status, the job's state, its restart count, SLURM_RESTART_COUNT) -> requeued by the script?, a line
REQUEUE_CASES = [
    ((0, "RUNNING", 0, 0), False, "the run finished (exit 0)"),
    ((75, "RUNNING", 1, 1), True, "requeueing job 404"),  # the time limit's TERM, a signal-only preemption
    # scontrol requeue, a preemption with PreemptMode=REQUEUE: the restart count went up
    ((75, "COMPLETING", 2, 1), False, "SLURM requeues job 404 itself"),
    ((75, "COMPLETING", 0, 0), False, "not requeued; resubmit with --job-name=dapo-7b"),  # a user's scancel
    ((70, "RUNNING", 0, 0), False, "the watchdog ended a stalled process (exit 70"),
    ((137, "RUNNING", 0, 0), False, "failed (exit 137: a task was killed by signal 9): not requeued"),
    ((1, "RUNNING", 0, 0), False, "failed (exit 1): not requeued"),
]


@pytest.mark.parametrize("case,requeued,line", REQUEUE_CASES)
def test_the_requeue_follows_the_exit_status_and_the_job_state(tmp_path, case, requeued, line) -> None:
    """Requeue only a run that stopped to be resumed (75) in a job SLURM keeps running; a job SLURM requeues
    or cancels itself is left to it, whatever TERM the shell saw (a user's scancel TERMs the shell too)."""
    rc, state, restarts, restart_count = case
    env = {"FAKE_SRUN_RC": str(rc), "FAKE_STATE": state, "FAKE_RESTARTS": str(restarts)}
    proc = _submit(tmp_path, 404, RECIPE, SLURM_RESTART_COUNT=str(restart_count), **env)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == rc, err
    assert line in out, out
    requeue = tmp_path / "log404" / "scontrol"
    assert (requeue.exists() and requeue.read_text().split() == ["requeue", "404"]) == requeued, out


def test_a_term_after_srun_exits_is_harmless(tmp_path: pathlib.Path) -> None:
    """A TERM that reaches the shell after srun has exited (here while it reads the job's state; scancel
    failing, as for a job SLURM is ending) must not end the shell under `set -e` before its decision: the
    stopped run is still requeued, with srun's status."""
    proc = _submit(tmp_path, 505, RECIPE, FAKE_SRUN_RC="75", FAKE_TERM_AFTER="1", FAKE_SCANCEL_RC="1")
    out, err = proc.communicate(timeout=30)
    assert (tmp_path / "log505" / "asked").exists()
    assert proc.returncode == 75, (out, err)
    assert "requeueing job 505" in out and (tmp_path / "log505" / "scontrol").read_text().split() == [
        "requeue",
        "505",
    ]


def test_model_and_data_may_be_the_configs_own(tmp_path: pathlib.Path) -> None:
    """MODEL= / DATA= (set, empty): no --config.model.path / --config.task.path (a config with its own model
    and task, configs/smoke.py in tests/slurm); unset: an error naming the variable."""
    proc = _submit(tmp_path, 606, [], MODEL="", DATA="")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    argv, _ = _srun_call(tmp_path, 606)
    assert not [a for a in argv if a.startswith(("--config.model.path", "--config.task.path"))], argv
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MODEL", "DATA"))}
    out = subprocess.run(["bash", str(SCRIPT)], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode != 0 and "MODEL: set MODEL to the HF model directory" in out.stderr


def test_dry_run_prints_the_srun_line_and_the_mesh(tmp_path: pathlib.Path) -> None:
    """DRY_RUN=1 on a login node: the srun line, then the run's own validation and mesh on 2 x 8 fake CPU
    devices (the paper config's model axis of 4: data 4 x model 4); nothing is started or written."""
    model, data = tmp_path / "Qwen2.5-7B", tmp_path / "train.parquet"
    model.mkdir()  # the HF directory's config.json (the deadlock check reads its KV heads), no weights
    qwen7b = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28)
    qwen7b |= dict(num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)
    (model / "config.json").write_text(json.dumps(qwen7b))
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
    assert lines[1].startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=64")
    assert lines[1].split()[-len(RECIPE) :] == RECIPE
    assert "mesh data=4 x model=4 over 16 of 16 cpu devices" in out.stdout
    assert f"workdir workdirs/{name} starts anew" in out.stdout
    assert not (ROOT / "workdirs" / name).exists()


def test_every_signal_recommendation_names_the_batch_shell() -> None:
    """The script's TERM reaches the tasks only through its batch shell (`--signal=B:TERM@...`); a bare
    `--signal=TERM@...` sends it to every task AND srun, which then kills the step: no recommendation in the
    code, configs or docs may say that."""
    files = [*(ROOT / "tlt_jax").rglob("*.py"), *(ROOT / "configs").rglob("*"), ROOT / "README.md"]
    files += [f for f in (ROOT / "docs").glob("*.md")]
    bare = [
        f"{f.relative_to(ROOT)}: {m.group(0)}"
        for f in files
        if f.is_file()
        for m in re.finditer(r"--signal=(?!B:)[^\s@]*TERM@\S*", f.read_text(errors="replace"))
    ]
    assert bare == [], bare
