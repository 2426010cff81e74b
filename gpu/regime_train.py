"""gpu/regime_7b.py's training parts at Qwen2.5-7B width: the EAGLE drafter's optimizer step (the spot
trainer's `drafter.trainer.train_step` on config.spot's packed batch) and the policy update's accumulation
over one micro-batch with as many layers as the memory plan says fit (peak memory against the plan)."""

from __future__ import annotations

import argparse
import pathlib
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ml_collections

from gpu.regime_common import FIT_FRACTION, GIB, TINY, Recorder, bytes_in_use, device_limit, peak_bytes

# XLA:CPU's plans of the update (experiments/models/update_record.py), what update_7b sets its own beside
CPU_PLAN = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "models" / "update_plans_7b.json"
DRAFTER_COMPILE_S = 21.0  # the drafter's step at 7B width: 21.3 s to compile on the H200 (2026-11-26)


def load_7b_config(dry: bool) -> ml_collections.ConfigDict:
    """configs/qwen2_5_7b.py with random weights (a dry run: its architecture at TINY sizes)."""
    from tlt_jax import config_lib

    config = config_lib.load_config_file(
        pathlib.Path(__file__).resolve().parents[1] / "configs" / "qwen2_5_7b.py"
    )
    config.model.init = "random"
    if dry:  # and a small drafter step: 48 packed tokens, no training-time-test passes (each one adds a
        # drafter forward to the program: ~15 s of compilation on a busy 2-core CPU instead of ~5 s)
        config.model.random.update(TINY)
        config.spot.update(window=32, context=16, ce_tokens=32, ttt_steps=0)
    return config


def part_drafter(rec: Recorder, args: argparse.Namespace, dry: bool) -> None:
    """One optimizer step of the EAGLE drafter at the target's width on config.spot's packed batch (rows x
    (context + window) tokens): compile seconds, step ms (median of reps), peak memory."""
    import functools
    import statistics

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tlt_jax import config_schema
    from tlt_jax.drafter import trainer as dtr
    from tlt_jax.drafter.packing import PackedBatch
    from tlt_jax.models.build import model_config_from
    from tlt_jax.models.random_init import random_drafter

    config = load_7b_config(dry)
    cfg, spot = model_config_from(config), config_schema.section(config, "spot")
    if not rec.affordable("drafter step", DRAFTER_COMPILE_S + 5.0):
        return
    graphdef, params = nnx.split(random_drafter(cfg, seed=1), nnx.Param)
    tx = spot.optimizer()
    state = dtr.TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), jax.random.key(0))
    r, s, h = spot.rows, spot.seq_len, cfg.hidden_size
    k = jax.random.key(2)
    batch = PackedBatch(
        tokens=jax.random.randint(k, (r, s), 0, cfg.vocab_size, jnp.int32),
        hidden=jax.random.normal(k, (r, s, h), jnp.float32),
        segment_ids=jnp.ones((r, s), jnp.int32),
        positions=jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (r, s)),
        loss_mask=jnp.ones((r, s), jnp.bool_),
    )
    embed = 0.02 * jax.random.normal(k, (cfg.vocab_size, h), cfg.dtype)
    head = (
        embed
        if cfg.tie_embeddings
        else 0.02 * jax.random.normal(jax.random.fold_in(k, 1), (cfg.vocab_size, h), cfg.dtype)
    )
    fn = functools.partial(dtr.train_step, graphdef=graphdef, tx=tx, loss_cfg=spot.loss_config())
    t = time.perf_counter()
    step = jax.jit(fn, donate_argnums=(0,)).lower(state, batch, embed, head).compile()
    rec.compiled(f"drafter_step_r{r}_s{s}", time.perf_counter() - t, estimate=False)
    times = []
    for _ in range(args.reps + 1):
        t = time.perf_counter()
        state, metrics = step(state, batch, embed, head)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    row = {"rows": r, "seq_len": s, "step_ms": 1e3 * statistics.median(times[1:]), "peak_bytes": peak_bytes()}
    row["loss_finite"] = bool(jnp.isfinite(metrics["loss"])) if "loss" in metrics else None
    print(f"   drafter step: {row['step_ms']:.1f} ms ({r} x {s} tokens)", flush=True)
    rec.add("drafter", row)


