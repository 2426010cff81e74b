"""BEG-MAB: TLT's bucketed epsilon-greedy selector of the speculative strategy, and the baselines it faces.

Which strategy (draft depth, topk, tokens_to_verify) decodes fastest depends on the running batch (paper Table
4: big trees lose at large batch) and drifts as RL changes the policy and its drafter. TLT maps running-row
counts to buckets, gives each bucket the strategies whose tokens_to_verify suit it, and within a bucket plays
epsilon-greedy on the MEDIAN reward (tokens emitted per second of a chunk) over a sliding window. Beyond the
paper, "plain" (no speculation, tokens_to_verify = 1) is an arm in every bucket, so the selector learns where
SD pays on this hardware instead of trusting a constant threshold. Baselines share the same state and API:
"egreedy", "ucb1", "fixed" (vLLM-style table), "sglang" (EMA + hysteresis on a depth ladder) and
"threshold" (the paper's switch); their rules are in `selector_policies.py`.

Pure and jit-compatible with the config static: `init(cfg)`, `select(cfg, state, running, key) -> arm`,
`update(cfg, state, running, arm, reward, accept_length)`, `reset_rollout(state)`; `BanditPolicy` wraps them
for the host loop (arm names in, arm names out, checkpointable state dict, metrics).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tlt_jax.rollout import selector_policies as policies

ALGORITHMS = ("beg_mab", "egreedy", "ucb1", "fixed", "sglang", "threshold")
PLAIN = "plain"
MAX_RUNNING = 2**31 - 1
PAPER_BUCKET_BOUNDS = (1, 4, 20, MAX_RUNNING)  # bs 1 | 2-4 | 5-20 | >= 21
PAPER_BUCKET_TARGETS = (48, 32, 16, 8)  # tokens_to_verify each of those buckets is grouped with


def beg_eligibility(
    tokens_to_verify: tuple[int, ...], bucket_targets: tuple[int, ...]
) -> tuple[tuple[bool, ...], ...]:
    """The paper's BEG grouping: bucket b gets the speculative arms whose tokens_to_verify is closest to
    `bucket_targets[b]` (all of them on a tie), plus every plain arm (tokens_to_verify = 1)."""
    spec = [t for t in tokens_to_verify if t > 1]
    rows = []
    for target in bucket_targets:
        best = min((abs(t - target) for t in spec), default=None)
        rows.append(tuple(t == 1 or abs(t - target) == best for t in tokens_to_verify))
    return tuple(rows)


def all_arms_eligibility(num_buckets: int, num_arms: int) -> tuple[tuple[bool, ...], ...]:
    """Every arm eligible in every bucket (the un-grouped baselines)."""
    return tuple((True,) * num_arms for _ in range(num_buckets))


def _fail(field: str, problem: str, fix: str) -> None:
    raise ValueError(f"SelectorConfig.{field}: {problem}; {fix}")


@dataclasses.dataclass(frozen=True)
class SelectorConfig:
    """Static (hashable) selector config: pass it as the static argument of the jitted functions.

    arms: arm names ("plain" = no speculation, or the engine's mode names like "8_4_48", "ngram_4_1_4").
    tokens_to_verify: per arm (1 for plain). max_accept: per arm, the most tokens one round can emit (depth +
      1; default tokens_to_verify, exact for chains); only the sglang ladder reads it.
    bucket_bounds: inclusive upper bounds on the running-row count, increasing; counts above the last go to
      the last bucket. eligible: [bucket][arm] mask; None = BEG grouping by `bucket_targets` for beg_mab, all
      arms everywhere for the others.
    epsilon / window / ucb_c: exploration rate, sliding-window length, UCB1 bonus constant. Rewards are
      normalised by the window's best, so they sit near 1 with a spread of ~10%: 0.15 ~ sqrt(2) x that
      spread, where UCB1's own sqrt(2) (for rewards spread over [0, 1]) would mostly explore.
    fixed_table: arm name per bucket. threshold / min_steps_below / sd_arm: the paper's switch, counted in
      updates (chunks). sglang_*: the ladder (arm names shallow to deep, optionally starting with "plain"),
      EMA rate, up/down fractions, plain floor, updates between moves, probe interval on plain, start rung.
    """

    arms: tuple[str, ...]
    tokens_to_verify: tuple[int, ...]
    bucket_bounds: tuple[int, ...] = PAPER_BUCKET_BOUNDS
    algorithm: str = "beg_mab"
    eligible: tuple[tuple[bool, ...], ...] | None = None
    bucket_targets: tuple[int, ...] = PAPER_BUCKET_TARGETS
    max_accept: tuple[int, ...] | None = None
    epsilon: float = 0.1
    window: int = 300
    ucb_c: float = 0.15
    fixed_table: tuple[str, ...] | None = None
    threshold: int = 32
    min_steps_below: int = 10
    sd_arm: str | None = None
    sglang_ladder: tuple[str, ...] | None = None
    sglang_alpha: float = 0.2
    sglang_up: float = 0.8
    sglang_down: float = 0.5
    sglang_plain_floor: float = 0.25
    sglang_min_obs: int = 5
    sglang_probe_interval: int = 20
    sglang_start: int = 0

    def __post_init__(self) -> None:
        for f in ("arms", "tokens_to_verify", "bucket_bounds", "bucket_targets", "max_accept", "fixed_table"):
            if getattr(self, f) is not None:  # lists from ConfigDicts become tuples: the config must hash
                object.__setattr__(self, f, tuple(getattr(self, f)))
        if self.sglang_ladder is not None:
            object.__setattr__(self, "sglang_ladder", tuple(self.sglang_ladder))
        if self.eligible is not None:
            object.__setattr__(self, "eligible", tuple(tuple(bool(x) for x in row) for row in self.eligible))
        self._check_arms()
        bounds = self.bucket_bounds
        if not bounds or any(b < 1 for b in bounds) or any(x >= y for x, y in itertools.pairwise(bounds)):
            _fail("bucket_bounds", f"got {bounds}", "give increasing ints >= 1, e.g. (1, 4, 20, 2**31 - 1)")
        if self.algorithm not in ALGORITHMS:
            _fail("algorithm", f"unknown {self.algorithm!r}", f"use one of {ALGORITHMS}")
        if self.eligible is None:
            if self.algorithm == "beg_mab":
                if len(self.bucket_targets) != self.num_buckets:
                    _fail(
                        "bucket_targets",
                        f"{len(self.bucket_targets)} targets for {self.num_buckets} buckets",
                        "give one tokens_to_verify target per bucket, or pass `eligible`",
                    )
                mask = beg_eligibility(self.tokens_to_verify, self.bucket_targets)
            else:
                mask = all_arms_eligibility(self.num_buckets, self.num_arms)
            object.__setattr__(self, "eligible", mask)
        if len(self.eligible) != self.num_buckets or any(len(r) != self.num_arms for r in self.eligible):
            _fail("eligible", "shape is not [num_buckets][num_arms]", "give one bool per arm for each bucket")
        if not all(any(r) for r in self.eligible):
            _fail("eligible", "a bucket has no eligible arm", "make at least one arm eligible per bucket")
        if not 0.0 <= self.epsilon <= 1.0 or self.window < 1 or self.ucb_c < 0:
            _fail(
                "epsilon/window/ucb_c",
                f"got {self.epsilon}, {self.window}, {self.ucb_c}",
                "need 0 <= epsilon <= 1, window >= 1, ucb_c >= 0",
            )
        if self.algorithm == "fixed" or self.fixed_table is not None:
            table = self.fixed_table or ()
            if len(table) != self.num_buckets or any(a not in self.arms for a in table):
                _fail("fixed_table", f"got {self.fixed_table}", "give one arm name (from `arms`) per bucket")
        if self.threshold < 0 or self.min_steps_below < 0:
            _fail("threshold/min_steps_below", "negative", "use counts >= 0")
        if self.algorithm == "threshold":
            if self.sd_arm not in self.arms or self.sd_arm == PLAIN or PLAIN not in self.arms:
                _fail("sd_arm", f"got {self.sd_arm!r}", "name a speculative arm, and include 'plain' in arms")
        if self.algorithm == "sglang" or self.sglang_ladder is not None:
            self._check_sglang()

    def _check_arms(self) -> None:
        arms, ttv = self.arms, self.tokens_to_verify
        if not arms or len(set(arms)) != len(arms) or not all(isinstance(a, str) and a for a in arms):
            _fail("arms", f"got {arms}", "give unique non-empty names, e.g. ('plain', '3_1_4', '8_4_48')")
        if len(ttv) != len(arms) or any(int(t) != t or t < 1 for t in ttv):
            _fail("tokens_to_verify", f"got {ttv} for {len(arms)} arms", "give one int >= 1 per arm")
        if any((a == PLAIN) != (t == 1) for a, t in zip(arms, ttv, strict=True)):
            _fail(
                "tokens_to_verify",
                "'plain' must verify 1 token and only 'plain' may",
                "set 1 for 'plain' and >= 2 for speculative arms",
            )
        if self.max_accept is not None and (
            len(self.max_accept) != len(arms)
            or any(not 1 <= m <= t for m, t in zip(self.max_accept, ttv, strict=True))
        ):
            _fail("max_accept", f"got {self.max_accept}", "give per arm 1 <= max_accept <= tokens_to_verify")

    def _check_sglang(self) -> None:
        ladder = self.sglang_ladder or ()
        if not ladder or len(set(ladder)) != len(ladder) or any(a not in self.arms for a in ladder):
            _fail("sglang_ladder", f"got {self.sglang_ladder}", "give unique arm names, shallow to deep")
        caps = self.ladder_max_accept
        if any(x >= y for x, y in itertools.pairwise(caps)):
            _fail(
                "sglang_ladder",
                f"max_accept along the ladder is {caps}",
                "order it strictly shallow to deep ('plain' only first)",
            )
        if not all(any(r) for r in self.ladder_eligible):
            _fail(
                "sglang_ladder", "a bucket has no eligible rung", "make a ladder arm eligible in every bucket"
            )
        if not (0 < self.sglang_alpha <= 1 and 0 <= self.sglang_down < self.sglang_up <= 1):
            _fail(
                "sglang_alpha/up/down",
                f"got {self.sglang_alpha}, {self.sglang_up}, {self.sglang_down}",
                "need 0 < alpha <= 1 and 0 <= down < up <= 1 (up > down is the hysteresis)",
            )
        if self.sglang_plain_floor < 0 or self.sglang_min_obs < 1 or self.sglang_probe_interval < 0:
            _fail("sglang_plain_floor/min_obs/probe_interval", "out of range", "need >= 0, >= 1, >= 0")
        if not 0 <= self.sglang_start < len(ladder):
            _fail("sglang_start", f"got {self.sglang_start}", f"give a rung index in [0, {len(ladder)})")

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_bounds)

    @property
    def num_arms(self) -> int:
        return len(self.arms)

    def arm_index(self, name: str) -> int:
        """Index of arm `name` (ValueError naming the known arms otherwise)."""
        if name not in self.arms:
            raise ValueError(f"unknown arm {name!r}; the selector's arms are {self.arms}")
        return self.arms.index(name)

    @property
    def ladder_index(self) -> tuple[int, ...]:
        return tuple(self.arms.index(a) for a in self.sglang_ladder or ())

    @property
    def ladder_max_accept(self) -> tuple[int, ...]:
        per_arm = self.max_accept or self.tokens_to_verify
        return tuple(per_arm[i] for i in self.ladder_index)

    @property
    def ladder_eligible(self) -> tuple[tuple[bool, ...], ...]:
        return tuple(tuple(row[i] for i in self.ladder_index) for row in self.eligible)

    @property
    def ladder_start(self) -> tuple[int, ...]:
        """Start rung per bucket: the first eligible rung at or after `sglang_start`, else the deepest one."""
        out = []
        for row in self.ladder_eligible:
            ok = [r for r, e in enumerate(row) if e]
            out.append(next((r for r in ok if r >= self.sglang_start), ok[-1]) if ok else 0)
        return tuple(out)


@struct.dataclass
class SelectorState:
    """Everything the selector learns or counts, fixed shapes (B buckets, A arms, W = window, R rungs).

    The windows are per (bucket, arm) ring buffers of the last W rewards / accept lengths (NaN = empty);
    `stamps` holds the bucket's update count when each entry was written (-1 empty), so UCB1 can restrict to
    the bucket's last W plays. `below_steps` / `sd_on` are the threshold rule's per-rollout part.
    """

    rewards: jax.Array  # f32[B, A, W]
    accepts: jax.Array  # f32[B, A, W]
    stamps: jax.Array  # i32[B, A, W]
    head: jax.Array  # i32[B, A] next slot of each ring
    count: jax.Array  # i32[B, A] updates of each arm in each bucket, ever
    bucket_steps: jax.Array  # i32[B] updates in each bucket, ever
    ema: jax.Array  # f32[B] sglang: EMA of accepted drafts per round (NaN = no observation yet)
    rung: jax.Array  # i32[B] sglang: current ladder rung
    since_move: jax.Array  # i32[B] sglang: updates since the last move
    below_steps: jax.Array  # i32[] threshold: consecutive updates with running <= threshold
    sd_on: jax.Array  # bool[] threshold: switched on for the rest of the rollout


def init(cfg: SelectorConfig) -> SelectorState:
    """A fresh state: empty windows, zero counts, sglang at its start rung, threshold off."""
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
        below_steps=jnp.zeros((), jnp.int32),
        sd_on=jnp.zeros((), bool),
    )


def check_state(cfg: SelectorConfig, state: SelectorState) -> None:
    """chex shape/dtype assertions of a state against its config (trace-time: free under jit)."""
    b, a, w = cfg.num_buckets, cfg.num_arms, cfg.window
    chex.assert_shape([state.rewards, state.accepts, state.stamps], (b, a, w))
    chex.assert_shape([state.head, state.count], (b, a))
    chex.assert_shape([state.bucket_steps, state.ema, state.rung, state.since_move], (b,))
    chex.assert_shape([state.below_steps, state.sd_on], ())
    chex.assert_type([state.rewards, state.accepts, state.ema], jnp.float32)
    chex.assert_type([state.stamps, state.head, state.count, state.bucket_steps, state.rung], jnp.int32)
    chex.assert_type([state.since_move, state.below_steps, state.sd_on], [jnp.int32, jnp.int32, bool])


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
    if cfg.algorithm == "threshold":
        return policies.threshold_arm(cfg, state, running)
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
    report the same metrics); sglang also moves its ladder, threshold counts its steps below."""
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
    below_steps, sd_on = policies.threshold_step(cfg, state, running)
    return new.replace(below_steps=below_steps, sd_on=sd_on)


def reset_rollout(state: SelectorState) -> SelectorState:
    """Start a new rollout: clear the per-rollout parts (the threshold rule's counter and switch) and keep
    what was learned (windows, counts, sglang EMA and rungs)."""
    return state.replace(below_steps=jnp.zeros_like(state.below_steps), sd_on=jnp.zeros_like(state.sd_on))


def _select_and_split(
    cfg: SelectorConfig, state: SelectorState, running: jax.Array, key: jax.Array
) -> tuple[jax.Array, jax.Array]:
    key, sub = jax.random.split(key)
    return select(cfg, state, running, sub), key


# One jitted program per config (the static argument is the cache key): no recompiles across calls.
_select_jit = jax.jit(_select_and_split, static_argnums=0)
_update_jit = jax.jit(update, static_argnums=0)
_reset_jit = jax.jit(reset_rollout)


class BanditPolicy:
    """Host-side selector for the rollout loop: arm names in and out, state and PRNG key held here.

    Per chunk: `arm = policy.select(running)`, run it, then `policy.observe(arm, running, tokens_per_second,
    accept_length)`; `new_rollout()` before each rollout. The learner keeps one policy across RL steps and
    checkpoints `state_dict()` (the key included, so a resumed run continues bit-identically).
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
        """Learn from a finished chunk of `arm` at `running` rows (accept_length: tokens per verify round)."""
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

    def new_rollout(self) -> None:
        """Clear the per-rollout parts of the state (see `reset_rollout`)."""
        self.state = _reset_jit(self.state)

    def state_dict(self) -> dict[str, Any]:
        """The checkpointable pytree of arrays: the selector state and the PRNG key."""
        return {"state": flax.serialization.to_state_dict(self.state), "key": self.key}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore from `state_dict()` output (e.g. a `Checkpointer.restore` into a fresh policy's dict)."""
        state = flax.serialization.from_state_dict(init(self.cfg), d["state"])
        state = jax.tree_util.tree_map(jnp.asarray, state)
        check_state(self.cfg, state)
        key = jnp.asarray(d["key"])
        chex.assert_trees_all_equal_shapes_and_dtypes(key, self.key)
        self.state, self.key = state, key

    def summary(self) -> dict[str, float]:
        """Metrics: per bucket and eligible arm the chunks played ("count"), and over the arm's window the
        median reward ("reward", what BEG-MAB ranks by), mean reward and mean accept length (when non-empty);
        sglang adds each bucket's rung and EMA, threshold whether SD is on."""
        s = jax.device_get(self.state)
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
        if self.cfg.algorithm == "threshold":
            out["bandit/sd_on"] = float(s.sd_on)
        return out
