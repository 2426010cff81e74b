"""Tests for tlt_jax.utils.checkpoint: round-trips (typed keys, optax state, None drafter), shardings, errors,
crash safety under SIGKILL mid-save, selective drafter checkpoints and the preemption guard."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax.utils.checkpoint import (
    TRASH,
    Checkpointer,
    SaveInfo,
    Unsaved,
    item_bytes,
    path_str,
)
from tlt_jax.utils.drafter_checkpoint import DrafterCheckpointer
from tlt_jax.utils.preemption import PreemptionGuard

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _train_state(seed: int = 0, drafter: bool = True) -> dict:
    k = jax.random.key(seed)
    params = {"w": jax.random.normal(k, (4, 3)), "b": jnp.arange(3.0) + seed}
    return {
        "params": params,
        "opt_state": optax.adam(1e-3).init(params),
        "drafter": {"fc": {"kernel": jnp.full((3, 3), 2.0 + seed)}} if drafter else None,
        "rng": jax.random.split(jax.random.key(seed + 100), 2),
    }


def _assert_same(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key)
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_roundtrip_with_abstract_state_keeps_types_and_typed_keys(tmp_path):
    state = _train_state(seed=1)
    meta = {"step": 7, "data_position": 123, "config_hash": "abc", "np_scalar": np.int64(5)}
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        info = ckpt.save(7, state, meta)
        assert isinstance(info, SaveInfo) and info.saved and info.blocking_ms >= 0
        ckpt.wait()
        assert ckpt.latest_step() == 7
        restored, rmeta = ckpt.restore(abstract_state=jax.eval_shape(lambda: state))
    _assert_same(state, restored)
    assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
    assert restored["rng"].dtype == state["rng"].dtype  # typed key came back as a typed key
    assert jax.random.key_impl(restored["rng"]) == jax.random.key_impl(state["rng"])
    assert rmeta == {"step": 7, "data_position": 123, "config_hash": "abc", "np_scalar": 5}
    # the restored key drives the same random stream
    np.testing.assert_array_equal(
        jax.random.uniform(restored["rng"][0], (3,)), jax.random.uniform(state["rng"][0], (3,))
    )


def test_unsaved_leaves_are_not_written_and_come_back_from_the_target(tmp_path):
    state = _train_state(seed=2)
    frozen = jnp.arange(6.0).reshape(2, 3)
    saving = {**state, "params": {**state["params"], "frozen": Unsaved(frozen)}}
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(1, saving)
        layout = ckpt.layout()
        assert "params/frozen" not in layout["leaves"] and "params/w" in layout["leaves"]
        sizes = item_bytes(layout)
        assert sizes["params"] == (12 + 3) * 4 and sizes["opt_state"] == 2 * (12 + 3) * 4 + 4
        assert list(sizes) == ["opt_state", "params", "drafter", "rng"]  # largest first
        other = frozen + 1.0  # the target's value is what comes back: the caller rebuilds it
        target = {**saving, "params": {**state["params"], "frozen": Unsaved(other)}}
        restored, _ = ckpt.restore(abstract_state=target)
    assert restored["params"]["frozen"] is other
    _assert_same(restored, {**state, "params": {**state["params"], "frozen": other}})


def test_restore_without_target_rewraps_keys_and_returns_plain_tree(tmp_path):
    state = _train_state(seed=2, drafter=False)
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(3, state, {"x": 1})
    restored, meta = ckpt.restore(3)
    ckpt.close()
    assert meta == {"x": 1}
    assert restored["drafter"] is None
    assert jax.dtypes.issubdtype(restored["rng"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(restored["rng"]), jax.random.key_data(state["rng"]))
    np.testing.assert_array_equal(restored["opt_state"][0]["mu"]["w"], state["opt_state"][0].mu["w"])


def test_restore_keeps_named_shardings_of_the_target(tmp_path):
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    rows = NamedSharding(mesh, P("data"))
    repl = NamedSharding(mesh, P())
    state = {
        "w": jax.device_put(jnp.arange(8 * n * 2, dtype=jnp.float32).reshape(8 * n, 2), rows),
        "v": jax.device_put(jnp.ones(5), repl),
        "keys": jax.device_put(jax.random.split(jax.random.key(0), 8 * n), rows),
    }
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, state)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    for target in (abstract, state):  # ShapeDtypeStructs or live arrays
        restored, _ = ckpt.restore(1, target)
        _assert_same(state, restored)
        for name in state:
            assert restored[name].sharding == state[name].sharding, name
    ckpt.close()


def test_missing_checkpoint_errors_name_the_directory_and_steps(tmp_path):
    ckpt = Checkpointer(tmp_path / "empty")
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match="no finalised checkpoint in .*empty"):
        ckpt.restore()
    ckpt.save(2, {"a": jnp.zeros(2)})
    with pytest.raises(FileNotFoundError, match=r"step 5 .* available: \[2\]"):
        ckpt.restore(5)
    ckpt.close()


def test_tree_mismatch_error_names_the_paths(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, _train_state(drafter=False))
    target = jax.eval_shape(lambda: _train_state(drafter=True))
    target["params"]["w"] = jax.ShapeDtypeStruct((5, 3), jnp.float32)
    del target["params"]["b"]
    with pytest.raises(ValueError) as e:
        ckpt.restore(1, target)
    msg = str(e.value)
    assert "in the target but not in the checkpoint: drafter/fc/kernel" in msg
    assert "in the checkpoint but not in the target: params/b" in msg
    assert "params/w: target (5, 3) vs saved (4, 3)" in msg
    ckpt.close()


def test_max_to_keep_and_meta_validation(tmp_path):
    ckpt = Checkpointer(tmp_path, max_to_keep=2)
    for step in range(1, 5):
        ckpt.save(step, {"a": jnp.full(2, step)}, {"step": step})
    assert ckpt.all_steps() == [3, 4]
    assert not ckpt.save(4, {"a": jnp.zeros(2)}).saved  # not newer than the latest: declined, not overwritten
    with pytest.raises(ValueError, match="meta must be JSON"):
        ckpt.save(5, {"a": jnp.zeros(2)}, {"bad": object()})
    with pytest.raises(TypeError, match="put strings .* in `meta`"):
        ckpt.save(5, {"a": "text"})
    ckpt.close()


_CHILD = textwrap.dedent(
    """
    import sys, numpy as np, jax, jax.numpy as jnp
    from tlt_jax.utils.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1])
    ckpt.save(1, {"w": jnp.arange(4.0), "rng": jax.random.key(1)}, {"data_position": 10})
    ckpt.wait()
    big = np.random.default_rng(0).integers(0, 2**32, size=(40_000_000,), dtype=np.uint32).view(np.float32)
    ckpt.save(2, {"w": jnp.asarray(big), "rng": jax.random.key(2)}, {"data_position": 20})  # 160 MB
    ckpt.wait()
    print("STEP2_FINISHED", flush=True)
    """
)


def _bytes_under(path: pathlib.Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def test_sigkill_mid_save_leaves_previous_step_restorable(tmp_path):
    ckdir = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    with open(tmp_path / "child.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(ckdir)], stdout=log, stderr=log, env=env)
    killed_at = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            tmps = list(ckdir.glob("2.orbax-checkpoint-tmp*")) if ckdir.exists() else []
            # kill once step 2's data is being written (a few MB of 160 MB landed), not just its dir created
            if tmps and _bytes_under(tmps[0]) > 4 << 20:
                proc.send_signal(signal.SIGKILL)
                killed_at = _bytes_under(tmps[0])
                break
            time.sleep(0.002)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    child_log = (tmp_path / "child.log").read_text()
    assert killed_at is not None, (
        f"never saw step 2 being written (rc={proc.returncode}):\n{child_log[-2000:]}"
    )
    assert proc.returncode == -signal.SIGKILL
    names = sorted(os.listdir(ckdir))
    assert "2" not in names and any(n.startswith("2.orbax-checkpoint-tmp") for n in names), names
    assert killed_at < 160 << 20  # the kill really landed mid-write

    ckpt = Checkpointer(ckdir)
    assert ckpt.latest_step() == 1
    state, meta = ckpt.restore(abstract_state={"w": jnp.zeros(4), "rng": jax.random.key(0)})
    np.testing.assert_array_equal(state["w"], np.arange(4.0))
    np.testing.assert_array_equal(jax.random.key_data(state["rng"]), jax.random.key_data(jax.random.key(1)))
    assert meta == {"data_position": 10}
    left = os.listdir(ckdir)
    assert not any("tmp" in n for n in left), left  # the half-written step was cleaned up on open
    assert ckpt.save(2, {"w": jnp.ones(4), "rng": jax.random.key(3)}, {"data_position": 20}).saved
    assert ckpt.latest_step() == 2
    assert ckpt.restore(2)[1] == {"data_position": 20}
    ckpt.close()


def test_retention_renames_a_retired_step_into_the_trash_then_empties_it(tmp_path):
    """A step retention retires is renamed into `<dir>/.deleted` (atomic: orbax's in-place delete, killed
    midway, left a half-deleted `<step>` that it lists as finalised); the trash is emptied after the next
    save, at close, and when a Checkpointer opens the directory (after a kill while emptying it)."""
    state = {"w": jnp.arange(4.0)}
    with Checkpointer(tmp_path, max_to_keep=1) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
        ckpt.wait()
        assert ckpt.all_steps() == [2] and os.listdir(tmp_path / TRASH) == ["1"]
        ckpt.save(3, state)
        ckpt.wait()
        assert os.listdir(tmp_path / TRASH) == ["2"]  # 1 emptied after save 3; 2 retired by it
    assert sorted(os.listdir(tmp_path)) == ["3"]
    (tmp_path / TRASH / "2" / "state").mkdir(parents=True)  # a kill while emptying the trash
    with Checkpointer(tmp_path, max_to_keep=1) as ckpt:
        assert sorted(os.listdir(tmp_path)) == ["3"] and ckpt.all_steps() == [3]


class _Drafter(nnx.Module):
    """A drafter-shaped module: a large shared embedding / head and a small trainable block."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(4096, 64, rngs=rngs)  # 1 MiB, shared with the target
        self.fc = nnx.Linear(128, 64, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(64, 64, rngs=rngs) for _ in range(2)])
        self.lm_head = nnx.Linear(64, 4096, use_bias=False, rngs=rngs)  # 1 MiB, shared


