"""The spot trainer's idle-device mode on a data x model mesh (tensor parallelism), 8 fake CPU devices.

On 2 x 4 and 4 x 2 meshes a data group (the model-axis devices of one data index) whose rows have all ended
trains the drafter while the other groups decode with the policy in its tensor-parallel layout. Checked:
(a) the drafter after the rollout equals the same updates replayed on one device, (b) the rollout's tokens
are those of the same rollout without the spot trainer, (c) the fused tick takes the policy params sharded
over the model axis and never gathers one whole inside.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.drafter.test_spot_trainer import SPOT, assert_tick_gathers_no_split_param, leaves
from tlt_jax import sharding as shd
from tlt_jax.drafter import trainer as tr
from tlt_jax.drafter.spot_trainer import SpotConfig, SpotTrainer
from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams

# sampled decoding (temperature 1) of a tiny untied model (4 KV heads: whole heads per device on both meshes);
# a third of the vocabulary ends a row, so rows end at different steps and data groups go idle while others
# still decode. Sampling's `categorical` runs inside a decoding group's branch next to a training group (a
# reversed vocabulary-sharded array there was a collective-permute, which deadlocks XLA:CPU in one group's
# branch: `rollout/spmd.py`)
PROMPTS = [[1, p, p + 1] for p in (6, 14, 50, 54, 2, 10, 18, 22)]
EOS = list(range(2, 128, 3))
SP = SamplingParams(temperature=1.0)

# drafter params vs the same steps on one device. The tick's head is vocabulary-sharded, so its logits'
# log-sum-exp (and the gradient sums over "data") add in another order: float32 rounding, measured at most
# 4.7e-8 (2 x 4, 2 ticks) and 5.7e-8 (4 x 2, 5 ticks) here (1.0e-7 over 9 ticks of a greedy rollout). Each
# step moves a weight by up to lr = 3e-4 (Adam's normalised update): a tick with a wrong batch, key or set of
# groups would be ~1e-4 off, not 1e-6
ATOL = 1e-6


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer(tiny_config("qwen2", num_kv_heads=4), nnx.Rngs(0))


def tp_engine(model: Transformer, data: int, tp: int) -> RolloutEngine:
    cfg = EngineConfig(
        max_new_tokens=24, max_cache_len=96, chunk_steps=2, min_cache_bucket=32, record_hidden=True
    )
    mesh = shd.make_mesh(data, tp, jax.devices()[: data * tp])
    return RolloutEngine(model, cfg, eos_ids=EOS, mesh=mesh, drafter=Drafter(model.cfg, nnx.Rngs(1)))


def record_ticks(spot: SpotTrainer) -> list[tuple[np.ndarray, object]]:
    """Wrap `spot.idle_work`: each tick that ran appends (idle groups, its micro-batches [data, k, ...])."""
    ticks: list[tuple[np.ndarray, object]] = []
    work = spot.idle_work

    def recording(live: tuple[int, ...]):  # noqa: ANN202
        w = work(live)
        if w is None:
            return None
        done, batches = w.on_done, jax.tree.map(np.asarray, w.operands[1])

        def on_done(outputs, seconds) -> None:  # noqa: ANN001
            done(outputs, seconds)
            ticks.append((np.asarray(live) == 0, batches))

        return type(w)(w.key, w.fn, w.operands, w.in_specs, w.out_specs, on_done)

    spot.idle_work = recording
    return ticks


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def replay_tick(graphdef, loss_cfg, tx, state, batches, idle, embed, head):  # noqa: ANN001, ANN201
    """One tick's optimizer step on one device: the summed gradients of every idle group's micro-batches
    (group d, micro-step j keyed as on the mesh), then the mean-gradient update."""
    groups, k = batches.tokens.shape[:2]

    def micro(i: jax.Array, acc: tuple) -> tuple:
        d, j = i // k, i % k
        batch = jax.tree.map(lambda x: x[d, j], batches)
        key = tr.micro_step_key(state.key, state.step, d, j)
        g = tr.drafter_grads_if(idle[d], graphdef, loss_cfg, state.params, batch, key, embed, head)
        return jax.tree.map(jnp.add, acc, g)

    first = jax.tree.map(lambda x: x[0, 0], batches)
    shapes = jax.eval_shape(
        lambda: tr.drafter_grads(graphdef, loss_cfg, state.params, first, state.key, embed, head)
    )
    g, m = jax.lax.fori_loop(0, groups * k, micro, jax.tree.map(jnp.zeros_like, shapes))
    return tr.apply_mean_grads(tx, state, g, m["num_tokens"])


def replay_on_one_device(spot: SpotTrainer, state: tr.TrainState, ticks: list) -> tr.TrainState:
    """The recorded ticks' optimizer steps, in order, on one device (the target's embedding and head whole).
    Padded to 4 groups (the padding never idle), so both meshes share one compiled step."""
    dev = jax.devices()[0]
    embed, head = (jax.device_put(np.asarray(x), dev) for x in (spot.embed_w, spot.head_w))
    for idle, batches in ticks:
        pad = 4 - len(idle)
        batches = jax.tree.map(
            lambda x, p=pad: np.concatenate([x, np.zeros_like(x[:1]).repeat(p, 0)]), batches
        )
        args = jax.device_put((batches, np.concatenate([idle, np.zeros(pad, bool)])), dev)
        state = replay_tick(spot.trainer.graphdef, spot.loss_cfg, spot.tx, state, *args, embed, head)
    return state


def assert_trained_as_on_one_device(spot: SpotTrainer, start: tr.TrainState, ticks: list) -> None:
    """The spot trainer's params equal the recorded ticks replayed on one device from `start`, and moved
    (by more than 100x the tolerance: a tick that trained nothing would pass the equality)."""
    want = replay_on_one_device(spot, start, ticks)
    moved = 0.0
    for a, b, s in zip(leaves(spot.params), leaves(want.params), leaves(start.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)
        moved = max(moved, float(np.abs(b - s).max()))
    assert moved > 100 * ATOL, moved


@pytest.mark.slow
@pytest.mark.devices(8)
@pytest.mark.extended  # make test: the idle-device spot trainer on a 4 x 2 mesh (test_spot_trainer.py)
@pytest.mark.parametrize(("data", "tp"), [(2, 4), (4, 2)])
def test_idle_groups_train_while_tensor_parallel_groups_decode(model: Transformer, data: int, tp: int):
    eng = tp_engine(model, data, tp)
    reference = eng.generate(PROMPTS, n=2, key=jax.random.key(4), sampling=SP)
    spot = SpotTrainer(SpotConfig(mode="idle_devices", **SPOT), Drafter(model.cfg, nnx.Rngs(1)), eng)
    ticks = record_ticks(spot)
    spot.begin_step(1)
    start = jax.device_put(spot.state, jax.devices()[0], may_alias=False)  # a one-device copy
    out = eng.generate(PROMPTS, n=2, key=jax.random.key(4), sampling=SP, hooks=[spot])
    # (b) the decoding groups' results are those of the rollout without the spot trainer
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    np.testing.assert_array_equal(out.lengths, reference.lengths)
    assert ticks and int(spot.state.step) == len(ticks), "no tick trained"
    assert all(idle.any() and not idle.all() for idle, _ in ticks)  # some groups trained, others decoded
    # (a) the drafter equals the same steps on one device
    assert_trained_as_on_one_device(spot, start, ticks)
    # (c) the tick takes the params model-sharded and no collective rebuilds a whole one
    assert_tick_gathers_no_split_param(eng)
