"""Several processes, one program (issue #26, "Two processes equal one").

Unit tests of tlt_jax.utils.distributed's launch resolution (explicit TLT_JAX_* variables, SLURM's, the
SLURM node list), then real multi-process runs on this machine's CPU: subprocesses with 2 fake CPU devices
each (XLA_FLAGS=--xla_force_host_platform_device_count=2) joined through a coordinator on a free local port,
compared with one process on 4 fake devices.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable

import numpy as np
import pytest

from tlt_jax.utils import distributed as dist
from tlt_jax.utils.checkpoint import Checkpointer
from tlt_jax.utils.kill_runs import FAST_COMPILE_FLAGS, TINY_SPOT, leftovers
from tlt_jax.utils.phase import PHASE_FILE, read_phase
from tlt_jax.utils.tracking import read_metrics
from tlt_jax.utils.watchdog import EXIT_STOPPED

ROOT = pathlib.Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "multiprocess_driver.py"


# ---- the launch variables -> (coordinator, process count, process id) -----------------------------------
SLURM = {"SLURM_JOB_ID": "4100", "SLURM_PROCID": "3", "SLURM_NTASKS": "4"}
RESOLVE_CASES = [
    (
        {dist.COORDINATOR: "10.0.0.1:1234", dist.NUM_PROCESSES: "2", dist.PROCESS_ID: "1"},
        ("10.0.0.1:1234", 2, 1),
    ),
    # SLURM alone: the first host of the step's node list, the port derived from the job id (as JAX does)
    ({**SLURM, "SLURM_STEP_NODELIST": "node[01-03],gpu7"}, ("node01:61444", 4, 3)),
    # the step's node list wins over the job's; TLT_JAX_COORDINATOR_PORT sets the port
    (
        {**SLURM, "SLURM_STEP_NODELIST": "b2", "SLURM_JOB_NODELIST": "a1", dist.COORDINATOR_PORT: "5000"},
        ("b2:5000", 4, 3),
    ),
    ({**SLURM, "SLURM_JOB_NODELIST": "gpu7,gpu8"}, ("gpu7:61444", 4, 3)),
    # explicit variables override SLURM's, one by one
    (
        {**SLURM, "SLURM_STEP_NODELIST": "n1", dist.COORDINATOR: "head:99", dist.PROCESS_ID: "0"},
        ("head:99", 4, 0),
    ),
    # a host without a port gets TLT_JAX_COORDINATOR_PORT, else the default one
    (
        {
            dist.COORDINATOR: "node5",
            dist.COORDINATOR_PORT: "999",
            dist.NUM_PROCESSES: "1",
            dist.PROCESS_ID: "0",
        },
        ("node5:999", 1, 0),
    ),
    (
        {dist.COORDINATOR: "node5", dist.NUM_PROCESSES: "2", dist.PROCESS_ID: "0"},
        (f"node5:{dist.DEFAULT_PORT}", 2, 0),
    ),
]


@pytest.mark.parametrize("env,want", RESOLVE_CASES)
def test_resolve(env, want) -> None:
    spec = dist.resolve(env)
    assert (spec.coordinator, spec.num_processes, spec.process_id) == want
    assert spec.timeout_s == dist.DEFAULT_TIMEOUT_S


@pytest.mark.parametrize(
    "nodelist,host",
    [
        ("node[01-03],gpu7", "node01"),
        ("gpu7", "gpu7"),
        ("gpu7,gpu8", "gpu7"),
        ("node[007-010]", "node007"),
        ("node[3,5-6]", "node3"),
        ("a[3,5-6]-ib,b1", "a3-ib"),
        ("rack[1-2]n[3,4],x", "rack1n3"),
        (" host-1.cluster ", "host-1.cluster"),
    ],
)
def test_first_host_of_a_slurm_nodelist(nodelist, host) -> None:
    assert dist.first_host(nodelist) == host


def test_resolve_errors_name_the_variables_to_set() -> None:
    with pytest.raises(ValueError) as e:
        dist.resolve({})
    for name in (dist.COORDINATOR, dist.NUM_PROCESSES, dist.PROCESS_ID, "SLURM_PROCID", "SLURM_NTASKS"):
        assert name in str(e.value)
    # only what is missing is listed
    with pytest.raises(ValueError, match="missing this process's id") as e:
        dist.resolve({dist.COORDINATOR: "h:1", dist.NUM_PROCESSES: "2"})
    assert "the number of processes" not in str(e.value).split("missing")[1].split(". Set")[0]
    with pytest.raises(ValueError, match=r"process id 2 \(TLT_JAX_PROCESS_ID\) must be in 0..1"):
        dist.resolve({dist.COORDINATOR: "h:1", dist.NUM_PROCESSES: "2", dist.PROCESS_ID: "2"})
    with pytest.raises(ValueError, match="TLT_JAX_NUM_PROCESSES='two' is not an integer"):
        dist.resolve({dist.COORDINATOR: "h:1", dist.NUM_PROCESSES: "two", dist.PROCESS_ID: "0"})
    with pytest.raises(ValueError, match="cannot read a host name"):
        dist.resolve({"SLURM_STEP_NODELIST": "[", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"})
    spec = dist.resolve(
        {dist.COORDINATOR: "h:1", dist.NUM_PROCESSES: "2", dist.PROCESS_ID: "0", dist.INIT_TIMEOUT: "7"}
    )
    assert spec.timeout_s == 7
    # auto: JAX's cluster detection (a TPU VM slice) finds the three values at initialize
    spec = dist.resolve({dist.COORDINATOR: "auto", dist.INIT_TIMEOUT: "9"})
    assert (spec.coordinator, spec.timeout_s) == (dist.AUTO, 9)


def test_local_device_ids_one_process_per_gpu_or_all() -> None:
    """TLT_JAX_LOCAL_DEVICE_IDS: unset = every local device; a list; `localid` = SLURM_LOCALID's device (one
    process per GPU where every task sees the node's GPUs); malformed values name the variable."""
    slurm = {"SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NTASKS": "16", "SLURM_PROCID": "9"}
    assert dist.resolve(slurm).local_device_ids is None
    spec = dist.resolve({**slurm, "SLURM_LOCALID": "1", dist.LOCAL_DEVICE_IDS: "localid"})
    assert (spec.process_id, spec.local_device_ids) == (9, (1,))
    assert dist.resolve({**slurm, dist.LOCAL_DEVICE_IDS: "0, 2"}).local_device_ids == (0, 2)
    for bad in ("localid", "0,0", "gpu0", "-1"):
        with pytest.raises(ValueError, match=dist.LOCAL_DEVICE_IDS):
            dist.resolve({**slurm, dist.LOCAL_DEVICE_IDS: bad})


