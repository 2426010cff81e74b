"""Several processes, one program: the launch path of a multi-process (multi-host) run.

JAX's own distributed runtime does the work: every process calls `jax.distributed.initialize` with the
coordinator's address (process 0's host and a port), the number of processes and its own id, then sees the
devices of all processes in `jax.devices()`; the mesh built from them (config_lib.build_mesh) is global and
every jitted program runs SPMD across the processes. This module only finds those three values and calls it:

  explicit   TLT_JAX_COORDINATOR=host:port  TLT_JAX_NUM_PROCESSES=N  TLT_JAX_PROCESS_ID=i   (any launcher)
  SLURM      SLURM_PROCID, SLURM_NTASKS, and the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST)
             as the coordinator, on port TLT_JAX_COORDINATOR_PORT (default: derived from SLURM_JOB_ID, as
             JAX's own SLURM detection does, so that every task of a job picks the same one)
  auto       TLT_JAX_COORDINATOR=auto: JAX's own cluster detection finds all three (a Cloud TPU VM slice
             from its metadata server; also SLURM, Open MPI, Kubernetes jobsets)

Which local devices a process drives: all it sees (one process per host with all its GPUs), unless
TLT_JAX_LOCAL_DEVICE_IDS names them: a comma list ("0,1"), or `localid` for one device per process, the
one numbered SLURM_LOCALID (srun --ntasks-per-node=8 where every task sees all 8 GPUs).

Each value comes from its explicit variable when set, else from SLURM's. TLT_JAX_INIT_TIMEOUT (seconds,
default 120) bounds the wait for the peers: a process whose peers never come fails with an error naming the
coordinator and the process count instead of hanging. TLT_JAX_HEARTBEAT_TIMEOUT (seconds, default 100, JAX's)
bounds a run whose peer dies: JAX's coordination service declares it dead after that long without a heartbeat
and ends every other process (which then resume from the last checkpoint when relaunched). On CPU the
cross-process collectives are gloo's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

COORDINATOR = "TLT_JAX_COORDINATOR"
NUM_PROCESSES = "TLT_JAX_NUM_PROCESSES"
PROCESS_ID = "TLT_JAX_PROCESS_ID"
COORDINATOR_PORT = "TLT_JAX_COORDINATOR_PORT"
INIT_TIMEOUT = "TLT_JAX_INIT_TIMEOUT"
HEARTBEAT_TIMEOUT = "TLT_JAX_HEARTBEAT_TIMEOUT"
LOCAL_DEVICE_IDS = "TLT_JAX_LOCAL_DEVICE_IDS"
ENV_VARS = (
    COORDINATOR,
    NUM_PROCESSES,
    PROCESS_ID,
    COORDINATOR_PORT,
    INIT_TIMEOUT,
    HEARTBEAT_TIMEOUT,
    LOCAL_DEVICE_IDS,
)

SLURM_PROCID = "SLURM_PROCID"
SLURM_NTASKS = "SLURM_NTASKS"
SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_LOCALID = "SLURM_LOCALID"

AUTO = "auto"  # TLT_JAX_COORDINATOR=auto: JAX's cluster detection
DEFAULT_TIMEOUT_S = 120
DEFAULT_HEARTBEAT_S = 100
DEFAULT_PORT = 61_234  # a host without a port, and neither TLT_JAX_COORDINATOR_PORT nor SLURM_JOB_ID set


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """Where process 0 listens, how many processes there are, which one this is, and where each came from."""

    coordinator: str
    num_processes: int
    process_id: int
    timeout_s: int = DEFAULT_TIMEOUT_S
    source: str = ""
    heartbeat_s: int = DEFAULT_HEARTBEAT_S
    local_device_ids: tuple[int, ...] | None = None  # None: every local device


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'node[01-03],gpu7' -> 'node01', 'gpu7,gpu8' -> 'gpu7',
    'a[3,5-6]-ib' -> 'a3-ib' (zero padding kept: it is part of the name)."""
    text = nodelist.strip()
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\]((?:[^,\[]|\[[^\]]*\])*))?", text)
    if not text or m is None or not (m.group(1) or m.group(2)):
        raise ValueError(f"cannot read a host name from the SLURM node list {nodelist!r}")
    prefix, ranges, suffix = m.group(1), m.group(2), m.group(3) or ""
    if ranges is None:
        return prefix
    if "[" in suffix:  # several bracket groups: 'rack[1-2]n[3-4]' -> 'rack1n3'
        suffix = first_host(suffix)
    first = re.split(r"[,-]", ranges.strip(), maxsplit=1)[0].strip()
    if not first:
        raise ValueError(f"cannot read a host name from the SLURM node list {nodelist!r}")
    return f"{prefix}{first}{suffix}"


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name].strip()
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not an integer.") from None


