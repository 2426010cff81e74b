"""What every export shares: reading a run's checkpoints without touching them, and writing the export
folder atomically (a crash never leaves a half-written export; a non-empty folder is replaced only when
asked). Used by the drafter's and the policy's exports."""

from __future__ import annotations

import os
import pathlib
import shutil
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
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


def restore_leaves(directory: pathlib.Path, step: int, leaves: Mapping[str, Mapping[str, Any]]) -> Any:
    """The checkpoint `step`'s leaves named in `leaves` ("a/b/c" -> {"shape", "dtype"}), restored alone onto
    the first device as a nested dict (no other leaf is read; the run may still be writing)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    item: dict[str, Any] = {}
    for path, v in leaves.items():
        node = item
        *parents, last = path.split("/")
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = jax.ShapeDtypeStruct(tuple(v["shape"]), jnp.dtype(v["dtype"]), sharding=device)
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), item)
    mngr = read_only_manager(directory)
    try:
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        return mngr.restore(step, args=ocp.args.Composite(state=args))["state"]
    finally:
        mngr.close()