def test_detection_outside_a_cluster_is_a_clear_error() -> None:
    """TLT_JAX_COORDINATOR=auto where JAX detects no cluster (this CPU machine): the error names the
    variables to set instead (a subprocess: initialize is once per process)."""
    code = "from tlt_jax.utils import distributed; distributed.initialize()"
    env = {**clean_env(1), dist.COORDINATOR: "auto"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "TLT_JAX_COORDINATOR=auto: JAX's cluster detection could not start" in proc.stderr
    assert f"set {dist.COORDINATOR}=host:port, {dist.NUM_PROCESSES} and {dist.PROCESS_ID}" in proc.stderr


def test_single_process_refuses_an_explicit_process_count() -> None:
    with pytest.raises(ValueError, match="config.multiprocess=False"):
        dist.check_single_process({dist.NUM_PROCESSES: "2"})
    dist.check_single_process({dist.NUM_PROCESSES: "1"})
    dist.check_single_process({"SLURM_NTASKS": "4"})  # a SLURM allocation alone decides nothing
    dist.check_single_process({})


# ---- subprocesses ---------------------------------------------------------------------------------------
def clean_env(devices: int) -> dict[str, str]:
    """This environment without any launch variable, with `devices` fake CPU devices per process."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TLT_JAX_", "SLURM_", "JAX_COORDINATOR", "JAX_PROCESS", "JAX_NUM_PROCESSES"))
    }
    # as tests/conftest.py: the same programs, compiled in about a third of the default's time
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_FLAGS}"
    env["JAX_PLATFORMS"] = "cpu"
    env["WANDB_MODE"] = "disabled"
    env["JAX_COMPILATION_CACHE_DIR"] = str(ROOT / ".cache" / "jax_test_cache")  # as tests/conftest.py
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env[dist.INIT_TIMEOUT] = "60"
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    cmd: list[str], num: int, *, devices: int = 2, ids: list[int] | None = None, env: dict | None = None
) -> list[subprocess.Popen]:
    """Start processes `ids` (default all) of a `num`-process job running `cmd` (stdout/stderr piped)."""
    port, procs = free_port(), []
    for i in range(num) if ids is None else ids:
        penv = {**clean_env(devices), **(env or {})}
        penv.update(
            {dist.COORDINATOR: f"127.0.0.1:{port}", dist.NUM_PROCESSES: str(num), dist.PROCESS_ID: str(i)}
        )
        procs.append(
            subprocess.Popen(
                cmd, env=penv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float, what: str) -> list[subprocess.CompletedProcess]:
    """Wait for every process (all killed, and the test failed, past `timeout`)."""
    deadline, out = time.monotonic() + timeout, []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{what} did not finish within {timeout} s")
    return out


def launch(
    cmd: list[str], num: int, *, devices: int = 2, ids: list[int] | None = None, timeout: float = 300
) -> list[subprocess.CompletedProcess]:
    """Start processes `ids` (default all) of a `num`-process job running `cmd` and wait for all of them."""
    return wait_all(start(cmd, num, devices=devices, ids=ids), timeout, f"{cmd} in {num} processes")


def ok(procs: list[subprocess.CompletedProcess]) -> None:
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i}: exit {p.returncode}\n{p.stderr[-6000:]}"


def test_two_processes_see_four_devices_and_agree_on_a_psum() -> None:
    procs = launch([sys.executable, str(DRIVER)], 2, timeout=180)
    ok(procs)
    reports = [json.loads(p.stdout.split("RESULT ", 1)[1]) for p in procs]
    for i, r in enumerate(reports):
        assert r["process_index"] == r["spec_process_id"] == i
        assert r["process_count"] == 2 and r["device_count"] == 4 and r["local_device_count"] == 2
        assert r["mesh_shape"] == {"data": 4, "model": 1}
        assert r["sum"] == r["psum"] == 1 + 2 + 3 + 4  # both need the other process's shards
    assert reports[0]["local_shards"] == [1.0, 2.0] and reports[1]["local_shards"] == [3.0, 4.0]
    for r in reports:
        # tlt_jax.sharding's host helpers: the whole array from both processes' shards; a process-local value
        # (a typed key included) put on all 4 devices
        assert r["to_host"] == [1.0, 2.0, 3.0, 4.0]
        assert r["to_host_tree"] == {"x": [1.0, 2.0, 3.0, 4.0], "total": 10.0, "host": [1.0, 2.0, 3.0, 4.0]}
        put = r["put_global"]
        assert put["w"] == [0.0, 1.0, 2.0] and put["key"] == put["local_key"]
        assert put["devices"] == put["key_devices"] == 4
    # BEG-MAB with different measured speeds per process: both learn their mean and play the same arms (alone,
    # process 0 would have stayed on plain)
    assert reports[0]["bandit_played"] == reports[1]["bandit_played"]
    assert reports[0]["process_max"] == reports[1]["process_max"] == [13, 5]  # 3 vs 13, 5 vs 4
    assert reports[0]["bandit_rewards"] == reports[1]["bandit_rewards"]
    assert set(reports[0]["bandit_rewards"]) == {80.0, 100.0} and reports[0]["bandit_played"][-1] == "3_1_4"
    # rewards whose checker passes a row in process 0 and fails it in process 1 (a wall-clock timeout on one
    # side, #52 item 5): each row scored once, by process row % 2, both processes holding the same verdicts
    rewards = [r["rewards"] for r in reports]
    assert rewards[0] == rewards[1], rewards
    assert [row[2] for row in rewards[0]] == [i % 2 for i in range(7)]
    right = [True, False, True, True, True, False, True]  # texts vs 2, 4, 6 (multiprocess_driver.py)
    assert [row[:2] for row in rewards[0]] == [[float(r and i % 2 == 0)] * 2 for i, r in enumerate(right)]


@pytest.mark.parametrize("process_id", [1, pytest.param(0, marks=pytest.mark.extended)])
def test_a_process_whose_peers_never_come_exits_within_its_timeout(process_id) -> None:
    """Process 1 alone (no coordinator ever listens): a RuntimeError naming the coordinator. Process 0 alone
    (its peer never registers): JAX's client ends it after the timeout (a C++ fatal error, DEADLINE_EXCEEDED),
    after the line saying what it waited for. Neither hangs."""
    port, wait_s = free_port(), 5
    env = clean_env(2)
    env.update(
        {
            dist.COORDINATOR: f"127.0.0.1:{port}",
            dist.NUM_PROCESSES: "2",
            dist.PROCESS_ID: str(process_id),
            dist.INIT_TIMEOUT: str(wait_s),
        }
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(DRIVER)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    assert time.monotonic() - t0 < 60
    if process_id == 1:
        assert "jax.distributed.initialize failed for process 1 of 2" in proc.stderr, proc.stderr[-3000:]
        assert f"coordinator 127.0.0.1:{port}" in proc.stderr and "nothing accepts connections" in proc.stderr
    else:
        assert f"process 0 of 2 joining via 127.0.0.1:{port}" in proc.stderr, proc.stderr[-3000:]
        assert "DEADLINE_EXCEEDED" in proc.stderr


def test_multiprocess_without_launch_variables_is_a_clear_config_error(tmp_path) -> None:
    cmd = [sys.executable, "-m", "tlt_jax.main", "--config", str(ROOT / "configs" / "smoke.py")]
    cmd += ["--config.multiprocess=True", "--workdir", str(tmp_path)]
    proc = subprocess.run(cmd, env=clean_env(1), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for name in (dist.COORDINATOR, dist.NUM_PROCESSES, dist.PROCESS_ID, "SLURM_PROCID"):
        assert name in proc.stderr
    # and a process count without --config.multiprocess=True
    env = {**clean_env(1), dist.NUM_PROCESSES: "2"}
    proc = subprocess.run(cmd[:-3] + cmd[-2:], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "TLT_JAX_NUM_PROCESSES=2 but config.multiprocess=False" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.extended  # make test: idle devices on one process (test_spot_trainer.py), TLT across two here
def test_idle_devices_train_across_processes_as_on_one() -> None:
    """The spot trainer's `idle_devices` mode on a global 4-device data mesh: a rollout whose rows end at
    different steps, devices whose rows all ended training the drafter while the others decode (one SPMD
    program spanning both processes). 2 processes x 2 devices give the tokens, lengths, tick count and metrics
    of 1 process x 4 devices exactly, and its drafter parameters to float32 rounding
    (`tests/multiprocess_driver.py spot`)."""
    cmd = [sys.executable, str(DRIVER), "spot"]
    single = subprocess.run(cmd, env=clean_env(4), cwd=ROOT, capture_output=True, text=True, timeout=300)
    ok([single])
    procs = launch(cmd, 2, timeout=300)
    ok(procs)
    one, two = (json.loads(p.stdout.split("RESULT ", 1)[1]) for p in (single, procs[0]))
    assert (one["process_count"], two["process_count"]) == (1, 2) and one["device_count"] == two[
        "device_count"
    ]
    assert len(set(one["lengths"])) > 4, "rows should end at different steps"
    assert one["spot_steps"] > 0, "no device was idle while another decoded"
    assert two["tokens"] == one["tokens"] and two["lengths"] == one["lengths"]
    assert two["spot_steps"] == one["spot_steps"] and two["metrics"] == one["metrics"]
    # not bitwise: the drafter's gradient all-reduce spans the processes and sums in another order (measured
    # 2026-11-26: 2.4e-8 apart on a leaf sum of -0.0959), so its parameters agree to float32 rounding
    np.testing.assert_allclose(two["param_sums"], one["param_sums"], rtol=1e-5, atol=1e-6)


# ---- two processes equal one: TLT (GRPO and more) through `python -m tlt_jax.main` ----------------------
# Metrics that depend only on the computation (as tests/test_main.py), and the TLT ones.
DETERMINISTIC = ("reward/mean", "accuracy", "length/mean", "length/max", "loss/pg", "optim/grad_norm")
TLT_METRICS = ("spec/verify_rounds", "spec/accept_len", "spot/steps", "spot/drafter_step", "spot/loss")
# The same programs on the same global 4-device mesh: the cross-process all-reduces (gloo) could sum in
# another order than the in-process ones, but they do not; every leaf and metric is compared bitwise.
# TLT on the smoke model: n-gram speculative rollouts, a spot trainer training a fresh EAGLE drafter after
# each rollout, and the fixed selector: BEG-MAB's rewards are measured wall-clock speeds (the processes of one
# run learn their mean and agree, test_two_processes_see_four_devices_and_agree_on_a_psum; a run on one
# process measures others, so its choices could differ). The smoke model's rows all run to max_new_tokens,
# so no device goes idle here: test_idle_devices_train_across_processes_as_on_one runs that mode.
TLT = (
    "--config.spot.mode=after_rollout",
    "--config.spot.after_rollout_steps=2",
    *TINY_SPOT,
    "--config.bandit.algorithm=fixed",
    "--config.bandit.arms=('plain','3_1_4','ngram_3_1_4')",
    "--config.bandit.bucket_bounds=(4,8)",
    "--config.bandit.fixed_table=('3_1_4','ngram_3_1_4','ngram_3_1_4')",
)


def main_args(workdir: pathlib.Path, *overrides: str, config: str) -> list[str]:
    return ["--config", str(ROOT / "configs" / config), *overrides, "--workdir", str(workdir)]


def leaves(tree, path: str = "") -> dict[str, np.ndarray]:
    """Every array leaf by path (typed PRNG keys as their key data)."""
    import jax

    if isinstance(tree, dict):
        return {k: v for key in sorted(tree) for k, v in leaves(tree[key], f"{path}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, x in enumerate(tree) for k, v in leaves(x, f"{path}/{i}").items()}
    if tree is None:
        return {}
    if jax.dtypes.issubdtype(tree.dtype, jax.dtypes.prng_key):
        tree = jax.random.key_data(tree)
    return {path: np.asarray(tree)}


def restore_on_one_device(workdir: pathlib.Path, step: int, like=None) -> dict:
    """A run's checkpoint `step` restored onto one device (into `like`'s structure: without a target orbax
    refuses a checkpoint saved on another topology)."""
    import jax

    with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        if like is None:
            state, meta = ckpt.restore(step)
        else:
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), like)
            state, meta = ckpt.restore(step, target)
    assert meta["step"] == step
    return state


def assert_same_state(a: dict, b: dict, what: str) -> None:
    """All of the state but the selector's rewards, which are measured speeds (wall clock): integer leaves
    (steps, rng, counters) bitwise; float leaves within float32 rounding, because the update's gradient sums
    over rows sharded across the data axis add in another order across processes (measured after 2 steps:
    AdamW moments 1.5e-7 relative apart, parameters up to 8.5e-7 absolute where Adam divides a near-zero
    gradient by its near-zero second moment, on weights of ~1e-2; tokens, rewards, SD metrics: bitwise)."""
    la = {k: v for k, v in leaves(a).items() if not k.startswith("/bandit/state/")}
    lb = {k: v for k, v in leaves(b).items() if not k.startswith("/bandit/state/")}
    assert la.keys() == lb.keys() and any(k.startswith("/params/") for k in la)
    for k in la:
        x, y = np.asarray(la[k]), np.asarray(lb[k])
        if np.issubdtype(x.dtype, np.floating):
            # <= 0.1% of the entries may be Adam steps whose direction the rounding decided (one measured:
            # 2.3e-5 on a weight of 1.3e-2), none further apart than opposite steps at both steps (4 x lr)
            off = ~np.isclose(x, y, rtol=1e-5, atol=2e-6)
            assert off.mean() <= 1e-3, f"{what}: {k}: {off.sum()} of {off.size} entries differ"
            np.testing.assert_allclose(x, y, rtol=0, atol=4 * 0.01, err_msg=f"{what}: {k}")
        else:
            np.testing.assert_array_equal(x, y, err_msg=f"{what}: {k} (bitwise)")


# Metrics that are sums over the update's rows, which are sharded over the data axis: across processes the
# all-reduce adds them in another order than on one process, so they agree to rounding, not bit for bit
# (measured: loss/pg 7.5e-9 vs 0.0 at step 2); the state they update is compared bitwise below.
REDUCED = ("loss/pg", "optim/grad_norm")


def assert_same_metrics(one: pathlib.Path, other: pathlib.Path, steps: int, metrics: tuple[str, ...]) -> None:
    """Each step logged exactly once in both runs, with equal values: bitwise, but for the cross-device sums
    in REDUCED (within float32 rounding of their scale)."""
    ma, mb = read_metrics(one / "metrics.jsonl"), read_metrics(other / "metrics.jsonl")
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == list(range(1, steps + 1))
    for ra, rb in zip(ma, mb, strict=True):
        chosen = tuple(k for k in ra if k.startswith("bandit/") and k.endswith(("/chosen", "/count")))
        for k in metrics + chosen:
            if k in REDUCED:
                np.testing.assert_allclose(ra[k], rb[k], rtol=1e-5, atol=1e-7, err_msg=f"{other.name} {k}")
            else:
                assert ra[k] == rb[k], (other.name, ra["step"], k)  # bitwise (JSON floats round-trip exactly)


def wait_for_step(
    workdir: pathlib.Path, step: int, procs: list[subprocess.Popen], timeout: float = 300
) -> None:
    """Until checkpoint `step` is finalised and its metrics line written (failing if the run ends first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = workdir / "metrics.jsonl"
        logged = metrics.exists() and any(m["step"] == step for m in read_metrics(metrics))
        if logged and (workdir / "checkpoints" / str(step)).is_dir():
            return
        assert all(p.poll() is None for p in procs), "the run ended before it could be killed"
        time.sleep(0.05)
    pytest.fail(f"no checkpoint {step} in {workdir} within {timeout} s")


MAIN = [sys.executable, "-m", "tlt_jax.main"]
MP = "--config.multiprocess=True"
JAX_PEER_DIED = "JAX distributed service detected fatal errors. This most likely indicates that another task"
HEARTBEAT_S = 10  # TLT_JAX_HEARTBEAT_TIMEOUT of the 2-process runs: how long a dead peer goes unnoticed


def one_process(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        MAIN + args, env=clean_env(4), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def killed_after_step_one(workdir: pathlib.Path, args: list[str]) -> None:
    """1 process x 4 devices, SIGKILLed once step 1's checkpoint and metrics line are written. The phase file
    it leaves may already say step 2's rollout: it is removed, so that the next launch's watcher waits for
    that launch's own phases."""
    proc = one_process(args)
    wait_for_step(workdir, 1, [proc])
    proc.kill()
    proc.communicate(timeout=60)
    assert not (workdir / "checkpoints" / "2").exists()
    (workdir / PHASE_FILE).unlink(missing_ok=True)


def peer_dies_then_resumed_on_one(workdir: pathlib.Path, args: list[str]) -> None:
    """2 processes x 2 devices; process 1 SIGKILLed after step 1's checkpoint: process 0 must exit within
    the heartbeat bound with the error saying what happened and how to resume; relaunched as 1 process."""
    procs = start(MAIN + [*args[:-2], MP, *args[-2:]], 2, env={dist.HEARTBEAT_TIMEOUT: str(HEARTBEAT_S)})
    wait_for_step(workdir, 1, procs)
    procs[1].kill()
    t0 = time.monotonic()
    survivor = wait_all(procs[:1], HEARTBEAT_S + 50, "process 0 after its peer died")[0]
    assert time.monotonic() - t0 < HEARTBEAT_S + 50
    procs[1].communicate(timeout=60)
    assert survivor.returncode != 0 and not (workdir / "checkpoints" / "2").exists()
    # Either a collective fails in Python first (gloo: connection reset) and tlt_jax says what to do, or the
    # process is blocked on a device and JAX's coordination service ends it after the heartbeat timeout
    ours = "error: process 0 of 2: a cross-process operation failed" in survivor.stderr
    assert ours or JAX_PEER_DIED in survivor.stderr, survivor.stderr[-3000:]
    assert not ours or "Relaunch all 2 processes with the same command" in survivor.stderr
    proc = one_process(args)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-6000:]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> pathlib.Path:
    """3 steps of TLT on the smoke config, 1 process x 4 devices, uninterrupted, a checkpoint after each step:
    the run the interrupted ones below must equal."""
    workdir = tmp_path_factory.mktemp("one")
    proc = one_process(main_args(workdir, *TLT, EVERY_STEP, config=CONFIG))
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-6000:]
    return workdir


