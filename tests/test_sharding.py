"""tlt_jax.sharding's host helpers on one process (where they must change nothing); their multi-process paths
run in tests/test_multiprocess.py (two real processes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax import sharding as shd


@pytest.mark.devices(4)
def test_to_host_on_one_process_is_device_get() -> None:
    mesh = shd.make_mesh(data=4)
    x = jax.device_put(np.arange(8, dtype=np.int32).reshape(4, 2), NamedSharding(mesh, P("data")))
    tree = {"x": x, "y": jnp.ones(3), "host": np.zeros(2), "none": None}
    out = shd.to_host_tree(tree)
    want = jax.device_get(tree)
    assert jax.tree.structure(out) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(shd.to_host(x), np.arange(8).reshape(4, 2))


@pytest.mark.devices(4)
def test_put_global_on_one_process_is_device_put() -> None:
    mesh = shd.make_mesh(data=4)
    replicated = NamedSharding(mesh, P())
    tree = {"w": jnp.arange(3.0), "key": jax.random.key(1), "n": np.int32(2)}
    out = shd.put_global(tree, replicated, may_alias=False)
    assert all(leaf.sharding == replicated for leaf in jax.tree.leaves(out))
    np.testing.assert_array_equal(out["w"], tree["w"])
    np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(tree["key"]))
    assert int(out["n"]) == 2


def test_process_mean_averages_what_each_process_measured(monkeypatch) -> None:
    """One process: the values as float32. Several (faked: process 1 measured +40 tokens/s): their mean, the
    same array in every process."""
    np.testing.assert_array_equal(shd.process_mean(np.asarray([100.0, 2.0])), np.float32([100.0, 2.0]))
    assert shd.process_mean([1.5]).dtype == np.float32

    def allgather(x, tiled=False):  # noqa: ANN001, ANN202
        assert not tiled
        return np.stack([x, x + np.float32([40.0, 0.0])])

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    np.testing.assert_array_equal(shd.process_mean(np.asarray([100.0, 2.0])), np.float32([120.0, 2.0]))