def _port(env: Mapping[str, str]) -> int:
    if env.get(COORDINATOR_PORT, "").strip():
        return _int(env, COORDINATOR_PORT)
    if env.get(SLURM_JOB_ID, "").strip().isdigit():  # the same port in every task of the job, as JAX picks
        return int(env[SLURM_JOB_ID]) % 2**12 + (65535 - 2**12 + 1)
    return DEFAULT_PORT


def _coordinator(env: Mapping[str, str]) -> tuple[str | None, str]:
    explicit = env.get(COORDINATOR, "").strip()
    if explicit:
        if ":" not in explicit.rsplit("]", 1)[-1]:  # a host alone ('node01', '[::1]'): add the port
            return f"{explicit}:{_port(env)}", COORDINATOR
        return explicit, COORDINATOR
    for name in SLURM_NODELISTS:
        if env.get(name, "").strip():
            return f"{first_host(env[name])}:{_port(env)}", name
    return None, ""


def _count_and_id(env: Mapping[str, str]) -> tuple[int | None, str, int | None, str]:
    count = count_src = pid = pid_src = None
    for name in (NUM_PROCESSES, SLURM_NTASKS):
        if env.get(name, "").strip():
            count, count_src = _int(env, name), name
            break
    for name in (PROCESS_ID, SLURM_PROCID):
        if env.get(name, "").strip():
            pid, pid_src = _int(env, name), name
            break
    return count, count_src or "", pid, pid_src or ""