CONFIG = "smoke.py:steps=3,spec=true"
EVERY_STEP = "--config.checkpoint_every=1"


@pytest.mark.slow
@pytest.mark.extended  # make test's SIGTERM chain below also resumes a 2-process checkpoint on 1 process
def test_a_dead_peer_costs_only_the_steps_since_the_last_checkpoint(tmp_path, reference_run) -> None:
    """2 processes whose process 1 dies after step 1: process 0 exits, bounded, saying so; resumed as 1
    process, the run equals the uninterrupted one (`reference_run`), step 1 having run on two processes."""
    workdir = tmp_path / "b"
    peer_dies_then_resumed_on_one(workdir, main_args(workdir, *TLT, EVERY_STEP, config=CONFIG))
    assert_same_as_reference(reference_run, [workdir])


def assert_same_as_reference(reference: pathlib.Path, runs: Iterable[pathlib.Path]) -> None:
    """Every step's metrics (once each) and checkpoints of `runs` equal the reference run's."""
    steps = len(read_metrics(reference / "metrics.jsonl"))
    for run in runs:
        assert_same_metrics(reference, run, steps, DETERMINISTIC + TLT_METRICS)
    for step in range(1, steps + 1):
        want = restore_on_one_device(reference, step)
        for run in runs:
            assert_same_state(want, restore_on_one_device(run, step, want), f"run {run.name} step {step}")


