"""The GPU suite's plan: which phases each device call runs, in which order, how many seconds each may take.

A lent GPU has 15 minutes of device time in all (the machine's start, every call's transfers and idle time
included; nothing starts with under 4 minutes left). `PLAN` is two calls made back to back, each phase with
its cap, its least useful time and the basis of both: the seconds the H200 run of 2026-11-26 measured
(docs/gpu_runs/2026-11-26-h200/, docs/gpu.md section 2). `plan_lines` prints it with the machine's start and
each call's transfers, summing to at most `DEVICE_PLAN_S`. The bottom of the gpu package: it imports none of
it, and every other module may read it (runner.py's clock, suite.py's calls, the phases' sizes).
"""

from __future__ import annotations

DEVICE_PLAN_S = 780.0  # the two calls, the machine's start and the transfers: <= 13 of the 15 minutes
START_S = 90.0  # a fresh machine's start (the device tool: "1-2 minutes"; counted against the budget)
CALL_OVERHEAD_S = 25.0  # per call: the transfers (~15-20 s on 2026-11-24), Python's start, the wheels
RL_STEP_LAYERS = 4  # decoder layers of Qwen2.5-7B in the rl_step_7b phase (its basis below)
RL_STEP_STEPS = 3

RL_STEP_BASIS = (
    "H200 2026-11-26, cold: 7B chunk programs 7.4-13.2 s at 28 layers (~0.3-0.45 s per unrolled layer), the "
    "drafter step 21.3 s, the scanned update 12-20 s flat in depth, the weights' init 35 s; at 4 layers ~15 "
    "rollout programs ~2-3 s each, + update/logprob/apply ~30 s, drafter 21 s, init ~8 s, a 24 GB checkpoint"
)
REGIME_BASIS = (
    "H200 2026-11-26: the weights' init 35 s cold (1.8 s cached), before the parts' shares; decode 7-9 s per "
    "cold program (4 cells ~40 s); rounds 11-13 s per cold program (TV 16/4/48 at 4K and 32K ~75 s)"
)
# (phase, cap s, least s, basis) per call, in priority order. A phase gets its cap less the later phases'
# least seconds, and is skipped (with the reason) when not even its own least time is left.
PLAN: dict[str, list[tuple[str, float, float, str]]] = {
    "1": [
        ("env", 15, 8, "H200 2026-11-26: 11 s, 9 s, 7 s, 8 s"),
        ("rl_step_7b", 140, 100, RL_STEP_BASIS),
        ("regime_7b", 150, 90, REGIME_BASIS),
    ],
    "2": [
        ("env", 10, 5, "H200 2026-11-26: 9 s"),
        ("model", 5, 3, "H200 2026-11-26: 0.3 s (assembles the GGUF from the stashed parts)"),
        (
            "gpu_tests",
            40,
            25,
            "H100 2026-11-24: tests/kernels/test_tree_attention.py compiled in 25 s; + flash attention "
            "(cuDNN) and the Triton module checks on 8 xdist workers",
        ),
        (
            "identity",
            120,
            90,
            "H200 2026-11-26: float32 cut at 49 s before its plain rollout; bfloat16's plain rollout "
            "19.1 s, cut at 49 s: float32 ~100 s alone, bfloat16 what it leaves",
        ),
        (
            "update_7b",
            70,
            35,
            "H200 2026-11-26: 8K 31 s + 32K 38 s, cold, 28 layers (part a's wheels, installed in call 1)",
        ),
        (
            "compile",
            60,
            40,
            "H200 2026-11-26: GRPO step 1 still in its rollout at 100 s (13 programs in 80 s): cut here, "
            "it gives a lower bound; rl_step_7b's step 1 is the first step's compile to completion",
        ),
    ],
}
CALL_BUDGET_S = {"1": 320.0, "2": 320.0}  # each call's --budget-s (the suite's own clock)
# Seconds on a GPU for the phases outside the plan's calls: (most a phase may take, least worth starting).
# Measured on an H100 (2026-11-24): env 10, kernel_tests 25, tree_attention 116, decode (dynamic HF only)
# 137 + >103, drafter ~290 in all, sd 326 for batch 1 and 4, a GRPO step 1 of configs/tlt.py:quick 313
# (compile's first run); rollout_tests did not finish in 240 with 4 workers.
LIMITS = {
    "env": (60, 15),
    "kernel_tests": (90, 30),
    "tree_attention": (180, 45),
    "rollout_tests": (150, 60),
    "model": (30, 5),
    "decode": (300, 90),
    "identity": (240, 90),
    "compile": (420, 60),
    "verify_cost": (150, 30),
    "drafter": (420, 60),
    "sd": (300, 90),
    "e2e": (300, 90),
    "gpu_tests": (240, 60),
}
# the plan's 7B phases outside the plan's calls (resumes, --call all): the plan's caps
LIMITS.update({p: (cap, least) for ph in PLAN.values() for p, cap, least, _ in ph if p not in LIMITS})
# every phase of the suite, in the order `--call all` and the report list them
PHASES = (
    "env",
    "rl_step_7b",
    "regime_7b",
    "update_7b",
    "gpu_tests",
    "kernel_tests",
    "tree_attention",
    "rollout_tests",
    "model",
    "decode",
    "identity",
    "compile",
    "verify_cost",
    "drafter",
    "sd",
    "e2e",
)
CALLS = {  # calls 1 and 2: the 15-minute plan; 3 and 4: the rest, for a longer lease
    **{call: tuple(p[0] for p in phases) for call, phases in PLAN.items()},
    "3": ("env", "kernel_tests", "rollout_tests", "model", "decode", "tree_attention"),
    "4": ("env", "model", "verify_cost", "drafter", "sd", "e2e"),
    "all": PHASES,
}
CALLS["plan"] = tuple(dict.fromkeys(CALLS["1"] + CALLS["2"]))  # `--resume --call plan`: the plan's phases
CALL_BUDGETS = {**CALL_BUDGET_S, "3": 570.0, "4": 540.0, "plan": 285.0, "all": 570.0}  # default --budget-s
PLAN_LIMITS = {c: {p[0]: (p[1], p[2]) for p in phases} for c, phases in PLAN.items()}
DRY_CAP_S = 300.0  # per phase in a dry run: generous, so a slow CI machine is not a failure
REPORT_RESERVE_S = 15.0  # kept for plots and the summary at the end of a call


def plan_lines(measured: dict[str, float] | None = None) -> list[str]:
    """The two calls' budget: per phase its cap, least time and basis, with the seconds a run measured when
    given (a dry run's); last line the total against DEVICE_PLAN_S."""
    lines = [f"# device plan ({DEVICE_PLAN_S / 60:.0f} min of the 15 lent): machine start {START_S:.0f}s"]
    total = START_S
    for call, phases in PLAN.items():
        budget = CALL_BUDGET_S[call]
        total += budget + CALL_OVERHEAD_S
        lines.append(f"#  call {call}: --budget-s {budget:.0f} + {CALL_OVERHEAD_S:.0f}s transfers/start")
        for name, cap, least, basis in phases:
            seen = f", this run {measured[name]:.0f}s" if measured and name in measured else ""
            lines.append(f"#    {name:<15} cap {cap:>4.0f}s  least {least:>3.0f}s  ({basis}{seen})")
    lines.append(f"#  total {total:.0f}s = {total / 60:.1f} min <= {DEVICE_PLAN_S / 60:.0f} min")
    return lines


def plan_total_s() -> float:
    """The plan's device seconds: start + both calls' budgets and overheads."""
    return START_S + sum(b + CALL_OVERHEAD_S for b in CALL_BUDGET_S.values())
