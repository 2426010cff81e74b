"""PolicyTrainer's layouts (the optimizer state lives where its parameters live, real or abstract) and its
forward: flash attention equals the tree-attention forward, per-layer remat and chunked logits keep the
numbers (log-probs, entropies, gradients)."""

from __future__ import annotations

import dataclasses
import pathlib

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
from tlt_jax.rl import config as rl_config
from tlt_jax.rl.advantages import Advantages, train_batch
from tlt_jax.rl.batch import TrainBatch, build_train_batch, micro_weights
from tlt_jax.rl.config import trainer_options
from tlt_jax.rl.forward import ForwardOut, response_logprobs
from tlt_jax.rl.optimizer import OptimConfig
from tlt_jax.rl.plan import StepPlan
from tlt_jax.rl.trainer import PolicyLossConfig, PolicyTrainer, TrainerOptions
from tlt_jax.rl.update import mini_batch_groups, update_policy
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
    """Rematerialised layers recompute the same numbers: outputs and gradients equal within 3e-6 (f32; the
    recomputed forward is fused apart from the backward, so sums may round differently: 1 of 8,192 gradient
    entries 1.1e-6 apart with XLA:CPU's loop emitters, where a wrong remat would be off by far more)."""
    batch = _batch()
    plain = _forward_and_grads(batch, attn_impl="blockwise")
    for policy in ("nothing_saveable", "dots_saveable"):
        _assert_same(_forward_and_grads(batch, attn_impl="blockwise", remat=policy), plain, 3e-6)


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.extended)])
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


# make test's case pads its last chunk (11 = 4 + 4 + 3): the paper configs' path (bucket 512, chunk 1024)
@pytest.mark.parametrize("nb,chunk", [(11, 4), pytest.param(12, 4, marks=pytest.mark.extended)])
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


# ----------------------------------------------------------------------------------------------------------
# VeRL's loss options (#46 item 4): config checks and plumbing, PPO epochs, one update with every option
# ----------------------------------------------------------------------------------------------------------

SMOKE = pathlib.Path(__file__).resolve().parents[2] / "configs" / "smoke.py"


def test_loss_option_keys_are_checked_and_reach_the_loss_and_plan() -> None:
    bad = config_lib.load_config_file(SMOKE, "")
    bad.rl.update(clip_ratio_c=1.0, kl_loss_type="full", reward_kl_penalty="k4", adv_std="sample")
    bad.rl.update(rollout_is="geometric", rollout_is_threshold=0.0, reward_kl_ctrl="pid")
    bad.rl.update(entropy_coeff=-0.1, ppo_epochs=0, reward_kl_coef=-1.0)
    with pytest.raises(ValueError) as err:
        rl_config.validate_grpo(bad, check_paths=False)
    for needle in (
        "clip_ratio_c=1.0: dual-clip's bound must be > 1",
        "kl_loss_type='full': use one of",
        "reward_kl_penalty='k4'",
        "adv_std='sample'",
        "rollout_is='geometric'",
        "rollout_is_threshold=0.0",
        "reward_kl_ctrl='pid'",
        "entropy_coeff=-0.1: must be >= 0",
        "ppo_epochs=0: must be >= 1",
        "reward_kl_coef=-1.0: must be >= 0",
    ):
        assert needle in str(err.value), needle
    plain = rl_config.validate_grpo(config_lib.load_config_file(SMOKE, ""), check_paths=False)
    assert rl_config.policy_loss_config(plain) == PolicyLossConfig(
        temperature=1.0, max_len=16, fuse_old_logprobs=True
    )
    assert not rl_config.trainer_options(plain).with_reference
    c = config_lib.load_config_file(SMOKE, "")
    c.rl.update(clip_ratio_c=3.0, entropy_coeff=0.01, kl_loss_type="k2", adv_std="unbiased", ppo_epochs=2)
    c.rl.update(
        mini_batch_shuffle=True, rollout_is="sequence", rollout_is_threshold=3.0, reward_kl_coef=0.001
    )
    job = rl_config.validate_grpo(c, check_paths=False)
    lc = rl_config.policy_loss_config(job)
    assert (lc.clip_ratio_c, lc.entropy_coeff, lc.kl_loss_type) == (3.0, 0.01, "k2")
    assert (lc.rollout_is, lc.rollout_is_threshold) == ("sequence", 3.0)
    assert not lc.fuse_old_logprobs  # two epochs (and KL in the reward) need the old log-probs first
    assert rl_config.trainer_options(job).with_reference  # KL in the reward needs the reference
    plan = StepPlan.from_config(job)
    assert (plan.adv_std, plan.ppo_epochs, plan.mini_batch_shuffle, plan.rollout_is) == (
        "unbiased",
        2,
        True,
        "sequence",
    )
    assert plan.updates_per_step == 2 and plan.needs_reference and plan.reward_kl.coef == 0.001
    assert rl_config.optim_config(job).decay_steps == c.num_steps * 2  # the schedule counts every update


