"""The drafter trainer: device gradients summed then applied once equal one step on the union (also under a
real shard_map on 8 fake CPU devices, idle devices contributing exact zeros), per-device key streams,
bit-identical save/restore, no recompiles, and training that lowers the loss."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tlt_jax.drafter import packing
from tlt_jax.drafter.loss import LossConfig
from tlt_jax.drafter.trainer import (
    DrafterTrainer,
    apply_mean_grads,
    drafter_grads,
    drafter_grads_if,
    make_schedule,
    mean_grads,
    micro_step_key,
    optimizer_from_config,
)
from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.utils.checkpoint import Checkpointer

CFG = tiny_config(vocab_size=64)
LENGTHS, PROMPTS = [10, 14, 7, 12, 9, 11, 13, 8, 12], [3, 5, 2, 4, 3, 4, 2, 3, 5]
grads_fn = jax.jit(drafter_grads, static_argnums=(0, 1))


class CompileCounter:
    """Counts programs lowered for XLA (fires even when the persistent compilation cache supplies them)."""

    def __init__(self) -> None:
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            self.count += 1


_COMPILES = CompileCounter()


@pytest.fixture(scope="module")
def setup(random_samples):
    target = Transformer(CFG, nnx.Rngs(0))
    samples = random_samples(target, LENGTHS, PROMPTS, seed=3)
    return target, samples, target.embed[...], target.head_weight()


def _tx(lr: float = 1e-2, steps: int = 20):
    return optimizer_from_config(
        {"lr": lr, "steps": steps, "warmup": 2, "weight_decay": 0.01, "clip_norm": 1.0}
    )[0]


def _batch(samples, rows=2, seq_len=32):
    batch, idx = packing.pack_samples(samples, seq_len, rows)
    assert idx == list(range(len(samples)))
    return packing.to_device(batch)


def _close(a, b, rtol=2e-4, atol=1e-7):
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol), a, b
    )


def test_summed_device_gradients_equal_one_step_on_the_union(setup):
    """Three "devices" with different amounts of data: sum (grad S, N), divide once, apply once == the mean
    gradient and the update of one step on all their samples packed together (token-weighted, not an
    average of the three per-device means)."""
    target, samples, emb, head = setup
    cfg = LossConfig(w_feat=1.0, w_ce=0.1, ttt_steps=1, ttt_positions=32)  # nothing subsampled: exact
    trainer = DrafterTrainer(_tx(), cfg, seed=0)
    state = trainer.init_state(Drafter(CFG, nnx.Rngs(1)))
    graphdef, key = trainer.graphdef, jax.random.key(5)
    parts = [samples[:2], samples[2:7], samples[7:]]
    per_dev = [grads_fn(graphdef, cfg, state.params, _batch(p), key, emb, head) for p in parts]
    g_sum = jax.tree.map(lambda *g: sum(g), *[g for g, _ in per_dev])
    n_sum = sum(float(m["num_tokens"]) for _, m in per_dev)
    g_union, m_union = grads_fn(graphdef, cfg, state.params, _batch(samples, rows=6), key, emb, head)
    assert float(m_union["num_tokens"]) == n_sum == sum(s.num_response for s in samples)
    _close(mean_grads(g_sum, n_sum), mean_grads(g_union, m_union["num_tokens"]))
    # the per-device means weighted equally would be a different (wrong) gradient
    g_avg = jax.tree.map(lambda *g: sum(g) / 3, *[mean_grads(g, m["num_tokens"]) for g, m in per_dev])
    gap = max(float(jnp.abs(a - b).max()) for a, b in zip(*map(jax.tree.leaves, (g_avg, g_sum)), strict=True))
    assert gap > 1e-4
    # applied once (SGD: the update is proportional to the gradient) == one step on the union
    sgd = optax.sgd(0.5)
    from_devices = apply_mean_grads(sgd, state.replace(opt_state=sgd.init(state.params)), g_sum, n_sum)
    from_union = apply_mean_grads(sgd, state.replace(opt_state=sgd.init(state.params)), g_union, n_sum)
    _close(from_devices.params, from_union.params, rtol=1e-5, atol=1e-7)
    assert int(from_devices.step) == 1
    # no trained tokens anywhere: the state is left as it was (AdamW momentum would still move it)
    same = apply_mean_grads(trainer.tx, state, jax.tree.map(jnp.zeros_like, g_sum), jnp.float32(0))
    assert int(same.step) == 0
    jax.tree.map(np.testing.assert_array_equal, same.params, state.params)


@pytest.mark.devices(8)
def test_spot_step_under_shard_map(setup):
    """The spot trainer's pattern on 8 fake CPU devices: idle devices run a micro-step with their own key,
    busy devices contribute exact zeros (skipped by lax.cond, their data ignored), one psum, one update;
    equal to the host computing the same devices' gradients one by one."""
    target, samples, emb, head = setup
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    cfg = LossConfig(w_feat=1.0, w_ce=0.1, ce_tokens=8, ttt_steps=1, ttt_positions=4)  # keyed draws
    trainer = DrafterTrainer(_tx(), cfg, seed=7)
    state = trainer.init_state(Drafter(CFG, nnx.Rngs(2)))
    graphdef, tx = trainer.graphdef, trainer.tx
    active = np.array([1, 0, 1, 1, 0, 0, 1, 0], bool)
    host = [packing.pack_samples([samples[d], samples[d + 1]], 32, 2)[0] for d in range(8)]
    stacked = jax.tree.map(lambda *x: jnp.asarray(np.stack(x)), *host)

    def per_device(state, batch, active):
        batch = jax.tree.map(lambda x: x[0], batch)
        key = micro_step_key(state.key, state.step, jax.lax.axis_index("data"))
        g, m = drafter_grads_if(
            active[0], graphdef, cfg, state.params, batch, key, emb, head, axis_name="data"
        )
        g_all, m_all = jax.lax.psum((g, m), "data")
        new = apply_mean_grads(tx, state, g_all, m_all["num_tokens"])
        return new, m_all, jax.tree.map(lambda x: x[None], (g, m))

    spot = jax.jit(
        jax.shard_map(
            per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P(), P("data"))
        )
    )
    new, m_all, (g_dev, m_dev) = spot(state, stacked, jnp.asarray(active))

    want_g, want_n = [], 0.0
    for d in range(8):
        g_d = jax.tree.map(lambda x, d=d: np.asarray(x)[d], g_dev)
        if not active[d]:  # exact zeros, no matter the data it was handed
            assert all((leaf == 0).all() for leaf in jax.tree.leaves(g_d))
            assert float(np.asarray(m_dev["num_tokens"])[d]) == 0.0
            continue
        key = micro_step_key(state.key, state.step, d)
        g, m = grads_fn(graphdef, cfg, state.params, packing.to_device(host[d]), key, emb, head)
        _close(g_d, g, rtol=1e-5, atol=1e-8)
        want_g.append(g)
        want_n += float(m["num_tokens"])
    assert float(m_all["num_tokens"]) == want_n > 0
    g_sum = jax.tree.map(lambda *g: sum(g), *want_g)
    ref = apply_mean_grads(tx, state, g_sum, want_n)
    _close(new.params, ref.params, rtol=1e-5, atol=1e-7)
    _close(new.opt_state, ref.opt_state, rtol=1e-4, atol=1e-9)
    assert int(new.step) == 1
    # per-device streams: the same batch on every device draws different CE subsets
    same = jax.tree.map(lambda x: jnp.broadcast_to(x[2], x.shape), stacked)
    _, _, (_, m_same) = spot(state, same, jnp.ones(8, bool))
    ce = np.asarray(m_same["ce_sum"])
    assert len(set(np.round(ce, 5).tolist())) == 8
    _, _, (_, m_again) = spot(state, same, jnp.ones(8, bool))
    np.testing.assert_array_equal(np.asarray(m_again["ce_sum"]), ce)  # and deterministic


