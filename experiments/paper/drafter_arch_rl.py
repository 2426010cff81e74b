"""Table 7's second half: the three warmed drafters (experiments/paper/drafter_arch.py) through the same spot
training in RL, and the speedup each one's acceptance projects at Qwen2.5-7B shape from measured round costs.

RL: three GRPO runs in lockstep (experiments/lib/lockstep.py, as drafter_staleness.py runs its two), the
same config for every arm but the drafter: `drafter.path` = the arm's warm-up workdir (its drafter/ checkpoint
with the arch and draft vocabulary the warm-up saved, and its train_state/ whose AdamW moments the spot
trainer carries over; `drafter.init_from` is for exported drafters, config.json + safetensors, and carries
no moments), `drafter.arch`, and the spot trainer's loss as the arm's warm-up trained it (`spot.ttt_steps`,
`spot.topk`: HASS's top-K distillation is reachable from the RL config as `config.spot.topk`). SD is on for
the whole rollout (threshold = any batch, one fixed strategy, no bandit) so every step measures acceptance on
all its text; the spot trainer trains between tail chunks. With coupled verification the arms sample the
same sequences, so the policy is the same at every step and accept-length differences are the drafters'.
Per arm and step: `spec/accept_len` (sampled at the run's temperature) and the spot trainer's cost per
drafter update: (spot/added_seconds - the step's drafter compile seconds) / spot/steps, i.e. one update plus
its share of the step's staleness probe, on this machine.

Projection: speedup = accepted tokens per round / the round's cost in plain decode steps, at batch 1, the
run's tokens to verify and `--cache`, with `experiments/models/measured_costs.py` (the H200 call's 7B steps
and rounds that `project_sd --measured` reads, docs/gpu_runs/2026-11-26-h200/README.md). Those rounds drafted
with an EAGLE-1-shaped pass over the full 152K vocabulary (the roofline's drafter: fc 2H -> H, one decoder
layer, the target's head; the call's meta names no draft vocabulary). Every arm is projected at the SAME draft
vocabulary (`--draft-vocab`, default 32,000, published EAGLE-3 drafters'), so the ranking compares drafters,
not head widths. ASSUMED: each arm's drafter pass is the roofline's for its own parameters (EAGLE and HASS:
fc 2H, a `--draft-vocab` head; EAGLE-3: fc 3H -> H, q/k/v over 2H, its own `--draft-vocab` head, counted
from `tlt_jax.models.eagle3.Eagle3Drafter` at Qwen2.5-7B's config, not written down), and its round keeps the
measured / roofline ratio of the EAGLE-1 round measured at that cell. The measured full-vocabulary EAGLE-1
round is printed beside them.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from experiments.lib import harness as h
from experiments.lib import lockstep
from experiments.models import measured_costs as mc
from experiments.models.roofline import QWEN2_5_7B, ModelShape
from tlt_jax.rl.learner import Learner

# the H200 lease's 7B costs, as docs/gpu_runs/2026-11-26-h200/project_sd_measured.log's command reads them
H200_RUN = h.ROOT / "docs" / "gpu_runs" / "2026-11-26-h200"
MEASURED = ",".join(str(H200_RUN / f"call{i}_summary.json") for i in (1, 3, 4))
# the projection's draft vocabulary for every arm: published EAGLE-3 drafters' (config.json
# `draft_vocab_size` 32000 in the Llama-3.1-8B EAGLE-3 configs SGLang's LlamaForCausalLMEagle3 tests load and
# in public Qwen (vocab 151936) EAGLE-3 drafters' configs); the paper does not state its own
DRAFT_VOCAB = 32_000
SMOKE_SPOT = dict(
    window=16, context=8, ce_tokens=16, ttt_positions=8, eval_samples=4
)  # configs/smoke.py's 16


def rl_configs(
    warm: Mapping[str, pathlib.Path],
    losses: Mapping[str, tuple[int, int]],
    steps: int,
    quick: bool,
    full: bool,
) -> dict[str, Any]:
    """One GRPO config per arm (module docstring): configs/smoke.py for --quick (the tiny random target the
    tiny warm-ups trained for), else configs/tlt.py (`:quick`, 4 prompts x 4 samples, unless `full`).
    `losses[arm]` = the warm-up's (ttt_steps, topk)."""
    out = {}
    for arm, wd in warm.items():
        if quick:
            cfg = lockstep.quiet(h.load_config("smoke.py", f"steps={steps}"), steps)
            cfg.drafter.min_accept_len = 0.0  # a random target: no acceptance alarm
            cfg.spot.update(SMOKE_SPOT)
        else:
            cfg = lockstep.quiet(h.load_config(h.TLT_CONFIG, "" if full else "quick"), steps)
        cfg.drafter.kind, cfg.drafter.path = "eagle", str(wd)
        cfg.drafter.arch = "eagle3" if arm == "eagle3" else "eagle"
        cfg.bandit.algorithm = "off"  # one strategy (spec.strategy) for every arm and chunk
        cfg.spec.threshold = 1 << 20  # SD for the whole rollout: acceptance measured on all the text
        cfg.spot.mode, cfg.spot.threshold = "between_chunks", 1 << 20
        cfg.spot.ttt_steps, cfg.spot.topk = losses[arm]
        out[arm] = cfg
    return out


def spot_step_ms(m: Mapping[str, float]) -> float:
    """Milliseconds per spot-trainer update in one RL step, the drafter programs' compile time taken out
    (nan when the step trained none)."""
    n = m.get("spot/steps", 0.0)
    if not n:
        return float("nan")
    return 1e3 * (m.get("spot/added_seconds", 0.0) - m.get("compile/drafter_s", 0.0)) / n


