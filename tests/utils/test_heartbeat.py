"""The console heartbeat (tlt_jax/utils/heartbeat.py): a line only for long phases, at most one per interval,
and never the job's death."""

from __future__ import annotations

import time

from tlt_jax.utils.heartbeat import Heartbeat


class FakeStatus:
    """A job whose phase the test sets; the heartbeat reads it from its own thread."""

    def __init__(self) -> None:
        self.phase: str | None = None

    def key(self) -> str | None:
        return self.phase

    def line(self, elapsed: float) -> str:
        return f"{self.phase} {elapsed:.2f}"


def test_heartbeat_prints_only_for_long_phases_at_most_once_per_interval():
    lines: list[str] = []
    status = FakeStatus()
    with Heartbeat(status, interval=0.3, poll=0.02, print_fn=lines.append):
        status.phase = "short"
        time.sleep(0.15)  # shorter than the interval: nothing
        status.phase, t0 = "long", time.perf_counter()
        time.sleep(1.0)  # ~3 lines (at 0.3, 0.6, 0.9 s), never more than one per interval
        status.phase, long_s = None, time.perf_counter() - t0  # None: nothing to report
        time.sleep(0.4)
    assert lines and all(x.startswith("long ") for x in lines), lines
    assert 2 <= len(lines) <= long_s / 0.3 + 1, (lines, long_s)
    elapsed = [float(x.split()[1]) for x in lines]
    assert elapsed[0] >= 0.3 and all(b - a >= 0.25 for a, b in zip(elapsed, elapsed[1:], strict=False)), (
        elapsed
    )


def test_heartbeat_stops_with_a_warning_when_the_status_fails(caplog):
    class Broken(FakeStatus):
        def key(self) -> str | None:
            raise OSError("phase file gone")

    with caplog.at_level("WARNING"), Heartbeat(Broken(), interval=0.05, poll=0.01, print_fn=print) as hb:
        time.sleep(0.1)
        assert not hb._thread.is_alive()
    assert "console heartbeat stopped: OSError: phase file gone" in caplog.text
    assert Heartbeat(FakeStatus(), enabled=False)._thread is None