def update_config(dry: bool, rows: int) -> ml_collections.ConfigDict:
    """configs/qwen2_5_7b.py's trainer on one device: one micro-batch of `rows` rows per step (one prompt x
    `rows` samples, one mini-batch), everything else (scan, remat, FSDP, chunks, dtypes) as configured."""
    from tlt_jax import memory_plan as mpp

    return mpp.one_device_update(load_7b_config(dry), rows)  # the program the CPU record compiles


def update_program(
    config: ml_collections.ConfigDict, layers: int, prompt_len: int, response_len: int
) -> tuple[Any, Any, tuple]:
    """(compiled accumulation, its ProgramInfo: XLA's accounting = the plan's figure, abstract args) of the
    policy update over one micro-batch at `layers` decoder layers (`memory_plan.compile_update`'s body)."""
    import jax

    from tlt_jax import config_lib
    from tlt_jax import memory_plan as mpp
    from tlt_jax.models.build import model_config_from
    from tlt_jax.rollout.programs import ProgramCache

    mesh = config_lib.build_mesh(config)
    am = mpp.abstract_models(model_config_from(config), mesh, layers)
    t = mpp.abstract_trainer(config, am, mesh)
    micro, weights = mpp.abstract_micro(config, mesh, prompt_len, response_len)

    def accum(p: Any, acc: Any, m: Any, w: Any) -> tuple:
        acc, aux = t._accum_fn(p, acc, m, w)
        return jax.lax.with_sharding_constraint(acc, t.param_shardings), aux

    cache = ProgramCache()
    args = (t.params, t.params, micro, weights)
    compiled = cache.compile(("update_accum", layers, response_len), accum, args, (1,))
    return compiled, cache.infos()[0], args


def materialise(abstract: Any) -> Any:
    """Zeros of an abstract pytree on its shardings (the response mask and weights ones: every token
    counts), without a host copy."""
    import jax
    import jax.numpy as jnp

    def make() -> Any:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)

    out = jax.jit(make, out_shardings=jax.tree.map(lambda s: s.sharding, abstract))()
    params, acc, micro, weights = out
    micro = micro.replace(response_mask=jnp.ones_like(micro.response_mask))
    return params, acc, micro, jnp.ones_like(weights)


