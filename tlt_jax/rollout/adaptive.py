"""The adaptive rollout engine's policy: a strategy selector (BEG-MAB by default) choosing each chunk's mode.

`AdaptivePolicy` is a rollout hook around `beg_mab.BanditPolicy`: before each chunk it selects an arm for the
running-row count ("plain" is an arm, so it learns where speculation pays on this hardware), and after the
chunk it rewards the arm with the chunk's tokens per second (the paper's accepted tokens / elapsed time; a
rate, so chunks of different lengths compare), scaled to the rows the chunk started with
(`ChunkRecord.rate_at_start_rows`: rows finishing inside a chunk do not count against the arm). Fair rewards:
the engine compiles a chunk's program before it starts the chunk's clock, so no reward contains a compilation,
and an arm's first visit to a shape is a reward like any other (dropping it, as before, wasted a probe per new
program: at 9-32 rows an SD probe runs at a third to a half of plain's speed). The first execution of a fresh
program is still slower than its reruns (median 1.08x against 1.02x between reruns, up to 1.56x for SD
programs at 8-16 rows: `experiments/checks/first_execution.py`), which biases an arm's first reward low; at a
few rows, where the choice is close, by 0-18%, and a wrongly dismissed arm is re-measured once its rewards
leave the window. Such chunks are counted (`bandit/compiled_chunks`). The selector's state lives across
rollouts (the learner owns it and checkpoints `state_dict()`).

`build_policy(section, engine)` registers the section's arms as engine modes ("3_1_4" = an EAGLE strategy,
"ngram_4_1_5" = the n-gram drafter, "history_4_1_5" = the history drafter, "plain") and returns the policy.
Without a selector (`config.bandit.algorithm=off`) the engine applies the paper's threshold switch
(`SpecConfig.threshold` / `min_steps_below`, `hooks.ThresholdPolicy`) instead.
"""

from __future__ import annotations

from collections import Counter

from tlt_jax.rollout.beg_mab import BanditPolicy
from tlt_jax.rollout.hooks import ChunkView, RolloutHooks, RolloutInfo
from tlt_jax.rollout.interface import EngineLike
from tlt_jax.rollout.selector_config import (
    MAX_RUNNING,
    PLAIN,
    BanditSection,
    SelectorConfig,
    all_arms_eligibility,
)


class AdaptivePolicy(RolloutHooks):
    """Chooses every chunk's mode with a selector and learns from the chunk's tokens per second."""

    def __init__(self, policy: BanditPolicy):
        self.policy = policy
        self._pending: tuple[str, int] | None = None
        self.chosen: Counter[tuple[int, str]] = Counter()  # (bucket, arm) -> chunks, this rollout
        self.compiled_chunks = 0

    def on_start(self, info: RolloutInfo) -> None:
        """A new rollout: this rollout's counts restart; the selector keeps what it learned."""
        del info
        self.chosen.clear()
        self.compiled_chunks = 0

    def choose_mode(self, running: int, batch_bucket: int) -> str:
        del batch_bucket
        arm = self.policy.select(running)
        self._pending = (arm, running)
        return arm

    def on_chunk(self, view: ChunkView) -> None:
        if self._pending is None or view.record.mode != self._pending[0]:
            return  # another hook chose this chunk's mode
        arm, running = self._pending
        self._pending = None
        self.chosen[(self.bucket(running), arm)] += 1
        rec = view.record
        self.compiled_chunks += int(rec.compiled)
        self.policy.observe(arm, running, rec.rate_at_start_rows, rec.accept_length)

    def bucket(self, running: int) -> int:
        bounds = self.policy.cfg.bucket_bounds
        return next((i for i, b in enumerate(bounds) if running <= b), len(bounds) - 1)

    def metrics(self) -> dict[str, float]:
        """The selector's learned statistics plus this rollout's choices per (bucket, arm)."""
        out = dict(self.policy.summary())
        for (b, arm), n in sorted(self.chosen.items()):
            out[f"bandit/b{b}/{arm}/chosen"] = float(n)
        out["bandit/compiled_chunks"] = float(self.compiled_chunks)
        return out


def build_policy(section: BanditSection, engine: EngineLike, seed: int = 0) -> AdaptivePolicy:
    """The `bandit` config section -> an AdaptivePolicy over arms registered in `engine`.

    Arms: "plain", an EAGLE strategy like "3_1_4", "ngram_<strategy>" or "history_<strategy>". With
    `all_arms` every arm is eligible in every bucket (the CPU default: the selector finds where each pays);
    otherwise BEG-MAB's grouping by tokens_to_verify (`bucket_targets`).
    """
    arms = []
    for name in section.arms:
        if name == PLAIN:
            arms.append(PLAIN)
        elif name.startswith(("ngram_", "history_")):
            kind, strategy = name.split("_", 1)
            arms.append(engine.add_mode(kind, strategy))
        else:
            arms.append(engine.add_mode("eagle", name))
    tv = tuple(1 if a == PLAIN else engine.modes[a].strategy.tokens_to_verify for a in arms)
    max_accept = tuple(1 if a == PLAIN else engine.modes[a].tokens_per_step for a in arms)
    bounds = tuple(int(b) for b in section.bucket_bounds)
    if bounds[-1] != MAX_RUNNING:
        bounds = (*bounds, MAX_RUNNING)
    eligible = all_arms_eligibility(len(bounds), len(arms)) if section.all_arms else None
    cfg = SelectorConfig(
        arms=tuple(arms),
        tokens_to_verify=tv,
        max_accept=max_accept,
        bucket_bounds=bounds,
        algorithm=str(section.algorithm),
        eligible=eligible,
        bucket_targets=tuple(section.bucket_targets) or (48, 32, 16, 8)[: len(bounds)],
        epsilon=float(section.epsilon),
        window=int(section.window),
        min_plays=int(section.min_plays),
        fixed_table=tuple(section.fixed_table) or None,
        sglang_ladder=tuple(section.sglang_ladder) or None,
    )
    return AdaptivePolicy(BanditPolicy(cfg, seed=seed))
