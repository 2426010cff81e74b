"""PolicyTrainer's layouts: the optimizer state lives where its parameters live, real or abstract."""

from __future__ import annotations

import jax
import optax
import pytest
from flax import nnx
from optax.transforms import MaskedNode

from tlt_jax import sharding as shd
from tlt_jax.models.config import tiny_config
from tlt_jax.models.llama import Transformer
from tlt_jax.rl.trainer import OptimConfig, PolicyLossConfig, PolicyTrainer, TrainerOptions

CFG = tiny_config(num_layers=2)


def _masked(x: object) -> bool:
    return isinstance(x, MaskedNode)


def _same_layout(t: PolicyTrainer, state: object) -> list[bool]:
    """Per leaf of `state`: params-shaped parts sharded like their parameter, the rest replicated."""
    flags = optax.tree_map_params(
        t.tx,
        lambda m, p: m if _masked(m) else m.sharding.is_equivalent_to(p.sharding, len(p.shape)),
        state,
        t.params,
        transform_non_params=lambda x: x.sharding.is_fully_replicated,
        is_leaf=_masked,
    )
    return jax.tree_util.tree_leaves(flags)


@pytest.mark.devices(4)
@pytest.mark.parametrize("train_layers,fsdp", [(0, False), (1, False), (0, True)])
def test_adamw_moments_are_sharded_like_the_params(train_layers: int, fsdp: bool) -> None:
    """The moments of a tensor-parallel (and FSDP) policy are split like its weights, frozen layers have no
    state; `jax.jit(tx.init)` alone replicated them on every device (a 7B's 56.7 GiB per device on 2 x 4)."""
    mesh = shd.make_mesh(2, 2, jax.devices()[:4])
    opts = TrainerOptions(micro_batch_size=4, with_reference=True, fsdp=fsdp, train_layers=train_layers)
    t = PolicyTrainer(Transformer(CFG, nnx.Rngs(0)), mesh, PolicyLossConfig(), OptimConfig(), opts)
    flags = _same_layout(t, t.opt_state)
    assert flags and all(flags)
    moments = [x for x in jax.tree_util.tree_leaves(t.opt_state) if x.ndim == 2]
    assert moments and not any(x.sharding.is_fully_replicated for x in moments)
    # frozen parameters (train_layers) carry no moments: 2 (mu, nu) per trainable parameter
    trainable = sum(jax.tree_util.tree_leaves(t.trainable))
    assert sum(x.ndim > 0 for x in jax.tree_util.tree_leaves(t.opt_state)) == 2 * trainable

    # the abstract trainer (memory plans) lays everything out the same, and its apply compiles to that layout
    graphdef, params = nnx.split(Transformer(CFG, nnx.Rngs(0)), nnx.Param)
    a = PolicyTrainer.abstract(
        graphdef, jax.eval_shape(lambda: params), CFG, mesh, PolicyLossConfig(), OptimConfig(), opts
    )
    for got, want in zip(
        jax.tree_util.tree_leaves(a.opt_state), jax.tree_util.tree_leaves(t.opt_state), strict=True
    ):
        assert (got.shape, got.dtype, got.sharding) == (want.shape, want.dtype, want.sharding)
    assert a.ref_params is not None and all(
        x.dtype == CFG.dtype for x in jax.tree_util.tree_leaves(a.ref_params)
    )
    compiled = a._apply.lower(a.params, a.opt_state, a.params).compile()
    out_opt = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(a.opt_state), jax.tree_util.tree_leaves(compiled.output_shardings[1])
    )
    ok = jax.tree_util.tree_leaves(
        jax.tree_util.tree_map(lambda s, x: s.is_equivalent_to(x.sharding, x.ndim), out_opt, a.opt_state)
    )
    assert ok and all(ok)
