"""The arithmetic of one TLT rollout and RL step, as small pure functions (the simulator's model).

`experiments/models/simulate_rl.py` replays a batch of response lengths through this model; the tests check
it on hand-computed cases. What it models is the engine's host loop (`tlt_jax/rollout/scheduler.py`):

  * rows are spread over D data-axis devices in contiguous blocks (row i on device i // (B / D)); before each
    chunk the live rows are compacted WITHIN each device into the smallest power-of-two local bucket that
    holds the fullest device's live rows (every device runs the same SPMD program, so the fullest one sets
    the bucket), and the chunk runs at `local bucket x D` rows;
  * a chunk runs up to `chunk_steps` decode steps (plain: one token per live row) or verify rounds (a
    speculative mode: `accept` tokens per live row on average) and exits early, after at least one step,
    once the fullest device has at most half its bucket live (the engine's `exit_live`);
  * its cache bucket is the power of two >= the longest live row's cache length + `chunk_steps` x the
    mode's tokens per step + its lookahead (at least `min_cache_bucket`, capped as the engine caps it);
  * its time is steps x the cost of one step of that mode at (per-device batch bucket, cache bucket; and the
    KV tokens the fullest device's live rows hold, for a paged-attention cost model), plus a host overhead
    per chunk; a rollout adds its prefill and a fixed overhead;
  * the mode per chunk, from the fullest device's live rows and its bucket: plain, the threshold switch (a
    mode once at most `threshold` rows run) or the converged bandit (per chunk the mode with the most
    tokens per second at that bucket: BEG-MAB's choice once its window medians have settled, an oracle);
  * a device whose rows have all finished is idle until the rollout ends: the spot trainer's time.

Response lengths count the first token, which prefill samples, so a response of L tokens decodes L - 1
tokens in chunks. A row's cache holds its prompt and every generated token but the newest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

PLAIN = "plain"


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor)."""
    return 1 << max(0, math.ceil(math.log2(max(n, floor, 1))))


@dataclasses.dataclass(frozen=True)
class Mode:
    """A decode mode: plain (1 token per row per step) or speculative (`accept` tokens per row per round on
    average; `tokens_per_step` = depth + 1 tokens at most, `lookahead` cache slots a round writes ahead)."""

    name: str = PLAIN
    accept: float = 1.0
    tokens_per_step: int = 1
    lookahead: int = 0

    @staticmethod
    def speculative(name: str, accept: float) -> Mode:
        """A mode from a strategy name ("3_1_4", "ngram_3_1_4"; `tlt_jax.rollout.strategy.Strategy`): at
        most depth + 1 tokens per round (depth <= tokens_to_verify - 1), and the cache slots a round writes
        past a row's end (the verify pass, the drafter's tree)."""
        depth, topk, tv = (int(x) for x in name.split("_")[-3:])
        depth = min(depth, tv - 1)
        return Mode(name, accept, depth + 1, max(tv, 1 + (depth - 1) * topk, depth + 1))


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """The engine settings the timeline depends on (`EngineConfig`; `config.rollout.*`)."""

    chunk_steps: int = 16
    min_cache_bucket: int = 128
    max_cache_len: int = 512
    compact: bool = True


class StepCost(Protocol):
    """Seconds of one decode step (plain) or verify round (a speculative mode) of `batch` rows per device at
    a cache bucket of `cache` slots, the fullest device's live rows holding `kv` cached tokens in all: a
    measured table (`simulate_rl.CostTable`, by buckets) or a roofline model (`project_sd.Roofline`)."""

    def __call__(self, mode: str, batch: int, cache: int, kv: int = 0) -> float: ...


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One simulated device call: its mode, buckets, steps and seconds, and live rows at each step."""

    mode: str
    batch: int
    cache: int
    running: tuple[int, ...]
    seconds: float
    start: float

    @property
    def steps(self) -> int:
        return len(self.running)


@dataclasses.dataclass(frozen=True)
class RolloutTimeline:
    """A simulated rollout: its chunks, when each device's last row finished, and its total seconds."""

    chunks: tuple[Chunk, ...]
    device_done: tuple[float, ...]  # seconds from the start of decoding to each device's last row's end
    prefill: float
    overhead: float  # host time: per chunk and per rollout

    @property
    def decode_seconds(self) -> float:
        return sum(c.seconds for c in self.chunks)

    @property
    def seconds(self) -> float:
        return self.prefill + self.decode_seconds + self.overhead

    def seconds_at_running(self, at_most: int) -> float:
        """Decode seconds of the steps with at most `at_most` running rows (a chunk's time spread evenly
        over its steps, as `RolloutStats.seconds_at_running`)."""
        return sum(c.seconds / c.steps * sum(r <= at_most for r in c.running) for c in self.chunks)

    def mode_seconds(self, mode: str) -> float:
        return sum(c.seconds for c in self.chunks if c.mode == mode)

    def profile(self) -> list[tuple[float, int]]:
        """(seconds since decoding started, running rows) at each step: the paper's Fig 14 curve."""
        out = []
        for c in self.chunks:
            dt = c.seconds / max(c.steps, 1)
            out.extend((c.start + i * dt, r) for i, r in enumerate(c.running))
        return out


Chooser = Callable[[int, int, int], Mode]  # (running rows, batch bucket, cache bucket) per device -> mode


def threshold_chooser(mode: Mode, threshold: int) -> Chooser:
    """The paper's switch (`ThresholdPolicy`, min_steps_below = 0): `mode` once at most `threshold` rows
    run; running rows only fall during a rollout, so it stays on."""
    return lambda running, batch, cache: mode if running <= threshold else Mode()


