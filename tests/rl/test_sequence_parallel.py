"""Sequence (context) parallelism of the update (issue 35 item 4): the tokens of a micro-batch split over the
model axis (`trainer.seq_parallel`) give the unsplit update: attention equals the reference with gradients,
and a GRPO update on 2 x 2 and 2 x 4 meshes equals the one-device update (loss, gradients, new params).

Tolerances: the split changes only summation orders in float32 (each device sums its tokens' contributions
to a weight gradient, then the devices' partial sums are added; the attention of a query visits the same key
blocks in the same order, so the forward is nearly bitwise), hence 1e-5 on log-probs and 1e-4 relative (1e-6
absolute) on gradients (read from AdamW's first moments, 0.1 g), the bounds test_learner's micro-batching test
uses for the same kind of reordering, and 1e-4 on the loss terms, entropy and gradient norm; the new
parameters by `assert_same_update` (AdamW's first step is about lr * sign(g): equal where the gradient stands
above float noise, at most lr apart elsewhere)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.rl.test_learner import CFG, LR, assert_same_update, leaves, random_batch
from tlt_jax import config_lib, config_schema
from tlt_jax import sharding as shd
from tlt_jax.config_sections import TrainerSection
from tlt_jax.kernels import flash_attention as fa
from tlt_jax.models.layouts import to_layout
from tlt_jax.models.llama import Transformer
from tlt_jax.rl.batch import TrainBatch, micro_weights
from tlt_jax.rl.config import trainer_options
from tlt_jax.rl.optimizer import OptimConfig
from tlt_jax.rl.trainer import PolicyLossConfig, PolicyTrainer, TrainerOptions

MICRO = 4  # rows per micro-batch: 2 groups of 2, so the 8-row batch is 2 accumulated micro-batches


@pytest.mark.devices(8)
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_sequence_parallel_attention_equals_the_reference(dtype: str, tol: float) -> None:
    """Queries split over 4 devices (rows over 2) at ragged cache offsets, key padding and packed segments:
    output and dq, dk, dv equal the masked-softmax reference (float32 1e-5; bfloat16 3e-2, the flash tests'
    bound: both compute in float32 and round their results to bfloat16)."""
    rng = np.random.default_rng(0)
    b, t, hq, hkv, d, s = 2, 16, 4, 2, 8, 24
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(b, hkv, s, d)), dtype) for _ in range(2))
    off, kv_len = jnp.asarray([3, 8]), jnp.asarray([19, 22])
    qseg = jnp.asarray(np.sort(rng.integers(0, 2, (b, t)), axis=1))
    kseg = jnp.concatenate(
        [jnp.zeros((b, 8), jnp.int32), jnp.asarray(np.sort(rng.integers(0, 2, (b, 16))))], 1
    )
    sp = fa.SequenceParallel(shd.make_mesh(2, 4), "model", "blockwise")

    def run(impl: object) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        def f(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            out = fa.flash_attention(q, k, v, off, kv_len, qseg, kseg, impl=impl, block_q=2, block_k=4)
            return jnp.sum(jnp.sin(out)), out

        (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return out, grads

    (want, gwant), (got, ggot) = run("reference"), run(sp)
    for x, y in zip((got, *ggot), (want, *gwant), strict=True):
        assert x.dtype == y.dtype == dtype
        np.testing.assert_allclose(np.float32(x), np.float32(y), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="multiples of 4"):
        fa.flash_attention(q[:, :6], k, v, off, kv_len, impl=sp)


def _trainer(data: int, model: int, **kw: object) -> PolicyTrainer:
    """The test_learner trainer's loss and optimizer (lr 1e-2), with a KL term and fused old log-probs."""
    mesh = shd.make_mesh(data, model, jax.devices()[: data * model])
    chunk = kw.pop("logits_chunk", 0)
    return PolicyTrainer(
        Transformer(CFG, nnx.Rngs(0)),
        mesh,
        PolicyLossConfig(temperature=0.8, kl_coef=0.5, logits_chunk=chunk),
        OptimConfig(lr=LR, weight_decay=0.0),
        TrainerOptions(micro_batch_size=MICRO, **kw),
    )


