"""The rollout of the paper's RL step planned per device (issue 36): `memory_plans.py --rollout`.

configs/qwen2_5_7b.py's step (its 64 prompts x 8 = 512 rows, --rollout-prompt-len 1,024-token prompts,
responses up to its max_new_tokens, 32,768) on its 2 x 4 mesh of fake CPU devices, with continuous batching at
the config's `max_running_rows` (from `rollout.kv_budget_gib`, as the engine picks it): every program of a
capped rollout (`tlt_jax.rollout_memory_plan`: the prompt cache, the start of the first rows, per
--insert-rows (rows per shard) the start of the inserted rows and the insert, the plain chunk at the cap, the
SD chunk of the deepest BEG-MAB arm at the tail's batch bucket, the drafter step and the composed spot tick)
compiled from abstract shapes at --layers (two small depths, bfloat16 and float32) and extrapolated linearly
to the model's depth, as the main plan does (`layer_fit.extrapolate`; --check-layers compiles once more and
reports the fit's error). Temporaries: XLA:CPU copies a bfloat16 KV cache to float32 around each layer's cache
write (a CPU artefact), so high = the smaller of the two compiles' temporaries, low = half the float32 one
(`layer_fit.estimate`); arguments are the bfloat16 program's. "need" adds what is alive outside the program
(masters, AdamW, reference, the spot trainer's drafter state; the prompt cache; the running batch beside an
insert's start). Final line: RESULT <program>_gib=<low-high> .. cap_rows=.. top_cache=..
fits_72gib=yes|no|uncertain wall_s=..
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from experiments.lib import harness
from experiments.models import layer_fit as lf
from tlt_jax import config_lib
from tlt_jax import memory_plan as mpp
from tlt_jax import rollout_memory_plan as rmp
from tlt_jax.models.build import model_config_from

GIB = 2**30
LIMIT_GIB = 72.0  # the memory plans' target per 80 GB device (JAX sees ~78 GiB; headroom for the runtime)


def add_args(ap: argparse.ArgumentParser) -> None:
    """This plan's flags on memory_plans.py's parser (--layers, --check-layers, --prompt-len are shared)."""
    ap.add_argument(
        "--rollout", action="store_true", help="the paper's rollout at the config's cap (see top)"
    )
    ap.add_argument("--insert-rows", default="8,64", help="rows per shard of the planned inserts")
    ap.add_argument("--rollout-prompt-len", type=int, default=1024, help="prompt bucket of the rollout plan")


def measure(
    config: Any, engine: Any, cfg: Any, shape: rmp.RolloutShape, args: argparse.Namespace
) -> tuple[list, dict]:
    """(specs, {(dtype, depth): {key: ProgramInfo}}): the programs compiled at each depth and dtype (at the
    second and check depths only those with a per-layer slope)."""
    keys = rmp.rollout_keys(config, shape)
    specs = [lf.Spec(k, "rollout", () if k[0] == "drafter_step" else k) for k in keys]
    (l1, l2), check = args.layers, args.check_layers
    measured, t0 = {}, time.perf_counter()
    for dtype in ("bfloat16", "float32"):
        for depth in [l1, l2] + ([check] if check else []):
            todo = keys if depth == l1 else [s.key for s in specs if s.rep]
            measured[dtype, depth] = rmp.compile_all(
                config, engine, rmp.with_depth(cfg, dtype, depth), shape, todo
            )
            print(
                f"  {len(todo)} programs in {dtype} at {depth} layers ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    return specs, measured


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Compile, extrapolate and account the rollout programs of configs/qwen2_5_7b.py (module docstring)."""
    config = config_lib.load_config_file(lf.CONFIGS["7b"])
    config.model.init = "random"
    mesh, cfg = config_lib.build_mesh(config), model_config_from(config)
    engine = rmp.plan_engine(config, mesh)
    shape = rmp.rollout_shape(config, engine, cfg, args.rollout_prompt_len, tuple(args.insert_rows))
    print(
        f"mesh {dict(mesh.shape)}; {shape.line}; top cache bucket {shape.top_cache}; SD arm {shape.sd_mode}"
    )
    specs, measured = measure(config, engine, cfg, shape, args)
    mpp.dump("rollout_7b", harness.out_dir(args), measured)
    (l1, l2), check = args.layers, args.check_layers
    full = {
        dt: lf.extrapolate(specs, measured[dt, l1], measured[dt, l2], l1, l2, cfg.num_layers)
        for dt in ("bfloat16", "float32")
    }
    est = {k: lf.estimate(full["bfloat16"][k], full["float32"][k]) for k in full["bfloat16"]}
    res = mpp.resident(config, cfg, mesh)
    live = rmp.live_bytes(config, engine, cfg, shape)
    needs = {
        end: rmp.rollout_needs({k: e[end] for k, e in est.items()}, res, live) for end in ("low", "high")
    }
    err = None
    if check:
        err = max(  # the worst field of any program, either dtype: (of need, of field, key, field, dtype)
            e + (dt,)
            for dt in ("bfloat16", "float32")
            for e in lf.fit_errors(specs, {d: measured[dt, d] for d in (l1, l2, check)}, (l1, l2, check))
        )
    return dict(shape=shape, full=full, needs=needs, res=res, live=live, err=err, cfg=cfg, mesh=mesh)


