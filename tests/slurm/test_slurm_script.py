"""configs/cluster/slurm_grpo.sh on a real Slurm (`make test-slurm`; tests/slurm/cluster.py: Debian's
slurm-wlm 22.05 and munge, one node with this machine's CPUs): submitted with sbatch as a user submits it
(CONFIG, MODEL=, DATA=, WORKDIR, LAYOUT, PYTHON in the environment; sbatch options on the command line to fit
a 2-CPU node without GPUs), the smoke config on CPU, and interrupted the ways a cluster interrupts a job:

- the time limit's early TERM (`#SBATCH --signal=B:TERM@300`), emulated by `scancel --batch --signal=TERM`:
  the same delivery (the batch shell alone) at a moment the test chooses instead of SLURM's event clock;
- a preemption that signals the tasks (`scancel --signal=TERM JOBID`, what SLURM sends a job it preempts);
- a preemption that requeues (`scontrol requeue JOBID`: SLURM ends the job and queues it again);
- a task SIGKILLed outright (the job ends, not requeued, saying so; a resubmission resumes);
- a user's `scancel JOBID` (the job ends, not requeued). On 22.05 the batch shell is killed (KillWait) before
  srun returns after a cancel, so the script's own decision is not reached there: the fake-srun unit test
  (tests/test_cluster_script.py) is the one that checks it.

Every interrupted run resumes in its workdir, and the chain's run ends equal to an uninterrupted one
(metrics and every checkpoint; tests/test_multiprocess.py's comparisons: 2 processes x 1 device against
1 process x 2 devices, floats to float32 rounding where the update sums across processes).
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import sys
import time

import pytest

from tests.slurm.cluster import Cluster
from tests.test_multiprocess import (
    DETERMINISTIC,
    assert_same_metrics,
    assert_same_state,
    clean_env,
    restore_on_one_device,
)
from tlt_jax.utils.checkpoint import Checkpointer
from tlt_jax.utils.tracking import read_metrics

pytestmark = pytest.mark.slurm

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "configs" / "cluster" / "slurm_grpo.sh"
STEPS = 12
CONFIG = f"configs/smoke.py:steps={STEPS}"
ARGS = ["--config.checkpoint_every=1", f"--config.keep_checkpoints={STEPS}", "--config.stop_within=60"]
# the node: 2 CPUs, no GPU. LAYOUT=gpu gets its task count from GPUS_PER_NODE (SLURM sets no
# SLURM_GPUS_ON_NODE without GPUs); each of its 2 processes has 1 CPU device, LAYOUT=node's one process 2:
# the same 2-device mesh
SBATCH = ["--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=15"]
DEVICES = {"node": 2, "gpu": 1}
TERM_LINE = "sending it to the tasks"
STEP_LINE = re.compile(r"^step \d+/\d+ \|", re.M)  # a step's summary line
RECEIVED = re.compile(r"received SIGTERM: stopping at the next agreed point")


def submit(slurm: Cluster, tmp: pathlib.Path, name: str, layout: str) -> int:
    """sbatch the project's script as a user would (from the repository root), job `name`, workdir under
    `tmp`; returns the job id."""
    env = {**clean_env(DEVICES[layout]), **slurm.env}
    env |= {"CONFIG": CONFIG, "MODEL": "", "DATA": "", "WORKDIR": str(tmp / name), "LAYOUT": layout}
    env |= {"PYTHON": sys.executable, "GPUS_PER_NODE": "2", "TLT_JAX_HEARTBEAT_TIMEOUT": "20"}
    cmd = ["sbatch", "--parsable", f"--job-name={name}", f"--output={tmp}/{name}.log", *SBATCH, str(SCRIPT)]
    out = slurm.run(*cmd, *ARGS, env=env, cwd=ROOT)
    return int(out.stdout.strip().split(";")[0])


def job(slurm: Cluster, job_id: int) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
    out = slurm.run("scontrol", "show", "job", "-o", str(job_id)).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait(what: str, ready, timeout: float, slurm: Cluster, log: pathlib.Path) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            text = log.read_text(errors="replace")[-6000:] if log.exists() else "(no log)"
            pytest.fail(f"no {what} within {timeout} s; job log:\n{text}\n{slurm.logs(10)}")
        time.sleep(0.2)


def launches(log: pathlib.Path) -> list[str]:
    """The job log (appended across restarts) split at each start of the script."""
    text = log.read_text(errors="replace") if log.exists() else ""
    parts = re.split(r"^(?=job \d+ \()", text, flags=re.M)
    return [p for p in parts if p.startswith("job ")]


def logged_steps(workdir: pathlib.Path) -> list[int]:
    path = workdir / "metrics.jsonl"
    return [m["step"] for m in read_metrics(path)] if path.exists() else []


def saved_steps(workdir: pathlib.Path) -> list[int]:
    d = workdir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def running_launch(slurm: Cluster, job_id: int, log: pathlib.Path, n: int) -> str:
    """Until launch `n` (1-based) of the job's log runs and has logged a step of its own (so every launch of
    the chain runs at least one step); its log so far."""
    wait(f"launch {n}", lambda: len(launches(log)) >= n, 120, slurm, log)
    wait(f"a step in launch {n}", lambda: STEP_LINE.search(launches(log)[n - 1]), 240, slurm, log)
    assert job(slurm, job_id)["JobState"] == "RUNNING", launches(log)[-1][-3000:]
    return launches(log)[n - 1]


def ended(slurm: Cluster, job_id: int) -> bool:
    return job(slurm, job_id)["JobState"] not in ("RUNNING", "PENDING", "COMPLETING", "REQUEUED")


def task_pids(job_id: int, procid: int) -> list[int]:
    """The pids of task `procid`'s python (tlt_jax.main) in job `job_id` (from /proc: this machine is the
    node)."""
    found = []
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in (p / "environ").read_text().split("\0") if "=" in kv)
            cmd = (p / "cmdline").read_text()
        except OSError:
            continue
        if env.get("SLURM_JOB_ID") == str(job_id) and env.get("SLURM_PROCID") == str(procid):
            if "tlt_jax.main" in cmd:
                found.append(int(p.name))
    return found


@pytest.fixture(scope="module")
def reference(slurm: Cluster, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The uninterrupted run: LAYOUT=node (one task with the node's 2 devices), every step checkpointed. It is
    also the node layout's launch: on 22.05 srun inherits the job's SLURM_NTASKS=2 and, without --ntasks,
    asks for 2 tasks x 2 CPUs ("More processors requested than permitted")."""
    tmp = tmp_path_factory.mktemp("reference")
    job_id = submit(slurm, tmp, "ref", "node")
    log = tmp / "ref.log"
    wait("the reference's end", lambda: ended(slurm, job_id), 300, slurm, log)
    info, text = job(slurm, job_id), log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", text[-6000:]
    assert "the run finished (exit 0)" in text and "process 0 of 1" in text
    assert logged_steps(tmp / "ref") == list(range(1, STEPS + 1))
    return tmp / "ref"


