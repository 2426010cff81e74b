"""What a gpu_suite call leaves under --out: summary.json, report.md, PNG plots (and per-phase JSON files).

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
import os
import pathlib
import re
import time
from typing import Any

os.environ.setdefault("MPLBACKEND", "Agg")  # headless: the device machine has no display

MAX_FILES = 8


class NoData(ValueError):
    """A phase ran but left nothing to plot (a dry run's SD phase, a run killed before its first row)."""


SD_TARGET, DECODE_TARGET = 2.0, 1.0


def load_results(state: pathlib.Path) -> dict[str, dict[str, Any]]:
    """Every phase's latest result in this lease (written by gpu_suite into state/results)."""
    out = {}
    for path in (state / "results").glob("*.json"):
        try:
            out[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    order = [
        "env",
        "kernel_tests",
        "tree_attention",
        "rollout_tests",
        "model",
        "decode",
        "drafter",
        "sd",
        "e2e",
    ]
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


def _verdict(value: Any, ok: bool) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "na"
    return "pass" if ok else "fail"


def targets(results: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The issue's targets: the verify kernel at least as fast as the reference for every T in 16..64; decode
    at batch 1 faster than HF transformers on the same GPU (bfloat16, else float32); SD >= 2x at batch 1."""
    ta = results.get("tree_attention", {}).get("metrics", {})
    fast = ta.get("faster_t16_64")
    dec = results.get("decode", {}).get("metrics", {})
    ratio = dec.get("bfloat16_ratio_vs_hf_bs1", dec.get("float32_ratio_vs_hf_bs1"))
    sd = results.get("sd", {}).get("metrics", {}).get("sd_speedup_bs1")
    return {
        "kernel": _verdict(fast, fast == 1),
        "decode": _verdict(ratio, isinstance(ratio, float) and ratio > DECODE_TARGET),
        "sd": _verdict(sd, isinstance(sd, float) and sd >= SD_TARGET),
    }


# ------------------------------------------------------------------------------------------------- plots
def plot_tree_attention(d: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

    if not any(isinstance(v, dict) and v.get("rows") for v in d.values()):
        raise NoData
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for (dtype, data), color in zip(d.items(), ("C0", "C1", "C2"), strict=False):
        rows = data.get("rows", []) if isinstance(data, dict) else []
        if not rows:
            continue
        b = [r["batch"] for r in rows]
        ax.plot(b, [r["ours_tok_s"] for r in rows], "o-", color=color, label=f"tlt_jax {dtype}")
        hf = [r["hf_tok_s"] for r in rows]
        if any(isinstance(v, float) and math.isfinite(v) for v in hf):
            ax.plot(b, hf, "s--", color=color, label=f"HF generate {dtype}")
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
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt
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
def _cell(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def report_md(results: dict[str, dict[str, Any]], tgt: dict[str, str], device: str) -> str:
    """A markdown section for docs/benchmarks.md: date, device, each phase's status and numbers, targets."""
    day = time.strftime("%Y-%m-%d")
    dry = (
        " (dry run: tiny shapes, not a measurement)"
        if any(r.get("dry_run") for r in results.values())
        else ""
    )
    lines = [
        f"## GPU suite ({day}, {device}){dry}",
        "",
        "`python3 experiments/gpu_suite.py --call N` (docs/gpu.md).",
        "",
    ]
    lines += ["| phase | call | status | seconds | numbers |", "|---|---|---|---|---|"]
    for name, r in results.items():
        nums = ", ".join(f"{k} {_cell(v)}" for k, v in r.get("metrics", {}).items())
        lines.append(f"| {name} | {r.get('call')} | {r.get('status')} | {r.get('seconds', 0):.0f} | {nums} |")
    lines += ["", "Targets (docs/gpu.md): " + ", ".join(f"{k} **{v}**" for k, v in tgt.items()), ""]
    ta = results.get("tree_attention", {}).get("details", {})
    if ta.get("rows"):
        lines += [
            f"Tree attention ({ta.get('dtype')}, S={ta.get('seq')}, {ta.get('lowering')}, blocks "
            f"{ta.get('block_sizes')}): kernel / reference time",
            "",
            "| model | B | T | ref ms | kernel ms | ratio | max err |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in ta["rows"]:
            lines.append(
                f"| {r['model']} | {r['B']} | {r['T']} | {_cell(r['ref_ms'])} | {_cell(r['kernel_ms'])} | "
                f"{_cell(r['ratio'])} | {_cell(r['max_err'])} |"
            )
        lines.append("")
    dec = results.get("decode", {}).get("details", {})
    for dtype, data in dec.items():
        if isinstance(data, dict) and data.get("rows"):
            lines += [
                f"Decode {dtype} (attention {data.get('attn_impl')}): tokens/s",
                "",
                "| batch | ours | HF | ratio | roofline frac |",
                "|---|---|---|---|---|",
            ]
            for r in data["rows"]:
                ratio = r["ours_tok_s"] / r["hf_tok_s"] if r["hf_tok_s"] else float("nan")
                lines.append(
                    f"| {r['batch']} | {r['ours_tok_s']:.0f} | {_cell(r['hf_tok_s'])} | {_cell(ratio)} | "
                    f"{_cell(r.get('roofline_frac'))} |"
                )
            lines.append("")
    sd = results.get("sd", {}).get("details", {})
    if sd.get("rows"):
        lines += [
            "SD (bench_sd): speedup (accept length)",
            "",
            "| batch | column | strategy | plain tok/s | SD tok/s | speedup | accept | round cost |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in sd["rows"]:
            lines.append(
                f"| {r['batch']} | {r['column']} | {r['strategy']} | {r['plain_tok_s']} | {r['sd_tok_s']} | "
                f"{r['speedup']}x | {r['accept']} | {r['round_cost']} |"
            )
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
