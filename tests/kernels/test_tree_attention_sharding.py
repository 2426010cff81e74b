"""The tree-attention kernels under a data x model mesh: each device attends over its own rows and heads."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax import sharding as shd
from tlt_jax.kernels import tree_attention as ta
from tlt_jax.kernels.tree_attention_reference import tree_attention_reference

from .test_tree_attention_tpu import make_inputs

# the rollout's layout: rows on the data axis, heads on the model axis
SPECS = (P("data", None, "model", None), P("data", "model"), P("data", "model"), P("data"), P("data"))
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


@pytest.mark.devices(4)
@pytest.mark.parametrize("impl", ["pallas", "pallas_tpu"])
def test_kernels_run_on_their_own_rows_and_heads(impl: str) -> None:
    """Sharded inputs give the reference's result, sharded the same way, and the compiled program moves no
    data between devices: without the partitioning rule the Triton call was replicated (every device
    gathered the whole KV cache) and the Mosaic one did not lower at all."""
    mesh = shd.make_mesh(2, 2, jax.devices()[:4])
    args = [
        jax.device_put(x, NamedSharding(mesh, s))
        for x, s in zip(make_inputs(3, 4, 8, 128, 8, 4, 32, jnp.float32), SPECS, strict=True)
    ]
    fn = jax.jit(functools.partial(ta.tree_attention, impl=impl, interpret=True))
    got = fn(*args)
    np.testing.assert_allclose(got, tree_attention_reference(*args), atol=1e-5, rtol=1e-5)
    assert got.sharding.spec == P("data", None, "model")
    hlo = fn.lower(*args).compile().as_text()
    assert not [c for c in COLLECTIVES if c in hlo], [c for c in COLLECTIVES if c in hlo]


@pytest.mark.devices(4)
def test_heads_that_do_not_divide_the_model_axis_stay_whole() -> None:
    """3 KV heads on a model axis of 2: the rule splits rows only (heads replicated), still exact."""
    mesh = shd.make_mesh(2, 2, jax.devices()[:4])
    specs = (P("data"), P("data"), P("data"), P("data"), P("data"))
    args = [
        jax.device_put(x, NamedSharding(mesh, s))
        for x, s in zip(make_inputs(5, 4, 4, 128, 6, 3, 16, jnp.float32), specs, strict=True)
    ]
    got = jax.jit(functools.partial(ta.tree_attention, impl="pallas", interpret=True))(*args)
    np.testing.assert_allclose(got, tree_attention_reference(*args), atol=1e-5, rtol=1e-5)