# ---- preemption: SIGTERM to one process of two (#47 item 3) ---------------------------------------------
STOP_WITHIN_S = 120  # --config.stop_within of the runs stopped below: each must end within it, cleanly
# (phase the signal is sent in, step) -> what both processes must agree on: the stop's kind and where
STOP_TARGETS = (
    (("rollout", 2), ("abandoned", ("rollout chunk",))),  # mid-rollout: the next chunk boundary
    (("update", 2), ("abandoned", ("update start", "update part"))),  # mid-update: a part (or its start)
    (("checkpoint", 2), ("stopped after", ("",))),  # during step 2's save: the point before step 3
)
STOPPED = re.compile(
    r"^W\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*stop agreed by every process"
    r"(?: at (?P<where>.+?) of step (?P<step>\d+): step \d+ abandoned|: stopped after step (?P<after>\d+))",
    re.M,
)
RECEIVED = re.compile(r"^W\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*received SIGTERM", re.M)


def stop_point(stderr: str) -> tuple[str, str, int, float]:
    """(kind, where, step, the line's time of day in s) of the stop a process logged."""
    m = STOPPED.search(stderr)
    assert m is not None, stderr[-4000:]
    t = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    if m.group("after"):
        return "stopped after", "", int(m.group("after")), t
    return "abandoned", m.group("where"), int(m.group("step")), t


