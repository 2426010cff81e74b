"""The memory plans of an rl_step_7b run's config, compiled by the process that ran it (gpu/rl_step_run.py).

The figures the README's plans are made of, at the run's own shapes: `memory_plan.resident` (the state that
lives through the step: engine weights and drafter, float32 masters, AdamW moments, the reference, the spot
trainer's drafter state; exact, from shapes), the update's programs (`memory_plan.compile_update`: the
accumulation over one micro-batch at the trainer's largest response bucket, the log-prob pass, the
optimizer's apply; the trainer's layers scanned as the config has them) and the rollout's
(`rollout_memory_plan`: the prompt cache, the start of the first running rows, an insert, the plain chunk at
the running-rows cap, the SD chunk of the deepest BEG-MAB arm at the tail's bucket, the drafter step, and
the composed spot tick). Each program's need per device = its arguments + temporaries, non-aliased outputs
and code + what lives beside it, as the plans count it; compiled with this process's backend (XLA:GPU on a
GPU), one program at a time while the deadline lasts (`plan.skipped` lists the rest).
"""

from __future__ import annotations

import time
from typing import Any

GIB = 2**30


def round_up(x: int, k: int) -> int:
    return -(-x // k) * k


def plans(path: str, arg: str | None, parts: list[str], budget_s: float, watch: Any) -> None:
    """Compile the `parts` ("rollout", "update"; "resident" alone: the resident state only) of the plan of
    config `path`:`arg` into `watch.data["plan"]` (saved after every program)."""
    import jax

    from tlt_jax import config_lib
    from tlt_jax import memory_plan as mpp
    from tlt_jax.models.build import model_config_from

    config = config_lib.load_config_file(path, arg)
    mesh, cfg = config_lib.build_mesh(config), model_config_from(config)
    deadline = time.perf_counter() + budget_s
    res = mpp.resident(config, cfg, mesh)
    out: dict[str, Any] = {"backend": jax.default_backend(), "resident": res, "programs": [], "skipped": []}
    watch.data["plan"] = out
    bucket = int(config.trainer.seq_bucket)
    prompt = round_up(int(config.task.prompt_len), bucket)
    response = round_up(int(config.rollout.max_new_tokens), bucket)
    out["update_shape"] = {"prompt_len": prompt, "response_len": response}
    if "update" in parts:
        _update(config, mesh, cfg, prompt, response, res, deadline, watch)
    if "rollout" in parts:
        _rollout(config, mesh, cfg, res, deadline, watch)
    needs = [p["need"] for p in out["programs"]]
    out["need_max"] = max(needs) if needs else None
    for kind in ("update", "rollout"):
        kneeds = [p["need"] for p in out["programs"] if p["kind"] == kind]
        out[f"{kind}_need_max"] = max(kneeds) if kneeds else None
    watch.save()


def _record(watch: Any, kind: str, label: str, info: Any, outside: int, seconds: float) -> None:
    args, temps = int(info.argument_bytes), int(info.footprint_bytes)
    row = {"kind": kind, "program": label, "args": args, "footprint": temps, "outside": int(outside)}
    row.update(need=args + temps + int(outside), compile_s=round(seconds, 2))
    watch.data["plan"]["programs"].append(row)
    print(f"   plan {kind} {label}: need {row['need'] / GIB:.2f} GiB ({seconds:.1f} s)", flush=True)
    watch.save()


def _update(
    config: Any, mesh: Any, cfg: Any, prompt: int, response: int, res: dict, deadline: float, watch: Any
) -> None:
    """The update's apply, accumulation and log-prob programs, with `memory_plan.update_table`'s outside."""
    from tlt_jax import memory_plan as mpp

    am = mpp.abstract_models(cfg, mesh)
    for length in (0, response):
        if time.perf_counter() > deadline:
            watch.data["plan"]["skipped"].append(f"update {length or 'apply'}: out of time")
            continue
        t = time.perf_counter()
        infos = mpp.compile_update(config, am, mesh, prompt, length)
        for info in infos:
            outside = [
                k for k in mpp.UPDATE_OUTSIDE if not (info.key[0] == "update_apply" and k == "optimizer")
            ]
            _record(
                watch,
                "update",
                mpp.label(info.key),
                info,
                sum(res[k] for k in outside),
                time.perf_counter() - t,
            )
            t = time.perf_counter()


def _rollout(config: Any, mesh: Any, cfg: Any, res: dict, deadline: float, watch: Any) -> None:
    """The rollout's programs at the run's cap (`rollout_memory_plan.rollout_keys`) and the composed tick."""
    from tlt_jax import memory_plan as mpp
    from tlt_jax import rollout_memory_plan as rmp

    engine = rmp.plan_engine(config, mesh)
    prompt = int(config.rollout.prompt_bucket)
    first = rmp.rollout_shape(config, engine, cfg, prompt, (1,))
    shape = rmp.rollout_shape(config, engine, cfg, prompt, (max(first.cap // 2, 1),))
    live = rmp.live_bytes(config, engine, cfg, shape)
    am = mpp.abstract_models(cfg, engine.mesh)
    watch.data["plan"]["rollout_shape"] = {
        k: getattr(shape, k) for k in ("cap", "tail_rows", "top_cache", "sd_mode")
    }
    infos = {}
    for key in rmp.rollout_keys(config, shape):
        if time.perf_counter() > deadline:
            watch.data["plan"]["skipped"].append(f"rollout {rmp.rollout_label(key)}: out of time")
            continue
        infos[key] = rmp.compile_rollout_program(key, config, engine, am, shape)  # its compile seconds kept
    if not any(k[0] == "drafter_step" for k in infos) or not any(k[0] == "chunk" for k in infos):
        return
    for key, need in rmp.rollout_needs(infos, res, live).items():
        info = infos.get(key)
        secs = info.compile_seconds if info is not None else 0.0
        row = {"kind": "rollout", "program": rmp.rollout_label(key), "args": need["args"]}
        row.update(
            footprint=need["temps"], outside=need["outside"], need=need["need"], compile_s=round(secs, 2)
        )
        watch.data["plan"]["programs"].append(row)
        print(f"   plan rollout {row['program']}: need {row['need'] / GIB:.2f} GiB", flush=True)
    watch.save()
