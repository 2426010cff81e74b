"""Orbax checkpoints for the RL loop (the drafter's selective one: `drafter_checkpoint`; the preemption
guard: `preemption`).

One checkpoint step is a directory with three orbax items:
- `state`: the array pytree (policy params, optimizer state, drafter params or None, rng key, ...),
- `meta`: the caller's JSON (data position, step, config hash, ...),
- `layout`: our JSON (normalised leaf paths, shapes, dtypes, typed PRNG keys), used to name tree mismatches
  before orbax fails with a less specific error, and to rewrap typed keys.

Typed PRNG keys (`jax.random.key`) cannot be serialised by orbax: `save` stores their raw `key_data` (uint32)
and records the key implementation in `layout`; `restore` rewraps them with `jax.random.wrap_key_data`, so a
typed key round-trips as a typed key (raw uint32 keys are ordinary arrays and round-trip as such).

A leaf wrapped in `Unsaved` is not written: restoring into a target gives back the target's own value there
(the learner's frozen policy layers, which the run rebuilds from its model file). `item_bytes` sizes a step.

Crash safety comes from orbax: a step is written into `<step>.orbax-checkpoint-tmp` and renamed to `<step>`
only once complete, so a process killed mid-save leaves the previous step restorable; half-written temporary
directories are ignored, and removed when the next `Checkpointer` opens the directory (synchronously, by
`_remove_half_written_steps`: orbax's own cleanup runs in a background thread, so a directory listed right
after opening could still hold them; it is switched off). Retention renames a retired step into `TRASH`, gone
after the next save, at close and at open (orbax's in-place delete, killed midway, left a "finalised" step).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

PyTree = Any
_LAYOUT_VERSION = 1
TRASH = ".deleted"  # `<dir>/.deleted/<step>`: retired by retention (an atomic rename), removed soon after
# Leaves whose path has one of these components are the target's embedding / LM head that the drafter shares.


class Unsaved:
    """A state leaf the checkpoint does not store (a pytree leaf; orbax sees None there): `restore` with a
    target puts the target's `value` back, so the caller must rebuild the same value before restoring."""

    def __init__(self, value: Any):
        self.value = value


def _is_unsaved(x: Any) -> bool:
    return isinstance(x, Unsaved)


def _drop_unsaved(tree: PyTree) -> PyTree:
    """`tree` with its Unsaved leaves replaced by None (an empty node: no leaf, no layout entry)."""
    return jax.tree_util.tree_map(lambda x: None if _is_unsaved(x) else x, tree, is_leaf=_is_unsaved)


