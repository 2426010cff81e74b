"""How evaluations decode: the training rollouts' engine, drafter and speculation, without teaching anything.

An evaluation generates with the learner's engine and its current weights (policy and, when the spot
trainer runs, the drafter it trains: `Learner.weights`), so speculation runs as configured:
- with a strategy selector (`config.bandit`), `FrozenSelector` plays what the selector has learned: per
  chunk, the arm it currently rates best for the running-row count (BEG-MAB: the best median among arms with
  `min_plays` rewards in the bucket's window; egreedy / ucb1: the best mean; fixed: its table; sglang: its
  rung), read from a snapshot of the selector's state taken when the evaluation starts. It never explores,
  never draws from the selector's PRNG key and never rewards it. Where the selector has no trusted arm yet
  (before training, or a running-row bucket training never reached) it gives no opinion and
- the paper's threshold switch decides (`config.spec.threshold` / `min_steps_below` with the configured
  strategy, which the engine appends after the caller's hooks: `rollout.scheduler`); without a selector it
  decides every chunk. Without a drafter (`config.drafter.kind=none`) every chunk is plain.
Why not let the selector choose and learn as in training: its choices draw from its key and its rewards move
its windows, so a run's training would differ with and without evaluation (and its checkpoints with them);
and exploration would spend evaluation time on arms the selector already rates slower. Why not only the
threshold switch: the selector knows where SD pays on this hardware, for the arms it has measured. Early in a
run BEG-MAB trusts plain first (its reference arm gets `min_plays` before the others), so the first
evaluations after training started may decode plain in buckets where the threshold switch would speculate:
what the selector currently believes, not a guess.
The spot trainer, the speculation monitor and the console's rollout watch are not hooks of an evaluation: its
rollouts feed neither the drafter's data nor the training step's metrics. The engine is shared, so its
compiled programs are too (a chunk program is keyed by batch and cache bucket, mode group and sampling).

In float32 with coupled acceptance (`config.spec.acceptance="coupled"`) speculative decoding emits the very
tokens plain decoding does with the same keys: an evaluation's scores do not depend on SD (in bfloat16 up to
rounding between a verify pass and a decode step). `config.eval.plain_baseline` decodes everything a second
time with `FixedMode("plain")` and the same keys: the measured speed-up and that identity (`plain_match`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tlt_jax import sharding as shd
from tlt_jax.rl.eval_metrics import SpeedTally
from tlt_jax.rollout.adaptive import AdaptivePolicy
from tlt_jax.rollout.beg_mab import BanditPolicy
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FixedMode, RolloutHooks
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.selector_config import SelectorConfig, SelectorState
from tlt_jax.rollout.types import Rollout


def exploit_arm(cfg: SelectorConfig, state: SelectorState, running: int) -> str | None:
    """The arm the selector rates best at `running` rows in `state` (host arrays), or None when it has no
    trusted arm there. Rates as the selector's own rules do (rollout/selector_policies.py): beg_mab by the
    median, egreedy and ucb1 by the mean of each arm's rewards (beg_mab and ucb1: those within the bucket's
    last `window` plays), beg_mab trusting an arm with `min_plays` of them, the others with one."""
    b = min(int(np.searchsorted(np.asarray(cfg.bucket_bounds), running, side="left")), cfg.num_buckets - 1)
    if cfg.algorithm == "fixed":
        return cfg.fixed_table[b] if cfg.fixed_table else None
    if cfg.algorithm == "sglang":
        return cfg.arms[cfg.ladder_index[int(state.rung[b])]]
    rewards = np.asarray(state.rewards[b], np.float64)  # [arms, window], NaN = empty
    valid = ~np.isnan(rewards)
    if cfg.algorithm in ("beg_mab", "ucb1"):
        valid &= np.asarray(state.stamps[b]) > int(state.bucket_steps[b]) - cfg.window
    plays = valid.sum(axis=1)
    trusted = np.asarray(cfg.eligible[b], bool) & (
        plays >= (cfg.min_plays if cfg.algorithm == "beg_mab" else 1)
    )
    if not trusted.any():
        return None
    rate = np.median if cfg.algorithm == "beg_mab" else np.mean
    score = [rate(rewards[a][valid[a]]) if trusted[a] else -np.inf for a in range(cfg.num_arms)]
    return cfg.arms[int(np.argmax(score))]


class FrozenSelector(RolloutHooks):
    """Each chunk's mode from a snapshot of `policy`'s state (`exploit_arm`); the policy is never touched."""

    def __init__(self, policy: BanditPolicy):
        self.cfg = policy.cfg
        self.state = shd.to_host_tree(policy.state)  # a copy: nothing the evaluation does reaches the policy

    def choose_mode(self, running: int, batch_bucket: int) -> str | None:
        del batch_bucket
        return exploit_arm(self.cfg, self.state, running)


@dataclasses.dataclass(frozen=True)
class EvalDecoding:
    """What every evaluation decodes with: the learner's engine, its current (policy, drafter) weights
    (`weights()`), its selector (None: the threshold switch alone) and whether to pair a plain pass."""

    engine: RolloutEngine
    weights: Callable[[], tuple[Any, Any]]
    selector: AdaptivePolicy | None = None
    plain_baseline: bool = False

    def begin(self, watchers: Sequence[RolloutHooks] = ()) -> EvalRun:
        """One evaluation: the weights read now, a fresh snapshot of the selector (it learned since the
        last one), a new speed tally. `watchers`: hooks of every pass that choose nothing (the learner's
        stop agreement: an agreement point after every chunk, tlt_jax.rl.stopping)."""
        params, dparams = self.weights()
        hooks: list[RolloutHooks] = [] if self.selector is None else [FrozenSelector(self.selector.policy)]
        return EvalRun(self, params, dparams, hooks + list(watchers), SpeedTally(), list(watchers))


@dataclasses.dataclass
class EvalRun:
    """One evaluation's decoding: `generate` returns the configured (speculative) rollout and tallies its
    speed, with the paired plain pass when asked (`tally.metrics()`)."""

    decoding: EvalDecoding
    params: Any
    dparams: Any
    hooks: list[RolloutHooks]
    tally: SpeedTally
    watchers: list[RolloutHooks] = dataclasses.field(default_factory=list)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        key: jax.Array,
        sampling: SamplingParams,
        max_new: int | None,
    ) -> Rollout:
        """`n` samples of every prompt with `key` (the same key gives the same samples: paired evaluations),
        at most `max_new` tokens each (None: the engine's)."""

        def run(hooks: list[RolloutHooks]) -> Rollout:
            return self.decoding.engine.generate(
                prompts, n=n, key=key, sampling=sampling, max_new_tokens=max_new, hooks=hooks,
                params=self.params, drafter_params=self.dparams,
            )  # fmt: skip

        rollout = run(self.hooks)
        plain = run([FixedMode("plain"), *self.watchers]) if self.decoding.plain_baseline else None
        self.tally.add(rollout, plain)
        return rollout
