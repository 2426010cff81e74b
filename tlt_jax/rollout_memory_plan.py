"""The rollout of the paper's RL step planned per device from compiled programs (issue 36).

The paper's step is 512 rows (64 prompts x 8) of 1,024-token prompts and up to 32,768-token responses. With
continuous batching at most `max_running_rows` rows decode per data shard; the cap comes from the config
(`rollout.max_running_rows`, or `rollout.kv_budget_gib` through `admission.running_rows_cap` with the real
model's KV bytes per token and the engine's top cache bucket), as `RolloutEngine.__init__` picks it. Every
program a capped rollout runs (`rollout/row_programs.py`, `scheduler._prefill` / `_insert`) is compiled for
the mesh from abstract shapes, the engine's own bodies over `memory_plan`'s tiny stand-in engine with the
real target's and drafter's graphs swapped in:

  the prompt cache: every prompt of the rollout through the target once (`decode.prefill_prompts`), kept for
    the whole rollout (replicated over the data axis);
  the start of the first running rows (cap rows per shard) from it (`decode.start_rows`: no forward pass);
  per insert size (`insert_rows` per shard): the start of the inserted rows while the running batch is alive
    at the top cache bucket, and the insert that writes them into free slots (`spmd.insert_program`, the
    running state donated);
  the plain chunk at the cap with the cache at the top bucket (while rows wait in the queue SD stays off);
  the SD chunk of the BEG-MAB arm with the most tokens to verify, at the tail's batch bucket (the rows of
    `spec.threshold`, all in one shard) and the top cache bucket;
  the spot trainer's drafter step (`drafter.trainer.train_step`, the `config.spot` shapes).

The running batch holds the target's hidden states of `rollout.hidden_window` response tokens of every row
(`DecodeState.out_hidden` [rows, W, H], batch-sharded, replicated over the model axis: the spot trainer's
data; which W, `rollout.hidden_span`, does not change the bytes); `live_bytes` reports them apart
(`recorded_hidden`, `hidden_line`), and the cap counts them beside the KV (`admission.running_rows_cap`). On
the host they stream to the spot trainer: one harvest's rows at a time, at most the running batch
(`host_hidden`). `warmup_memory`: the drafter warm-up's engine on one device (weights, KV and recorded states
per running row, the cap its budget gives, host bytes), from the same functions the engine sizes itself with.

The spot trainer's fused tick (`spmd.tick_program`: busy data groups decode, idle ones train) is not compiled
here: its idle-device body is a closure of `SpotTrainer.idle_work` that needs a live trainer with data, so it
cannot be built from abstract shapes without copying it. Its need is composed from two compiled programs: the
larger of the two chunks' needs plus the drafter step's temporaries, non-aliased outputs and the part of its
arguments not already resident (its micro-batches); an upper bound, since a device takes one of the tick's
two branches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections as mlc
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax import config_schema
from tlt_jax import memory_plan as mpp
from tlt_jax import sharding as shd
from tlt_jax.models.config import ModelConfig, tiny_config
from tlt_jax.models.eagle3 import config_drafter_spec, spec_aux_layers, states_width
from tlt_jax.models.llama import Transformer
from tlt_jax.models.random_init import bytes_per_device
from tlt_jax.rollout import admission, decode, spmd
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.programs import ProgramInfo, pow2_at_least
from tlt_jax.rollout.sampling import SamplingParams

GIB = 2**30
# the resident state outside the rollout programs' arguments (`memory_plan.resident`): the trainer's float32
# masters, AdamW moments and reference weights and the spot trainer's drafter state
ROLLOUT_OUTSIDE = ("masters", "optimizer", "reference", "drafter_state")


@dataclasses.dataclass(frozen=True)
class RolloutShape:
    """What the plan derives from the config, the mesh and the model: rows per data shard of the running
    batch (`cap`), of the inserts and of the SD tail; the cache buckets; the SD arm; the start-up line."""

    data: int
    cap: int
    insert_rows: tuple[int, ...]
    tail_rows: int
    prompt_len: int
    first_cache: int
    top_cache: int
    sd_mode: str
    line: str


def sd_arm(config: mlc.ConfigDict) -> str:
    """The speculative arm with the most tokens to verify among `config.bandit.arms` (the bandit's
    bs-1 arm: the largest verify batch per row), or `config.spec.strategy` without a bandit."""
    arms = [a for a in config.bandit.arms if a != "plain"] if config.bandit.algorithm != "off" else []
    arms = arms or [str(config.spec.strategy)]
    return max(arms, key=lambda a: int(a.rsplit("_", 1)[-1]))


def plan_engine(config: mlc.ConfigDict, mesh: Mesh) -> RolloutEngine:
    """The stand-in engine with the config's arms registered (the top cache bucket holds the deepest
    lookahead among them, as the learner's engine does once the bandit registered its arms)."""
    arms = [a for a in config.bandit.arms if a != "plain"] or [str(config.spec.strategy)]
    return mpp.stand_in_engine("naive", config, mesh, arms, arms[0])


