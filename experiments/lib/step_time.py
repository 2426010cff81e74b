"""A GRPO step's logged times without compilation: what the end-to-end comparisons (paper/e2e_speedup.py)
and the step simulator's validation (models/simulate_rl.py) both measure a step by."""

from __future__ import annotations

# compile/* keys that are totals over kinds, not a kind (lockstep logs both)
_COMPILE_TOTALS = ("compile/trace_s", "compile/lower_s", "compile/backend_s", "compile/total_s")


def compile_seconds(m: dict[str, float], key: str = "time/step") -> float:
    """Seconds of `key` spent compiling: the rollout programs first met in the step (time/compile_rollout)
    and, for the whole step, every other kind's (compile/<kind>_s outside the rollout: the log-prob and
    update programs, ...). A step that meets a new update shape compiles it (15-21 s per arm in step 3 of a
    --quick run on the 2-core CPU, 2026-11-24), which is not the arm's speed."""
    if "time/compile" in m:  # the disjoint breakdown (tlt_jax.rl.metrics.StepClock): parts hold no compile
        return m["time/compile"] if key == "time/step" else 0.0
    rollout = m.get("time/compile_rollout", 0.0)
    if key == "time/rollout":
        return rollout
    rest = [
        v
        for k, v in m.items()
        if k.startswith("compile/") and k.endswith("_s") and k not in _COMPILE_TOTALS
        if not k.startswith("compile/rollout")
    ]
    return rollout + sum(rest)


def net(m: dict[str, float], key: str) -> float:
    """A step's (or its rollout's) time without the compilation first met in it (`compile_seconds`)."""
    return m[key] - compile_seconds(m, key)
