"""The shape and GRPO settings of one RL step, read once from the config: what the step's phases share.

Why a plan: the phases (tlt_jax.rl.reward, advantages, update, metrics) take typed arguments instead of the
whole config, so each can be read, and tested, without building a learner.
"""

from __future__ import annotations

import dataclasses

from tlt_jax.config_schema import GrpoConfig
from tlt_jax.rl.config import optim_config
from tlt_jax.rl.kl_reward import KLInReward
from tlt_jax.rl.optimizer import OptimConfig
from tlt_jax.rl.reward import OverlongShaping


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step: `prompts` prompts x `group` samples = `rows` rows, updated in `mini_batches` mini-batches."""

    prompts: int
    group: int
    mini_batches: int = 1
    advantage: str = "grpo"  # tlt_jax.rl.grpo.group_advantages(method=)
    adv_eps: float = 1e-6
    dynamic_sampling: bool = False  # DAPO: drop groups whose filter metric is the same for all, refill
    filter_metric: str = "acc"  # what dynamic sampling compares (tlt_jax.rl.dynamic_sampling)
    max_gen_batches: int = 10  # generation batches per step at most (0: no limit)
    gen_prompts: int = 0  # prompts per generation batch (0: `prompts`)
    kl_coef: float = 0.0  # > 0: the loss has a KL term to the reference policy (needs its log-probs)
    adv_std: str = "population"  # the std "grpo" divides by (tlt_jax.rl.grpo.ADV_STDS)
    ppo_epochs: int = 1  # passes over the step's mini-batches
    mini_batch_shuffle: bool = False  # groups permuted into mini-batches every epoch (seeded: shuffle_seed)
    shuffle_seed: int = 0
    rollout_is: str = "none"  # != "none": the batch carries the rollout's log-probs (tlt_jax.rl.losses)
    reward_kl: KLInReward = KLInReward()  # VeRL's KL in the reward (off by default)
    loss_agg: str = "seq_mean_token_mean"
    loss_agg_scope: str = "mini_batch"  # the aggregation's counts: the mini-batch's or each micro-batch's
    train_short: bool = False  # at max_gen_batches with too few groups: train on them (else VeRL's error)
    seq_bucket: int = 16  # trainer columns are rounded up to multiples of this
    max_response: int | None = None  # the rollout's max_new_tokens (the widest response column count)
    optim: OptimConfig = OptimConfig()  # the policy optimizer's settings (its schedule: the optim/lr metric)
    overlong: OverlongShaping = OverlongShaping()  # DAPO's overlong reward shaping (off by default)

    @property
    def rows(self) -> int:
        return self.prompts * self.group

    @property
    def mini_rows(self) -> int:
        return self.rows // self.mini_batches

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates a step plans (mini-batches x epochs; a skipped mini-batch makes none)."""
        return self.mini_batches * self.ppo_epochs

    @property
    def needs_reference(self) -> bool:
        """Whether the step computes the reference policy's log-probs (KL in the loss or the reward)."""
        return self.kl_coef > 0 or self.reward_kl.coef > 0

    @classmethod
    def from_config(cls, job: GrpoConfig) -> StepPlan:
        """The plan of a GRPO config (`tlt_jax.rl.config.validate_grpo`)."""
        rl = job.rl
        return cls(
            prompts=rl.prompts_per_step,
            group=rl.samples_per_prompt,
            mini_batches=rl.mini_batches,
            advantage=rl.advantage,
            adv_eps=rl.adv_eps,
            dynamic_sampling=rl.dynamic_sampling,
            filter_metric=rl.filter_metric,
            max_gen_batches=rl.max_num_gen_batches,
            gen_prompts=rl.gen_prompts_per_batch or rl.prompts_per_step,
            kl_coef=rl.kl_coef,
            adv_std=rl.adv_std,
            ppo_epochs=rl.ppo_epochs,
            mini_batch_shuffle=rl.mini_batch_shuffle,
            shuffle_seed=job.run.seed,
            rollout_is=rl.rollout_is,
            reward_kl=KLInReward.from_section(rl),
            loss_agg=rl.loss_agg,
            loss_agg_scope=rl.loss_agg_scope,
            train_short=rl.train_short_steps,
            seq_bucket=job.trainer.seq_bucket,
            max_response=job.rollout.max_new_tokens,
            optim=optim_config(job),
            overlong=OverlongShaping(rl.overlong_buffer, rl.overlong_penalty, job.rollout.max_new_tokens),
        )