def test_micro_step_keys_are_distinct_and_deterministic():
    base = jax.random.key(11)
    grid = [(s, d, m) for s in range(4) for d in range(8) for m in range(3)]
    keys = {
        tuple(np.asarray(jax.random.key_data(micro_step_key(base, s, d, m))).tolist()) for s, d, m in grid
    }
    assert len(keys) == len(grid)
    a = jax.random.key_data(jax.jit(micro_step_key)(base, jnp.int32(3), jnp.int32(5), 1))
    np.testing.assert_array_equal(a, jax.random.key_data(micro_step_key(base, 3, 5, 1)))
    other = jax.random.key_data(micro_step_key(jax.random.key(12), 3, 5, 1))
    assert not np.array_equal(a, other)


def test_step_key_follows_the_state(setup):
    """The step's draws come from the state's key and step: two seeds give different CE subsets, the same
    seed the same, and successive steps different ones (the old step folded one fixed key)."""
    target, samples, emb, head = setup
    cfg = LossConfig(w_feat=0.0, w_ce=1.0, ce_tokens=4)
    batch = _batch(samples[:4])
    sgd = optax.sgd(0.0)  # lr 0: the params stay, so only the key changes between steps

    def ce_sums(seed, steps):
        trainer = DrafterTrainer(sgd, cfg, seed=seed)
        state = trainer.init_state(Drafter(CFG, nnx.Rngs(4)))
        out = []
        for _ in range(steps):
            state, m = trainer.step(state, batch, emb, head)
            out.append(float(m["ce"]))
        return out

    a, b, c = ce_sums(0, 3), ce_sums(0, 3), ce_sums(1, 3)
    assert a == b
    assert a != c
    assert len(set(a)) == 3