def _drafter_params(seed: int):
    """The drafter's nnx.Param state filled with host-made random values (eager nnx init is slow)."""
    _, abstract = nnx.split(nnx.eval_shape(lambda: _Drafter(nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape, dtype=np.float32)), abstract)


def test_drafter_checkpointer_saves_only_trainable_weights(tmp_path):
    params = _drafter_params(0)
    dckpt = DrafterCheckpointer(tmp_path / "drafter")
    info = dckpt.save(5, params)
    assert info.saved and info.blocking_ms > 0
    dckpt.wait()
    stored = dckpt.restore(5)
    assert set(stored) == {"fc", "layers"}  # no embedding, no LM head, no optimizer state
    stored_bytes = sum(x.nbytes for x in jax.tree.leaves(stored))
    assert stored_bytes == (128 * 64 + 64 + 2 * (64 * 64 + 64)) * 4
    assert _bytes_under(tmp_path / "drafter") < 1 << 20  # far below the 2 MiB of shared weights

    fresh = _drafter_params(1)
    merged = dckpt.restore(template=fresh)
    assert jax.tree.structure(merged) == jax.tree.structure(params)
    for (p, got), want, other in zip(
        jax.tree_util.tree_flatten_with_path(merged)[0],
        jax.tree.leaves(params),
        jax.tree.leaves(fresh),
        strict=True,
    ):
        shared = any(n in path_str(p).split("/") for n in ("embed", "lm_head"))
        np.testing.assert_array_equal(got, other if shared else want)
    dckpt.close()


