"""Stopping on request (tlt_jax.utils.preemption): the stop agreement's votes and decisions (the other process
simulated by the `agree` function, as `process_max` would combine it), the deadline that ends a process
whose stop does not complete, and signals noted while the main thread is inside a long C call. The two-process
runs with a real SIGTERM, and `process_max` across two processes, are tests/test_multiprocess.py's."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from tlt_jax.utils.preemption import (
    EXIT_STOP_LATE,
    PreemptionGuard,
    StopAgreement,
    StopRequested,
    Vote,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def agreement(within_s: float = 30.0) -> tuple[StopAgreement, PreemptionGuard, Clock, list[int]]:
    """An agreement of this process with one simulated peer whose vote is peer[0]."""
    clock, peer = Clock(), [int(Vote.GO_ON)]
    guard = PreemptionGuard(within_s=within_s, exit_fn=lambda code: None, clock=clock)
    return StopAgreement(guard, agree=lambda v: max(v, peer[0])), guard, clock, peer


def test_a_peers_stop_request_stops_this_process_at_the_same_point() -> None:
    a, guard, clock, peer = agreement()
    a.begin_step(saved=True)
    a.mid_step(1, "rollout chunk")  # nobody asked: nothing happens
    assert not a.between_steps(1) and not guard.should_stop and a.checks == 2
    peer[0] = Vote.ABANDON  # the other process received SIGTERM
    a.begin_step(saved=True)
    with pytest.raises(StopRequested) as e:
        a.mid_step(2, "update part")
    assert (e.value.step, e.value.where) == (2, "update part") and a.decided == (2, "update part")
    assert guard.should_stop and guard.requested_at == clock.t  # this one's deadline runs from here
    guard.disarm()
    a2, guard2, _, peer2 = agreement()
    peer2[0] = Vote.FINISH_STEP
    assert a2.between_steps(3) and a2.decided == (3, "between_steps")
    guard2.disarm()


def test_mid_step_vote_abandons_unless_finishing_keeps_unsaved_steps_within_the_bound() -> None:
    a, guard, clock, _ = agreement(within_s=30.0)
    assert a.mid_step_vote() == Vote.GO_ON
    guard.request("test")
    a.begin_step(saved=True)  # abandoning loses only the partial step
    assert a.mid_step_vote() == Vote.ABANDON
    a.begin_step(saved=False)  # completed steps unsaved, but no step timed yet in this launch
    assert a.mid_step_vote() == Vote.ABANDON
    a.end_step()
    a.saved(2.0)
    clock.t += 12.0  # the last step took 12 s, its save 2 s
    a.begin_step(saved=False)
    clock.t += 4.0  # request at 100, now 116: 8 s of step + 2 s of save left -> ends at 126, inside 30 s
    assert a.mid_step_vote() == Vote.FINISH_STEP
    a.mid_step(3, "rollout chunk")  # agreed: finish (no exception)
    assert a.finishing
    clock.t += 10.0  # 126: the step overran its estimate: 2 s of save left -> 128 - 100 <= 30
    assert a.mid_step_vote() == Vote.FINISH_STEP
    clock.t += 3.0  # 129 + 2 > 130: would miss the bound
    assert a.mid_step_vote() == Vote.ABANDON
    with pytest.raises(StopRequested):
        a.mid_step(3, "update part")
    guard.disarm()


def test_the_deadline_ends_a_process_whose_stop_does_not_complete(capfd) -> None:
    exits: list[int] = []
    with PreemptionGuard(within_s=0.2, describe=lambda: "step 3, phase update", exit_fn=exits.append) as g:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.01)
    assert exits == [EXIT_STOP_LATE] and g.received == signal.SIGTERM
    err = capfd.readouterr().err
    assert "stop requested 0.2 s ago did not complete (step 3, phase update)" in err
    assert "rerun the same command" in err and "config.stop_within" in err
    exits.clear()
    with PreemptionGuard(within_s=0.2, exit_fn=exits.append) as g:  # a stop that completes: disarmed
        g.request("test")
        g.disarm()
        time.sleep(0.4)
    assert exits == []


def send_sigterm(sent: list[float]) -> None:
    sent.append(time.monotonic())
    os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_is_noted_while_the_main_thread_is_inside_a_long_c_call() -> None:
    """Python runs its signal handlers only between bytecodes; the wakeup fd notes the signal (and would
    start the deadline) while the main thread is still inside one C call: here one matrix product of at
    least half a second (numpy releases the GIL inside it, as XLA's compiler and runtime do)."""
    rng = np.random.default_rng(0)
    n, took = 800, 0.0
    while took < 0.5 and n < 6000:  # size the product to the machine (and its load) now
        n = int(n * max(1.3, min((1.0 / max(took, 1e-3)) ** (1 / 3), 4.0)))
        a = rng.standard_normal((n, n))
        sent: list[float] = []
        with PreemptionGuard() as g:
            threading.Timer(0.1, send_sigterm, args=(sent,)).start()
            t0 = time.monotonic()
            a @ a  # one C call
            back, noted = time.monotonic(), g.requested_at
            while not (sent and g.should_stop) and time.monotonic() - back < 5:  # a short product: the
                time.sleep(0.01)  # signal still comes while the guard holds SIGTERM
        took = back - t0
    assert took >= 0.5, f"no product of {n} x {n} lasted 0.5 s"
    assert sent and noted is not None and noted < back, (sent, noted, back)
    # noted in the first half of the rest of the call: not when the call returned
    assert back - noted > (back - sent[0]) / 2, (sent[0] - t0, noted - t0, back - t0)


def test_the_stop_estimate_counts_the_async_saves_whole_write(tmp_path) -> None:
    """A finishing step's estimate adds the last save's full time: its blocking part and its background
    write, which a stopping process waits for before it exits (issue #52 item 4; the blocking part alone
    was counted). A real asynchronous orbax save of 32 MiB."""
    import jax.numpy as jnp

    from tlt_jax.utils.checkpoint import Checkpointer

    a, guard, _, _ = agreement()
    state = {"w": jnp.asarray(np.random.default_rng(0).random(8 << 20, np.float32))}
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        t0 = time.monotonic()
        ckpt.save(1, state)
        blocked = time.monotonic() - t0
        a.saved(blocked, ckpt.background_seconds)
        ckpt.wait()
        written = time.monotonic() - t0
        assert written > blocked + 0.02, (blocked, written)  # the premise: the write went on after save
        assert written - 0.02 <= a.save_estimate() <= written + 0.02, (blocked, a.save_estimate(), written)
        # nobody waits (a loop going on to the next step): the checkpointer's watcher notes the write's end
        ckpt.save(2, state)
        time.sleep(2.0)
        first = ckpt.background_seconds()
        time.sleep(0.1)
        assert 0 < ckpt.background_seconds() == first < 2.0  # measured once written, then fixed
    guard.disarm()