def test_save_restore_continues_bit_identically(setup, tmp_path):
    target, samples, emb, head = setup
    cfg = LossConfig(w_feat=1.0, w_ce=0.1, ce_tokens=8, feature_noise=0.2, ttt_steps=1, ttt_positions=4)
    batches = [_batch(samples[i : i + 3]) for i in range(0, 9, 3)] * 2

    trainer = DrafterTrainer(_tx(), cfg, seed=3)
    state = trainer.init_state(Drafter(CFG, nnx.Rngs(5)))
    ckpt = Checkpointer(tmp_path / "train_state")  # async
    for b in batches[:2]:
        state, _ = trainer.step(state, b, emb, head)
    info = trainer.save(ckpt, state)
    assert info.saved and info.step == 2
    for b in batches[2:]:  # the saved state's buffers are donated here: the checkpoint must not care
        state, _ = trainer.step(state, b, emb, head)
    ckpt.wait()

    other = DrafterTrainer(_tx(), cfg, seed=99)  # another seed and init: the restore brings key and params
    resumed = other.restore(ckpt, like=other.init_state(Drafter(CFG, nnx.Rngs(6))))
    ckpt.close()
    assert int(resumed.step) == 2
    for b in batches[2:]:
        resumed, _ = other.step(resumed, b, emb, head)

    def raw(s):
        return jax.tree.map(np.asarray, s.replace(key=jax.random.key_data(s.key)))

    jax.tree.map(np.testing.assert_array_equal, raw(resumed), raw(state))
    assert int(resumed.step) == 6


def test_training_lowers_the_loss_without_recompiling(setup):
    target, samples, emb, head = setup
    emb_before, head_before = np.asarray(emb).copy(), np.asarray(head).copy()
    trainer = DrafterTrainer(_tx(), LossConfig(w_feat=1.0, w_ce=0.1, max_loss_tokens=48), seed=0)
    state = trainer.init_state(Drafter(CFG, nnx.Rngs(3)))
    params_before = jax.tree.map(np.asarray, state.params)
    batches = [
        packing.to_device(b)
        for b in packing.iterate_packed(samples, 32, 2, np.random.default_rng(0), max_loss_tokens=48)
    ]
    assert len(batches) >= 2
    state, m = trainer.step(state, batches[0], emb, head)  # compiles once
    compiled, losses = _COMPILES.count, [float(m["loss"])]
    for i in range(1, 21):
        state, m = trainer.step(state, batches[i % len(batches)], emb, head)
        if i % len(batches) == 0:
            losses.append(float(m["loss"]))  # the loss on batches[0] before this step's update
    assert _COMPILES.count == compiled, "a step with another batch of the same shape recompiled"
    assert int(state.step) == 21
    assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses
    assert float(m["grad_norm"]) > 0
    np.testing.assert_array_equal(np.asarray(emb), emb_before)
    np.testing.assert_array_equal(np.asarray(head), head_before)
    changed = jax.tree.map(lambda a, b: not np.allclose(a, np.asarray(b)), params_before, state.params)
    assert all(jax.tree.leaves(changed))
    # the optimizer state covers the drafter's params only (no target-sized moments)
    n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
    assert n_opt <= 2 * sum(x.size for x in jax.tree.leaves(state.params)) + 8


def test_schedule_warmup_and_decay():
    s = make_schedule(1e-3, total_steps=100, warmup_steps=10, end_lr_ratio=0.1)
    assert float(s(0)) == 0.0
    np.testing.assert_allclose(float(s(5)), 5e-4, rtol=1e-5)
    np.testing.assert_allclose(float(s(10)), 1e-3, rtol=1e-5)
    np.testing.assert_allclose(float(s(100)), 1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="schedule"):
        make_schedule(1e-3, 10, 1, schedule="linear")
