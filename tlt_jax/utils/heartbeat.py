"""The console's heartbeat: while a long phase (compiling, a long rollout or update) is otherwise silent, a
background thread prints one line every few seconds saying what the job is doing (`rl/metrics.LearnerStatus`
supplies the words)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Protocol

from absl import logging

from tlt_jax.utils.background import BackgroundLoop
from tlt_jax.utils.tracking import console_print


class HeartbeatStatus(Protocol):
    """What a `Heartbeat` asks: `key()` names what the job is doing now (None: nothing to report; a new key
    restarts the clock), `line(elapsed)` describes it, `elapsed` seconds after that key first appeared."""

    def key(self) -> str | None: ...

    def line(self, elapsed: float) -> str: ...


def _print_around_bars(line: str) -> None:
    """`console_print` with any tqdm bar on stderr cleared first and redrawn after."""
    from tqdm import tqdm

    with tqdm.external_write_mode(file=sys.stderr):
        console_print(line)


class Heartbeat(BackgroundLoop):
    """A daemon thread that says what a long job is doing while it is otherwise silent (compiling, a long
    rollout or update). Every `poll` s it reads `status.key()`; once the same key has lasted `interval` s,
    and then every `interval` s, it prints `status.line(elapsed)`: at most one line per `interval`, on a TTY
    or in a CI log alike (no carriage-return redraws). A failing status stops it with one warning."""

    def __init__(
        self,
        status: HeartbeatStatus,
        interval: float = 10.0,
        poll: float = 0.5,
        print_fn: Callable[[str], None] | None = None,
        enabled: bool = True,
    ):
        self.status, self.interval, self.poll = status, float(interval), float(poll)
        self._print = print_fn or _print_around_bars
        super().__init__("heartbeat", enabled)

    def _run(self) -> None:
        key, since, last = None, 0.0, 0.0
        try:
            while not self._stop.wait(self.poll):
                now_key, now = self.status.key(), time.perf_counter()
                if now_key != key:
                    key, since, last = now_key, now, now
                elif key is not None and now - last >= self.interval:
                    last = now
                    self._print(self.status.line(now - since))
        except Exception as e:  # the console's heartbeat must never take the job down
            logging.warning("console heartbeat stopped: %s: %s", type(e).__name__, e)