def test_ppo_epochs_regroup_and_refuse_fused_old_logprobs() -> None:
    from tests.rl.test_learner_phases import rollout, stub_trainer

    plan = StepPlan(prompts=2, group=4, mini_batches=2, ppo_epochs=3, seq_bucket=4, max_response=6)
    groups = [g.tolist() for g in mini_batch_groups(plan)]
    assert groups == [[0], [1]] * 3
    shuffled = dataclasses.replace(plan, mini_batch_shuffle=True, shuffle_seed=3)
    runs = [[g.tolist() for g in mini_batch_groups(shuffled)] for _ in range(2)]
    assert runs[0] == runs[1]  # seeded: a resumed step regroups as the uninterrupted one
    assert all(sorted(runs[0][e] + runs[0][e + 1]) == [0, 1] for e in (0, 2, 4))  # each epoch: all once
    assert runs[0] != groups  # seed 3's permutations: [1] first in some epoch
    r = rollout()
    batch = train_batch(r, Advantages(np.zeros(8, np.float32), np.zeros(8, bool)), plan)
    out = update_policy(stub_trainer(fused=False), batch, r.lengths, np.zeros((8, 6), np.float32), plan)
    assert out.skipped == 6  # 2 mini-batches x 3 epochs, every group filtered
    with pytest.raises(ValueError, match="ppo_epochs=3 with fused old log-probs"):
        update_policy(stub_trainer(fused=True), batch, r.lengths, np.zeros((8, 6), np.float32), plan)
    # the rollout's log-probs ride along only when the loss weighs tokens by them, masked like the tokens
    assert batch.rollout_logp is None
    tis = train_batch(
        r,
        Advantages(np.zeros(8, np.float32), np.ones(8, bool)),
        dataclasses.replace(plan, rollout_is="token"),
    )
    np.testing.assert_array_equal(tis.rollout_logp, np.where(tis.response_mask > 0, -0.5, 0.0))


def _seq_mean_token_mean(x: np.ndarray, mask: np.ndarray) -> float:
    """NumPy's GRPO aggregation: each row's token mean, averaged over the rows with a token."""
    rows = mask.sum(1) > 0
    return float(np.mean((x * mask).sum(1)[rows] / mask.sum(1)[rows]))


