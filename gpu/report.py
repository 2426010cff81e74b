"""What a GPU suite call (suite.py) leaves under --out: summary.json, report.md, PNG plots (and per-phase
JSON files).

The device tool brings back at most 8 files per call, so the folder holds summary.json (every phase of this
call with its full details, plus the lease's cumulative results and the issue's targets), suite.log (all
subprocess output), report.md (a section to paste into docs/benchmarks.md, built from every phase run so far
in this lease), one PNG per plottable phase, and per-phase JSON copies only while the count stays <= 8.
A plot that fails is noted in the summary and never fails the call.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import time
from typing import Any

from experiments.lib.harness import pyplot
from gpu import regime_phases, rl_step_phases
from gpu.call_plan import PHASES
from gpu.markdown_tables import cell, div, table, verdict

MAX_FILES = 8


class NoData(ValueError):
    """A phase ran but left nothing to plot (a dry run's SD phase, a run killed before its first row)."""


SD_TARGET, DECODE_TARGET, IDENTITY_TARGET = 2.0, 1.0, 0.99


def load_results(state: pathlib.Path) -> dict[str, dict[str, Any]]:
    """Every phase's latest result in this lease (written by suite.py into state/results), in phase order."""
    out = {}
    for path in (state / "results").glob("*.json"):
        try:
            out[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    order = list(PHASES)
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


def targets(results: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The issues' targets: the verify kernel at least as fast as the reference for every T in 16..64; decode
    at batch 1 faster than HF transformers on the same GPU (bfloat16, else float32), against its dynamic-cache
    `generate` (decode) and its static cache + torch.compile path (decode_fast); SD >= 2x at batch 1; float32
    SD rollouts identical to plain ones (>= 99% of the sequences, every strategy: identity)."""
    ta = results.get("tree_attention", {}).get("metrics", {})
    fast = ta.get("faster_t16_64")
    dec = results.get("decode", {}).get("metrics", {})
    ratio = dec.get("bfloat16_ratio_vs_hf_bs1", dec.get("float32_ratio_vs_hf_bs1"))
    ratio_fast = dec.get("bfloat16_ratio_vs_hf_fast_bs1", dec.get("float32_ratio_vs_hf_fast_bs1"))
    sd = results.get("sd", {}).get("metrics", {}).get("sd_speedup_bs1")
    same = results.get("identity", {}).get("metrics", {}).get("float32_identical_frac_min")
    return {
        "kernel": verdict(fast, fast == 1),
        "decode": verdict(ratio, isinstance(ratio, float) and ratio > DECODE_TARGET),
        "decode_fast": verdict(ratio_fast, isinstance(ratio_fast, float) and ratio_fast > DECODE_TARGET),
        "sd": verdict(sd, isinstance(sd, float) and sd >= SD_TARGET),
        "identity": verdict(same, isinstance(same, float) and same >= IDENTITY_TARGET),
        **regime_phases.regime_targets(results),
        **rl_step_phases.rl_step_targets(results),
    }


# ------------------------------------------------------------------------------------------------- plots
def plot_tree_attention(d: dict[str, Any], path: pathlib.Path) -> None:
    plt = pyplot()  # Agg: the device machine has no display

    rows = [r for r in d.get("rows", []) if isinstance(r.get("ratio"), float) and math.isfinite(r["ratio"])]
    if not rows:
        raise NoData
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5.5 * max(1, len(models)), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=False):
        for b in sorted({r["B"] for r in rows if r["model"] == model}):
            pts = sorted((r["T"], r["ratio"]) for r in rows if r["model"] == model and r["B"] == b)
            ax.plot(*zip(*pts, strict=True), marker="o", label=f"B={b}")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.axvspan(16, 64, color="g", alpha=0.06)
        ax.set(xscale="log", yscale="log", xlabel="tokens to verify T", ylabel="kernel / reference time")
        ax.set_title(f"{model}: {d.get('dtype')} S={d.get('seq')} ({d.get('lowering')})", fontsize=9)
        ax.legend(fontsize=8)
    bs = ", ".join(f"{k}={v}" for k, v in (d.get("block_sizes") or {}).items())
    fig.suptitle(f"Pallas tree attention on {d.get('device')}\n{bs}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_decode(d: dict[str, Any], path: pathlib.Path) -> None:
    plt = pyplot()  # Agg: the device machine has no display

    if not any(isinstance(v, dict) and v.get("rows") for v in d.values()):
        raise NoData
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for (dtype, data), color in zip(d.items(), ("C0", "C1", "C2"), strict=False):
        rows = data.get("rows", []) if isinstance(data, dict) else []
        if not rows:
            continue
        b = [r["batch"] for r in rows]
        ax.plot(b, [r["ours_tok_s"] for r in rows], "o-", color=color, label=f"tlt_jax {dtype}")
        for key, style, label in (
            ("hf_tok_s", "s--", "HF dynamic cache"),
            ("hf_fast_tok_s", "^-.", "HF fast"),
        ):
            hf = [r.get(key, float("nan")) for r in rows]
            if any(isinstance(v, float) and math.isfinite(v) for v in hf):
                ax.plot(b, hf, style, color=color, label=f"{label} {dtype}")
        ax.plot(
            b, [r["roofline_tok_s"] for r in rows], "x:", color=color, label=f"bandwidth roofline {dtype}"
        )
    meta = next((v.get("meta", {}) for v in d.values() if isinstance(v, dict) and v.get("meta")), {})
    ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s")
    title = (
        f"{meta.get('model', '?')} greedy decode on {meta.get('device', '?')}, context {meta.get('context')}"
    )
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_drafter(d: dict[str, Any], path: pathlib.Path) -> None:
    plt = pyplot()  # Agg: the device machine has no display

    curve = [c for c in d.get("loss_curve", []) if c[0] is not None]
    if not curve:
        raise NoData
    fig, ax = plt.subplots(figsize=(6, 4))
    style = "o-" if len(curve) <= 30 else "-"  # a short (dry) run is a few points
    ax.plot([c[0] for c in curve], [c[1] for c in curve], style, color="C0")
    if all(c[2] is not None for c in curve):
        ax2 = ax.twinx()
        ax2.plot([c[0] for c in curve], [c[2] for c in curve], style, color="C1")
        ax2.set_ylabel("top-1 accuracy", color="C1")
    ax.set(xlabel="train step", ylabel="train loss")
    acc = (d.get("eval") or {}).get("after") or {}
    title = f"drafter warm-up: held-out accept length {acc.get('accept_length')} (greedy), "
    ax.set_title(title + f"{acc.get('sampled_accept_length')} (sampled)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sd(d: dict[str, Any], path: pathlib.Path) -> None:
    plt = pyplot()  # Agg: the device machine has no display
    import numpy as np

    rows = [r for r in d.get("rows", []) if r.get("column", "-") != "-"]
    if not rows:
        raise NoData
    cols = sorted({r["column"] for r in rows}, key=lambda c: int(re.sub(r"\D", "", c) or 0))
    batches = sorted({r["batch"] for r in rows})
    grid = np.full((len(batches), len(cols)), np.nan)
    fig, ax = plt.subplots(figsize=(1.3 * max(3, len(cols)) + 1, 0.8 * max(2, len(batches)) + 1.5))
    for r in rows:
        i, j = batches.index(r["batch"]), cols.index(r["column"])
        grid[i, j] = r["speedup"]
        ax.text(j, i, f"{r['speedup']:.2f}x\n({r['accept']})", ha="center", va="center", fontsize=7)
    ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=2.5, aspect="auto")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(batches)), batches)
    ax.set(xlabel="tokens to verify (column)", ylabel="batch")
    ax.set_title("speculative / plain decode speedup (accept length)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PLOTS = {"tree_attention": plot_tree_attention, "decode": plot_decode, "drafter": plot_drafter, "sd": plot_sd}


# ------------------------------------------------------------------------------------------------ report


def identity_md(r: dict[str, Any]) -> list[str]:
    """Speculative rollouts identical to plain ones, per dtype and strategy (sd_identity.py)."""
    out = []
    for dtype in ("bfloat16", "float32"):
        d = r.get("details", {}).get(dtype) or {}
        meta, res = d.get("meta", {}), d.get("results", {})
        names = [k for k in ("chain", "tree", "ngram") if k in d]
        if not names:
            continue
        drafter = r.get("details", {}).get("drafter")
        out += [
            f"Rollouts identical to plain decoding, {dtype} ({res.get('sequences')} sequences x "
            f"{res.get('new')} tokens, T {meta.get('temperature')}, top-p {meta.get('top_p')}, matmul "
            f"precision {res.get('matmul_precision')}, drafter {drafter}; a plain rerun with the same keys: "
            f"{cell(res.get('identical_frac_plain_rerun'))} identical)",
            "",
        ]
        rows = []
        for n in names:
            s = d[n]
            first = s.get("first_divergence") or []
            med = sorted(first)[len(first) // 2] if first else "-"
            flips = f"{s.get('rounding_flips')}/{len(s.get('gaps') or [])}"
            rows.append([n, s.get("mode"), s.get("identical_frac"), s.get("diverged"), med, flips])
            rows[-1].append(s.get("accept_len"))
        head = ["strategy", "mode", "identical", "diverged", "median first divergence"]
        out += table(head + ["gap < 1e-3 / checked", "accept"], rows) + [""]
    return out


def tree_attention_md(ta: dict[str, Any]) -> list[str]:
    """The kernel / reference table, then the block-size tuning's candidates (kv_splits is split-K)."""
    if not ta.get("rows"):
        return []
    bs = ta.get("block_sizes") or {}
    splits = bs.get("kv_splits") or f"per call (~{bs.get('target_programs')} programs)"  # 0: chosen per call
    out = [
        f"Tree attention ({ta.get('dtype')}, S={ta.get('seq')}, {ta.get('lowering')}, blocks "
        f"{ta.get('block_sizes')}): kernel / reference time",
        "",
    ]
    head = ["model", "B", "T", "split-K", "ref ms", "kernel ms", "ratio", "max err"]
    rows = [
        [r["model"], r["B"], r["T"], r.get("kv_splits", splits), r["ref_ms"], r["kernel_ms"]]
        for r in ta["rows"]
    ]
    rows = [row + [r["ratio"], r["max_err"]] for row, r in zip(rows, ta["rows"], strict=True)]
    out += table(head, rows) + [""]
    cands = (ta.get("tuning") or {}).get("candidates") or []
    if cands:
        out += ["Block-size tuning (coordinate descent; kv_splits = split-K over the cache):", ""]
        keys = list(dict.fromkeys(["kv_splits", *cands[0]["block_sizes"]]))  # split-K first
        rows = [
            [c["block_sizes"].get(k) for k in keys] + [c.get("geomean_ms"), c.get("error", "")[:80]]
            for c in cands
        ]
        out += table(keys + ["geomean ms", "error"], rows) + [""]
    return out


def decode_md(dec: dict[str, Any]) -> list[str]:
    """Ours against both of HF's paths (dynamic cache; static cache + torch.compile), per dtype."""
    out = []
    head = ["batch", "ours", "HF dynamic", "HF static+compile", "vs dynamic", "vs fast", "roofline frac"]
    for dtype, data in dec.items():
        if not (isinstance(data, dict) and data.get("rows")):
            continue
        fast = (data.get("meta") or {}).get("hf_fast", "")
        out += [f"Decode {dtype} (attention {data.get('attn_impl')}): tokens/s; HF fast path: {fast}", ""]
        rows = []
        for r in data["rows"]:
            ours, hf, hf_fast = r["ours_tok_s"], r["hf_tok_s"], r.get("hf_fast_tok_s")
            rows.append([r["batch"], round(ours), hf, hf_fast, div(ours, hf), div(ours, hf_fast)])
            rows[-1] += [r.get("roofline_frac"), r.get("hf_fast_warmup_s")]
        out += table(head + ["fast warm-up s"], rows) + [""]
    return out


def compile_md(r: dict[str, Any]) -> list[str]:
    m = r.get("metrics") or {}
    if "compile_first_s" not in m:
        return []
    nums = ", ".join(f"{k} {cell(v)}" for k, v in m.items())
    return [f"Compilation, first run vs rerun (compile_time.py --quick): {nums}", ""]


def rounds_md(r: dict[str, Any]) -> list[str]:
    """A speculative round's time by phase per strategy (bench_verify_cost.py --breakdown), in plain decode
    steps (`*_steps`) and ms, with the plain step's ms in the caption."""
    rounds = (r.get("details") or {}).get("rounds") or []
    if not rounds:
        return []
    step = (r.get("metrics") or {}).get("plain_step_ms")
    cols = list(dict.fromkeys(k for row in rounds for k in row if k not in ("column", "tv")))
    cols = sorted(cols, key=lambda k: (k.endswith("_ms"), k.startswith(("round", "phases"))))  # stable
    rows = [[row["column"], row["tv"]] + [row.get(c) for c in cols] for row in rounds]
    head = f"Speculative round by phase (bench_verify_cost.py --breakdown; a plain step {cell(step)} ms)"
    return [head, ""] + table(["column", "TV"] + cols, rows) + [""]


def sd_md(sd: dict[str, Any]) -> list[str]:
    if not sd.get("rows"):
        return []
    head = ["batch", "column", "strategy", "plain tok/s", "SD tok/s", "speedup", "accept", "round cost"]
    keys = ["batch", "column", "strategy", "plain_tok_s", "sd_tok_s", "speedup", "accept", "round_cost"]
    return ["SD (bench_sd): speedup (accept length)", ""] + table(
        head, [[r[k] for k in keys] for r in sd["rows"]]
    )


def report_md(results: dict[str, dict[str, Any]], tgt: dict[str, str], device: str) -> str:
    """A markdown section for docs/benchmarks.md: date, device, each phase's status and numbers, targets, then
    the identical fraction, the kernel table, compile times, the round breakdown, decode and SD tables."""
    day = time.strftime("%Y-%m-%d")
    dry = (
        " (dry run: tiny shapes, not a measurement)"
        if any(r.get("dry_run") for r in results.values())
        else ""
    )
    lines = [
        f"## GPU suite ({day}, {device}){dry}",
        "",
        "`python3 -m gpu.suite --call N` (docs/gpu.md).",
        "",
    ]
    rows = []
    for name, r in results.items():
        nums = ", ".join(f"{k} {cell(v)}" for k, v in r.get("metrics", {}).items())
        rows.append([name, r.get("call"), r.get("status"), f"{r.get('seconds', 0):.0f}", nums])
    lines += table(["phase", "call", "status", "seconds", "numbers"], rows)
    lines += ["", "Targets (docs/gpu.md): " + ", ".join(f"{k} **{v}**" for k, v in tgt.items()), ""]
    lines += rl_step_phases.rl_step_md(results.get("rl_step_7b", {}))
    lines += regime_phases.regime_md(results)
    lines += rl_step_phases.gpu_tests_md(results.get("gpu_tests", {}))
    lines += identity_md(results.get("identity", {}))
    lines += tree_attention_md(results.get("tree_attention", {}).get("details", {}))
    lines += compile_md(results.get("compile", {}))
    lines += rounds_md(results.get("verify_cost", {}))
    lines += decode_md(results.get("decode", {}).get("details", {}))
    lines += sd_md(results.get("sd", {}).get("details", {}))
    return "\n".join(lines) + "\n"


def write_outputs(out: pathlib.Path, state: pathlib.Path, results: list[Any], meta: dict[str, Any]) -> dict:
    """summary.json, report.md, the plots of this call's phases, per-phase JSON while under MAX_FILES."""
    this_call = {r.phase: dataclasses.asdict(r) for r in results}
    lease = load_results(state)
    tgt = targets(lease)
    device = str((lease.get("env", {}).get("metrics") or {}).get("device", "unknown device"))
    plots, plot_errors = [], {}
    for name, fn in PLOTS.items():
        r = this_call.get(name)
        if r is None or r["status"] in ("failed", "skipped"):
            continue
        try:
            fn(r["details"], out / f"{name}.png")
            plots.append(f"{name}.png")
        except NoData:
            continue
        except Exception as e:  # a plot is a convenience: note it and go on
            plot_errors[name] = f"{type(e).__name__}: {e}"
    (out / "report.md").write_text(report_md(lease, tgt, device))
    summary = {
        **meta,
        "device": device,
        "targets": tgt,
        "phases": this_call,
        "plots": plots,
        "plot_errors": plot_errors,
        "lease_results": {
            k: {kk: v.get(kk) for kk in ("status", "call", "metrics")} for k, v in lease.items()
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    for name, r in this_call.items():  # the device tool returns at most MAX_FILES files
        if len([p for p in out.iterdir() if p.is_file()]) >= MAX_FILES:
            break
        (out / f"{name}.json").write_text(json.dumps(r, indent=2, default=str))
    return summary
