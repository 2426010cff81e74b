"""The RL loop's side of the strategy selector (`config.bandit`): the adaptive engine's mode chooser.

The selector is updated inside the rollout: as a rollout hook (tlt_jax.rollout.adaptive.AdaptivePolicy) it
picks each chunk's mode (plain, an EAGLE or an n-gram strategy) for the running-row count and is rewarded
with the chunk's tokens per second. The learner keeps one selector across steps (it learns over the run),
checkpoints its state and logs its per-step choices and estimates (bandit/*).
"""

from __future__ import annotations

from typing import Any

from tlt_jax.rollout.adaptive import AdaptivePolicy, build_policy
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.selector_config import BanditSection


def build_selector(
    section: BanditSection, engine: RolloutEngine, has_eagle_drafter: bool, seed: int
) -> AdaptivePolicy | None:
    """The selector over the section's arms, registered as `engine` modes (None when `algorithm` is "off").
    EAGLE arms need the engine to hold an EAGLE drafter (a warmed one, or one the spot trainer trains)."""
    if section.algorithm == "off":
        return None
    eagle_arms = [a for a in section.arms if a != "plain" and not a.startswith(("ngram_", "history_"))]
    if eagle_arms and not has_eagle_drafter:
        raise ValueError(
            f"config.bandit.arms {eagle_arms} need an EAGLE drafter: set config.drafter.kind=eagle "
            "(a warmed drafter) or config.spot.mode (train one online), or keep plain/ngram_*/history_* arms."
        )
    return build_policy(section, engine, seed=seed)


def selector_metrics(selector: AdaptivePolicy | None) -> dict[str, float]:
    """What the selector chose and learned during this step's rollout (bandit/*), none without one."""
    return {} if selector is None else selector.metrics()


def selector_state(selector: AdaptivePolicy | None) -> dict[str, Any] | None:
    """The selector's state for the checkpoint (None without one)."""
    return None if selector is None else selector.policy.state_dict()


def load_selector_state(selector: AdaptivePolicy | None, state: dict[str, Any] | None) -> None:
    """Restore what `selector_state` saved."""
    if selector is not None:
        selector.policy.load_state_dict(state)
