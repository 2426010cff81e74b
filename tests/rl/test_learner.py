"""GRPO learner and trainer: batch layout, trainer log-probs vs a full forward, exact gradient accumulation,
one GRPO step improving its surrogate, no recompilation, and a Learner step's metrics."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax import config_lib
from tlt_jax import sharding as shd
from tlt_jax.models.build import build_model_and_tokenizer
from tlt_jax.models.config import tiny_config
from tlt_jax.models.llama import Transformer
from tlt_jax.rl import grpo
from tlt_jax.rl.batch import TrainBatch, build_train_batch, length_sorted_micro, micro_weights
from tlt_jax.rl.forward import response_logprobs
from tlt_jax.rl.learner import Learner
from tlt_jax.rl.optimizer import OptimConfig
from tlt_jax.rl.trainer import PolicyLossConfig, PolicyTrainer, TrainerOptions
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
CFG = tiny_config("llama")


def smoke_config(arg: str | None = None):
    return config_lib.load_config_file(CONFIGS / "smoke.py", arg)


def mesh(data: int):
    return shd.make_mesh(data, 1, jax.devices()[:data])


def random_batch(seed: int, groups: int = 4, n: int = 2, bucket: int = 8) -> TrainBatch:
    """Prompts of 2..9 tokens, responses of 1..12 tokens, advantages in [-1, 1]."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(groups):
        p = rng.integers(1, CFG.vocab_size, rng.integers(2, 10)).tolist()
        prompts += [p] * n
    b = groups * n
    lengths = rng.integers(1, 13, b)
    responses = rng.integers(1, CFG.vocab_size, (b, 12))
    adv = rng.uniform(-1, 1, b).astype(np.float32)
    return build_train_batch(
        prompts, responses, lengths, adv, np.ones(b, bool), group_size=n, seq_bucket=bucket
    )


def trainer(model_seed: int = 0, *, data: int = 1, micro: int = 8, **kw) -> PolicyTrainer:
    loss = kw.pop("loss", PolicyLossConfig(temperature=0.8, fuse_old_logprobs=False))
    return PolicyTrainer(
        Transformer(CFG, nnx.Rngs(model_seed)),
        mesh(data),
        loss,
        kw.pop("optim", OptimConfig(lr=1e-2, weight_decay=0.0)),
        TrainerOptions(micro_batch_size=micro, with_reference=kw.pop("with_reference", False), **kw),
    )


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


LR = 1e-2  # trainer()'s AdamW learning rate


def assert_same_update(before: list, a: list, b: list, grads: list) -> None:
    """Two AdamW first steps from the same parameters are the same update. AdamW's first step is
    lr * g / (|g| + eps): about lr * sign(g) per entry. Where the gradient stands above float noise (> 1e-4 of
    its leaf's largest entry; >= 95% of the entries with a gradient: an untied embedding's rows of tokens the
    batch lacks have none) both deltas are that step (|delta| > lr / 2, the same sign, equal to 1e-3 lr);
    everywhere they are at most lr, and their signs differ in at most 0.1% of the entries (noise-level
    gradients, whose sign the summation order decides)."""
    n = solid_n = flips = 0
    for p0, pa, pb, g in zip(before, a, b, grads, strict=True):
        da, db = pa - p0, pb - p0
        solid = np.abs(g) > 1e-4 * max(float(np.abs(g).max()), 1e-30)
        assert (np.abs(da[solid]) > LR / 2).all() and (np.sign(da[solid]) == np.sign(db[solid])).all()
        np.testing.assert_allclose(da[solid], db[solid], rtol=0, atol=1e-3 * LR)
        assert max(np.abs(da).max(), np.abs(db).max()) <= LR * (1 + 1e-3)
        n, solid_n = n + (g != 0).sum(), solid_n + solid.sum()
        flips += (np.sign(da) != np.sign(db)).sum()
    assert solid_n >= 0.95 * n and flips <= 1e-3 * n, (n, solid_n, flips)


# ----------------------------------------------------------------------------------------------------------
# batch layout
# ----------------------------------------------------------------------------------------------------------