def test_drafter_checkpointer_writes_in_the_background_until_wait(tmp_path):
    """Async: `save` returns while the step is still being written (no finalised `<step>` directory yet);
    `wait` blocks until it is durable and returns the seconds it blocked (> 0 with the write in flight, at
    most the wall time around the call; about 0 once nothing is pending). Sync: the step is finalised when
    `save` returns."""
    big = {"fc": jnp.asarray(np.random.default_rng(0).standard_normal((2048, 4096), dtype=np.float32))}
    with DrafterCheckpointer(tmp_path / "async") as dckpt:
        info = dckpt.save(1, big)
        in_flight = not (tmp_path / "async" / "1").is_dir()  # checked right away: 32 MiB take a while
        assert info.saved and in_flight
        t0 = time.perf_counter()
        waited = dckpt.wait()
        assert 0.0 < waited <= time.perf_counter() - t0
        assert (tmp_path / "async" / "1").is_dir() and dckpt.latest_step() == 1
        assert dckpt.wait() < min(waited, 0.05)  # nothing in flight: returns at once
    sync = DrafterCheckpointer(tmp_path / "sync", async_save=False)
    sync.save(1, big)
    assert (tmp_path / "sync" / "1").is_dir()
    np.testing.assert_array_equal(sync.restore(1)["fc"], big["fc"])
    sync.close()


def test_drafter_checkpointer_rejects_an_all_shared_selection(tmp_path):
    dckpt = DrafterCheckpointer(tmp_path, is_trainable=lambda path: False)
    with pytest.raises(ValueError, match="no trainable drafter leaves"):
        dckpt.save(0, {"embed": jnp.zeros(3)})
    dckpt.close()


def _wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.001)
    return predicate()


def test_preemption_guard_turns_sigterm_into_a_flag_and_restores_handlers():
    before_term, before_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with PreemptionGuard() as guard:
        assert not guard.should_stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert _wait_for(lambda: guard.should_stop)
        assert guard.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before_term
    assert signal.getsignal(signal.SIGINT) is before_int


def test_preemption_guard_second_sigint_interrupts():
    with PreemptionGuard() as guard:
        os.kill(os.getpid(), signal.SIGINT)
        assert _wait_for(lambda: guard.should_stop) and guard.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for(lambda: False, timeout=2.0)