def _put_back_unsaved(target: PyTree, restored: PyTree) -> PyTree:
    """`restored` (None where `target` has an Unsaved leaf) with the target's values put back there."""
    if not any(_is_unsaved(x) for x in jax.tree_util.tree_leaves(target, is_leaf=_is_unsaved)):
        return restored
    none_or_unsaved = lambda x: x is None or _is_unsaved(x)  # noqa: E731
    flat_t, treedef = jax.tree_util.tree_flatten(target, is_leaf=none_or_unsaved)
    flat_r = treedef.flatten_up_to(restored)
    leaves = [t.value if _is_unsaved(t) else r for t, r in zip(flat_t, flat_r, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


@dataclasses.dataclass(frozen=True)
class SaveInfo:
    """Outcome of one save: `saved` is False when orbax declined (step not newer than the latest);
    `blocking_ms` is the time the caller was blocked (device->host copy; the write continues in the
    background when async)."""

    step: int
    saved: bool
    blocking_ms: float


def path_str(path: Sequence[Any]) -> str:
    """A pytree key path as 'a/b/0/c', independent of the container kind (dict key, attribute, index), so
    a NamedTuple optimizer state and the dict orbax restores without a target have the same paths."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _is_typed_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(x.shape), x.dtype
    if isinstance(x, (bool, int, float, np.number)):
        arr = np.asarray(x)
        return arr.shape, arr.dtype
    raise TypeError(
        f"checkpoint state leaves must be arrays or numbers, got {type(x).__name__}: put strings and other "
        "non-array values in `meta` (JSON) instead."
    )


def flatten_paths(tree: PyTree) -> tuple[list[tuple[str, Any]], Any]:
    """(path 'a/b/0/c', leaf) pairs and the treedef; two leaves with one path string are an error."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    items = [(path_str(p), leaf) for p, leaf in flat]
    seen: set[str] = set()
    for p, _ in items:
        if p in seen:
            raise ValueError(
                f"two leaves share the normalised path {p!r} (e.g. dict keys 0 and '0'); rename one."
            )
        seen.add(p)
    return items, treedef


def _encode(state: PyTree) -> tuple[PyTree, dict[str, Any]]:
    """Replace typed PRNG keys by their key data and describe every leaf in a JSON layout."""
    items, treedef = flatten_paths(state)
    leaves, layout_leaves, keys = [], {}, {}
    for p, x in items:
        if _is_typed_key(x):
            keys[p] = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
        shape, dtype = _shape_dtype(x)
        layout_leaves[p] = {"shape": list(shape), "dtype": str(dtype)}
        leaves.append(_global(x))
    layout = {"version": _LAYOUT_VERSION, "leaves": layout_leaves, "prng_keys": keys}
    return jax.tree_util.tree_unflatten(treedef, leaves), layout


def _everywhere() -> jax.sharding.NamedSharding:
    """Replicated over every device of every process."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("all",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _process_local(x: Any) -> bool:
    return jax.process_count() > 1 and isinstance(x, jax.Array) and x.is_fully_addressable


def _global(x: Any) -> Any:
    """With several processes, a leaf only this process holds (an rng key, the selector's state: equal in
    every process) saved as replicated over all devices: orbax writes only global arrays there."""
    if not _process_local(x):
        return x
    value = np.asarray(x)
    return jax.make_array_from_callback(value.shape, _everywhere(), lambda idx: value[idx])


def _restore_sharding(x: Any) -> jax.sharding.Sharding:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
        # several processes: a process-local target leaf comes back replicated over all devices (see _global)
        return _everywhere() if _process_local(x) else sharding
    # No sharding given: the default device (all devices with several processes), not whatever topology the
    # checkpoint was written from.
    return _everywhere() if jax.process_count() > 1 else jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _abstract(target: PyTree, layout: dict[str, Any], where: str) -> tuple[PyTree, dict[str, str]]:
    """Target pytree -> ShapeDtypeStructs (with shardings) of what was stored; typed-key paths -> impl."""
    items, treedef = flatten_paths(target)
    saved_keys = layout.get("prng_keys", {})
    abstract, wrap = [], {}
    for p, x in items:
        sharding = _restore_sharding(x)
        shape, dtype = _shape_dtype(x)
        if _is_typed_key(x):
            if p not in saved_keys:
                raise ValueError(
                    f"{where}: the target has a typed PRNG key at {p!r} but the checkpoint stores a plain "
                    "array there; pass a uint32 key-data target for that leaf (then wrap it yourself)."
                )
            wrap[p] = saved_keys[p]
            kd = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
            shape, dtype = kd.shape, kd.dtype
        abstract.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    return jax.tree_util.tree_unflatten(treedef, abstract), wrap


def _check_layout(abstract: PyTree, layout: dict[str, Any], where: str) -> None:
    """Name the paths that differ between the target and the saved tree (orbax reports only the first)."""
    want = {p: tuple(x.shape) for p, x in flatten_paths(abstract)[0]}
    have = {p: tuple(v["shape"]) for p, v in layout["leaves"].items()}
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    shapes = sorted(
        f"{p}: target {want[p]} vs saved {have[p]}" for p in set(want) & set(have) if want[p] != have[p]
    )
    if not (missing or unexpected or shapes):
        return

    def show(xs: list[str]) -> str:
        return ", ".join(xs[:8]) + (f", ... ({len(xs)} in all)" if len(xs) > 8 else "")

    lines = [f"{where}: the abstract state does not match the saved tree."]
    if missing:
        lines.append(f"  in the target but not in the checkpoint: {show(missing)}")
    if unexpected:
        lines.append(f"  in the checkpoint but not in the target: {show(unexpected)}")
    if shapes:
        lines.append(f"  shape mismatches: {show(shapes)}")
    lines.append(
        "  Build the target from the same model/optimizer config as the saved run (e.g. a drafter present in "
        "both or None in both), or restore with abstract_state=None to inspect what was saved."
    )
    raise ValueError("\n".join(lines))


def _json_default(o: Any) -> Any:
    if hasattr(o, "item") and np.ndim(o) == 0:
        return o.item()
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def _to_json(meta: dict[str, Any] | None) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(meta or {}, default=_json_default))
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint meta must be JSON (numbers, strings, lists, dicts): {e}") from e


def _remove_half_written_steps(directory: str) -> None:
    """Delete `<step>.orbax-checkpoint-tmp*` directories left by a process killed mid-save and the retired
    steps in `TRASH` (process 0 only; never a finalised `<step>` directory)."""
    if jax.process_index() != 0 or not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        if ".orbax-checkpoint-tmp" in name or name == TRASH:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def prune_steps(
    directory: str | os.PathLike, root: str | os.PathLike, keep_step: int | None = None
) -> list[int]:
    """Remove the `<root>/<step>` folders whose checkpoint step is gone from `directory` (deleted by
    retention, or never finalised by a process killed mid-save), except `keep_step`; returns their steps.

    A folder goes only once its checkpoint has: orbax deletes the oldest step after the next save is
    finalised (in the background), so while a save is in flight the step it will delete keeps its folder
    (removed by the next call). A step being written (`<step>.orbax-checkpoint-tmp*`) keeps its folder.
    Process 0 only."""
    root = os.fspath(root)
    if jax.process_index() != 0 or not os.path.isdir(root):
        return []
    directory = os.fspath(directory)
    names = os.listdir(directory) if os.path.isdir(directory) else []
    have = {int(n.split(".", 1)[0]) for n in names if n.split(".", 1)[0].isdigit()}
    if keep_step is not None:
        have.add(int(keep_step))
    removed = sorted(int(d) for d in os.listdir(root) if d.isdigit() and int(d) not in have)
    for step in removed:
        shutil.rmtree(os.path.join(root, str(step)), ignore_errors=True)
    return removed


class Checkpointer:
    """Saves and restores the training state (arrays) plus JSON metadata; keeps the last `max_to_keep` steps.

    Async by default: `save` blocks only for the device->host copy (so the caller may then donate or mutate
    its arrays) and the write finishes in a background thread; `wait()` joins it, `close()` waits and frees.
    `background_seconds()` is how long that write took after `save` returned (what a stop waits for).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        followers: Sequence[str | os.PathLike] = (),
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        # folders of per-step subfolders (`<root>/<step>`, e.g. a data buffer saved beside each checkpoint)
        # that follow these checkpoints' retention: `close` removes those whose step is gone (`prune_steps`)
        self.followers = tuple(os.path.abspath(os.fspath(r)) for r in followers)
        _remove_half_written_steps(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            # half-written `<step>.orbax-checkpoint-tmp` dirs are removed above, before opening; orbax's own
            # cleanup would do it again in a background thread, racing a caller that lists the directory
            cleanup_tmp_directories=False,
            todelete_subdir=TRASH,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options)
        self._writes = threading.Lock()
        self._writing_since: float | None = None  # monotonic time the in-flight save returned
        self._background_s = 0.0  # the last complete save's write after its `save` returned

    def _write_done(self, since: float) -> None:
        """The save that returned at `since` is written: note its background time (once)."""
        with self._writes:
            if self._writing_since == since:
                self._background_s, self._writing_since = time.monotonic() - since, None

    def _watch_write(self, since: float) -> None:
        """A daemon thread per async save: polls orbax until the write is done, then `_write_done`."""
        try:
            while self._mngr.is_saving_in_progress():
                time.sleep(0.01)
        except Exception:  # noqa: BLE001 - closed meanwhile: `close` waited for the write
            pass
        self._write_done(since)

    def background_seconds(self) -> float:
        """The background write time of the last save: measured once complete; while it is in flight, the
        time since its `save` returned (a lower bound). 0 for synchronous saves."""
        with self._writes:
            if self._writing_since is not None:
                return max(self._background_s, time.monotonic() - self._writing_since)
            return self._background_s

    def save(
        self, step: int, state: PyTree, meta: dict[str, Any] | None = None, force: bool = False
    ) -> SaveInfo:
        """Save `state` (a pytree of arrays; None subtrees allowed) and `meta` (JSON) as checkpoint `step`.

        `force` bypasses orbax's save-interval policy. Returns `SaveInfo(saved=False)` when orbax declines
        (the step is not newer than the latest saved one).
        """
        meta_json = _to_json(meta)
        encoded, layout = _encode(_drop_unsaved(state))
        t0 = time.perf_counter()
        saved = self._mngr.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(encoded),
                meta=ocp.args.JsonSave(meta_json),
                layout=ocp.args.JsonSave(layout),
            ),
            force=force,
        )
        blocking_ms = (time.perf_counter() - t0) * 1e3
        if saved and self._mngr.is_saving_in_progress():
            since = time.monotonic()
            with self._writes:
                self._writing_since = since
            threading.Thread(target=self._watch_write, args=(since,), name="ckpt-write", daemon=True).start()
        if jax.process_index() == 0:  # the steps the previous save retired (that save is complete now)
            shutil.rmtree(os.path.join(self.directory, TRASH), ignore_errors=True)
        if not saved:
            logging.warning("checkpoint step %d not saved (latest is %s)", step, self._mngr.latest_step())
        return SaveInfo(step=int(step), saved=bool(saved), blocking_ms=blocking_ms)

    def latest_step(self) -> int | None:
        """The newest finalised step, or None if the directory holds none (waits for an in-flight save)."""
        self._mngr.wait_until_finished()
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """All finalised steps, oldest first."""
        self._mngr.wait_until_finished()
        return sorted(self._mngr.all_steps())

    def reload(self) -> None:
        """Re-read the steps on disk (after a step's folder was moved away: `rl.checkpointing.set_aside`)."""
        self._mngr.reload()

    def restore(
        self, step: int | None = None, abstract_state: PyTree = None
    ) -> tuple[PyTree, dict[str, Any]]:
        """Restore `(state, meta)` of `step` (default: the latest).

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct`s or arrays shaped like the saved state: the
        result has its tree structure, dtypes and shardings (NamedShardings are kept; leaves without a
        sharding go to the default device). Without it, orbax returns plain nested dicts/lists of arrays.
        """
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(
                f"no finalised checkpoint in {self.directory} (half-written *.orbax-checkpoint-tmp "
                "directories do not count): start from scratch, or point the run at the workdir that holds "
                "its checkpoints."
            )
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; available: {steps}")
        where = f"restoring step {step} from {self.directory}"
        small = self._mngr.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), layout=ocp.args.JsonRestore())
        )
        meta, layout = dict(small["meta"] or {}), small["layout"]
        if abstract_state is None:
            target, wrap = None, dict(layout.get("prng_keys", {}))
        else:
            target, wrap = _abstract(_drop_unsaved(abstract_state), layout, where)
            _check_layout(target, layout, where)
        restored = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        state = restored["state"]
        if abstract_state is not None:
            state = _put_back_unsaved(abstract_state, state)
        if wrap:
            state = jax.tree_util.tree_map_with_path(
                lambda p, x: (
                    jax.random.wrap_key_data(x, impl=wrap[path_str(p)]) if path_str(p) in wrap else x
                ),
                state,
            )
        return state, meta

    def layout(self, step: int | None = None) -> dict[str, Any]:
        """The saved layout of `step` (default: the latest): {"leaves": {path: {"shape", "dtype"}}, ...}."""
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no finalised checkpoint in {self.directory}")
        step = steps[-1] if step is None else int(step)
        return self._mngr.restore(step, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))["layout"]

    def wait(self) -> float:
        """Block until pending async saves are written; returns the seconds waited."""
        t0 = time.perf_counter()
        self._mngr.wait_until_finished()
        since = self._writing_since
        if since is not None:
            self._write_done(since)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Wait for pending saves, release orbax's resources, and remove the followers' per-step folders
        whose checkpoint retention has deleted."""
        self._mngr.close()
        since = self._writing_since
        if since is not None:
            self._write_done(since)
        _remove_half_written_steps(self.directory)  # and the steps retention retired
        for root in self.followers:
            prune_steps(self.directory, root)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def leaf_bytes(layout: dict[str, Any]) -> dict[str, int]:
    """Bytes of every saved leaf (shape x dtype size, before orbax's compression), by path."""
    return {
        p: int(np.prod(v["shape"], dtype=np.int64)) * np.dtype(v["dtype"]).itemsize
        for p, v in layout["leaves"].items()
    }


def item_bytes(layout: dict[str, Any], depth: int = 1) -> dict[str, int]:
    """Bytes per item of a saved step: leaf sizes summed by the first `depth` path components (depth 1:
    the top-level items, e.g. params / opt_state / spot / rng), largest first."""
    out: dict[str, int] = {}
    for p, n in leaf_bytes(layout).items():
        key = "/".join(p.split("/")[:depth])
        out[key] = out.get(key, 0) + n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