def test_one_update_with_every_loss_option() -> None:
    """A tiny trainer's update over 3 micro-batches with the default aggregation (seq_mean_token_mean),
    given old log-probs (not fused: ratios 0.37..6), dual-clip binding (A < 0 tokens with ratio > 3 capped at
    -3A), clip-higher, entropy bonus, k1 KL loss and token-level truncated IS: its metrics equal the terms
    recomputed in NumPy from the log-probs and entropies of the same parameters' forward (VeRL's
    compute_policy_loss_vanilla with rollout_is_weights, agg_loss's seq-mean-token-mean)."""
    rng = np.random.default_rng(3)
    batch = jax.tree_util.tree_map(np.asarray, _batch())  # rows of 12, 3, 1, 10, 5, 12 tokens
    mask = batch.response_mask.reshape(6, -1)
    adv = np.asarray([[-1.0, 1.0], [0.8, -0.5], [0.3, -1.5]], np.float32)  # A < 0 on the long rows
    lc = PolicyLossConfig(clip_high=0.28, fuse_old_logprobs=False, kl_coef=0.1, kl_loss_type="k1")
    lc = dataclasses.replace(lc, entropy_coeff=0.01, clip_ratio_c=3.0, rollout_is="token")
    assert lc.aggregation == "seq_mean_token_mean" == config_schema.base_config().rl.loss_agg  # defaults
    mesh = shd.make_mesh(1, 1, jax.devices()[:1])
    opts = TrainerOptions(micro_batch_size=2, attn_impl="reference", with_reference=True)
    t = PolicyTrainer(Transformer(tiny_config(num_layers=1), nnx.Rngs(0)), mesh, lc, OptimConfig(), opts)
    fwd = t.logprobs(t.put_micro(batch))  # these parameters' log-probs and entropies, [3 micro, 2, Nb]
    logp, ent = (np.asarray(x, np.float64).reshape(6, -1) for x in (fwd.logp, fwd.entropy))
    old = (logp - rng.uniform(-1.0, 1.8, logp.shape)) * mask
    rollout = (old - rng.uniform(-1.0, 1.0, logp.shape)) * mask  # IS weights e^-1..e^1, some above 2
    shape = batch.response_mask.shape
    batch = batch.replace(
        advantages=adv,
        old_logp=old.reshape(shape).astype(np.float32),
        rollout_logp=rollout.reshape(shape).astype(np.float32),
        ref_logp=np.full(shape, -5.0, np.float32),
    )
    w = micro_weights(batch.response_mask.reshape(3, 1, 2, -1), lc.aggregation)
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(t.params)]
    m, (got,) = t.update([t.put_micro(batch)], [w])
    np.testing.assert_allclose(np.asarray(got).reshape(6, -1) * mask, logp * mask, atol=1e-5)
    # NumPy's token terms
    a, on = adv.reshape(6, 1), mask > 0
    ratio = np.exp(logp - old)
    ppo = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.28))
    dual = (a < 0) & (ppo > -a * 3.0) & on
    is_w = np.exp(old - rollout)
    token_loss = np.where(a < 0, np.minimum(ppo, -a * 3.0), ppo) * np.minimum(is_w, 2.0)
    assert dual.sum() >= 3 and ((a > 0) & (ratio > 1.28) & on).sum() >= 3  # both clips bind somewhere
    assert m["loss/pg"] == pytest.approx(_seq_mean_token_mean(token_loss, mask), rel=1e-4)
    assert m["loss/kl"] == pytest.approx(_seq_mean_token_mean(logp + 5.0, mask), rel=1e-4)
    assert m["loss/entropy"] == pytest.approx(_seq_mean_token_mean(ent, mask), rel=1e-4)
    assert m["policy/entropy"] == pytest.approx(ent[on].mean(), rel=1e-4)  # a token mean
    assert m["policy/clip_frac_lower"] == pytest.approx(dual.sum() / on.sum(), abs=1e-6)
    clipped = (-a * np.clip(ratio, 0.8, 1.28) > -a * ratio) & on
    assert m["policy/clip_frac"] == pytest.approx(clipped.sum() / on.sum(), abs=1e-6)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(is_w[on].mean(), rel=1e-4)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(is_w[on].max(), rel=1e-4)
    # the token mean would differ: the rows' lengths (12, 3, 1, 10, 5, 12) weigh it
    assert abs(m["loss/pg"] - token_loss[on].mean()) > 1e-2
    moved = [
        float(np.abs(a - np.asarray(b)).max())
        for a, b in zip(before, jax.tree_util.tree_leaves(t.params), strict=True)
    ]
    assert max(moved) > 0
