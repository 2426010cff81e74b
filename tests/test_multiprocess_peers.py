"""Two processes, the cheap checks make test keeps (tests/test_multiprocess.py's extended tests run the full
jobs): in ONE 2-process launch of `tests/multiprocess_peer_driver.py`, the spot trainer's `idle_devices`
ticks spanning both processes, then a SIGKILLed process 1 ending process 0 within the heartbeat bound."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.test_multiprocess import JAX_PEER_DIED, ROOT, clean_env, free_port
from tlt_jax.utils import distributed as dist

DRIVER = ROOT / "tests" / "multiprocess_peer_driver.py"
HEARTBEAT_S = 6  # TLT_JAX_HEARTBEAT_TIMEOUT of the launch: how long a dead peer goes unnoticed
BOUND_S = HEARTBEAT_S + 20  # process 0's exit after its peer's death, at most (JAX's default: 100 s)


def _launch(tmp: pathlib.Path) -> list[subprocess.Popen]:
    """Both processes, stdout / stderr to files (read while they run; pipes could fill and block them)."""
    port, procs = free_port(), []
    for i in range(2):
        env = clean_env(2) | {dist.HEARTBEAT_TIMEOUT: str(HEARTBEAT_S)}
        env |= {dist.COORDINATOR: f"127.0.0.1:{port}", dist.NUM_PROCESSES: "2", dist.PROCESS_ID: str(i)}
        out, err = (open(tmp / f"{i}.{s}", "w") for s in ("out", "err"))
        procs.append(
            subprocess.Popen([sys.executable, str(DRIVER)], env=env, cwd=ROOT, stdout=out, stderr=err)
        )
    return procs


def _wait_ready(tmp: pathlib.Path, procs: list[subprocess.Popen], timeout: float = 400) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        outs = [(tmp / f"{i}.out").read_text() for i in range(2)]
        if all("READY" in o for o in outs):
            return [json.loads(o.split("RESULT ", 1)[1].splitlines()[0]) for o in outs]
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        p.kill()
    errs = "\n".join((tmp / f"{i}.err").read_text()[-3000:] for i in range(2))
    pytest.fail(f"the processes did not both report within {timeout} s:\n{errs}")


@pytest.mark.slow
def test_idle_devices_across_processes_then_a_dead_peer_ends_the_other(tmp_path: pathlib.Path) -> None:
    """A rollout on the global 4-device data mesh (2 processes x 2 devices) with the spot trainer in
    `idle_devices` mode: ticks ran while some devices of the two processes decoded, every idle device trained
    on its own batch and every busy one contributed exact zeros, the decoded tokens are those of the same
    rollout without the spot trainer, and both processes hold the same results. Then process 1 is SIGKILLed
    while process 0 waits in Python (no collective to fail): JAX's coordination service, told the
    heartbeat timeout by `distributed.initialize`, ends process 0 within the bound, saying why."""
    procs = _launch(tmp_path)
    reports = _wait_ready(tmp_path, procs)
    procs[1].kill()
    t0 = time.monotonic()
    try:
        procs[0].wait(timeout=BOUND_S + 60)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail(f"process 0 still ran {BOUND_S + 60} s after its peer died")
    took = time.monotonic() - t0
    procs[1].wait(timeout=60)
    err0 = (tmp_path / "0.err").read_text()
    assert procs[0].returncode != 0 and JAX_PEER_DIED in err0, err0[-3000:]
    assert took < BOUND_S, f"process 0 ended {took:.1f} s after its peer died (bound {BOUND_S} s)"
    print(f"RESULT dead_peer_exit_s {took:.1f} (heartbeat {HEARTBEAT_S} s, bound {BOUND_S} s)")
    # the spot trainer's ticks across the two processes
    one, two = reports
    assert (one["process_index"], two["process_index"], one["device_count"]) == (0, 1, 4)
    for k in ("plain", "spot", "ticks", "spot_steps", "drafter_moved"):
        assert one[k] == two[k], k  # one SPMD program: both processes hold the same results
    assert one["spot"] == one["plain"], "the spot trainer changed what the decoding devices produced"
    assert len(set(one["plain"][1])) > 4, "rows should end at different steps"
    assert one["ticks"] and one["spot_steps"] == len(one["ticks"]) and one["drafter_moved"] > 0
    for live, norms in one["ticks"]:
        idle = np.asarray(live) == 0
        assert idle.any() and not idle.all(), live
        assert (np.asarray(norms)[~idle] == 0).all() and (np.asarray(norms)[idle] > 0).all(), (live, norms)
    # idle devices on both processes' halves of the mesh (shards 0-1: process 0; 2-3: process 1)
    assert any((np.asarray(live)[:2] == 0).any() for live, _ in one["ticks"])
    assert any((np.asarray(live)[2:] == 0).any() for live, _ in one["ticks"])
