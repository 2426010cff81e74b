"""Our loss, advantage and KL ports against VeRL 0.9.1's own core_algos (verl/trainer/ppo/core_algos.py,
loaded from the installed wheel by tests/verl_oracle) on generated inputs: hundreds of random batches per
family, seeded; VeRL in torch on CPU, ours vmapped over the cases (one traced program per family).

VeRL's workers aggregate a mini-batch's loss with its token and sequence counts (verl/workers/utils/losses.py
ppo_loss: batch_num_tokens and global_batch_size of the mini-batch, passed to agg_loss per micro-batch);
ours weighs micro-batches so that the sum is the mini-batch's aggregate (tlt_jax.rl.batch.micro_weights,
rl.loss_agg_scope "mini_batch"). Its rows always hold a token (a response has one at least); ours may hold
none (dynamic sampling's filler groups, with rl.train_short_steps), so the cases here give every row one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.verl_oracle import verl_line, verl_module
from tlt_jax.rl import grpo
from tlt_jax.rl.batch import micro_weights
from tlt_jax.rl.kl_reward import KLInReward, kl_penalised_rewards

CORE = "verl.trainer.ppo.core_algos"
MODES = {  # ours -> VeRL's loss_agg_mode
    "token_mean": "token-mean",
    "seq_mean_token_mean": "seq-mean-token-mean",
    "seq_mean_token_sum": "seq-mean-token-sum",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
}


@pytest.fixture(scope="module")
def core():
    return verl_module(CORE)


B, T = 8, 12  # one shape: each jnp operation compiles once (eager, no jit), the masks vary


def batch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random [B, T] float32 loss matrix and a mask of ragged responses, each row holding >= 1 token."""
    lengths = rng.integers(1, T + 1, B)
    mask = (np.arange(T) < lengths[:, None]).astype(np.float32)
    return rng.normal(size=(B, T)).astype(np.float32) * 3, mask


def verl_agg(core, loss: np.ndarray, mask: np.ndarray, mode: str, **global_info) -> float:
    return float(core.agg_loss(torch.as_tensor(loss), torch.as_tensor(mask), MODES[mode], **global_info))


def vmapped(fn, *arrays):
    """`fn` over the leading (case) axis of `arrays`, traced once: hundreds of cases, one program."""
    return np.asarray(jax.vmap(fn)(*map(jnp.asarray, arrays)))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_aggregation_matches_verl_agg_loss(core, mode: str) -> None:
    """aggregate_loss == agg_loss (core_algos.py) with the counts VeRL's worker passes, 300 batches; and the
    micro-batch weights ("mini_batch") reproduce VeRL's per-micro-batch calls with the mini-batch's counts,
    ("micro_batch") the mean of agg_loss over micro-batches (VeRL's legacy dp_actor)."""
    where = verl_line(CORE, 'elif loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]:')
    rng = np.random.default_rng(len(mode))
    loss, mask = map(np.stack, zip(*[batch(rng) for _ in range(300)], strict=True))
    ours = vmapped(lambda x, m: grpo.aggregate_loss(x, m, mode, T), loss, mask)
    h = B // 2
    halves = [vmapped(lambda x, m: grpo.aggregate_loss(x, m, mode, T), loss[:, p], mask[:, p])
              for p in (slice(0, h), slice(h, B))]  # fmt: skip
    for i in range(300):
        info = dict(batch_num_tokens=float(mask[i].sum()), global_batch_size=B, loss_scale_factor=T)
        assert ours[i] == pytest.approx(verl_agg(core, loss[i], mask[i], mode, **info), rel=1e-5, abs=1e-6), (
            where
        )
        parts = [slice(0, h), slice(h, B)]
        mine = [halves[0][i], halves[1][i]]
        w = micro_weights(mask[i].reshape(2, h, 1, T), mode, "mini_batch")
        # Dr.GRPO's divisor: each micro-batch's rows x max_len in ours, the mini-batch's in VeRL's call
        verl_parts = sum(verl_agg(core, loss[i][p], mask[i][p], mode, **info) for p in parts)
        assert float(np.dot(w, mine)) == pytest.approx(verl_parts, rel=1e-5, abs=1e-6), where
        legacy = np.mean([verl_agg(core, loss[i][p], mask[i][p], mode, loss_scale_factor=T) for p in parts])
        w = micro_weights(mask[i].reshape(2, h, 1, T), mode, "micro_batch")
        assert float(np.dot(w, mine)) == pytest.approx(legacy, rel=1e-5, abs=1e-6), where


