"""BEG-MAB: TLT's bucketed epsilon-greedy selector of the speculative strategy, and the baselines it faces.

Which strategy (draft depth, topk, tokens_to_verify) decodes fastest depends on the running batch (paper Table
4: big trees lose at large batch) and drifts as RL changes the policy and its drafter. TLT maps running-row
counts to buckets, gives each bucket the strategies whose tokens_to_verify suit it, and within a bucket plays
epsilon-greedy on the MEDIAN reward (tokens emitted per second of a chunk) over a sliding window. Beyond the
paper, "plain" (no speculation, tokens_to_verify = 1) is an arm in every bucket, so the selector learns where
SD pays on this hardware instead of trusting a constant threshold. Baselines share the same state and API:
"egreedy" (mean reward), "ucb1" (sliding-window UCB), "fixed" (vLLM-style arm per bucket) and "sglang"
(EMA + hysteresis on a depth ladder); their rules are in `selector_policies.py`. The paper's own baseline,
the threshold switch, is not a selector: it is `SpecConfig.threshold` / `min_steps_below`
(`hooks.ThresholdPolicy`), which the engine applies when no selector chooses (`config.bandit.algorithm=off`).

Pure and jit-compatible with the config static: `init(cfg)`, `select(cfg, state, running, key) -> arm`,
`update(cfg, state, running, arm, reward, accept_length)`; `BanditPolicy` wraps them for the host loop (arm
names in, arm names out, checkpointable state dict, metrics). The state has no per-rollout part: what it
learned carries over from one rollout to the next.
"""

from __future__ import annotations

import math
from typing import Any

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax import sharding as shd
from tlt_jax.rollout import selector_policies as policies
from tlt_jax.rollout.selector_config import MAX_RUNNING, SelectorConfig, SelectorState


def init(cfg: SelectorConfig) -> SelectorState:
    """A fresh state: empty windows, zero counts, sglang at its start rung."""
    b, a, w = cfg.num_buckets, cfg.num_arms, cfg.window
    start = cfg.ladder_start if cfg.sglang_ladder else (0,) * b
    return SelectorState(
        rewards=jnp.full((b, a, w), jnp.nan, jnp.float32),
        accepts=jnp.full((b, a, w), jnp.nan, jnp.float32),
        stamps=jnp.full((b, a, w), -1, jnp.int32),
        head=jnp.zeros((b, a), jnp.int32),
        count=jnp.zeros((b, a), jnp.int32),
        bucket_steps=jnp.zeros((b,), jnp.int32),
        ema=jnp.full((b,), jnp.nan, jnp.float32),
        rung=jnp.asarray(start, jnp.int32),
        since_move=jnp.zeros((b,), jnp.int32),
    )


def check_state(cfg: SelectorConfig, state: SelectorState) -> None:
    """chex shape/dtype assertions of a state against its config (trace-time: free under jit)."""
    b, a, w = cfg.num_buckets, cfg.num_arms, cfg.window
    chex.assert_shape([state.rewards, state.accepts, state.stamps], (b, a, w))
    chex.assert_shape([state.head, state.count], (b, a))
    chex.assert_shape([state.bucket_steps, state.ema, state.rung, state.since_move], (b,))
    chex.assert_type([state.rewards, state.accepts, state.ema], jnp.float32)
    chex.assert_type(
        [state.stamps, state.head, state.count, state.bucket_steps, state.rung, state.since_move], jnp.int32
    )


def bucket_index(cfg: SelectorConfig, running: jax.Array | int) -> jax.Array:
    """Bucket of a running-row count: the first with running <= its bound (int32; above all -> the last)."""
    bounds = jnp.asarray(cfg.bucket_bounds, jnp.int32)
    b = jnp.searchsorted(bounds, jnp.asarray(running, jnp.int32), side="left")
    return jnp.minimum(b, cfg.num_buckets - 1).astype(jnp.int32)


def _scalar(x: jax.Array | int | float, dtype: Any) -> jax.Array:
    x = jnp.asarray(x, dtype)
    chex.assert_rank(x, 0)
    return x


def select(cfg: SelectorConfig, state: SelectorState, running: jax.Array | int, key: jax.Array) -> jax.Array:
    """The arm (int32 scalar index into `cfg.arms`) for the next chunk at `running` rows. Pure; `key` is used
    by the epsilon-greedy algorithms only (pass a fresh one each call)."""
    check_state(cfg, state)
    running = _scalar(running, jnp.int32)
    b = bucket_index(cfg, running)
    if cfg.algorithm == "fixed":
        return jnp.asarray([cfg.arm_index(a) for a in cfg.fixed_table], jnp.int32)[b]
    if cfg.algorithm == "sglang":
        return jnp.asarray(cfg.ladder_index, jnp.int32)[state.rung[b]]
    return policies.bandit_arm(cfg, state, b, key)