def run_rl(
    configs: Mapping[str, Any], root: pathlib.Path, steps: int
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
    """The arms in lockstep: per arm the per-step accept length and spot ms per update, and the spot-trained
    drafter's weights after the last step (a pure dict on the host)."""

    def report(step: int, arm: str, m: dict[str, float]) -> None:
        print(
            f"RL step {step} {arm:>6}: accept {m.get('spec/accept_len', float('nan')):.3f} spot "
            f"{m.get('spot/steps', 0):.0f} updates, {spot_step_ms(m):.0f} ms each (drafter compile "
            f"{m.get('compile/drafter_s', 0.0):.1f} s) step {m['time/step']:.0f} s",
            flush=True,
        )

    finals: dict[str, Any] = {}

    def done(arm: str, learner: Learner) -> None:
        if learner.spot is None:
            raise ValueError(f"arm {arm}: no spot trainer (config.spot.mode is off)")
        finals[arm] = jax.device_get(nnx.to_pure_dict(learner.spot.state.params))

    history = lockstep.run_lockstep(configs, root, steps, report, on_done=done)
    curves = {
        arm: {
            "accept": np.asarray([m.get("spec/accept_len", np.nan) for m in hist], dtype=float),
            "spot_ms": np.asarray([spot_step_ms(m) for m in hist], dtype=float),
        }
        for arm, hist in history.items()
    }
    return curves, finals


def warm_spot_ms(ms: np.ndarray) -> float:
    """Spot ms per update over the steps after the first (its updates share a cold start), or over all of
    them when only the first trained; nan when none did."""
    warm = ms[1:] if np.isfinite(ms[1:]).any() else ms
    return float(np.nanmean(warm)) if np.isfinite(warm).any() else float("nan")


def late_mean(x: np.ndarray) -> float:
    """The mean over the last half of the steps (the first of one step), nan-aware; nan when all are nan."""
    tail = x[len(x) // 2 :]
    return float(np.nanmean(tail)) if np.isfinite(tail).any() else float("nan")


# ---- the projection ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DrafterShape(ModelShape):
    """A target shape whose drafter pass reads `drafter` parameters (the roofline's `draft` term)."""

    drafter: int = 0

    def drafter_params(self, draft_vocab: int | None = None) -> int:
        del draft_vocab  # counted in `drafter`
        return self.drafter


def eagle3_params(draft_vocab: int) -> int:
    """Parameters of our EAGLE-3 drafter for Qwen2.5-7B with a `draft_vocab`-token head, counted from the
    module's abstract shapes (nothing allocated)."""
    import jax
    from flax import nnx

    from tlt_jax.models.eagle3 import Eagle3Drafter
    from tlt_jax.models.presets import arch_config

    cfg = arch_config("qwen2_5_7b")
    if (cfg.hidden_size, cfg.vocab_size) != (QWEN2_5_7B.hidden, QWEN2_5_7B.vocab):
        raise ValueError("tlt_jax's qwen2_5_7b preset and the roofline's QWEN2_5_7B disagree")
    model = nnx.eval_shape(lambda: Eagle3Drafter(cfg, nnx.Rngs(0), draft_vocab_size=draft_vocab))
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def arm_costs(costs: mc.MeasuredCosts, arm: str, draft_vocab: int) -> mc.MeasuredCosts:
    """The cost model of one arm's rounds: the drafter pass of its own parameters at a `draft_vocab` head
    swapped in (the measured / roofline ratios unchanged: module docstring)."""
    params = eagle3_params(draft_vocab) if arm == "eagle3" else costs.model.drafter_params(draft_vocab)
    shape = DrafterShape(**dataclasses.asdict(costs.model), drafter=params)
    return dataclasses.replace(costs, model=shape)


def tokens_to_verify(strategy: str) -> int:
    """TV of a chain/tree strategy "depth_topk_tv" (the roofline's `strategy_for` maps it back)."""
    return int(strategy.split("_")[-1])


def project(
    accept: Mapping[str, float], strategy: str, measured: str, cache: int, draft_vocab: int
) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Per arm {round_steps, speedup} at batch 1 (module docstring) and the lines that say what is measured
    and what is assumed."""
    m = mc.load(measured)
    costs = mc.measured_costs(m)
    tv = tokens_to_verify(strategy)
    out = {}
    for arm, acc in accept.items():
        c = arm_costs(costs, arm, draft_vocab)
        steps = c.round(1, tv, cache) / c.plain(1, cache)
        out[arm] = {"round_steps": steps, "speedup": acc / steps}
    full = costs.round(1, tv, cache) / costs.plain(1, cache)
    e1, e3 = QWEN2_5_7B.drafter_params(draft_vocab), eagle3_params(draft_vocab)
    lines = [
        *mc.describe(m, costs),
        f"PROJECTION (Qwen2.5-7B, batch 1, TV {tv} = spec.strategy {strategy}, cache {cache}): speedup = the "
        f"arm's RL accept length / its round in plain steps; the measured EAGLE-1 round over the full "
        f"vocabulary ({QWEN2_5_7B.drafter_params() / 1e6:.0f}M drafter parameters) costs {full:.3f} plain "
        f"steps. ASSUMED: every arm at a {draft_vocab}-token draft head, its drafter pass at the roofline "
        f"for its own parameters (EAGLE / HASS {e1 / 1e6:.0f}M; EAGLE-3 {e3 / 1e6:.0f}M: fc 3H, q/k/v over "
        "2H), same measured / roofline ratio.",
    ]
    return out, lines
