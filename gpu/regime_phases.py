"""The GPU suite's 7B-regime phases (issues #38, #45): Qwen2.5-7B shapes with random bf16 weights, no model.

  regime_7b   (call 1) `gpu/regime_7b.py decode,round`: plain decode tok/s at batch 1 and 8 with a 4K and a
              32K cache against the paper's 164.65 tok/s and the roofline of the bandwidth the env phase
              measured; a speculative round in plain steps at TV 16, 4 and 48, batch 1 then 8, each at both
              caches, drafting over the warm-up's 8,192-id head; every program's first-call compile seconds
              (`--regime-parts` adds the drafter's step and the round's split);
  update_7b   (call 2; part a's wheels, installed in call 1) `gpu/regime_7b.py update` at 8K then 32K
              response tokens per row: the policy update's micro-step at 7B width with as many layers as fit,
              its peak memory beside XLA:GPU's plan of the same program and XLA:CPU's (recorded on a CPU:
              experiments/models/update_plans_7b.json), and whether the update's attention is cuDNN's.

The plan of the device calls is call_plan.py's.
"""

from __future__ import annotations

import json
import re
import sys
from typing import TYPE_CHECKING, Any

from gpu.markdown_tables import table, verdict
from gpu.parse import PhaseResult, tail

if TYPE_CHECKING:
    from gpu.runner import Suite

REGIME_PARTS = "decode,round"  # the plan's (the drafter step was measured on 2026-11-26: 16.7 ms)
UPDATE_LENS = (8192, 32768)
UPDATE_FIRST_S = 35.0  # the first length's time, even if the second then has none (fit, compile, 2 runs)
WORKER_START_S = 10.0  # of a phase's time: the worker's start before its clock (H200: 2.6-3.1 s) + a margin
TARGET_TOK_S = 164.65  # the paper's Table 2: Qwen2.5-7B batch 1 on one H100
TARGET_ROOFLINE = 0.7
TARGET_ROUND_TV16 = 1.3  # plain steps per round at TV 16, batch 1


def _env_args(suite: Suite) -> list[str]:
    """This call's measured copy bandwidth (GB/s) and bf16 matmul rate (TFLOP/s) from the env phase's file,
    as the worker's flags (0 where the env phase has none): its roofline and its JSON's ceilings."""
    env = suite.state / "env.json"
    info = json.loads(env.read_text()) if env.exists() else {}
    num = lambda k: float(info[k]) if isinstance(info.get(k), (int, float)) else 0.0  # noqa: E731
    return [
        "--bandwidth-gb-s",
        f"{num('bandwidth_gb_s'):.1f}",
        "--matmul-tflops",
        f"{num('bf16_matmul_tflops'):.1f}",
    ]


