"""What every export shares: reading a run's checkpoints without touching them, and writing the export
folder atomically (a crash never leaves a half-written export; a non-empty folder is replaced only when
asked). Used by the drafter's and the policy's exports."""

from __future__ import annotations

import os
import pathlib
import shutil
import uuid
from collections.abc import Callable

import orbax.checkpoint as ocp
from absl import logging


def read_only_manager(directory: pathlib.Path) -> ocp.CheckpointManager:
    """An orbax manager that never creates, cleans or deletes anything in `directory` (a run may still be
    writing there)."""
    level = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)  # orbax warns that a read-only manager will not save
    try:
        options = ocp.CheckpointManagerOptions(read_only=True, create=False, cleanup_tmp_directories=False)
        return ocp.CheckpointManager(directory, options=options)
    finally:
        logging.set_verbosity(level)


def write_atomically(
    out: str | os.PathLike, force: bool, fill: Callable[[pathlib.Path], None]
) -> pathlib.Path:
    """`fill(tmp)` writes the export into a temporary sibling folder, renamed to `out` once complete. A
    non-empty `out` is replaced only with `force` (moved aside first, removed once the new one is there)."""
    out = pathlib.Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file: choose a directory path.")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(
            f"--out {out} is not empty: pass --force to replace it, or choose another path."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp, old = out.with_name(f".{out.name}.tmp-{tag}"), out.with_name(f".{out.name}.old-{tag}")
    tmp.mkdir()
    try:
        fill(tmp)
        if out.is_dir():
            os.rename(out, old)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out