class _ActorConfig(dict):
    """The fields compute_policy_loss_vanilla reads from VeRL's ActorConfig (a dataclass of its config
    package, which needs omegaconf): clip ratios, clip_ratio_c (`.get`) and global_batch_info."""

    def __getattr__(self, name: str) -> object:
        return self[name]


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_policy_loss_with_dual_clip_matches_verl(core, mode: str) -> None:
    """policy_loss (clip 0.2 / 0.28, dual-clip 3, truncated IS weights on half the cases) == VeRL's
    compute_policy_loss_vanilla on 300 batches whose ratios reach past 1 / 3 and 3 (the dual clip binds):
    the loss, pg_clipfrac, ppo_kl and pg_clipfrac_lower."""
    where = verl_line(CORE, "pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)")
    rng = np.random.default_rng(1)
    cases = 300
    mask = np.stack([batch(rng)[1] for _ in range(cases)])
    old = rng.normal(-2, 1, (cases, B, T)).astype(np.float32)
    new = (old + rng.normal(0, 1.5, (cases, B, T))).astype(np.float32)
    adv = rng.normal(size=(cases, B)).astype(np.float32)
    weights = np.minimum(np.exp(rng.normal(0, 0.5, (cases, B, T))), 2.0).astype(np.float32)
    kw = dict(clip_low=0.2, clip_high=0.28, aggregation=mode, clip_ratio_c=3.0)
    plain = jax.vmap(lambda n, o, a, m: grpo.policy_loss(n, o, a, m, **kw))(new, old, adv, mask)
    weighted = jax.vmap(lambda n, o, a, m, w: grpo.policy_loss(n, o, a, m, **kw, is_weights_bt=w))(
        new, old, adv, mask, weights
    )
    bound = 0
    for i in range(cases):
        use = i % 2 == 1
        got, ours = weighted if use else plain
        cfg = _ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
        cfg["global_batch_info"] = dict(batch_num_tokens=float(mask[i].sum()), global_batch_size=B)
        want, metrics = core.compute_policy_loss_vanilla(
            torch.as_tensor(old[i]), torch.as_tensor(new[i]), torch.as_tensor(adv[i])[:, None].expand(B, T),
            torch.as_tensor(mask[i]), MODES[mode], cfg, torch.as_tensor(weights[i]) if use else None,
        )  # fmt: skip
        assert float(got[i]) == pytest.approx(float(want), rel=1e-5, abs=1e-5), where
        assert float(ours["clip_frac"][i]) == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)
        assert float(ours["approx_kl"][i]) == pytest.approx(metrics["actor/ppo_kl"], rel=1e-5, abs=1e-6)
        assert float(ours["clip_frac_lower"][i]) == pytest.approx(
            metrics["actor/pg_clipfrac_lower"], abs=1e-6
        )
        bound += metrics["actor/pg_clipfrac_lower"] > 0
    assert bound > 50  # the dual clip bound in many cases, not only on paper