def test_build_train_batch_layout() -> None:
    prompts = [[5, 6, 7]] * 2 + [[8, 9]] * 2
    responses = np.arange(1, 21).reshape(4, 5)
    lengths = np.array([5, 2, 1, 3])
    keep = np.array([True, True, False, False])
    b = build_train_batch(prompts, responses, lengths, np.arange(4.0), keep, group_size=2, seq_bucket=4)
    assert b.prompt.shape == (2, 4) and b.response.shape == (2, 2, 8)  # Tp, Nb rounded up to 4
    np.testing.assert_array_equal(b.prompt, [[5, 6, 7, 0], [8, 9, 0, 0]])
    np.testing.assert_array_equal(b.prompt_len, [3, 2])
    np.testing.assert_array_equal(b.response[0, 1], [6, 7, 0, 0, 0, 0, 0, 0])  # padding zeroed
    np.testing.assert_array_equal(b.response_mask.sum(-1), [[5, 2], [0, 0]])  # dropped group: no tokens
    np.testing.assert_array_equal(b.advantages, [[0, 1], [2, 3]])
    capped = build_train_batch(
        prompts, responses, lengths, np.arange(4.0), keep, group_size=2, seq_bucket=4, max_response=6
    )
    assert capped.response.shape == (2, 2, 6)  # the rollout's cap, not the next multiple of 4
    with pytest.raises(ValueError, match="exceeds max_response=4"):
        build_train_batch(
            prompts, responses, lengths, np.arange(4.0), keep, group_size=2, seq_bucket=4, max_response=4
        )
    with pytest.raises(ValueError, match="does not share the prompt of its group"):
        build_train_batch(
            [[1], [2], [1], [2]], responses, lengths, np.zeros(4), keep, group_size=2, seq_bucket=4
        )


def test_micro_weights_reproduce_the_full_batch_aggregation() -> None:
    rng = np.random.default_rng(0)
    loss = rng.normal(size=(8, 6)).astype(np.float32)
    mask = (rng.uniform(size=(8, 6)) < 0.6).astype(np.float32)
    mask[3] = 0.0  # a row without tokens
    for agg in grpo.LOSS_AGGREGATIONS:
        full = float(grpo.aggregate_loss(jnp.asarray(loss), jnp.asarray(mask), agg, max_len=6))
        w = micro_weights(mask.reshape(4, 1, 2, 6), agg)  # 4 micro-batches of one group of 2
        parts = [
            float(
                grpo.aggregate_loss(
                    jnp.asarray(loss[2 * k : 2 * k + 2]), jnp.asarray(mask[2 * k : 2 * k + 2]), agg, max_len=6
                )
            )
            for k in range(4)
        ]
        assert np.dot(w, parts) == pytest.approx(full, rel=1e-5), agg