def fit_layers(
    rec: Recorder, config: ml_collections.ConfigDict, prompt_len: int, response_len: int
) -> tuple[int, dict, tuple | None]:
    """(layers, how they were chosen, the compiled program when it is the full depth's): the model's depth
    when its update program (plan: arguments + temporaries + outputs + code) fits FIT_FRACTION of the device
    (or the limit is unknown: a CPU), else the most layers that fit by a linear fit of two more compiles at
    1 and 2 layers (weights, gradients and saved activations are per layer)."""
    from tlt_jax.models.build import model_config_from

    depth = model_config_from(config).num_layers
    limit = device_limit()
    t = time.perf_counter()
    full = update_program(config, depth, prompt_len, response_len)
    rec.compiled(f"update_accum_l{depth}_{response_len}", time.perf_counter() - t)
    need_full = full[1].argument_bytes + full[1].footprint_bytes
    if limit is None or need_full <= FIT_FRACTION * limit:
        return depth, {"limit": limit, "plan_full_depth": need_full}, full
    need = {}
    for n in (1, 2):
        t = time.perf_counter()
        _, info, _ = update_program(config, n, prompt_len, response_len)
        rec.compiled(f"update_plan_l{n}_{response_len}", time.perf_counter() - t)
        need[n] = info.argument_bytes + info.footprint_bytes
    slope, base = need[2] - need[1], 2 * need[1] - need[2]
    n = depth if slope <= 0 else min(depth, int((FIT_FRACTION * limit - base) // slope))
    fit = {"limit": limit, "plan_full_depth": need_full, "plan_l1": need[1], "plan_l2": need[2]}
    return n, {**fit, "per_layer": slope, "base": base}, None


def part_update(rec: Recorder, args: argparse.Namespace, dry: bool) -> None:
    """The update's accumulation over one micro-batch at --update-len response tokens per row, with as many
    layers as fit: compile seconds, step seconds, measured peak against the plan's bytes."""
    import jax

    prompt_len = 16 if dry else 1024
    config = update_config(dry, args.update_rows)
    what = f"update {args.update_rows} x ({prompt_len} + {args.update_len})"
    if not rec.affordable(what, rec.compile_guess + 10.0):
        return
    layers, fit, program = fit_layers(rec, config, prompt_len, args.update_len)
    if layers < 1:
        rec.skip(what, f"memory: not even one layer fits ({fit})", "memory")
        return
    if program is None:
        t = time.perf_counter()
        program = update_program(config, layers, prompt_len, args.update_len)
        rec.compiled(f"update_accum_l{layers}_{args.update_len}", time.perf_counter() - t)
    compiled, info, abstract = program
    plan = info.argument_bytes + info.footprint_bytes
    row = {"rows": args.update_rows, "prompt_len": prompt_len, "response_len": args.update_len}
    row.update(layers=layers, plan_bytes=plan, temp_bytes=info.temp_bytes, argument_bytes=info.argument_bytes)
    # the process's peak before the run (compiles' autotuning scratch, the arguments) and after it: the run's
    # own peak is the later one when it is larger
    params, acc, micro, weights = materialise(abstract)
    row.update(fit=fit, bytes_in_use_before_run=bytes_in_use(), peak_before_run=peak_bytes())
    times = []
    try:
        for _ in range(2):
            t = time.perf_counter()
            acc, aux = compiled(params, acc, micro, weights)
            jax.block_until_ready((acc, aux))
            times.append(time.perf_counter() - t)
    except Exception as e:  # e.g. out of memory although the plan said it fits: that is the finding
        row.update(error=f"{type(e).__name__}: {str(e)[:500]}", first_call_s=None, step_s=None)
        row.update(peak_bytes=peak_bytes(), peak_over_plan=None)
        rec.add("update", row)
        return
    peak = peak_bytes()
    row.update(first_call_s=times[0], step_s=times[-1], peak_bytes=peak)
    row["peak_over_plan"] = peak / plan if peak else None
    row.update(attention_calls(compiled))
    row.update(cpu_plan_fields(row))
    print(
        f"   {what} at {layers} layers: {times[-1]:.2f}s, plan {plan / GIB:.2f} GiB, peak {peak}", flush=True
    )
    rec.add("update", row)


def attention_calls(compiled: Any) -> dict[str, int]:
    """How the compiled update computes attention: its cuDNN fused-attention custom calls (forward and
    backward; 0 where `flash_attention`'s "auto" chose the blockwise jnp path, e.g. on a CPU)."""
    text = compiled.as_text()
    return {"cudnn_fmha_calls": text.count("__cudnn$fmha"), "cudnn_custom_calls": text.count("__cudnn$")}


def cpu_plan_fields(row: dict[str, Any]) -> dict[str, Any]:
    """XLA:CPU's plan of the same update program (`experiments/models/update_plans_7b.json`, layout
    "one_device": `python -m experiments.models.update_record` on a CPU, jax 0.10.2), beside XLA:GPU's
    (`row["plan_bytes"]`) and the measured peak; None where the record has no row of these shapes (another
    depth: an 80 GB GPU fits fewer than 28 layers)."""
    import json

    want = {"layout": "one_device", "program": "update_accum", "micro_batch_rows": row["rows"]}
    want |= {"prompt_len": row["prompt_len"], "response_len": row["response_len"], "layers": row["layers"]}
    rows = json.loads(CPU_PLAN.read_text()).get("programs", []) if CPU_PLAN.exists() else []
    found = next((r for r in rows if all(r.get(k) == v for k, v in want.items())), None)
    if found is None:
        return {"cpu_plan_bytes": None, "cpu_plan_record": f"{CPU_PLAN.name}: no row {want}"}
    cpu, peak = found["plan_bytes"], row.get("peak_bytes")
    return {
        "cpu_plan_bytes": cpu,
        "cpu_plan_record": CPU_PLAN.name,
        "cpu_over_gpu_plan": cpu / row["plan_bytes"] if row.get("plan_bytes") else None,
        "peak_over_cpu_plan": peak / cpu if peak else None,
    }


# ---- main -------------------------------------------------------------------------------------------
