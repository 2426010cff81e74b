"""The job's current phase in a one-line file, `<workdir>/.phase` ("<step> <phase>"), for whoever watches the
process from outside: a supervisor, or `experiments/checks/kill_loop.py`, which SIGKILLs a run at chosen
phases and reads, after the kill, where the process was when it died.

Always on and cheap: the file is opened once, and each phase change is one `pwrite` of a fixed-width line at
offset 0. No temp file (a kill leaves nothing half-written) and no truncation (a reader never sees it empty).
"""

from __future__ import annotations

import os

PHASE_FILE = ".phase"
_WIDTH = 63  # characters per line (then "\n"): one small write replaces the whole line


class PhaseFile:
    """Writes "<step> <phase>" to `<workdir>/.phase` at every `set`; `workdir=None` writes nothing (the
    processes other than process 0)."""

    def __init__(self, workdir: str | os.PathLike | None):
        self.path = None if workdir is None else os.path.join(os.fspath(workdir), PHASE_FILE)
        self._fd: int | None = None
        if self.path is not None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)

    def set(self, step: int, phase: str) -> None:
        """The process is now in `phase` of step `step` (phase: one word, e.g. "rollout", "checkpoint")."""
        if self._fd is None:
            return
        line = f"{int(step)} {phase}"
        if len(line) > _WIDTH or not phase or any(c.isspace() for c in phase):
            raise ValueError(f"phase {phase!r}: give one word of at most {_WIDTH - 12} characters")
        os.pwrite(self._fd, (line.ljust(_WIDTH) + "\n").encode(), 0)

    def close(self) -> None:
        """Close the file (idempotent); it keeps the last phase written."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_phase(workdir: str | os.PathLike) -> tuple[int, str] | None:
    """(step, phase) of `<workdir>/.phase`, or None when there is none (the job has not started its
    learner) or it does not parse."""
    try:
        with open(os.path.join(os.fspath(workdir), PHASE_FILE), encoding="utf-8") as f:
            parts = f.read().split()
    except FileNotFoundError:
        return None
    if len(parts) != 2 or not parts[0].lstrip("-").isdigit():
        return None
    return int(parts[0]), parts[1]