def _update(t: PolicyTrainer, batch: TrainBatch) -> tuple[list, list, dict[str, float], np.ndarray]:
    """One update on `batch` (two micro-batches): (AdamW's state after it, new params, metrics, log-probs).
    The state holds the gradient (clipped by its global norm): mu = 0.1 g and nu = 0.001 g^2 after the first
    step, so comparing it compares the gradients without compiling a second backward pass."""
    mask = np.asarray(batch.response_mask)
    w = micro_weights(mask.reshape((-1, MICRO // 2) + mask.shape[1:]), t.loss.aggregation)
    metrics, (logp,) = t.update([t.put_micro(batch)], [w])
    state, params = to_layout((t.opt_state, t.params), stacked=False)  # a scanned trainer's are stacked
    return leaves(state), leaves(params), metrics, np.asarray(logp).reshape(mask.shape)


@pytest.fixture(scope="module")
def unsplit() -> tuple[TrainBatch, list, tuple]:
    """The batch, the initial params and the one-device update. Prompts of 10 columns, responses of 15
    (bucket 5: neither divides 2 or 4, so the split pads both); reference log-probs near the policy's
    (uniform over the 128 tokens, +-0.3) for a KL term that depends on every log-prob."""
    batch = random_batch(3, bucket=5)
    noise = np.random.default_rng(1).normal(0.0, 0.3, batch.ref_logp.shape).astype(np.float32)
    batch = batch.replace(ref_logp=np.float32(-np.log(CFG.vocab_size)) + noise)
    t = _trainer(1, 1)
    return batch, leaves(t.params), _update(t, batch)


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    "model,kw",
    [
        (2, dict()),  # unrolled layers, no remat, logits at once
        (4, dict(scan_layers=True, remat="nothing_saveable", fsdp=True, logits_chunk=8, mlp_chunk=2)),
    ],
)
def test_sequence_parallel_update_equals_the_unsplit_update(model: int, kw: dict, unsplit: tuple) -> None:
    """An update with each row's tokens split over `model` devices (rows over 2) = the one-device update:
    log-probs, loss terms, entropy, gradient norm, the gradients (AdamW's moments) and the new params."""
    batch, before, (s0, p0, m0, logp0) = unsplit
    t = _trainer(2, model, seq_parallel=True, attn_impl="blockwise", **kw)
    assert isinstance(t._attn, fa.SequenceParallel) and t._attn.size == model
    for x, y in zip(leaves(to_layout(t.params, stacked=False)), before, strict=True):
        np.testing.assert_array_equal(x, y)
    state, params, metrics, logp = _update(t, batch)
    mask = np.asarray(batch.response_mask) > 0
    np.testing.assert_allclose(logp[mask], logp0[mask], atol=1e-5, rtol=1e-5)
    for key in ("loss/pg", "loss/kl", "policy/entropy", "optim/grad_norm"):
        assert metrics[key] == pytest.approx(m0[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(state, s0, strict=True):  # mu = 0.1 g: 1e-6 absolute in g
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    grads = [
        x / 0.1 for x in s0[1 : 1 + len(before)]
    ]  # optax's chain: clip (no state), adamw (count, mu, nu)
    assert_same_update(before, p0, params, grads)


def test_seq_parallel_config_key_reaches_the_trainer() -> None:
    """config.trainer.seq_parallel (off by default) becomes TrainerOptions.seq_parallel."""
    assert not TrainerSection().seq_parallel
    config = config_schema.base_config()
    config.model.random, config.trainer.seq_parallel = config_lib.tiny_random_model("llama"), True
    assert trainer_options(config_schema.parse(config, check_paths=False)).seq_parallel
