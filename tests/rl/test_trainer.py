"""PolicyTrainer's layouts (the optimizer state lives where its parameters live, real or abstract) and its
forward: flash attention equals the tree-attention forward, per-layer remat and chunked logits keep the
numbers (log-probs, entropies, gradients)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from optax.transforms import MaskedNode

from tlt_jax import config_lib, config_schema
from tlt_jax import sharding as shd
from tlt_jax.config_sections import TrainerSection
from tlt_jax.models.config import ModelConfig, tiny_config
from tlt_jax.models.layouts import layout_graphdef, stack_layers, unstack_layers
from tlt_jax.models.llama import Transformer
from tlt_jax.rl.batch import TrainBatch, build_train_batch
from tlt_jax.rl.config import trainer_options
from tlt_jax.rl.forward import ForwardOut, response_logprobs
from tlt_jax.rl.optimizer import OptimConfig
from tlt_jax.rl.trainer import PolicyLossConfig, PolicyTrainer, TrainerOptions
from tlt_jax.utils.config_checks import SectionError

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


# ----------------------------------------------------------------------------------------------------------
# the trainer's forward: flash attention, per-layer remat, chunked logits (issue 35)
# ----------------------------------------------------------------------------------------------------------


def _batch(nb: int = 12, seed: int = 0) -> TrainBatch:
    """3 groups x 2 samples: prompts of 3..8 tokens (padded to 8), responses of 1..nb tokens."""
    rng = np.random.default_rng(seed)
    prompts = [p for g in range(3) for p in [rng.integers(1, CFG.vocab_size, 3 + 2 * g).tolist()] * 2]
    lengths = np.asarray([nb, 3, 1, nb - 2, 5, nb])
    return jax.tree_util.tree_map(
        jnp.asarray,
        build_train_batch(
            prompts,
            rng.integers(1, CFG.vocab_size, (6, nb)),
            lengths,
            rng.uniform(-1, 1, 6).astype(np.float32),
            np.ones(6, bool),
            group_size=2,
            seq_bucket=4,
            max_response=nb,
        ),
    )


def _forward_and_grads(
    batch: TrainBatch, cfg: ModelConfig = CFG, stacked: bool = False, **kw: object
) -> tuple[ForwardOut, list[np.ndarray]]:
    """response_logprobs and the gradient of sum(logp * mask) + 0.1 * sum(entropy * mask) in the params
    (`stacked`: the model in the stacked layout, its layers scanned; gradients unstacked to compare)."""
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(5)), nnx.Param)
    if stacked:
        graphdef, params = layout_graphdef(cfg, True), stack_layers(params)
    mask = batch.rows(batch.response_mask)

    def loss(p: nnx.State) -> tuple[jax.Array, ForwardOut]:
        out = response_logprobs(nnx.merge(graphdef, p), batch, temperature=0.7, return_hidden=True, **kw)
        return jnp.sum(out.logp * mask) + 0.1 * jnp.sum(out.entropy * mask), out

    grads, out = jax.jit(jax.grad(loss, has_aux=True))(params)
    return out, [np.asarray(x) for x in jax.tree_util.tree_leaves(unstack_layers(grads))]


def _assert_same(
    a: tuple[ForwardOut, list[np.ndarray]], b: tuple[ForwardOut, list[np.ndarray]], tol: float
) -> None:
    (oa, ga), (ob, gb) = a, b
    for x, y in ((oa.logp, ob.logp), (oa.entropy, ob.entropy), (oa.hidden, ob.hidden)):
        np.testing.assert_allclose(x, y, atol=tol, rtol=tol)
    for x, y in zip(ga, gb, strict=True):
        np.testing.assert_allclose(x, y, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", ["blockwise", "reference"])
def test_flash_attention_forward_equals_the_tree_attention_forward(impl: str) -> None:
    """The trainer's forward with `flash_attention` (a prompt pass, then responses at each row's prompt
    length) equals the forward it replaced (tree attention under a causal mask): log-probs, entropies,
    hidden states and parameter gradients, float32 within 2e-5."""
    batch = _batch()
    _assert_same(_forward_and_grads(batch, attn_impl=impl), _forward_and_grads(batch, attn_impl=None), 2e-5)


def test_per_layer_remat_keeps_the_gradients() -> None:
    """Rematerialised layers recompute the same numbers: outputs and gradients equal within 1e-6 (f32)."""
    batch = _batch()
    plain = _forward_and_grads(batch, attn_impl="blockwise")
    for policy in ("nothing_saveable", "dots_saveable"):
        _assert_same(_forward_and_grads(batch, attn_impl="blockwise", remat=policy), plain, 1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_scanned_layers_equal_the_unrolled_stack(arch: str) -> None:
    """The stacked layout's layers as one `lax.scan` over [L]-leading parameters and a stacked cache (prompt
    pass writing the cache the response pass reads) give the unrolled stack's log-probs, entropies, hidden
    states and per-layer parameter gradients, with and without per-layer remat: float32 within 1e-5 (Llama
    tied head; Qwen2 QKV bias)."""
    cfg = tiny_config(arch, num_layers=3)
    batch = _batch()
    plain = _forward_and_grads(batch, cfg, attn_impl="blockwise")
    for remat in ("none", "nothing_saveable"):
        scanned = _forward_and_grads(batch, cfg, stacked=True, attn_impl="blockwise", remat=remat)
        _assert_same(scanned, plain, 1e-5)


def test_scanned_remat_cuts_the_temporaries() -> None:
    """What per-layer remat is for, as XLA:CPU compiles it: at 12 tiny layers the scanned update's
    temporaries with nothing_saveable are well under half of those without remat (measured 72 vs 242 MiB;
    the unrolled stack keeps 248 MiB with remat: XLA:CPU's CSE merges its recompute back)."""
    cfg = tiny_config(num_layers=12, hidden_size=128, intermediate_size=256)
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _batch(256))
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0), True)), nnx.Param)

    def temp(remat: str) -> int:
        def loss(p: nnx.State, b: TrainBatch) -> jax.Array:
            out = response_logprobs(
                nnx.merge(graphdef, p), b, temperature=1.0, attn_impl="blockwise", remat=remat
            )
            return jnp.sum(out.logp * b.rows(b.response_mask))

        return jax.jit(jax.grad(loss)).lower(params, batch).compile().memory_analysis().temp_size_in_bytes

    assert temp("nothing_saveable") < 0.5 * temp("none")