def test_node_layout_launches_one_task_with_the_node(reference: pathlib.Path) -> None:
    assert saved_steps(reference) == list(range(1, STEPS + 1))


def assert_equal_to(reference: pathlib.Path, workdir: pathlib.Path, steps: list[int]) -> None:
    """Checkpoints `steps` of `workdir` equal the reference's (floats to float32 rounding)."""
    for step in steps:
        want = restore_on_one_device(reference, step)
        assert_same_state(want, restore_on_one_device(workdir, step, want), f"{workdir.name} step {step}")


def stop_requeued(slurm: Cluster, job_id: int, log: pathlib.Path, n: int, how: list[str]) -> None:
    """Launch `n` gets a TERM (`scancel <how> --signal=TERM`): both tasks receive it, stop at one agreed
    point and exit 75; the shell requeues the job and launch n + 1 starts."""
    restarts = int(job(slurm, job_id)["Restarts"])
    slurm.run("scancel", *how, "--signal=TERM", str(job_id))
    wait(f"launch {n + 1}", lambda: len(launches(log)) > n or ended(slurm, job_id), 180, slurm, log)
    text = launches(log)[n - 1]
    assert (TERM_LINE in text) == ("--batch" in how), text[-4000:]
    assert len(RECEIVED.findall(text)) == 2, f"each of the 2 tasks must get the TERM:\n{text[-6000:]}"
    assert "stop agreed by every process" in text, text[-4000:]
    requeued = f"the run stopped with its checkpoint saved (exit 75): requeueing job {job_id}"
    assert requeued in text, text[-4000:]
    assert int(job(slurm, job_id)["Restarts"]) == restarts + 1