def stop_one_of_two(
    workdir: pathlib.Path, args: list[str], phase: str, step: int, expect: tuple[str, tuple[str, ...]]
) -> dict[str, float | str]:
    """2 processes; SIGTERM to process 1 alone once process 0's phase file says `step phase`. Both must
    exit with EXIT_STOPPED (75) within STOP_WITHIN_S at the same agreed point, of kind `expect[0]` at one of
    `expect[1]`; returns the seconds from the signal to the agreement (process 1's log) and to both
    processes' exit, and the CPU seconds of the two processes."""
    cmd = MAIN + [*args[:-2], MP, f"--config.stop_within={STOP_WITHIN_S}", *args[-2:]]
    procs = start(cmd, 2)
    deadline = time.monotonic() + 600
    while read_phase(workdir) != (step, phase):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            pytest.fail(
                f"the run ended or stalled before phase {phase} of step {step}: {read_phase(workdir)}"
            )
        time.sleep(0.002)
    t0, cpu0 = time.monotonic(), children_cpu_s()
    procs[1].send_signal(signal.SIGTERM)
    outs = wait_all(procs, STOP_WITHIN_S + 60, f"the stop at {phase} of step {step}")
    exited = time.monotonic() - t0
    for i, p in enumerate(outs):  # EXIT_STOPPED (75) for both: a clean, agreed stop, to be requeued
        assert p.returncode == EXIT_STOPPED, f"process {i}: exit {p.returncode}\n{p.stderr[-6000:]}"
    assert exited < STOP_WITHIN_S, f"the stop took {exited:.1f} s"
    assert "received SIGTERM" in outs[1].stderr and "received SIGTERM" not in outs[0].stderr
    assert "another process received a stop request" in outs[0].stderr
    points = [stop_point(p.stderr) for p in outs]
    assert points[0][:3] == points[1][:3], points  # the same point in both processes
    assert points[0][0] == expect[0] and points[0][1] in expect[1], (phase, points[0])
    assert all("job grpo: preempted" in p.stderr for p in outs)
    m = RECEIVED.search(outs[1].stderr)
    received = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    seconds = {"agreed_s": points[1][3] - received, "exited_s": exited, "cpu_s": children_cpu_s() - cpu0}
    return {**seconds, "where": points[0][1] or "between steps"}