def local_device_ids(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """TLT_JAX_LOCAL_DEVICE_IDS: None (unset: every local device), a comma list, or `localid` (the one device
    SLURM_LOCALID numbers). A malformed value is a ValueError naming the variable and its forms."""
    raw = env.get(LOCAL_DEVICE_IDS, "").strip()
    if not raw:
        return None
    forms = f"{LOCAL_DEVICE_IDS}={raw!r}: use a comma list of local device ids (0,1) or 'localid'"
    if raw == "localid":
        if not env.get(SLURM_LOCALID, "").strip().isdigit():
            raise ValueError(f"{forms}; 'localid' needs {SLURM_LOCALID} (set by srun in every task).")
        return (int(env[SLURM_LOCALID]),)
    parts = [p.strip() for p in raw.split(",")]
    if not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
        raise ValueError(f"{forms} (distinct non-negative integers).")
    return tuple(int(p) for p in parts)


def resolve(env: Mapping[str, str] | None = None) -> ProcessSpec:
    """The process layout from `env` (default os.environ): explicit TLT_JAX_* variables first, then SLURM's.
    Raises one ValueError naming every missing or inconsistent value and the variables that set it."""
    env = os.environ if env is None else env
    timeout = _int(env, INIT_TIMEOUT) if env.get(INIT_TIMEOUT, "").strip() else DEFAULT_TIMEOUT_S
    beat = _int(env, HEARTBEAT_TIMEOUT) if env.get(HEARTBEAT_TIMEOUT, "").strip() else DEFAULT_HEARTBEAT_S
    for name, value in ((INIT_TIMEOUT, timeout), (HEARTBEAT_TIMEOUT, beat)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1 second.")
    devices = local_device_ids(env)
    if env.get(COORDINATOR, "").strip() == AUTO:  # count and id are known once initialized
        return ProcessSpec(AUTO, 0, 0, timeout, "JAX's cluster detection", beat, devices)
    coordinator, coord_src = _coordinator(env)
    count, count_src, pid, pid_src = _count_and_id(env)
    missing = []
    if coordinator is None:
        missing.append(f"the coordinator address ({COORDINATOR}=host:port, or SLURM's SLURM_STEP_NODELIST)")
    if count is None:
        missing.append(f"the number of processes ({NUM_PROCESSES}, or SLURM's {SLURM_NTASKS})")
    if pid is None:
        missing.append(f"this process's id ({PROCESS_ID}, or SLURM's {SLURM_PROCID})")
    if missing:
        raise ValueError(
            "config.multiprocess=True but the distributed launch is not fully described: missing "
            + "; ".join(missing)
            + f". Set {COORDINATOR}=<host of process 0>:<free port>, {NUM_PROCESSES}=N and "
            f"{PROCESS_ID}=0..N-1 in every process (or launch with srun, which sets SLURM_PROCID, "
            "SLURM_NTASKS and SLURM_STEP_NODELIST), or run one process with config.multiprocess=False."
        )
    assert coordinator is not None and count is not None and pid is not None
    if count < 1 or not 0 <= pid < count:
        raise ValueError(
            f"process id {pid} ({pid_src}) must be in 0..{count - 1} for {count} processes ({count_src})."
        )
    return ProcessSpec(
        coordinator=coordinator,
        num_processes=count,
        process_id=pid,
        timeout_s=timeout,
        source=f"coordinator from {coord_src}, count from {count_src}, id from {pid_src}",
        heartbeat_s=beat,
        local_device_ids=devices,
    )


def check_single_process(env: Mapping[str, str] | None = None) -> None:
    """A run with config.multiprocess=False refuses an explicit TLT_JAX_NUM_PROCESSES > 1: N independent
    copies of the run would write the same workdir."""
    env = os.environ if env is None else env
    if env.get(NUM_PROCESSES, "").strip() and _int(env, NUM_PROCESSES) > 1:
        raise ValueError(
            f"{NUM_PROCESSES}={env[NUM_PROCESSES]} but config.multiprocess=False: pass "
            f"--config.multiprocess=True to run as one of {env[NUM_PROCESSES]} processes, or unset it."
        )


def _failure(spec: ProcessSpec, what: str) -> str:
    return (
        f"jax.distributed.initialize failed for process {spec.process_id} of {spec.num_processes} "
        f"(coordinator {spec.coordinator}; {spec.source}) within {spec.timeout_s} s: {what}. Start all "
        f"{spec.num_processes} processes with the same coordinator address (process 0's host, a free port) "
        f"and distinct ids; {INIT_TIMEOUT} sets the wait."
    )


def wait_for_coordinator(spec: ProcessSpec, poll_s: float = 0.25) -> None:
    """Processes other than 0: wait (up to the timeout) until process 0's coordinator port accepts TCP
    connections; a RuntimeError otherwise. JAX's own client aborts the process (a C++ fatal error, no Python
    exception) when it cannot register in time, so this check gives the clear error for the common case: a
    wrong address, or process 0 not started."""
    host, port = spec.coordinator.rsplit(":", 1)
    host = host.strip("[]")
    deadline = time.monotonic() + spec.timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(2.0, spec.timeout_s))):
                return
        except OSError as e:
            if time.monotonic() + poll_s > deadline:
                raise RuntimeError(
                    _failure(spec, f"nothing accepts connections at the coordinator ({e})")
                ) from e
            time.sleep(poll_s)


def initialize(env: Mapping[str, str] | None = None) -> ProcessSpec:
    """Resolve the layout and call `jax.distributed.initialize` (before anything touches a device). Cluster
    auto-detection is off: the values are exactly the resolved ones. A process other than 0 whose coordinator
    never opens fails with a RuntimeError naming it; when the coordinator is up but some peers never register,
    JAX's client ends the process after the timeout (DEADLINE_EXCEEDED in RegisterTask, preceded by the line
    this function writes to stderr saying what it waits for)."""
    import jax

    spec = resolve(env)
    if spec.coordinator == AUTO:
        return _initialize_detected(spec)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process collectives on CPU
    if spec.process_id != 0:
        wait_for_coordinator(spec)
    print(
        f"tlt_jax.utils.distributed: process {spec.process_id} of {spec.num_processes} joining via "
        f"{spec.coordinator} ({spec.source}); waiting up to {spec.timeout_s} s ({INIT_TIMEOUT}) for all "
        f"{spec.num_processes} processes",
        file=sys.stderr,
        flush=True,
    )
    try:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            cluster_detection_method="deactivate",
            initialization_timeout=spec.timeout_s,
            heartbeat_timeout_seconds=spec.heartbeat_s,
            shutdown_timeout_seconds=spec.timeout_s,
            local_device_ids=None if spec.local_device_ids is None else list(spec.local_device_ids),
        )
    except Exception as e:  # the runtime's own errors (DEADLINE_EXCEEDED, UNAVAILABLE) name no remedy
        raise RuntimeError(_failure(spec, str(e))) from e
    return spec