@pytest.mark.parametrize("nb,chunk", [(12, 4), (11, 4)])
def test_chunked_logits_equal_full_logits_at_any_length(nb: int, chunk: int) -> None:
    """Logits in chunks (the last one zero-padded when Nb is not a multiple) give the same log-probs,
    entropies and gradients as all logits at once (f32, 1e-5); nothing falls back to full logits."""
    batch = _batch(nb)
    _assert_same(
        _forward_and_grads(batch, attn_impl="blockwise", logits_chunk=chunk),
        _forward_and_grads(batch, attn_impl="blockwise", logits_chunk=0),
        1e-5,  # the tied embedding's gradient sums the chunks in another order
    )
    # the chunked program holds no [rows, Nb, V] logits, only [rows, chunk, V] (V = 97: no other dim is)
    model = Transformer(tiny_config(num_layers=1, vocab_size=97), nnx.Rngs(0))
    hlo = jax.jit(lambda b: response_logprobs(model, b, temperature=1.0, logits_chunk=chunk).logp)
    text = hlo.lower(batch).as_text()
    assert f"6x{nb}x97xf32" not in text and f"6x{chunk}x97xf32" in text


def test_trainer_config_keys_reach_the_trainer() -> None:
    """config.trainer.attn_impl / remat are checked by the section and become TrainerOptions."""
    assert TrainerSection(attn_impl="blockwise", remat="dots_saveable").remat == "dots_saveable"
    with pytest.raises(SectionError) as err:
        TrainerSection(attn_impl="flash", remat="full")
    assert "attn_impl='flash'" in str(err.value) and "remat='full'" in str(err.value)
    mesh = shd.make_mesh(1, 1, jax.devices()[:1])
    opts = TrainerOptions(micro_batch_size=2, attn_impl="reference", remat="nothing_saveable")
    t = PolicyTrainer(Transformer(CFG, nnx.Rngs(0)), mesh, PolicyLossConfig(), OptimConfig(), opts)
    assert (t.attn_impl, t.remat, t.stacked) == ("reference", "nothing_saveable", False)
    config = config_schema.base_config()
    config.model.random, config.trainer.scan_layers = config_lib.tiny_random_model("llama"), True
    assert trainer_options(config_schema.parse(config, check_paths=False)).scan_layers
    with pytest.raises(SectionError, match="train_layers=2 with config.trainer.scan_layers=True"):
        TrainerSection(train_layers=2, scan_layers=True)