@pytest.mark.slow
def test_two_processes_equal_one_through_a_kill_and_three_stops(tmp_path, reference_run) -> None:
    """One chained run of 3 steps of TLT on the smoke config (GRPO with n-gram SD rollouts, the spot trainer,
    the fixed selector) through `python -m tlt_jax.main`, on the reference's 4-device mesh, relaunched after
    each interruption with the same command:

    1. 1 process x 4 devices, SIGKILLed after step 1's checkpoint;
    2. 2 processes x 2 devices from that checkpoint (it crosses from 1 process to 2), SIGTERM to process 1
       alone in step 2's rollout (both abandon the step at the next chunk boundary, nothing saved), then in
       step 2's update (abandoned at an update part boundary), then during step 2's checkpoint (both stop
       before step 3, step 2 saved: a step run on two processes); each time both exit 75 (stopped) within
       `stop_within` at the same point;
    3. 1 process x 4 devices runs step 3 (the 2-process checkpoint crosses back).

    Every step logged once; rewards, losses, SD and spot metrics and every checkpoint (policy, optimizer,
    spot-trained drafter, rng) equal the uninterrupted run's (`reference_run`; floats to float32 rounding:
    `assert_same_state`): the abandoned steps were redone bit-identically. Process 1 compiles every program
    at each launch (JAX writes the persistent cache from process 0 only, and on CPU the keys differ per
    process): one chain instead of a 1 -> 2 -> 1 run beside a stop chain saves a 2-process launch."""
    workdir = tmp_path / "chain"
    args = main_args(workdir, *TLT, EVERY_STEP, config=CONFIG)
    killed_after_step_one(workdir, args)
    latency, cpu0 = {}, children_cpu_s()
    for (phase, step), expect in STOP_TARGETS:
        latency[phase] = stop_one_of_two(workdir, args, phase, step, expect)
        saved = [1, 2] if phase == "checkpoint" else [1]
        logged = read_metrics(workdir / "metrics.jsonl")
        assert [m["step"] for m in logged] == saved and leftovers(workdir) == [], phase
        with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
            assert ckpt.all_steps() == saved, phase
    two = read_metrics(workdir / "metrics.jsonl")[-1]  # step 2, run on two processes
    assert two["spot/drafter_step"] > 0 and two["spec/verify_rounds"] > 0
    proc = one_process(args)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-6000:]
    assert_same_as_reference(reference_run, [workdir])
    assert leftovers(workdir) == []
    parts = " ".join(
        f"{k}={v['agreed_s']:.2f}/{v['exited_s']:.1f}/{v['cpu_s']:.0f}({v['where']})"
        for k, v in latency.items()
    )
    print(
        f"RESULT stop_latency_s {parts} (signal -> agreed in process 1 / -> both exited / the launch's "
        f"CPU s); processes' CPU in all {children_cpu_s() - cpu0:.0f} s"
    )


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished children (the launched runs)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# the same stops once the programs are compiled (each launch's first step compiles them in process 1), for
# docs/benchmarks.md: ((phase, step), expected stop) per launch of one 6-step run, in order
STEADY_TARGETS = (
    (("rollout", 4), ("abandoned", ("rollout chunk",))),
    (("update", 5), ("abandoned", ("update start", "update part"))),  # resumed from 3
    (("checkpoint", 5), ("stopped after", ("",))),  # resumed from 4
)


