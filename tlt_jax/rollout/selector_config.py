"""The strategy selector's static config and state (shared by `beg_mab.py`, the API, and
`selector_policies.py`, the per-algorithm rules): arms, running-batch buckets, eligibility, algorithm
parameters, and the pytree of sliding windows and counters the rules read and update.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
from flax import struct

from tlt_jax.utils.config_checks import Section

ALGORITHMS = ("beg_mab", "egreedy", "ucb1", "fixed", "sglang")
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
    epsilon / window / ucb_c: exploration rate, sliding-window length (beg_mab and ucb1: the bucket's last
      `window` plays; egreedy: each arm's last `window` rewards), UCB1 bonus constant. Rewards are
      normalised by the window's best, so they sit near 1 with a spread of ~10%: 0.15 ~ sqrt(2) x that
      spread, where UCB1's own sqrt(2) (for rewards spread over [0, 1]) would mostly explore.
    min_plays: beg_mab ranks an arm by its median only with this many rewards in the window (3: the median
      of three chunks outvotes one slowed by another process).
    fixed_table: arm name per bucket. sglang_*: the ladder (arm names shallow to deep, optionally starting
      with "plain"), EMA rate, up/down fractions, plain floor, updates between moves, probe interval on plain,
      start rung. (The paper's threshold switch is no selector algorithm: it is `SpecConfig.threshold` /
      `min_steps_below`, the engine's default when no selector chooses; see `hooks.ThresholdPolicy`.)
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
    min_plays: int = 3
    fixed_table: tuple[str, ...] | None = None
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
        if self.algorithm == "threshold":
            _fail(
                "algorithm",
                "'threshold' is not a selector algorithm",
                "the threshold switch is SpecConfig.threshold / min_steps_below "
                "(config.spec.threshold with config.bandit.algorithm=off)",
            )
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
        if not 1 <= self.min_plays <= self.window:
            _fail("min_plays", f"got {self.min_plays}", f"need 1 <= min_plays <= window ({self.window})")
        if self.algorithm == "fixed" or self.fixed_table is not None:
            table = self.fixed_table or ()
            if len(table) != self.num_buckets or any(a not in self.arms for a in table):
                _fail("fixed_table", f"got {self.fixed_table}", "give one arm name (from `arms`) per bucket")
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
    the bucket's last W plays. Nothing in it is per rollout: it lives across rollouts (the learner
    checkpoints it).
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


@dataclasses.dataclass(frozen=True)
class BanditSection(Section):
    """`config.bandit`, the adaptive engine (tlt_jax.rollout.adaptive): a selector picks each chunk's mode
    among `arms` ("plain", EAGLE strategies "3_1_4", n-gram "ngram_4_1_5", history "history_4_1_5") per
    running-batch bucket. "off": no selector; the SpecConfig threshold switch (`config.spec.threshold`)
    decides."""

    algorithm: str = "off"  # off | beg_mab | egreedy | ucb1 | fixed | sglang
    arms: tuple[str, ...] = ("plain", "3_1_4")
    bucket_bounds: tuple[int, ...] = (1, 2, 4, 8)  # inclusive upper bounds of the running-row buckets
    all_arms: bool = True  # every arm in every bucket (False: BEG-MAB's grouping by tokens_to_verify)
    bucket_targets: tuple[int, ...] = ()
    epsilon: float = 0.1
    window: int = 64  # beg_mab / ucb1: the bucket's last 64 chunks
    min_plays: int = 3  # beg_mab: chunks an arm needs in the window before its median is trusted
    fixed_table: tuple[str, ...] = ()
    sglang_ladder: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        if self.algorithm == "threshold":
            return [
                "config.bandit.algorithm='threshold': the threshold switch is config.spec.threshold / "
                "min_steps_below with config.bandit.algorithm=off."
            ]
        if self.algorithm not in ("off", *ALGORITHMS):
            return [f"config.bandit.algorithm={self.algorithm!r}: use one of {('off', *ALGORITHMS)}."]
        return []