def settled(slurm: Cluster, job_id: int) -> dict[str, str]:
    """The job's state once SLURM is done with it (neither running nor completing)."""
    wait("the job to settle", lambda: job(slurm, job_id)["JobState"] not in ("RUNNING", "COMPLETING"), 120,
         slurm, pathlib.Path("/nonexistent"))  # fmt: skip
    return job(slurm, job_id)


def test_interrupted_every_way_resumes_equal_to_the_uninterrupted_run(
    slurm: Cluster, tmp_path: pathlib.Path, reference: pathlib.Path
) -> None:
    """One run in LAYOUT=gpu (2 tasks) through three submissions of one job name (one workdir), six
    launches:

    job A 1. the time limit's early TERM to the batch shell (`scancel --batch --signal=TERM`): the shell
             passes it to both tasks (not to srun, which would kill them), they stop at one agreed point and
             exit 75, and the shell requeues the job;
          2. a user's `scancel`: the job ends CANCELLED, not requeued;
    job B 3. a preemption's TERM to the tasks (`scancel --signal=TERM`): as 1, the shell requeues;
          4. `scontrol requeue` (SLURM ends the job and queues it again): the job restarts;
          5. task 1 SIGKILLed: the job ends FAILED, not requeued, the log saying why, once the other task
             notices (JAX's heartbeat, TLT_JAX_HEARTBEAT_TIMEOUT: 20 s here);
    job C 6. resumed from B's last checkpoint, it runs to the end.
    Every step is logged once and every checkpoint equals the uninterrupted run's."""
    workdir, log = tmp_path / "chain", tmp_path / "chain.log"
    job_id = submit(slurm, tmp_path, "chain", "gpu")
    running_launch(slurm, job_id, log, 1)
    stop_requeued(slurm, job_id, log, 1, ["--batch"])

    running_launch(slurm, job_id, log, 2)
    slurm.run("scancel", str(job_id))
    info, text = settled(slurm, job_id), launches(log)[1]
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "1"), text[-4000:]
    assert "requeueing job" not in text, text[-4000:]

    job_id = submit(slurm, tmp_path, "chain", "gpu")
    text = running_launch(slurm, job_id, log, 3)
    assert "(start at step 1)" not in text, "the resubmission must resume"
    stop_requeued(slurm, job_id, log, 3, [])

    # SLURM requeues the job itself (a preemption with PreemptMode=REQUEUE does the same)
    running_launch(slurm, job_id, log, 4)
    slurm.run("scontrol", "requeue", str(job_id))
    wait("launch 5", lambda: len(launches(log)) > 4 or ended(slurm, job_id), 180, slurm, log)
    assert job(slurm, job_id)["Restarts"] == "2"
    assert "requeueing job" not in launches(log)[3], "SLURM requeued it already"

    # a task killed outright: the other ends too, the job fails without requeue, the log says why
    running_launch(slurm, job_id, log, 5)
    (pid,) = task_pids(job_id, 1)
    os.kill(pid, signal.SIGKILL)
    info, text = settled(slurm, job_id), launches(log)[4]
    assert (info["JobState"], info["Restarts"]) == ("FAILED", "2"), text[-4000:]
    assert re.search(r"srun: error: \S+: task 1: Killed", text), text[-4000:]
    failed = re.search(r"error: the run failed \(exit (\d+): a task was killed by signal \d+\)", text)
    assert failed and int(failed.group(1)) > 128 and "not requeued" in text, text[-4000:]
    killed_at = saved_steps(workdir)
    assert killed_at and len(launches(log)) == 5

    # resubmitted, it resumes from the last checkpoint and runs to the end
    job_id = submit(slurm, tmp_path, "chain", "gpu")
    wait("the chain's end", lambda: ended(slurm, job_id), 300, slurm, log)
    info, text = job(slurm, job_id), launches(log)[-1]
    assert info["JobState"] == "COMPLETED" and len(launches(log)) == 6, text[-6000:]
    assert f"(start at step {max(killed_at) + 1})" in text, text[-4000:]
    assert "the run finished (exit 0)" in text and "process 1 of 2" in text
    assert_same_metrics(reference, workdir, STEPS, DETERMINISTIC)
    with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        steps = ckpt.all_steps()
    assert steps == saved_steps(reference) == list(range(1, STEPS + 1))
    assert_equal_to(reference, workdir, steps)