def _initialize_detected(spec: ProcessSpec) -> ProcessSpec:
    """TLT_JAX_COORDINATOR=auto: `jax.distributed.initialize()` with JAX's cluster detection (on a TPU VM
    slice every host learns the coordinator, the host count and its id from the TPU metadata)."""
    import jax

    try:
        jax.distributed.initialize(
            initialization_timeout=spec.timeout_s,
            heartbeat_timeout_seconds=spec.heartbeat_s,
            shutdown_timeout_seconds=spec.timeout_s,
            local_device_ids=None if spec.local_device_ids is None else list(spec.local_device_ids),
        )
    except Exception as e:
        raise RuntimeError(
            f"{COORDINATOR}=auto: JAX's cluster detection could not start the distributed runtime ({e}). "
            f"It works on a Cloud TPU VM slice and under SLURM/Open MPI/Kubernetes; elsewhere set "
            f"{COORDINATOR}=host:port, {NUM_PROCESSES} and {PROCESS_ID}."
        ) from e
    return dataclasses.replace(spec, num_processes=jax.process_count(), process_id=jax.process_index())


PEER_SIGNS = ("Gloo", "Connection reset by peer", "Connection closed by peer", "heartbeat", "UNAVAILABLE")


def peer_failure_message(error: BaseException, process_id: int, num_processes: int) -> str | None:
    """What to tell the operator when a run of several processes fails in a cross-process step (a collective
    or the coordination service: a peer died, was preempted or hangs), or None for other errors. The
    process exits either way; JAX's coordination service ends it within TLT_JAX_HEARTBEAT_TIMEOUT."""
    text = f"{type(error).__name__}: {error}"
    if num_processes < 2 or not any(sign in text for sign in PEER_SIGNS):
        return None
    return (
        f"process {process_id} of {num_processes}: a cross-process operation failed, most likely because "
        f"another process died or was preempted ({text.splitlines()[0][:300]}). This process exits too. "
        f"Relaunch all {num_processes} processes with the same command: the run resumes from its last "
        "complete checkpoint."
    )


# ---- host values shared across processes -------------------------------------------------------------------
@functools.cache
def _gather_program() -> tuple[Any, Any]:
    """(the [devices, ...] sharding over every global device, the jitted all-gather to a replicated copy)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()), ("all",))
    return NamedSharding(mesh, P("all")), jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))


def _gather_rows(row: Any) -> list[Any]:
    """Every process's `row` (a numpy array of one shape and dtype in all of them), in process order: each
    device holds its process's row, gathered by one jitted program over every global device (gloo on CPU,
    NCCL on GPU), as `tlt_jax.utils.preemption.process_max` reduces."""
    import jax
    import numpy as np

    sharding, gather = _gather_program()
    x = jax.make_array_from_callback((jax.device_count(), *row.shape), sharding, lambda idx: row[None])
    rows = np.asarray(gather(x).addressable_data(0))
    first = {}
    for d, device in enumerate(jax.devices()):
        first.setdefault(device.process_index, d)
    return [rows[first[p]] for p in range(jax.process_count())]


def allgather_json(value: Any) -> list[Any]:
    """Every process's `value` (JSON: numbers, strings, lists, dicts, None), in process order; every process
    must call it at the same point (two collectives). One process: [value], nothing run. Floats round-trip
    exactly (JSON writes their repr); the bytes are padded to a power of two so few programs compile."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return [value]
    data = json.dumps(value, default=_json_number).encode()
    lengths = [int(n[0]) for n in _gather_rows(np.asarray([len(data)], np.int32))]
    padded = np.zeros((1 << max(max(lengths) - 1, 0).bit_length(),), np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    rows = _gather_rows(padded)
    return [json.loads(bytes(r[:n]).decode()) for r, n in zip(rows, lengths, strict=True)]


def _json_number(x: Any) -> Any:
    """numpy scalars (a reward function's np.float32) as Python numbers."""
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")
