"""A real one-node Slurm for the tests in this folder: Debian's slurm-wlm and munge, installed by `make
test-slurm` (tests/slurm/setup.sh) and started here under a temporary directory.

`Cluster.start(root)` writes a munge key and a slurm.conf into `root` (one CPU node: this machine's CPUs and
memory from `slurmd -C`; cons_tres; preemption by partition priority with REQUEUE; short KillWait; the state,
spool, logs and sockets under `root`), starts munged, slurmctld and slurmd on localhost and waits until the
node is idle. `Cluster.stop()` ends exactly the daemons it started, by their pids (TERM, then KILL). The
clients find the conf through SLURM_CONF (`Cluster.env`); nothing under /etc is read or written.
No accounting database: a job's state comes from `scontrol show job` and its log.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

DAEMONS = ("munged", "slurmctld", "slurmd")
PID_FILE = "daemons.pid"  # the pids this process started, removed once they are stopped
# a requeued job waits this long before it may start again (the step credentials' lifetime; 120 s by default)
CRED_EXPIRE_S = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_line() -> str:
    """`slurmd -C`'s NodeName line (this machine's real CPUs, sockets, cores and memory)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    (line,) = [x for x in out.splitlines() if x.startswith("NodeName=")]
    return line


def slurm_conf(root: pathlib.Path, node: str, ports: tuple[int, int]) -> str:
    """One node `node` (slurmd -C's line) in two partitions of one node: `batch` (the jobs under test) and
    `urgent` (a higher PriorityTier: its jobs preempt `batch`'s by requeueing them)."""
    name = re.match(r"NodeName=(\S+)", node).group(1)
    fields = " ".join(f for f in node.split()[1:] if not f.startswith("UpTime"))
    return f"""\
ClusterName=tltci
SlurmctldHost={name}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.sock,cred_expire={CRED_EXPIRE_S}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
KillWait=5
MinJobAge=3600
ReturnToService=2
InactiveLimit=0
Waittime=0
MessageTimeout=20
NodeName={name} NodeAddr=127.0.0.1 {fields} State=UNKNOWN
PartitionName=batch Nodes={name} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 OverSubscribe=NO
PartitionName=urgent Nodes={name} MaxTime=INFINITE State=UP PriorityTier=10 OverSubscribe=NO
"""


@dataclass
class Cluster:
    root: pathlib.Path
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, scontrol, ...) needs beside this environment: the conf's path."""
        return {"SLURM_CONF": str(self.root / "slurm.conf")}

    def start(self, timeout: float = 60) -> None:
        """Key, conf, then munged, slurmctld, slurmd (each foreground, a child of this process, its pid kept)
        until the node answers idle. On any failure the started daemons are stopped and the logs quoted."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)  # munged refuses a socket directory others can write
        for d in ("state", "spool"):
            (self.root / d).mkdir(exist_ok=True)
        key = self.root / "munge.key"
        subprocess.run(["mungekey", "-c", "-f", "-b", "1024", "-k", str(key)], check=True)
        key.chmod(0o400)
        conf = self.root / "slurm.conf"
        conf.write_text(slurm_conf(self.root, node_line(), (free_port(), free_port())))
        env = {**os.environ, **self.env}
        r = self.root
        commands = {
            "munged": [
                "munged", "-F", "-f", f"--socket={r}/munge.sock", f"--key-file={key}",
                f"--pid-file={r}/munged.pid", f"--log-file={r}/munged.log", f"--seed-file={r}/munged.seed",
            ],
            "slurmctld": ["slurmctld", "-D", "-i", "-f", str(conf)],
            "slurmd": ["slurmd", "-D", "-f", str(conf)],
        }  # fmt: skip
        try:
            for name in DAEMONS:
                log = open(self.root / f"{name}.stdout", "w")  # noqa: SIM115 (the daemon keeps it)
                proc = subprocess.Popen(
                    commands[name], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
                self.pids[name] = proc.pid
                # for `make test-slurm`'s EXIT trap, should this process die before `stop`
                (self.root / PID_FILE).write_text(" ".join(map(str, self.pids.values())) + "\n")
                if name == "munged":
                    self._wait(lambda: (self.root / "munge.sock").exists(), timeout, "munged's socket")
            self._wait(self._node_idle, timeout, "the node to be idle")
        except BaseException:
            self.stop()
            raise

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, pid in self.pids.items():
                if not alive(pid):
                    raise RuntimeError(f"{name} (pid {pid}) exited while waiting for {what}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {timeout} s:\n{self.logs()}")
            time.sleep(0.3)

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-o", "%t", check=False).stdout.split()
        return out == ["idle"] * len(out) and bool(out)

    def run(
        self, *cmd: str, check: bool = True, timeout: float = 60, env: dict | None = None, cwd=None
    ) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (in `env`, default this process's environment)."""
        env = {**(os.environ if env is None else env), **self.env}
        out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}\n{out.stdout}{out.stderr}")
        return out

    def logs(self, tail: int = 30) -> str:
        parts = []
        for f in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.stdout")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self, grace: float = 10) -> None:
        """Cancel every job (KILL) and wait for them, TERM each daemon this object started (slurmd first),
        KILL what is left after `grace` s; then KILL any process still running under this cluster's conf
        (a job's slurmstepd, srun or task that outlived the daemons: they carry SLURM_CONF)."""
        if "slurmctld" in self.pids and alive(self.pids["slurmctld"]):
            self.run("scancel", "--signal=KILL", "--full", "--user=root", check=False)
            self.run("scancel", "--user=root", check=False)
            deadline = time.monotonic() + 20
            while self.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.3)
        for name in reversed(DAEMONS):
            pid = self.pids.get(name)
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name in reversed(DAEMONS):
            pid = self.pids.pop(name, None)
            if pid is None:
                continue
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
            reap(pid)
        for pid in processes_with_env("SLURM_CONF", self.env["SLURM_CONF"]):
            os.kill(pid, signal.SIGKILL)
        (self.root / PID_FILE).unlink(missing_ok=True)


def processes_with_env(name: str, value: str) -> list[int]:
    """The pids (not this process) whose environment has name=value."""
    found = []
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            env = (p / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{name}={value}".encode() in env:
            found.append(int(p.name))
    return found


def alive(pid: int) -> bool:
    """Whether `pid` (a child of this process) still runs (a zombie counts as gone, and is reaped)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return done == 0


def reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