@pytest.mark.parametrize("name", sorted(grpo.KL_ESTIMATORS))
def test_kl_estimators_and_their_gradients_match_verl(core, name: str) -> None:
    """kl_estimate(name) == VeRL's kl_penalty(name) (k1 / abs / k2 / k3 and their "+" straight-through
    variants of 0.9.1) in value and in gradient w.r.t. the policy's log-probs, 200 batches each."""
    where = verl_line(CORE, "return backward_score - backward_score.detach() + forward_score.detach()")
    rng = np.random.default_rng(sum(map(ord, name)))
    logp = rng.normal(-2, 2, (200, 16)).astype(np.float32)  # 200 cases of 16 tokens: elementwise
    ref = (logp + rng.normal(0, 3, (200, 16))).astype(np.float32)
    lp = torch.tensor(logp, requires_grad=True)
    want = core.kl_penalty(lp, torch.as_tensor(ref), name)
    want.sum().backward()
    got = grpo.kl_estimate(jnp.asarray(logp), jnp.asarray(ref), name)
    grad = jax.grad(lambda x: grpo.kl_estimate(x, jnp.asarray(ref), name).sum())(jnp.asarray(logp))
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-5, atol=1e-5, err_msg=where)
    np.testing.assert_allclose(grad, lp.grad.numpy(), rtol=1e-5, atol=1e-5, err_msg=where)


@pytest.mark.parametrize(("method", "std"), [("grpo", "unbiased"), ("drgrpo", "unbiased")])
def test_group_advantages_match_verl_grpo(core, method: str, std: str) -> None:
    """group_advantages == compute_grpo_outcome_advantage (norm_adv_by_std_in_grpo True for GRPO, False for
    Dr.GRPO; VeRL's torch.std is our "unbiased") on 300 batches of verifier-like rewards."""
    where = verl_line(CORE, "scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)")
    rng = np.random.default_rng(5)
    groups = 4
    for n in (2, 4, 8):  # 100 batches per group size
        rewards = rng.choice([-1.0, 0.0, 0.5, 1.0, 1.5], (100, groups * n)).astype(np.float32)
        got = vmapped(lambda r, n=n: grpo.group_advantages(r, n, method=method, eps=1e-6, std=std), rewards)
        for i in range(100):
            scores = torch.zeros((groups * n, 4))
            scores[:, -1] = torch.as_tensor(rewards[i])
            want, _ = core.compute_grpo_outcome_advantage(
                scores, torch.ones((groups * n, 4)), np.repeat(np.arange(groups), n), 1e-6, method == "grpo"
            )
            np.testing.assert_allclose(got[i], want[:, 0].numpy(), rtol=1e-5, atol=1e-5, err_msg=where)


def test_kl_in_reward_matches_verl_penalty_and_adaptive_controller(core) -> None:
    """KL in the reward: VeRL's apply_kl_penalty (verl/trainer/ppo/ray_trainer.py, which imports ray: composed
    here from the core_algos pieces it calls, kl_penalty and AdaptiveKLController) == kl_penalised_rewards
    and KLInReward.next_coef, 200 batches."""
    where = verl_line(CORE, "proportional_error = np.clip(current_kl / target - 1, -0.2, 0.2)")
    rng = np.random.default_rng(9)
    for i in range(120):
        _, mask = batch(rng)
        b, t = B, T
        old, ref = rng.normal(-2, 1, (2, b, t)).astype(np.float32)
        rewards = rng.choice([0.0, 1.0], b).astype(np.float32)
        penalty = ["kl", "abs", "mse", "low_var_kl"][i % 4]
        kld = core.kl_penalty(torch.as_tensor(old), torch.as_tensor(ref), penalty) * torch.as_tensor(mask)
        current = float(
            torch.mean((kld * torch.as_tensor(mask)).sum(-1) / (torch.as_tensor(mask).sum(-1) + 1e-8))
        )
        ctrl = core.AdaptiveKLController(0.05, 0.1, 1000)
        ctrl.update(current_kl=current, n_steps=b)
        got, got_kl = kl_penalised_rewards(rewards, old, ref, mask, 0.05, penalty)
        np.testing.assert_allclose(
            got, rewards - 0.05 * kld.sum(-1).numpy(), rtol=1e-5, atol=1e-5, err_msg=where
        )
        assert got_kl == pytest.approx(current, rel=1e-5, abs=1e-6)
        rc = KLInReward(0.05, penalty, "adaptive", 0.1, 1000)
        assert rc.next_coef(0.05, got_kl, b) == pytest.approx(ctrl.value, rel=1e-6)