def best_chooser(modes: Sequence[Mode], cost: StepCost) -> Chooser:
    """The converged bandit: per chunk the mode with the most tokens per second at its bucket
    (accept / step cost; plain is always a candidate), evaluated at the cache bucket plain would use with
    every row of the bucket live."""
    cands = [Mode(), *[m for m in modes if m.name != PLAIN]]

    def choose(running: int, batch: int, cache: int) -> Mode:
        return max(cands, key=lambda m: m.accept / cost(m.name, batch, cache, batch * cache))

    return choose


def _cache_bucket(need: int, shape: EngineShape, max_lookahead: int) -> int:
    cap = pow2_at_least(shape.max_cache_len + max_lookahead)
    return min(pow2_at_least(need, shape.min_cache_bucket), cap)


def _chunk_steps(steps_left: np.ndarray, device: np.ndarray, devices: int, limit: int, exit_live: int) -> int:
    """Steps a chunk runs: up to `limit`, ending (after at least one) once the fullest device has at most
    `exit_live` live rows. steps_left: steps each live row needs to finish."""
    for k in range(1, limit):
        fullest = np.bincount(device[steps_left > k], minlength=devices).max(initial=0)
        if fullest == 0 or fullest <= exit_live:
            return k
    return limit


def simulate_rollout(
    lengths: Sequence[int],
    prompt_lengths: Sequence[int] | int,
    cost: StepCost,
    choose: Chooser,
    *,
    devices: int = 1,
    shape: EngineShape = EngineShape(),
    max_new: int | None = None,
    max_lookahead: int = 0,
    prefill: float = 0.0,
    chunk_overhead: float = 0.0,
    rollout_overhead: float = 0.0,
) -> RolloutTimeline:
    """The timeline of one rollout of rows with these response lengths (see the module docstring).

    prompt_lengths: per row, or one for all. max_new: the response cap (default the longest length).
    max_lookahead: the largest lookahead of the engine's registered modes (it widens the cache cap).
    """
    n = len(lengths)
    plen = np.full(n, prompt_lengths) if isinstance(prompt_lengths, int) else np.asarray(prompt_lengths)
    local0 = pow2_at_least(-(-n // devices))
    left = np.maximum(np.asarray(lengths, np.float64) - 1.0, 0.0)  # tokens each row still decodes
    cache = plen.astype(np.float64)  # prompt + the prefill token - the newest one
    device = np.arange(n) // local0
    max_total = int(plen.max()) + (max_new if max_new is not None else int(max(lengths)))
    done_at = np.zeros(devices)
    t, chunks, b_local = 0.0, [], local0
    while (left > 0).any():
        live = left > 0
        per_device = np.bincount(device[live], minlength=devices)
        fullest = pow2_at_least(int(per_device.max()))
        if shape.compact and fullest < b_local:
            b_local = fullest
        longest = int(np.ceil(cache[live].max()))
        plain_cap = _cache_bucket(longest + shape.chunk_steps + 1, shape, max_lookahead)
        mode = choose(int(per_device.max()), b_local, plain_cap)
        ahead = mode.lookahead if mode.name != PLAIN else 1
        need = min(longest + shape.chunk_steps * mode.tokens_per_step + ahead, max_total + ahead)
        cap = _cache_bucket(need, shape, max_lookahead)
        exit_live = b_local // 2 if shape.compact and b_local > 1 else -1
        steps_left = np.where(live, np.ceil(left / mode.accept - 1e-9), 0)
        k = _chunk_steps(steps_left, device, devices, shape.chunk_steps, exit_live)
        running = tuple(int((steps_left > j).sum()) for j in range(k))
        # the KV tokens of the fullest device's live rows, midway through the chunk
        kv_dev = np.bincount(device[live], weights=cache[live], minlength=devices)
        kv = int((kv_dev + per_device * min(k * mode.accept, float(left.max())) / 2).max())
        emit = np.minimum(left, k * mode.accept)
        left, cache = left - emit, cache + emit
        left[left < 1e-9] = 0.0
        secs = k * cost(mode.name, b_local, cap, kv)
        chunks.append(Chunk(mode.name, b_local * devices, cap, running, secs, t))
        t += secs
        finished = (np.bincount(device[left > 0], minlength=devices) == 0) & (done_at == 0)
        done_at[finished] = t
    overhead = len(chunks) * chunk_overhead + rollout_overhead
    return RolloutTimeline(tuple(chunks), tuple(float(x) for x in done_at), prefill, overhead)


def idle_device_seconds(done_at: Sequence[float], end: float) -> float:
    """Device-seconds the devices sit idle between their last row's end and the rollout's end."""
    return sum(max(end - t, 0.0) for t in done_at)


def spot_seconds_used(done_at: Sequence[float], end: float, step_seconds: float) -> float:
    """Idle device-seconds the spot trainer fills: whole drafter steps on each idle device (it is preempted
    at step granularity when the rollout ends)."""
    if step_seconds <= 0:
        return 0.0
    return sum(math.floor(max(end - t, 0.0) / step_seconds) * step_seconds for t in done_at)


def sd_speedup(accept: float, round_cost: float) -> float:
    """Decode speedup of SD over plain at one batch: tokens per round over the round's cost in plain
    decode steps (both per row, same batch)."""
    return accept / round_cost


def accept_from_positions(rates: Sequence[float]) -> float:
    """Accept length of a chain from its per-position acceptance rates (the probability that draft i is
    accepted, i.e. that positions 1..i all are): the bonus token plus the expected accepted drafts."""
    return 1.0 + float(sum(rates))


def step_time(rollout_seconds: float, other_seconds: float, spot_added: float = 0.0) -> float:
    """One RL step: the rollout, what the step does besides it (reward, log-probs, update: the same work
    with and without SD, since coupled verification leaves the samples unchanged), and the time a spot
    trainer adds outside idle devices."""
    return rollout_seconds + other_seconds + spot_added