@pytest.mark.experiments
def test_stop_latency_after_compilation(tmp_path) -> None:
    """Measurement, not in `make test` (`pytest -m experiments -s tests/test_multiprocess.py -k latency`): the
    stops of the test above in steps whose programs process 1 has compiled in the same launch, and what one
    agreement point costs on CPU (gloo), from process 0's `stop/check_s` / `stop/checks` of every step after
    a launch's first."""
    workdir = tmp_path / "steady"
    args = main_args(workdir, *TLT, EVERY_STEP, config="smoke.py:steps=6,spec=true")
    latency = {}
    for (phase, step), expect in STEADY_TARGETS:
        latency[f"{phase}@{step}"] = stop_one_of_two(workdir, args, phase, step, expect)
    rows = read_metrics(workdir / "metrics.jsonl")
    firsts = {1, 4, 5}  # each launch's first step (from scratch, resumed from checkpoints 3 and 4)
    steady = [r for r in rows if r["step"] not in firsts]
    per_check_ms = 1e3 * sum(r["stop/check_s"] for r in steady) / sum(r["stop/checks"] for r in steady)
    parts = " ".join(f"{k}={v['agreed_s']:.2f}/{v['exited_s']:.1f}({v['where']})" for k, v in latency.items())
    print(
        f"RESULT stop_latency_s {parts} (signal -> agreed in process 1 / -> both exited); agreement "
        f"{per_check_ms:.1f} ms x {steady[0]['stop/checks']:.0f} per step, steps "
        f"{[round(r['time/step'], 2) for r in steady]} s"
    )