def test_trainer_forward_and_backward_hold_no_t_by_s_scores() -> None:
    """The update's program (forward + backward, logits chunked) at 2,048 response tokens, compiled from
    abstract shapes: XLA's temporaries stay under two [T, T] float32 matrices (32 MiB; measured 22 MiB),
    where the tree-attention forward it replaced needs 273 MiB (its [rows, heads, T, T + Tp] scores)."""
    cfg = tiny_config(
        num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16
    )
    nb, s = 2048, jax.ShapeDtypeStruct
    batch = TrainBatch(
        prompt=s((1, 32), jnp.int32),
        prompt_len=s((1,), jnp.int32),
        response=s((1, 2, nb), jnp.int32),
        response_mask=s((1, 2, nb), jnp.float32),
        advantages=s((1, 2), jnp.float32),
        old_logp=s((1, 2, nb), jnp.float32),
        ref_logp=s((1, 2, nb), jnp.float32),
    )
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)

    def loss(p: nnx.State, b: TrainBatch) -> jax.Array:
        out = response_logprobs(
            nnx.merge(graphdef, p), b, temperature=1.0, attn_impl="blockwise", logits_chunk=256
        )
        return jnp.sum(out.logp * b.rows(b.response_mask))

    compiled = jax.jit(jax.grad(loss)).lower(params, batch).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * nb * nb * 4


@pytest.mark.devices(4)
def test_paper_layout_gradients_equal_one_device() -> None:
    """The paper configs' trainer layout on a 2 x 2 mesh (layers stacked and scanned, remat, FSDP: an untied
    embedding split by hidden dim for the lookup, each layer cast and gathered inside the scan, micro-batches
    of one row: sub-groups) gives one device's unrolled gradients (float32, 1e-5): Qwen2, untied head."""
    from tests.rl.test_learner import random_batch

    cfg = tiny_config("qwen2")
    batch = random_batch(2)  # 4 groups x 2 samples

    def grads(data: int, model: int, **kw: object) -> list[np.ndarray]:
        t = PolicyTrainer(
            Transformer(cfg, nnx.Rngs(0)),
            shd.make_mesh(data, model, jax.devices()[: data * model]),
            PolicyLossConfig(temperature=0.8),
            OptimConfig(),
            TrainerOptions(attn_impl="blockwise", **kw),
        )
        mask = np.asarray(batch.response_mask)
        k = mask.size // mask.shape[-1] // t.micro_batch_size
        w = np.asarray([1.0 / k] * k, np.float32)
        return [np.asarray(x) for x in jax.tree.leaves(unstack_layers(t.gradients(t.put_micro(batch), w)))]

    want = grads(1, 1, micro_batch_size=8)
    got = grads(2, 2, micro_batch_size=1, scan_layers=True, remat="nothing_saveable", fsdp=True)
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-4)