# ----------------------------------------------------------------------------------------------------------
# trainer forward
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [0, 3])  # 3: Nb = 8 in chunks of 3, the last one zero-padded
def test_shared_prompt_logprobs_match_a_full_forward(chunk: int) -> None:
    model = Transformer(CFG, nnx.Rngs(1))
    batch = jax.tree_util.tree_map(jnp.asarray, random_batch(0))
    out = response_logprobs(model, batch, temperature=0.7, logits_chunk=chunk, return_hidden=True)
    g, n, nb = batch.response.shape
    assert nb == 8 and (not chunk or nb % chunk)
    assert out.logp.shape == (g * n, nb) and out.hidden.shape == (g * n, nb, CFG.hidden_size)
    # the reference: each row's prompt + response as one sequence through the plain causal forward, all rows
    # in one call, right-padded to one width (causal: the padding changes no position before it)
    seqs, prompt_lens = [], []
    for row in range(g * n):
        gi, length = row // n, int(batch.response_mask[row // n, row % n].sum())
        prompt = np.asarray(batch.prompt[gi, : int(batch.prompt_len[gi])])
        seqs.append(np.concatenate([prompt, np.asarray(batch.response[gi, row % n, :length])]))
        prompt_lens.append(len(prompt))
    width = max(len(seq) for seq in seqs)
    padded = np.stack([np.pad(seq, (0, width - len(seq))) for seq in seqs])
    positions = np.broadcast_to(np.arange(width), padded.shape)
    logits = model(jnp.asarray(padded), jnp.asarray(positions)).logits / 0.7
    logp_all = np.asarray(jax.nn.log_softmax(logits, -1))
    for row, (seq, plen) in enumerate(zip(seqs, prompt_lens, strict=True)):
        ref = logp_all[row, plen - 1 : len(seq) - 1]
        want = np.take_along_axis(ref, seq[plen:, None], -1)[:, 0]
        np.testing.assert_allclose(out.logp[row, : len(seq) - plen], want, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.devices(2)
def test_micro_batching_and_fsdp_do_not_change_the_update() -> None:
    """Gradient accumulation over micro-batches (and sharding params over data) = one full-batch step, also
    with micro-batches of one row, half a group each (`regroup`: the prompt recomputed per sub-group).
    Untied, scanned, tensor-parallel: test_trainer.py's test_paper_layout_gradients_equal_one_device."""
    batch = random_batch(1)  # 4 groups x 2 samples
    results = []
    for micro, data, fsdp in [(8, 1, False), (1, 1, False), (4, 2, True)]:
        tr = trainer(micro=micro, data=data, fsdp=fsdp)
        before = leaves(tr.params)  # the same initial parameters in every layout (model seed 0)
        mb = tr.put_micro(batch)
        old = np.asarray(tr.logprobs(mb).logp).reshape(batch.old_logp.shape)
        mb = tr.put_micro(batch.replace(old_logp=old))
        mask = np.asarray(batch.response_mask)
        w = micro_weights(mask.reshape(8 // micro, -1, 1, mask.shape[-1]), tr.loss.aggregation)
        grads = leaves(tr.gradients(mb, w))
        metrics, _ = tr.update([mb], [w])
        results.append((grads, leaves(tr.params), metrics, before))
    (g0, p0, m0, b0), *rest = results
    for g, p, m, b in rest:
        for x, y in zip(b0, b, strict=True):
            np.testing.assert_array_equal(x, y)
        assert m["loss/pg"] == pytest.approx(m0["loss/pg"], abs=1e-6)
        assert m["optim/grad_norm"] == pytest.approx(m0["optim/grad_norm"], rel=1e-4)
        for a, b in zip(g0, g, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        assert_same_update(b0, p0, p, g0)  # the summation order differs between micro-batchings


# make test: DAPO's token_mean and Dr.GRPO's seq_mean_token_sum_norm; GRPO's seq_mean_token_mean normalises
# per row as the latter does
@pytest.mark.parametrize(
    "agg",
    [
        pytest.param(a, marks=pytest.mark.extended) if a == "seq_mean_token_mean" else a
        for a in sorted(grpo.LOSS_AGGREGATIONS)
    ],
)
def test_length_sorted_micro_batches_equal_the_full_width_update(agg: str) -> None:
    """Micro-batches sorted by length, each cut to its own Nb bucket (learner's layout), make the same
    optimizer step as the full-width batch: same loss, gradient norm, parameters and log-probs."""
    rng = np.random.default_rng(7)
    lengths = np.asarray([3, 12, 2, 1, 7, 5, 4, 4])  # groups' longest: 12, 2, 7, 4 -> widths 12, 8, 4, 4
    prompts = [p for g in range(4) for p in [rng.integers(1, CFG.vocab_size, 5 + g).tolist()] * 2]
    batch = build_train_batch(
        prompts,
        rng.integers(1, CFG.vocab_size, (8, 12)),
        lengths,
        rng.uniform(-1, 1, 8).astype(np.float32),
        np.ones(8, bool),
        group_size=2,
        seq_bucket=4,
    )
    loss = PolicyLossConfig(temperature=0.8, aggregation=agg, max_len=12)
    full, cut = trainer(micro=2, loss=loss), trainer(micro=2, loss=loss)
    before = leaves(full.params)
    w = micro_weights(np.asarray(batch.response_mask).reshape(4, 1, 2, 12), agg)
    grads = leaves(full.gradients(full.put_micro(batch), w))
    m_full, (logp_full,) = full.update([full.put_micro(batch)], [w])
    parts = length_sorted_micro(batch, lengths, 2, 4, agg)
    widths = [mb.num_response for mb in parts.micro]
    assert widths == [12, 8, 4, 4], widths
    assert sum(mb.response.size for mb in parts.micro) < batch.response.size
    m_cut, logps = cut.update([cut.put_micro(mb) for mb in parts.micro], [x[None] for x in parts.weights])
    for k in ("loss/pg", "policy/entropy", "optim/grad_norm"):
        assert m_cut[k] == pytest.approx(m_full[k], rel=1e-4, abs=1e-7), k
    mask = np.asarray(batch.response_mask).reshape(8, 12) > 0
    unsorted = parts.unsort([np.asarray(x) for x in logps], 12)
    np.testing.assert_allclose(unsorted[mask], np.asarray(logp_full).reshape(8, 12)[mask], atol=1e-5)
    assert_same_update(before, leaves(full.params), leaves(cut.params), grads)
    with pytest.raises(ValueError, match="micro_batch_size=3 must divide the mini-batch of 8 rows"):
        length_sorted_micro(batch, lengths, 3, 4, agg)
    one = length_sorted_micro(batch, lengths, 1, 4, agg)  # sub-groups of one row, sorted by their own length
    assert [mb.num_response for mb in one.micro] == [12, 8, 8, 4, 4, 4, 4, 4]
    assert one.unsort([np.full((1, mb.num_response), i) for i, mb in enumerate(one.micro)], 12)[
        :, 0
    ].tolist() == [5, 0, 6, 7, 1, 2, 3, 4]


def test_train_layers_freezes_the_bottom_of_the_model() -> None:
    """train_layers=1 on a 2-layer model: layer 1 and the final norm move; the embedding (tied head) and
    layer 0 stay bit-identical and carry no optimizer state."""
    tr = trainer(micro=8, train_layers=1, loss=PolicyLossConfig(fuse_old_logprobs=True))
    before = jax.tree_util.tree_map(np.asarray, tr.params)
    tr.update([tr.put_micro(random_batch(6))], [np.ones((1,), np.float32)])
    after = jax.tree_util.tree_map(np.asarray, tr.params)

    def moved(part) -> bool:
        return any(
            not np.array_equal(a, b)
            for a, b in zip(
                jax.tree_util.tree_leaves(part(before)), jax.tree_util.tree_leaves(part(after)), strict=True
            )
        )

    assert moved(lambda p: p["layers"][1]) and moved(lambda p: p["norm"])
    assert not moved(lambda p: p["layers"][0]) and not moved(lambda p: p["embed"])
    full = trainer(micro=8)
    assert len(jax.tree_util.tree_leaves(tr.opt_state)) < len(jax.tree_util.tree_leaves(full.opt_state))
    with pytest.raises(ValueError, match=r"train_layers=3 must be in \[0, 2\]"):
        trainer(train_layers=3)


def test_no_recompilation_after_warmup() -> None:
    tr = trainer(micro=4, loss=PolicyLossConfig(fuse_old_logprobs=True))
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda e, d, **kw: (
            compiles.append(e) if e == "/jax/core/compile/jaxpr_to_mlir_module_duration" else None
        )
    )
    w = np.full((2,), 0.5, np.float32)
    # prompts of 2-9 and responses of 1-12 tokens all land in the 16-token buckets: one shape, new values
    batches = [random_batch(seed, bucket=16) for seed in (2, 3, 4, 5)]
    assert {(b.prompt.shape, b.response.shape) for b in batches} == {((4, 16), (4, 2, 16))}
    tr.update([tr.put_micro(batches[0])], [w])
    tr.update([tr.put_micro(batches[1])], [w])
    before = len(compiles)
    for batch in batches[2:]:
        tr.update([tr.put_micro(batch)], [w])
    assert len(compiles) == before, "the update recompiled for same-bucket batches"
    assert tr._accum._cache_size() == 1 and tr._apply._cache_size() == 1


# ----------------------------------------------------------------------------------------------------------
# one GRPO step
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.devices(2)
def test_one_grpo_step_changes_params_and_raises_the_surrogate() -> None:
    """Rollout from the smoke model, rewards that prefer even tokens, one PPO-clipped update (with KL to the
    reference): the parameters move and the surrogate objective on the same batch goes up."""
    config = smoke_config()
    model, _ = build_model_and_tokenizer(config)
    m = mesh(2)
    engine = RolloutEngine(
        model, EngineConfig(max_new_tokens=10, max_cache_len=64, min_cache_bucket=16), [-1], mesh=m
    )
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    n = 4
    rollout = engine.generate(prompts, n=n, key=jax.random.key(0), sampling=SamplingParams(temperature=1.0))
    rewards = np.asarray(
        [
            (rollout.response(i) and np.mean(np.asarray(rollout.response(i)) % 2 == 0)) or 0.0
            for i in range(8)
        ],
        np.float32,
    )
    adv = np.asarray(grpo.group_advantages(jnp.asarray(rewards), n))
    assert np.abs(adv).sum() > 0
    batch = build_train_batch(
        rollout.prompt_tokens,
        rollout.tokens,
        rollout.lengths,
        adv,
        np.ones(8, bool),
        group_size=n,
        seq_bucket=8,
    )
    loss = PolicyLossConfig(temperature=1.0, kl_coef=0.01, fuse_old_logprobs=False)
    tr = PolicyTrainer(
        model, m, loss, OptimConfig(lr=1e-3, weight_decay=0.0), TrainerOptions(4, with_reference=True)
    )
    mb = tr.put_micro(batch)
    old = tr.logprobs(mb).logp
    # the trainer recomputes what the engine sampled with
    mask = rollout.mask
    np.testing.assert_allclose(
        np.asarray(old).reshape(8, -1)[:, : mask.shape[1]][mask], rollout.logprobs[mask], atol=1e-5
    )
    batch = batch.replace(old_logp=np.asarray(old).reshape(batch.old_logp.shape))
    ref = tr.logprobs(tr.put_micro(batch), params=tr.ref_params).logp
    batch = batch.replace(ref_logp=np.asarray(ref).reshape(batch.ref_logp.shape))
    mb = tr.put_micro(batch)
    w = micro_weights(np.asarray(batch.response_mask).reshape(2, 1, n, -1), "seq_mean_token_mean")
    before_params = leaves(tr.params)
    before = tr.surrogate_loss(mb, w)
    metrics, _ = tr.update([mb], [w])
    after = tr.surrogate_loss(mb, w)
    assert after < before - 1e-4, (before, after)
    assert metrics["loss/pg"] == pytest.approx(before, abs=1e-6)  # KL is 0 at the reference
    assert (
        max(float(np.abs(a - b).max()) for a, b in zip(before_params, leaves(tr.params), strict=True)) > 1e-4
    )
    # the engine picks up the new weights without recompiling
    programs = engine.compile_count
    engine.set_params(tr.rollout_params())
    engine.generate(prompts, n=n, key=jax.random.key(0), sampling=SamplingParams(temperature=1.0))
    assert engine.compile_count == programs


# ----------------------------------------------------------------------------------------------------------
# the Learner
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.devices(2)
def test_learner_step_metrics(tmp_path) -> None:
    """Two steps on 2 data shards, with VeRL's KL in the reward under the adaptive controller: step 1's
    policy is the reference (KL 0, so beta shrinks by the controller's floor, 1 - 0.2 x rows / horizon),
    step 2's KL is positive (step 1 learned from DAPO's overlong shaping); the controller's beta goes into
    the checkpoint."""
    config = smoke_config()
    config.mesh.data = 2
    config.rl.reward_kl_coef, config.rl.reward_kl_ctrl, config.rl.reward_kl_horizon = 0.01, "adaptive", 64
    config.rl.overlong_buffer = 8  # rewards that vary with the length: step 1 moves the policy
    learner = Learner(config, str(tmp_path))
    try:
        first = learner.train_step()
        m = learner.train_step()
        learner.save()
        _, meta = learner.ckpt.restore(2)
    finally:
        learner.close()
    assert first["actor/reward_kl_penalty"] == 0.0 and first["actor/reward_kl_penalty_coeff"] == 0.01
    beta = 0.01 * (1 - 0.2 * 16 / 64)  # 16 rows a step
    assert m["actor/reward_kl_penalty"] > 0 and m["actor/reward_kl_penalty_coeff"] == pytest.approx(beta)
    assert meta["reward_kl_coef"] == pytest.approx(learner.reward_kl_coef) and learner.reward_kl_coef < beta
    for key in (
        "reward/mean",
        "accuracy",
        "length/p50",
        "length/p90",
        "length/max",
        "time/rollout",
        "time/reward",
        "time/logprob",
        "time/update",
        "rollout/share",
        "throughput/tok_per_s",
        "loss/pg",
        "optim/grad_norm",
        "policy/entropy",
    ):
        assert key in m, key
    assert m["logprob/engine_gap"] < 1e-4  # the engine's sampling log-probs == the trainer's recomputation
    assert 0 < m["rollout/share"] < 1 and learner.step == 2 and learner.data_position == 4
    assert learner.engine.params is None  # one owner per weight: the trainer's, passed to each rollout