def rollout_shape(
    config: mlc.ConfigDict,
    engine: RolloutEngine,
    cfg: ModelConfig,
    prompt_len: int,
    insert_rows: tuple[int, ...],
) -> RolloutShape:
    """The running-rows cap as the engine picks it (`admission.running_rows_cap` with the real model's KV
    per token, the drafter's layer included when the spot trainer or an EAGLE arm holds one) and the
    buckets of the programs above."""
    rollout = config_schema.section(config, "rollout")
    data, model_axis = engine.data_size, engine.mesh.shape["model"]
    drafter_layers = int(engine.needs()[0] or config.spot.mode != "off")
    per_token = admission.kv_bytes_per_token(cfg, model_axis, drafter_layers)
    top = engine.top_cache_bucket()
    hid = recorded_bytes_per_row(config, cfg)
    cap, line = admission.running_rows_cap(
        rollout.max_running_rows, rollout.kv_budget_gib, per_token, top, hid
    )
    rows = int(config.rl.prompts_per_step) * int(config.rl.samples_per_prompt)
    full = engine.local_bucket(-(-rows // data))
    cap = min(cap, full) if cap else full
    return RolloutShape(
        data=data,
        cap=cap,
        insert_rows=tuple(sorted({min(k, cap) for k in insert_rows})),
        tail_rows=min(engine.local_bucket(int(config.spec.threshold)), cap),
        prompt_len=prompt_len,
        first_cache=mpp.prefill_cache_bucket(engine, prompt_len),
        top_cache=top,
        sd_mode=sd_arm(config),
        line=line,
    )


def prompt_cache_program(
    engine: RolloutEngine, am: mpp.AbstractModels, prompts: int, prompt_len: int
) -> tuple[Any, tuple]:
    """(fn, abstract args) of `RolloutEngine.prompt_cache`: every prompt of the rollout through the target
    once, the cache replicated over the data axis (KV heads over the model axis)."""
    mesh, rep = engine.mesh, NamedSharding(engine.mesh, P())
    prog = mpp.prefill_program(engine, am, SamplingParams(), engine.cache_bucket(prompt_len))
    rules = {**shd.DEFAULT_RULES, "batch": None}

    def fn(*args: Any) -> decode.PromptCache:
        pc = decode.prefill_prompts(prog, *args)
        return jax.lax.with_sharding_constraint(pc, shd.shard_pytree_batch(pc, mesh, rules))

    pb = pow2_at_least(prompts)
    tokens, lens = mpp.sds((pb, prompt_len), jnp.int32, rep), mpp.sds((pb,), jnp.int32, rep)
    return fn, (am.params, am.dparams if prog.drafter is not None else None, tokens, lens)


def abstract_prompt_cache(
    engine: RolloutEngine, am: mpp.AbstractModels, prompts: int, prompt_len: int
) -> Any:
    """The prompt cache as sharded `ShapeDtypeStruct`s (eval_shape of its program)."""
    fn, args = prompt_cache_program(engine, am, prompts, prompt_len)
    pc = jax.eval_shape(fn, *args)
    rules = {**shd.DEFAULT_RULES, "batch": None}
    return mpp.with_shardings(pc, shd.shard_pytree_batch(pc, engine.mesh, rules))


def start_program(
    engine: RolloutEngine, am: mpp.AbstractModels, sp: Any, pc: Any, rows: int, cache: int
) -> tuple[Any, tuple]:
    """(fn, abstract args) of `RolloutEngine.start_rows`: `rows` rows started from the prompt cache `pc` at
    cache bucket `cache`, their operands batch-sharded as `_start_operands` places them."""
    prog = mpp.prefill_program(engine, am, sp, cache)
    fn = lambda *args: engine._constrain(decode.start_rows(prog, *args))  # noqa: E731
    per_row = lambda shape, dt: mpp.sds(shape, dt, shd.batch_sharding(engine.mesh, len(shape), rows))  # noqa: E731
    ops = [per_row((rows,), jnp.int32), per_row((rows, 2), jnp.uint32), per_row((rows,), jnp.int32)]
    ops += [per_row((rows,), jnp.bool_), per_row((rows,), jnp.int32)]
    eos = mpp.sds((2,), jnp.int32, NamedSharding(engine.mesh, P()))
    return fn, (pc, *ops, eos)


def started_state(
    engine: RolloutEngine, am: mpp.AbstractModels, sp: Any, pc: Any, rows: int, cache: int
) -> Any:
    """The decode state of `rows` rows at cache bucket `cache` as `start_rows` lays it out (abstract)."""
    fn, args = start_program(engine, am, sp, pc, rows, cache)
    state = jax.eval_shape(fn, *args)
    return mpp.with_shardings(state, shd.shard_pytree_batch(state, engine.mesh))


def rollout_keys(config: mlc.ConfigDict, shape: RolloutShape) -> list[tuple]:
    """The keys of the planned programs, in the order of a capped rollout (module docstring); a start of
    inserted rows is tagged "insert" (the running batch is alive beside it)."""
    d, prompts = shape.data, int(config.rl.prompts_per_step)
    first = shape.cap * d
    spec = config_schema.section(config, "spot")
    tv = int(shape.sd_mode.rsplit("_", 1)[-1])
    keys = [("prompts", prompts, shape.prompt_len), ("start", first, shape.first_cache)]
    for k in shape.insert_rows:
        keys += [
            ("start", k * d, shape.first_cache, "insert"),
            ("insert", first, k * d, shape.top_cache, shape.first_cache),
        ]
    return keys + [
        ("chunk", first, shape.top_cache, 1, ()),
        ("chunk", shape.tail_rows * d, shape.top_cache, tv, (shape.sd_mode,)),
        ("drafter_step", spec.rows, spec.seq_len),
    ]


def compile_rollout_program(
    key: tuple, config: mlc.ConfigDict, engine: RolloutEngine, am: mpp.AbstractModels, shape: RolloutShape
) -> ProgramInfo:
    """One program of `rollout_keys` compiled for `am` (any depth and dtype)."""
    sp = config_schema.section(config, "rollout").sampling()
    prompts = int(config.rl.prompts_per_step)
    if key[0] == "prompts":
        return mpp.compile_info(key, *prompt_cache_program(engine, am, prompts, shape.prompt_len))
    if key[0] == "drafter_step":
        return dataclasses.replace(mpp.compile_drafter_step(config, am, engine.mesh), key=key)
    pc = abstract_prompt_cache(engine, am, prompts, shape.prompt_len)
    if key[0] == "start":
        return mpp.compile_info(key, *start_program(engine, am, sp, pc, key[1], key[2]))
    state = started_state(engine, am, sp, pc, key[1], shape.top_cache if key[0] == "insert" else key[2])
    if key[0] == "insert":
        new = started_state(engine, am, sp, pc, key[2], shape.first_cache)
        slots = mpp.sds((key[2],), jnp.int32, shd.batch_sharding(engine.mesh, 1, key[2]))
        fn = spmd.insert_program(engine.mesh, state, new, engine._constrain)
        return mpp.compile_info(key, fn, (state, new, slots), donate=(0,))
    info = mpp.compile_chunk(engine, am, sp, state, key[4][0] if key[4] else "plain")
    return dataclasses.replace(info, key=key)


def live_bytes(
    config: mlc.ConfigDict, engine: RolloutEngine, cfg: ModelConfig, shape: RolloutShape
) -> dict[str, int]:
    """Per-device bytes of what a capped rollout keeps alive beside its programs (eval_shape only): the
    prompt cache (the whole rollout) and the running batch at the cap and the top cache bucket."""
    am = mpp.abstract_models(cfg, engine.mesh, spec=config_drafter_spec(config, cfg))
    sp = config_schema.section(config, "rollout").sampling()
    pc = abstract_prompt_cache(engine, am, int(config.rl.prompts_per_step), shape.prompt_len)
    running = started_state(engine, am, sp, pc, shape.cap * shape.data, shape.top_cache)
    return {
        "prompt_cache": bytes_per_device(pc),
        "running": bytes_per_device(running),
        "recorded_hidden": bytes_per_device(running.out_hidden),  # part of "running"
    }


def recorded_bytes_per_row(config: mlc.ConfigDict, cfg: ModelConfig) -> int:
    """Bytes of one running row's recorded hidden states per device for the RL config (0 when nothing records
    them: neither the spot trainer nor `rollout.record_hidden`)."""
    ro = config_schema.section(config, "rollout")
    if not (ro.record_hidden or config.spot.mode != "off"):
        return 0
    width = states_width(cfg.hidden_size, spec_aux_layers(config_drafter_spec(config, cfg)))  # EAGLE-3: 4H
    return admission.hidden_bytes_per_row(ro.hidden_window, ro.max_new_tokens, width, cfg.dtype)


def host_hidden(config: mlc.ConfigDict, cfg: ModelConfig, shape: RolloutShape) -> dict[str, float]:
    """GiB of recorded states on the host per process: `kept`, what a rollout kept for `Rollout.hidden` until
    it returned (every row of the step; what the harvester held before the states streamed), and `harvest`,
    the most one harvest holds now (every running row of the mesh finishing in one chunk; fetched rows
    reach every process)."""
    per_row = recorded_bytes_per_row(config, cfg)
    rows = int(config.rl.prompts_per_step) * int(config.rl.samples_per_prompt)
    return {"kept": rows * per_row / GIB, "harvest": shape.cap * shape.data * per_row / GIB}


def hidden_line(config: mlc.ConfigDict, cfg: ModelConfig, shape: RolloutShape, live: dict[str, int]) -> str:
    """The recorded hidden states of the running batch in words: per row and per device at the cap, at the
    configured `rollout.hidden_window` and, for scale, at 512 tokens and at the whole response."""
    ro = config_schema.section(config, "rollout")
    width = states_width(cfg.hidden_size, spec_aux_layers(config_drafter_spec(config, cfg)))
    per_row = lambda w: admission.hidden_bytes_per_row(w, ro.max_new_tokens, width, cfg.dtype)  # noqa: E731
    at = lambda w: f"{per_row(w) / 2**20:.1f} MiB per row, {shape.cap * per_row(w) / GIB:.2f} GiB"  # noqa: E731
    host = host_hidden(config, cfg, shape)
    return (
        f"recorded hidden states (rollout.hidden_window={ro.hidden_window} of {ro.max_new_tokens} response "
        f"tokens, span {ro.hidden_span}, {width} values per token, {cfg.dtype}): {at(ro.hidden_window)} per "
        f"device at the cap of {shape.cap} rows (compiled: {live['recorded_hidden'] / GIB:.2f} GiB, part of "
        f"the running batch; counted in the cap); at 512: {at(512)}; the whole response: "
        f"{at(ro.max_new_tokens)}; host per process: <= {host['harvest']:.2f} GiB per harvest (streamed; "
        f"a rollout kept {host['kept']:.2f} GiB before)"
    )


def warmup_memory(config: mlc.ConfigDict, cfg: ModelConfig) -> dict[str, float]:
    """GiB of the drafter warm-up's generation (`config.generation`, one device, no drafter) for the target
    `cfg`: weights, per running row the KV cache at the engine's top cache bucket and the recorded hidden
    states of a whole response, the running-rows cap the budget gives to both (`admission.running_rows_cap`,
    as the engine picks it), the running rows and the prompt cache of one engine call on the device, and on
    the host the most one harvest holds (the states stream to `warmup_data.RecordedSamples`: every running
    row finishing at once), an engine call's states were it to keep them (`host_call`, what it held
    before) and the kept samples (float16, cut to `forward.seq_len`)."""
    gen = config_schema.section(config, "generation")
    fw = config_schema.section(config, "forward")
    ec = EngineConfig(max_new_tokens=gen.max_new_tokens, max_cache_len=gen.max_cache_len)
    top = RolloutEngine(Transformer(tiny_config("qwen2"), nnx.Rngs(0)), ec, [0]).top_cache_bucket()
    per_token = admission.kv_bytes_per_token(cfg, 1)
    h = admission.hidden_bytes_per_row(gen.max_new_tokens, gen.max_new_tokens, cfg.hidden_size, cfg.dtype)
    h = h if gen.record_hidden else 0
    cap, _ = admission.running_rows_cap(gen.max_running_rows, gen.kv_budget_gib, per_token, top, h)
    rows = gen.batch_prompts * gen.n
    cap = min(cap or rows, rows)
    room = gen.max_cache_len - gen.max_new_tokens
    weights = bytes_per_device(mpp.abstract_models(cfg, shd.make_mesh(1, 1, jax.devices()[:1])).params)
    out = dict(
        weights=weights,
        kv_per_row=per_token * top,
        hidden_per_row=h,
        running=cap * (per_token * top + h),
        prompt_cache=gen.batch_prompts * room * (per_token + cfg.hidden_size * jnp.dtype(cfg.dtype).itemsize),
        host_harvest=cap * h,
        host_call=rows * h,
        host_samples=gen.num_prompts * gen.n * fw.seq_len * cfg.hidden_size * 2,
    )
    return {"cap_rows": float(cap), "top_cache": float(top), **{k: v / GIB for k, v in out.items()}}


def rollout_needs(
    infos: dict[tuple, ProgramInfo], res: dict[str, int], live: dict[str, int]
) -> dict[tuple, dict[str, int]]:
    """Per program: arguments, footprint (temporaries + non-aliased outputs + code), the live state outside
    its arguments (`ROLLOUT_OUTSIDE`; the prompt cache beside every program after the one that builds it; the
    running batch beside an insert's start) and the need (their sum); and the composed spot
    tick (module docstring)."""
    resident = sum(res[k] for k in ROLLOUT_OUTSIDE)
    out: dict[tuple, dict[str, int]] = {}
    for key, i in infos.items():
        if key[0] == "drafter_step":
            continue
        # the starts take the cache as an argument, but jit drops the parts they do not read (the prompts'
        # recorded hidden states): counted whole here, its KV twice (<= the cache's size, conservative)
        extra = resident + (0 if key[0] == "prompts" else live["prompt_cache"])
        extra += live["running"] if key[-1] == "insert" and key[0] == "start" else 0
        out[key] = dict(args=i.argument_bytes, temps=i.footprint_bytes, outside=extra)
    step = next(i for k, i in infos.items() if k[0] == "drafter_step")
    chunks = [k for k in out if k[0] == "chunk"]
    worst = max(chunks, key=lambda k: sum(out[k].values()))
    embed_head = res["engine_params"] - res["engine_rest"]
    batch = max(step.argument_bytes - res["drafter_state"] - embed_head, 0)
    tick = dict(out[worst])
    tick["args"] += batch
    tick["temps"] += step.footprint_bytes
    out[("spot_tick",)] = tick
    for v in out.values():
        v["need"] = v["args"] + v["temps"] + v["outside"]
    return out


def rollout_label(key: tuple) -> str:
    """A readable program name for the rollout table."""
    labels = {
        "prompts": lambda: f"prompt cache: {key[1]} prompts x {key[2]}",
        "start": lambda: f"start {key[1]} rows{' (insert)' if key[-1] == 'insert' else ''}, cache {key[2]}",
        "insert": lambda: f"insert {key[2]} rows into {key[1]}, cache {key[3]}",
        "spot_tick": lambda: "spot tick (composed: the larger chunk + drafter step)",
        "drafter_step": lambda: f"drafter step {key[1]} x {key[2]}",
    }
    return labels[key[0]]() if key[0] in labels else mpp.label(key)


def with_depth(cfg: ModelConfig, dtype: str, layers: int | None = None) -> ModelConfig:
    """`cfg` in `dtype` with `layers` decoder layers (None: its own)."""
    return cfg.replace(dtype=dtype, num_layers=cfg.num_layers if layers is None else layers)


def compile_all(
    config: mlc.ConfigDict, engine: RolloutEngine, cfg: ModelConfig, shape: RolloutShape, keys: list[tuple]
) -> dict[tuple, ProgramInfo]:
    """Every program of `keys` for the target of `cfg` on the engine's mesh."""
    am = mpp.abstract_models(cfg, engine.mesh, spec=config_drafter_spec(config, cfg))
    return {k: compile_rollout_program(k, config, engine, am, shape) for k in keys}