def _worker(suite: Suite, label: str, parts: str, timeout: float, extra: list[str]) -> tuple[Any, dict]:
    """Run gpu/regime_7b.py under `timeout` (its own clock gets what is left after its start); its JSON
    (whatever it wrote before a cut) or {}."""
    js = suite.state / f"{label}.json"
    js.unlink(missing_ok=True)
    budget = max(5.0, timeout - WORKER_START_S)
    cmd = [sys.executable, "-m", "gpu.regime_7b", parts, "--json", str(js), "--budget-s", f"{budget:.0f}"]
    cmd += [*extra, *(["--dry-run", "--reps", "1"] if suite.dry else [])]
    # the allocator's limit (memory_stats' bytes_limit, what the cells are fitted to) at 95% of the device,
    # not XLA's default 75%: a 7B model and its KV cache need most of an 80 GB GPU
    proc = suite.run(label, cmd, timeout, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"})
    return proc, (json.loads(js.read_text()) if js.exists() else {})


def _status(proc: Any, data: dict, rows: int) -> tuple[str, str]:
    """ok / partial (something skipped, failed or cut, but rows measured) / timeout / failed, and why."""
    why = [f"{s['what']}: {s['why']}" for s in data.get("skipped", []) if s.get("kind") != "memory"]
    why += [f"{e['what']}: {e['error']}" for e in data.get("errors", [])]
    why += [f"update {r['response_len']}: {r['error']}" for r in data.get("update", []) if r.get("error")]
    if proc.timed_out:
        why.append(f"cut by the phase's timeout: {tail(proc.output, 300)}")
    elif proc.rc != 0:
        why.append(f"exit {proc.rc}: {tail(proc.output, 600)}")
    if not rows:
        return ("timeout" if proc.timed_out else "failed"), " | ".join(why) or "no measurement"
    return ("partial" if why else "ok"), " | ".join(why)


def regime_metrics(data: dict[str, Any]) -> dict[str, Any]:
    """RESULT keys of the worker's JSON: decode tok/s and roofline fraction per cell, rounds in plain steps,
    the split at TV 16, the drafter step, compile seconds (largest, total)."""
    m: dict[str, Any] = {}
    for r in data.get("decode", []):
        cell = f"b{r['batch']}_c{r['cache']}"
        m[f"decode_tok_s_{cell}"] = r["tok_s"]
        m[f"decode_roofline_frac_{cell}"] = r.get("roofline_frac")
        if "vs_paper" in r:
            m[f"decode_vs_paper_{cell}"] = r["vs_paper"]
    for r in data.get("round", []):
        m[f"round_steps_b{r['batch']}_tv{r['tv']}_c{r['cache']}"] = r["round_steps"]
    for r in data.get("split", []):
        for p in ("draft", "verify", "accept", "commit"):
            m[f"split_{p}_steps_b{r['batch']}_tv{r['tv']}"] = r[f"{p}_steps"]
    for r in data.get("drafter", []):
        m["drafter_step_ms"] = r["step_ms"]
    for r in data.get("update", []):
        n = r["response_len"]
        m.update({f"update_layers_{n}": r["layers"], f"update_step_s_{n}": r["step_s"]})
        m[f"update_peak_over_plan_{n}"] = r.get("peak_over_plan")
    comp = [c["seconds"] for c in data.get("compile", [])]
    if comp:
        m.update(compile_max_s=max(comp), compile_total_s=sum(comp), programs=len(comp))
    m["skipped"] = len(data.get("skipped", []))  # memory skips included (listed in the details)
    return m


def phase_regime_7b(suite: Suite, timeout: float) -> PhaseResult:
    """gpu/regime_7b.py's decode, round, split and drafter parts in one process (one 7B model on the
    device): see the module docstrings. Dry run: the tiny Qwen2 and `--regime-parts`."""
    parts = suite.regime_parts or REGIME_PARTS
    proc, data = _worker(suite, "regime_7b", parts, timeout, _env_args(suite))
    rows = sum(len(data.get(k, [])) for k in ("decode", "round", "split", "drafter"))
    status, why = _status(proc, data, rows)
    return PhaseResult("regime_7b", status, error=why, metrics=regime_metrics(data), details=data)


def phase_update_7b(suite: Suite, timeout: float) -> PhaseResult:
    """gpu/regime_7b.py update at each of UPDATE_LENS (8K first: the 32K one may not fit or finish), one
    process per length (its peak memory is the process's), each with half of what is left (the last: all)."""
    lens = (64,) if suite.dry else UPDATE_LENS
    res = PhaseResult("update_7b", details={"runs": []})
    rows: list[dict] = []
    bad = []
    for i, n in enumerate(lens):  # 8K first: up to 75 s of it even when 32K then gets nothing
        left = suite.phase_left()
        share = left if i == len(lens) - 1 else max(left / 2, min(left, 5 if suite.dry else UPDATE_FIRST_S))
        if share < (5 if suite.dry else 30):
            bad.append(f"{n} tokens: skipped, {suite.phase_left():.0f}s left")
            continue
        proc, data = _worker(suite, f"update_7b_{n}", "update", share, ["--update-len", str(n)])
        res.details["runs"].append(data)
        rows += data.get("update", [])
        status, why = _status(proc, data, len(data.get("update", [])))
        if status != "ok":
            bad.append(f"{n} tokens: {status}: {why}")
        for k, v in regime_metrics(data).items():
            if k.startswith(("compile", "programs", "skipped")):
                k = f"{k}_{n}"
            res.metrics[k] = v
    res.details["update"] = rows
    if bad:
        res.status, res.error = ("partial" if rows else "failed"), " | ".join(bad)
    return res


def regime_targets(results: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Issue #38's goals: 7B decode at batch 1 (4K cache) >= 164.65 tok/s and >= 0.7 of the roofline; a
    round at TV 16, batch 1 <= 1.3 plain steps; the first GRPO step compiled in <= 60 s, rerun <= 10 s (a
    first run cut after more than 60 s of compiles fails it)."""
    m = results.get("regime_7b", {}).get("metrics", {})
    tok = _first(m, r"decode_tok_s_b1_c\d+")
    frac = _first(m, r"decode_roofline_frac_b1_c\d+")
    rnd = _first(m, r"round_steps_b1_tv16_c\d+")
    c = results.get("compile", {}).get("metrics", {})
    first, rerun = c.get("compile_first_s"), c.get("compile_rerun_s")
    num = lambda v: isinstance(v, (int, float))  # noqa: E731
    low = c.get("compile_first_s_at_least")  # a cut first run's compile seconds so far: over 60 is a fail
    if first is None and num(low) and low > 60:
        first = low
    return {
        "decode_7b": verdict(tok, num(tok) and tok >= TARGET_TOK_S and num(frac) and frac >= TARGET_ROOFLINE),
        "round_7b": verdict(rnd, num(rnd) and rnd <= TARGET_ROUND_TV16),
        "compile": verdict(first, num(first) and num(rerun) and first <= 60 and rerun <= 10),
    }


def _first(metrics: dict[str, Any], pattern: str) -> Any:
    """The value of the first key matching `pattern` in sorted order (the smallest cache: 4K before 32K)."""
    keys = sorted((k for k in metrics if re.fullmatch(pattern, k)), key=lambda k: int(k.rsplit("_c", 1)[1]))
    return metrics[keys[0]] if keys else None


def regime_md(results: dict[str, dict[str, Any]]) -> list[str]:
    """report.md's 7B sections: decode beside the paper and the roofline, rounds in plain steps beside the
    paper's Table 4, the split, the drafter's step, the update's peak vs the plan, compile seconds, skips."""
    lines: list[str] = []
    for phase in ("regime_7b", "update_7b"):
        d = (results.get(phase) or {}).get("details") or {}
        runs = d.get("runs") or [d]
        compiles = [c for r in runs for c in r.get("compile", [])]
        skipped = [s for r in runs for s in r.get("skipped", [])]
        if d.get("decode"):
            rows = [[r["batch"], r["cache"], r["length"], r["step_ms"], r["tok_s"], r.get("roofline_tok_s"),
                     r.get("roofline_frac"), r.get("vs_paper")] for r in d["decode"]]  # fmt: skip
            lines += [
                f"7B plain decode ({d['meta']['model']}; the paper: {TARGET_TOK_S} tok/s at batch 1)",
                "",
            ]
            head = [
                "batch",
                "cache",
                "length",
                "ms/step",
                "tok/s",
                "roofline tok/s",
                "of roofline",
                "vs paper",
            ]
            lines += table(head, rows) + [""]
        if d.get("round"):
            rows = [[r["batch"], r["tv"], r["strategy"], r.get("cache"), r["round_ms"], r["plain_step_ms"],
                     r["round_steps"]] for r in d["round"]]  # fmt: skip
            lines += ["7B speculative round (the engine's chunk; paper Table 4, Qwen-32B TP4: 3.22x at bs1 "
                      "TV16, 2.48x bs32 TV16, 3.62x bs1 TV64, 1.70x bs32 TV64)", ""]  # fmt: skip
            head = ["batch", "TV", "strategy", "cache", "round ms", "plain ms", "plain steps"]
            lines += table(head, rows) + [""]
        if d.get("split"):
            ph = ("draft", "verify", "accept", "commit", "round")
            rows = [[r["batch"], r["tv"]] + [r[f"{p}_steps"] for p in ph] for r in d["split"]]
            lines += ["7B round by phase, in plain steps (verify_breakdown's programs)", ""]
            lines += table(["batch", "TV", *ph], rows) + [""]
        for r in d.get("drafter", []):
            lines += [
                f"7B-width drafter step: {r['step_ms']:.1f} ms ({r['rows']} x {r['seq_len']} tokens)",
                "",
            ]
        ups = d.get("update") or []
        if ups:
            rows = [[u["rows"], u["prompt_len"], u["response_len"], u["layers"], u["step_s"],
                     u["plan_bytes"] / 2**30, (u["peak_bytes"] or 0) / 2**30, u.get("peak_over_plan")]
                    for u in ups]  # fmt: skip
            lines += ["7B-width update micro-step (layers: as many as the plan fits)", ""]
            head = ["rows", "prompt", "response", "layers", "step s", "plan GiB", "peak GiB", "peak/plan"]
            lines += table(head, rows) + [""]
        if compiles:
            lines += [f"{phase} first-call compile seconds: "
                      + ", ".join(f"{c['program']} {c['seconds']:.1f}" for c in compiles), ""]  # fmt: skip
        if skipped:
            lines += [f"{phase} skipped: " + "; ".join(f"{s['what']} ({s['why']})" for s in skipped), ""]
    return lines
