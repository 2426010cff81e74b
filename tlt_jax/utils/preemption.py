"""A preemption guard for the RL loop: SIGTERM/SIGINT become a flag, so a step can finish and checkpoint."""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from typing import Any

from absl import logging


class PreemptionGuard:
    """Context manager turning SIGTERM/SIGINT into a flag, so the loop can checkpoint and exit cleanly.

    Inside the context the signals set `should_stop` (and `received`) instead of killing the process; a
    second SIGINT raises KeyboardInterrupt (an escape hatch at the terminal). The previous handlers come
    back on exit. Must be entered from the main thread (a Python rule for signal handlers). Multi-host runs
    must also agree on the stop step (e.g. `jax.experimental.multihost_utils.reached_preemption_sync_point`).
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)):
        self._signals = tuple(signals)
        self._previous: dict[int, Any] = {}
        self.received: signal.Signals | None = None

    @property
    def should_stop(self) -> bool:
        """True once one of the guarded signals arrived."""
        return self.received is not None

    def _handle(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum)
        logging.warning("received %s: stopping after the current step", self.received.name)

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "PreemptionGuard must be entered from the main thread (signal handlers live there)."
            )
        for s in self._signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