def result_name(key: tuple) -> str:
    """The RESULT name of a program: prompt_cache, start_<rows>, insert_start_<rows>, insert_<rows
    inserted>, plain_<rows>, sd<tokens to verify>_<rows>, spot_tick."""
    if key[0] == "prompts":
        return "prompt_cache"
    if key[0] == "start":
        return ("insert_start_" if key[-1] == "insert" else "start_") + str(key[1])
    if key[0] == "insert":
        return f"insert_{key[2]}"
    if key[0] == "chunk":
        return f"plain_{key[1]}" if not key[4] else f"sd{key[3]}_{key[1]}"
    return str(key[0])


def report(p: dict[str, Any]) -> dict[str, Any]:
    """Print the table (GiB per device) and return the RESULT items."""
    g, full, lo, hi = (lambda b: b / GIB), p["full"], p["needs"]["low"], p["needs"]["high"]  # noqa: E731
    print(
        f"\n{'program':<58} {'args':>6} {'tmpbf16':>7} {'tmpf32':>6} {'temps':>11} {'outside':>7} "
        f"{'need (low-high)':>15}"
    )
    out: dict[str, Any] = {}
    for key, h in hi.items():
        b = full["bfloat16"].get(key)
        f = full["float32"].get(key)
        raw = f"{g(b.temp_bytes):7.2f} {g(f.temp_bytes):6.2f}" if b else f"{'-':>7} {'-':>6}"
        temps = f"{g(lo[key]['temps']):5.2f}-{g(h['temps']):5.2f}"
        need = f"{g(lo[key]['need']):6.2f}-{g(h['need']):6.2f}"
        print(
            f"{rmp.rollout_label(key):<58.58} {g(h['args']):6.2f} {raw} {temps:>11} "
            f"{g(h['outside']):7.2f} {need:>15}"
        )
        out[f"{result_name(key)}_gib"] = f"{g(lo[key]['need']):.1f}-{g(h['need']):.1f}"
    res = p["res"]
    print("resident per device (GiB): " + ", ".join(f"{k} {g(v):.2f}" for k, v in res.items()))
    live = p["live"]
    print(
        f"alive beside the programs (GiB per device): the prompt cache {g(live['prompt_cache']):.2f}, the "
        f"running batch at the cap and the top bucket {g(live['running']):.2f} (beside an insert's start)"
    )
    if p["err"]:
        print(
            f"layer fit checked at --check-layers: worst {rmp.rollout_label(p['err'][2])} {p['err'][3]} "
            f"({p['err'][4]}): {p['err'][0]:.1%} of its need, {p['err'][1]:.1%} of the field"
        )
    top_hi = max(v["need"] for v in hi.values())
    top_lo = max(v["need"] for v in lo.values())
    fits = "yes" if top_hi <= LIMIT_GIB * GIB else ("no" if top_lo > LIMIT_GIB * GIB else "uncertain")
    print(f"largest need {g(top_lo):.2f}-{g(top_hi):.2f} GiB per device; fits {LIMIT_GIB:.0f} GiB: {fits}")
    if p["err"]:
        out["layer_fit_err_of_field"] = round(p["err"][1], 4)
    s = p["shape"]
    return out | dict(cap_rows=s.cap, top_cache=s.top_cache, fits_72gib=fits)


def main(args: argparse.Namespace, t0: float) -> None:
    """`memory_plans.py --rollout`: plan, table, RESULT line."""
    args.insert_rows = [int(x) for x in str(args.insert_rows).split(",") if x.strip()]
    out = report(plan(args))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    harness.result(out, args, fmt="")
