"""The watchdog (tlt_jax.utils.watchdog): a phase without progress past its kind's limit ends the process with
a line naming the phase; beats and compilations keep it alive; the compile tracker sees JAX's compilations
start and end; the config's limits are checked. In-process, with a fake clock or short limits."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from tlt_jax import config_schema
from tlt_jax.config_sections import RunSection
from tlt_jax.utils.config_checks import SectionError
from tlt_jax.utils.watchdog import DEFAULT_LIMITS, EXIT_STALLED, Watchdog, compile_tracker


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Compiles:
    """A stand-in for the compile tracker (its two readings)."""

    def __init__(self) -> None:
        self.running, self.last_end = 0, 0.0


def test_a_stalled_phase_is_named_past_its_kinds_limit() -> None:
    clock, compiles = Clock(), Compiles()
    limits = {"rollout": 10.0, "compile": 100.0, "update": 0.0}
    wd = Watchdog(
        limits, {"rollout": "rollout", "update": "update"}, clock=clock, compiles=compiles, enabled=False
    )
    wd.phase(2, "rollout")
    clock.t += 9.0
    assert wd.check() is None
    wd.beat()  # a chunk finished
    clock.t += 9.0
    assert wd.check() is None
    clock.t += 2.0
    line = wd.check()
    assert line is not None and "no progress for 11 s in phase 'rollout' of step 2" in line
    assert "config.watchdog.rollout=10 s" in line and f"status {EXIT_STALLED}" in line
    compiles.running = 1  # compiling: the compile limit applies
    assert wd.kind() == "compile" and wd.check() is None
    clock.t += 95.0
    line = wd.check()
    assert line is not None and "compiling; limit config.watchdog.compile=100 s" in line
    compiles.running, compiles.last_end = 0, clock.t  # the compilation ended: progress
    assert wd.check() is None
    wd.phase(2, "update")  # limit 0: no watchdog for this kind
    clock.t += 1e6
    assert wd.check() is None
    wd.phase(2, "metrics")  # not in `kinds`: "other", the default limit
    clock.t += DEFAULT_LIMITS["other"] + 1
    assert "(phase kind other; limit config.watchdog.other=1800 s)" in (wd.check() or "")


def test_the_thread_exits_on_a_stall_and_not_while_beating(capfd) -> None:
    """The real thread on a fake clock: 10 s of beats every 0.1 s under a 0.3 s limit, then a stall."""
    clock, exits = Clock(), []
    kw = dict(exit_fn=exits.append, poll=0.005, clock=clock, compiles=Compiles())
    with Watchdog({"other": 0.3}, {}, **kw) as wd:
        wd.phase(1, "reward")
        for _ in range(100):
            clock.t += 0.1
            wd.beat()
            time.sleep(0.002)  # the thread polls in between
        assert exits == []
        clock.t += 0.5
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.01)
    assert exits == [EXIT_STALLED] and wd.fired is not None and "phase 'reward' of step 1" in wd.fired
    assert "error: watchdog: no progress" in capfd.readouterr().err


def test_the_compile_tracker_sees_a_compilation_run() -> None:
    tracker = compile_tracker()
    seen: list[int] = []
    listener = lambda event, value, **kw: seen.append(tracker.running)  # noqa: E731
    jax.monitoring.register_scalar_listener(listener)  # after the tracker's: sees its count
    try:
        before = tracker.last_end
        jax.jit(lambda x: jnp_sum_of_cubes(x))(np.arange(5.0)).block_until_ready()
    finally:
        jax.monitoring.unregister_scalar_listener(listener)
    assert seen and max(seen) >= 1, "no compile start event: the tracker cannot tell compiling from hung"
    assert tracker.running == 0 and tracker.last_end > before


def jnp_sum_of_cubes(x: jax.Array) -> jax.Array:
    return (x**3).sum() + 17.0


def test_config_keys_checked() -> None:
    base = config_schema.base_config()
    assert dict(base.watchdog) == dict(DEFAULT_LIMITS) and base.stop_within > 0
    with pytest.raises(SectionError) as e:
        RunSection(watchdog={"rolout": 5.0, "compile": -1.0}, stop_within=0.0)
    text = str(e.value)
    assert "config.watchdog.rolout: unknown kind" in text and "config.watchdog.compile=-1.0" in text
    assert "config.stop_within=0.0: must be > 0" in text
    assert RunSection(watchdog={"rollout": 0.0}).watchdog == {"rollout": 0.0}