def update(
    cfg: SelectorConfig,
    state: SelectorState,
    running: jax.Array | int,
    arm: jax.Array | int,
    reward: jax.Array | float,
    accept_length: jax.Array | float,
) -> SelectorState:
    """Record a finished chunk: `arm` ran at `running` rows, emitted `reward` tokens/s and `accept_length`
    tokens per row per verify round (ignored for plain arms). Every algorithm records the windows (so all
    report the same metrics); sglang also moves its ladder."""
    check_state(cfg, state)
    running = _scalar(running, jnp.int32)
    arm = _scalar(arm, jnp.int32)
    reward = _scalar(reward, jnp.float32)
    accept_length = _scalar(accept_length, jnp.float32)
    b = bucket_index(cfg, running)
    t = state.bucket_steps[b] + 1
    h = state.head[b, arm]
    new = state.replace(
        rewards=state.rewards.at[b, arm, h].set(reward),
        accepts=state.accepts.at[b, arm, h].set(accept_length),
        stamps=state.stamps.at[b, arm, h].set(t),
        head=state.head.at[b, arm].set((h + 1) % cfg.window),
        count=state.count.at[b, arm].add(1),
        bucket_steps=state.bucket_steps.at[b].set(t),
    )
    if cfg.algorithm == "sglang":
        ema, rung, since = policies.sglang_step(cfg, state, b, arm, accept_length)
        new = new.replace(
            ema=new.ema.at[b].set(ema),
            rung=new.rung.at[b].set(rung),
            since_move=new.since_move.at[b].set(since),
        )
    return new


def _select_and_split(
    cfg: SelectorConfig, state: SelectorState, running: jax.Array, key: jax.Array
) -> tuple[jax.Array, jax.Array]:
    key, sub = jax.random.split(key)
    return select(cfg, state, running, sub), key


# One jitted program per config (the static argument is the cache key): no recompiles across calls.
_select_jit = jax.jit(_select_and_split, static_argnums=0)
_update_jit = jax.jit(update, static_argnums=0)


class BanditPolicy:
    """Host-side selector for the rollout loop: arm names in and out, state and PRNG key held here.

    Per chunk: `arm = policy.select(running)`, run it, then `policy.observe(arm, running, tokens_per_second,
    accept_length)`. The learner keeps one policy across rollouts and RL steps and checkpoints `state_dict()`
    (the key included, so a resumed run continues bit-identically).
    """

    def __init__(self, cfg: SelectorConfig, seed: int = 0):
        self.cfg = cfg
        self.state = init(cfg)
        self.key = jax.random.PRNGKey(seed)

    def select(self, running: int) -> str:
        """Name of the arm for the next chunk at `running` rows."""
        if running < 0:
            raise ValueError(f"running must be >= 0, got {running}")
        arm, self.key = _select_jit(self.cfg, self.state, np.int32(min(running, MAX_RUNNING)), self.key)
        return self.cfg.arms[int(arm)]

    def observe(self, arm: str, running: int, tokens_per_second: float, accept_length: float) -> None:
        """Learn from a finished chunk of `arm` at `running` rows (accept_length: tokens per verify round).

        With several processes each measured its own tokens/s (wall clock): every process learns their mean
        (`sharding.process_mean`, a collective), so all of them hold one state and choose the same arms (a
        different arm in one process would run another program there: a hang). On one process: the values."""
        tokens_per_second, accept_length = (
            float(x) for x in shd.process_mean(np.asarray([tokens_per_second, accept_length]))
        )
        if not (math.isfinite(tokens_per_second) and math.isfinite(accept_length)) or running < 0:
            raise ValueError(
                f"observe({arm!r}, running={running}, tokens_per_second={tokens_per_second}, "
                f"accept_length={accept_length}): need running >= 0 and finite rewards"
            )
        self.state = _update_jit(
            self.cfg,
            self.state,
            np.int32(min(running, MAX_RUNNING)),
            np.int32(self.cfg.arm_index(arm)),
            np.float32(tokens_per_second),
            np.float32(accept_length),
        )

    def state_dict(self) -> dict[str, Any]:
        """The checkpointable pytree of arrays: the selector state and the PRNG key."""
        return {"state": flax.serialization.to_state_dict(self.state), "key": self.key}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore from `state_dict()` output (e.g. a `Checkpointer.restore` into a fresh policy's dict)."""
        state = flax.serialization.from_state_dict(init(self.cfg), d["state"])
        # through the host: with several processes a restored leaf is replicated over every process's devices
        # (utils/checkpoint.py); the selector runs on this process's default device, as a fresh one does
        state = jax.tree_util.tree_map(lambda x: jnp.asarray(shd.to_host(x)), state)
        check_state(self.cfg, state)
        key = jnp.asarray(shd.to_host(d["key"]))
        chex.assert_trees_all_equal_shapes_and_dtypes(key, self.key)
        self.state, self.key = state, key

    def summary(self) -> dict[str, float]:
        """Metrics: per bucket and eligible arm the chunks played ("count"), and over the arm's window the
        median reward ("reward", what BEG-MAB ranks by), mean reward and mean accept length (when non-empty);
        sglang adds each bucket's rung and EMA."""
        s = shd.to_host_tree(self.state)
        out: dict[str, float] = {}
        for b in range(self.cfg.num_buckets):
            for a, name in enumerate(self.cfg.arms):
                if not self.cfg.eligible[b][a] and s.count[b, a] == 0:
                    continue
                key = f"bandit/b{b}/{name}"
                out[f"{key}/count"] = float(s.count[b, a])
                rew = s.rewards[b, a][~np.isnan(s.rewards[b, a])]
                if rew.size:
                    out[f"{key}/reward"] = float(np.median(rew))
                    out[f"{key}/reward_mean"] = float(np.mean(rew))
                    out[f"{key}/accept"] = float(np.nanmean(s.accepts[b, a]))
            if self.cfg.algorithm == "sglang":
                out[f"bandit/b{b}/rung"] = float(s.rung[b])
                if not np.isnan(s.ema[b]):
                    out[f"bandit/b{b}/ema_accept"] = float(s.ema[b]) + 1.0
        return out
