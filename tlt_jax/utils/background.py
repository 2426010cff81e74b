"""A daemon thread that runs while a `with` block does: the console's heartbeat and the watchdog."""

from __future__ import annotations

import threading
from typing import Self


class BackgroundLoop:
    """Runs `_run` on a daemon thread named `name` from `__enter__` to `__exit__` (none when not
    `enabled`); `_run` polls `self._stop.wait(seconds)` and returns once it is set."""

    def __init__(self, name: str, enabled: bool = True) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True) if enabled else None

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()
