"""Plain vs speculative rollouts timed in interleaved pairs: what bench_sd.py and sd_heatmaps.py measure with.

`measure_pairs` runs an untimed SD warm-up pass (it compiles every program the trajectory needs), then `reps`
pairs of a plain pass and an SD pass over the same prompts and PRNG keys; speedup and round cost are the
medians of the per-pair ratios, so a drift of the machine's speed cancels within a pair. Tokens/s are the
decode chunks' emitted tokens over their device seconds (prefill and host time excluded). `strategy_for`
maps tokens_to_verify to an EAGLE strategy (bench_sd's documented mapping).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FixedMode
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.strategy import Strategy

TASK_KWARGS = {
    "chain_sum": {},  # as configs/drafter_warmup.py (the drafter's training distribution)
    "gsm_symbolic": {},
}


def strategy_for(tv: int, max_depth: int = 8) -> str:
    """depth = min(max_depth, tv - 1); topk = smallest k with k + (depth - 1) k^2 >= tv - 1."""
    depth = min(max_depth, tv - 1)
    k = 1
    while k + (depth - 1) * k * k < tv - 1:
        k += 1
    return Strategy(depth, k, tv).name


class Totals:
    """Decode tokens/seconds and verify stats summed over the chunk records of several rollouts."""

    def __init__(self) -> None:
        self.tokens = self.accepted = self.rounds = self.steps = 0
        self.seconds = 0.0
        self.compiles = 0

    def add(self, stats, spec: bool) -> None:  # noqa: ANN001
        for c in stats.chunks:
            if (c.mode != "plain") != spec:
                raise RuntimeError(f"unexpected {c.mode!r} chunk in a {'SD' if spec else 'plain'} rollout")
            self.tokens += c.new_tokens
            self.seconds += c.seconds
            self.accepted += c.accepted_tokens
            self.rounds += c.verify_rounds
            self.steps += c.steps

    @property
    def tok_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def step_seconds(self) -> float:
        """Device seconds per decode step (plain) or per verify round (SD), batch-wide."""
        return self.seconds / max(self.steps, 1)

    @property
    def accept_len(self) -> float:
        return self.accepted / self.rounds if self.rounds else float("nan")


def one_pass(
    engine: RolloutEngine, groups: list[list[list[int]]], mode: str | None, new: int, temp: float, seed: int
) -> Totals:
    """One rollout of every prompt group: plain (mode None) or speculative from the first chunk."""
    sp = SamplingParams(temperature=temp)
    tot = Totals()
    c0 = engine.compile_count
    for i, prompts in enumerate(groups):
        sel = FixedMode(mode or "plain")  # SD for the whole rollout: on from the first chunk
        out = engine.generate(
            prompts, n=1, key=jax.random.key(seed + i), sampling=sp, max_new_tokens=new, hooks=sel
        )
        tot.add(out.stats, spec=mode is not None)
    tot.compiles = engine.compile_count - c0
    return tot


@dataclasses.dataclass
class Pairs:
    """`reps` interleaved (plain, SD) passes over the same prompts and keys: medians of the per-pair ratios,
    so a drift of the machine's speed during the run cancels within each pair."""

    plain: list[Totals]
    sd: list[Totals]

    def _median_ratio(self, f: Callable[[Totals], float]) -> float:
        pairs = zip(self.plain, self.sd, strict=True)
        return float(np.median([f(s) / max(f(p), 1e-9) for p, s in pairs]))

    @property
    def speedup(self) -> float:
        return self._median_ratio(lambda t: t.tok_s)

    @property
    def round_cost(self) -> float:
        return self._median_ratio(lambda t: t.step_seconds)

    @property
    def plain_tok_s(self) -> float:
        return float(np.median([p.tok_s for p in self.plain]))

    @property
    def sd_tok_s(self) -> float:
        return float(np.median([s.tok_s for s in self.sd]))


def measure_pairs(
    plain_engine: RolloutEngine,
    engine: RolloutEngine,
    groups: list[list[list[int]]],
    mode: str,
    new: int,
    temp: float,
    seed: int,
    reps: int,
) -> Pairs:
    """An untimed SD warm-up pass (it compiles every program the trajectory needs; the caller warms the plain
    engine up once per batch size), then `reps` timed pairs: a plain pass, then an SD pass."""
    one_pass(engine, groups, mode, new, temp, seed)
    out = Pairs([], [])
    for _ in range(reps):
        out.plain.append(one_pass(plain_engine, groups, None, new, temp, seed))
        out.sd.append(one_pass(engine, groups, mode, new, temp, seed))
    return out
