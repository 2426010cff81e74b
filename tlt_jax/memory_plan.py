"""The programs of an RL step compiled ahead of time from abstract shapes.

Used by experiments/models/memory_plans.py (also its `--responses` plan of the update at full depth),
tlt_jax/rollout_memory_plan.py (its `--rollout` plan of the paper's rollout at the running-rows cap),
tests/test_tpu_lowering.py and configs/qwen2_5_7b_tpu.py.

Nothing is materialised: weights, caches and batches are `jax.ShapeDtypeStruct`s carrying the shardings the
real run gives them (the rollout engine's parameter layout, the trainer's, batch-sharded decode state,
micro-batches split over the data axis), and every program is lowered and compiled for the mesh's devices by
`ProgramCache.compile`, whose `ProgramInfo` holds XLA's per-device accounting (arguments, outputs, aliased
outputs, temporaries, generated code).

The programs are the library's own bodies, not copies: rollout programs come from a layout's engine
(`layout_engine`) built over a tiny stand-in model of the same family, whose mode registry,
program groups, buckets and chunk bodies (`RolloutEngine.chunk_program` / `_chunk_fn`) are used with the
target's and drafter's graph definitions swapped in; the policy update is `PolicyTrainer`'s accumulation /
apply / log-prob functions on a trainer assembled without parameters (`abstract_trainer`); the drafter step is
`drafter.trainer.train_step`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax import config_lib, config_schema
from tlt_jax import sharding as shd
from tlt_jax.drafter import trainer as dtr
from tlt_jax.drafter.packing import PackedBatch
from tlt_jax.models.build import model_config_from
from tlt_jax.models.config import ModelConfig, tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.eagle3 import config_drafter_spec, drafter_from_spec, spec_aux_layers, states_width
from tlt_jax.models.llama import Transformer
from tlt_jax.models.random_init import abstract_params, bytes_per_device
from tlt_jax.rl import trainer as rtr
from tlt_jax.rl.batch import TrainBatch
from tlt_jax.rl.config import abstract_policy_trainer
from tlt_jax.rollout import decode
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.programs import ProgramCache, ProgramInfo, memory_fields
from tlt_jax.rollout.types import DecodeState


def register_modes(engine: RolloutEngine, names: list[str]) -> list[str]:
    """Register "ngram_<strategy>" / "<strategy>" (EAGLE) modes; returns the engine's mode names."""
    out = []
    for name in names:
        if name.startswith("ngram_"):
            out.append(engine.add_mode("ngram", name.removeprefix("ngram_")))
        else:
            out.append(engine.add_mode("eagle", name))
    return out


def layout_engine(
    layout: str,
    model: Transformer,
    ecfg: EngineConfig,
    names: list[str],
    single: str,
    drafter: Drafter | None,
    draft_vocab: np.ndarray | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> RolloutEngine:
    """The engine of one layout: programs shared by tokens_to_verify except in "naive"; every strategy of
    `names` registered except in "single" (only `single`)."""
    ecfg = dataclasses.replace(ecfg, share_programs=layout != "naive")
    engine = RolloutEngine(model, ecfg, eos_ids=[], drafter=drafter, draft_vocab=draft_vocab, mesh=mesh)
    register_modes(engine, [single] if layout == "single" else names)
    return engine


@dataclasses.dataclass(frozen=True)
class AbstractModels:
    """A target and its EAGLE drafter as graph definitions + sharded abstract parameters (engine layout)."""

    cfg: ModelConfig
    graphdef: Any
    params: Any
    dgraphdef: Any
    dparams: Any
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: the target states the drafter reads (and the rollout records)


def abstract_models(
    cfg: ModelConfig, mesh: Any, layers: int | None = None, spec: Mapping[str, Any] | None = None
) -> AbstractModels:
    """The target of `cfg` (with `layers` decoder layers if given) and its drafter (`spec`: a
    `config_drafter_spec`, EAGLE-1 by default; EAGLE-3's target also returns its aux layers' states),
    nothing materialised; `mesh` may be an `AbstractMesh` (resident-state accounting for meshes larger than
    this machine's)."""
    cfg = cfg if layers is None else cfg.replace(num_layers=layers)
    aux = spec_aux_layers(spec)
    shard = functools.partial(shd.param_shardings, mesh=mesh)
    graphdef, params = abstract_params(lambda: Transformer(cfg, nnx.Rngs(0), aux_layers=aux), shard)
    make = lambda: drafter_from_spec(spec or {"arch": "eagle"}, cfg, nnx.Rngs(1))  # noqa: E731
    dgraphdef, dparams = abstract_params(make, shard)
    return AbstractModels(cfg, graphdef, params, dgraphdef, dparams, aux)


def sds(shape: tuple[int, ...], dtype: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def with_shardings(tree: Any, shardings: Any) -> Any:
    """Abstract leaves of `tree` carrying `shardings` (a matching pytree, or one sharding for all)."""
    if not isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), tree, shardings)
    return jax.tree.map(lambda x: sds(x.shape, x.dtype, shardings), tree)


def compile_info(
    key: tuple,
    fn: Any,
    args: tuple,
    donate: tuple[int, ...] = (),
    options: Mapping[str, object] | None = None,
) -> ProgramInfo:
    """Compile `fn` for the abstract `args` (a fresh cache: nothing is kept); the program's `ProgramInfo`,
    keyed `key` (without the arguments' signature). `options`: XLA compiler options of this compile alone
    (e.g. tests/experiments/test_memory_plans.py's cheaper CPU code generator; None: the process's)."""
    if options:
        t0 = time.perf_counter()
        jitted = jax.jit(fn, donate_argnums=donate, compiler_options=dict(options))
        compiled = jitted.lower(*args).compile()
        return ProgramInfo(key, time.perf_counter() - t0, **memory_fields(compiled))
    cache = ProgramCache()
    cache.compile(key, fn, args, donate)
    return dataclasses.replace(cache.infos()[0], key=key)


# ---- rollout ---------------------------------------------------------------------------------------------


def stand_in_engine(
    layout: str, config: mlc.ConfigDict, mesh: Mesh, names: list[str], single: str
) -> RolloutEngine:
    """A layout's engine over a tiny Qwen2 stand-in: the config's engine settings (with the rollout's hidden
    states recorded, as the spot trainer needs), the layout's modes and program groups, the mesh."""
    ecfg = dataclasses.replace(config_lib.engine_config_from(config, "none"), record_hidden=True)
    tiny = tiny_config("qwen2")
    drafter = Drafter(tiny, nnx.Rngs(1))
    return layout_engine(layout, Transformer(tiny, nnx.Rngs(0)), ecfg, names, single, drafter, mesh=mesh)


def prefill_program(engine: RolloutEngine, am: AbstractModels, sp: Any, cache: int) -> decode.PrefillProgram:
    """The engine's prefill / row-start description (`RowPrograms.prefill_program`) for the real target and
    drafter (the stand-in's graphs swapped out)."""
    prog = engine.prefill_program(sp, cache, engine.config.max_new_tokens)
    return dataclasses.replace(
        prog, target=am.graphdef, drafter=am.dgraphdef if prog.drafter is not None else None
    )


def _prefill_args(
    engine: RolloutEngine, am: AbstractModels, rows: int, prompts: int, prompt_len: int
) -> tuple:
    """Abstract operands of the prefill, sharded as `RolloutEngine.prefill` places them."""
    mesh, use_drafter = engine.mesh, engine.needs()[0]
    rep = NamedSharding(mesh, P())
    per_row = lambda shape, dt: sds(shape, dt, shd.batch_sharding(mesh, len(shape), rows))  # noqa: E731
    return (
        am.params,
        am.dparams if use_drafter else None,
        sds((prompts, prompt_len), jnp.int32, rep),
        sds((prompts,), jnp.int32, rep),
        per_row((rows,), jnp.int32),
        per_row((rows, 2), jnp.uint32),
        per_row((rows,), jnp.int32),
        per_row((rows,), jnp.bool_),
        per_row((rows,), jnp.int32),
        sds((2,), jnp.int32, rep),
    )


def prefill_cache_bucket(engine: RolloutEngine, prompt_len: int) -> int:
    """The cache bucket rows of `prompt_len`-token prompts start in (`RowPrograms.start_cache_len`)."""
    return engine.start_cache_len(prompt_len, prompt_len, engine.config.max_new_tokens)


def abstract_state(
    engine: RolloutEngine, am: AbstractModels, sp: Any, rows: int, cache: int, prompt_len: int
) -> DecodeState:
    """The decode state of `rows` rows at cache bucket `cache`, sharded as the engine keeps it."""
    prog = prefill_program(engine, am, sp, cache)
    args = _prefill_args(engine, am, rows, min(rows, 8), prompt_len)
    state, _ = jax.eval_shape(functools.partial(decode.prefill, prog), *args)
    return with_shardings(state, shd.shard_pytree_batch(state, engine.mesh))


def compile_prefill(
    engine: RolloutEngine, am: AbstractModels, sp: Any, rows: int, prompts: int, prompt_len: int
) -> ProgramInfo:
    """The prefill of `prompts` unique prompts into `rows` rows (the engine's program)."""
    prog = prefill_program(engine, am, sp, prefill_cache_bucket(engine, prompt_len))

    def fn(*args: Any) -> tuple:
        state, hidden = decode.prefill(prog, *args)
        return jax.lax.with_sharding_constraint(state, shd.shard_pytree_batch(state, engine.mesh)), hidden

    key = ("prefill", rows, prog.cache_len, prompts, prompt_len)
    return compile_info(key, fn, _prefill_args(engine, am, rows, prompts, prompt_len))


def compile_chunk(
    engine: RolloutEngine, am: AbstractModels, sp: Any, state: DecodeState, mode: str
) -> ProgramInfo:
    """The chunk program of `mode` ("plain" or a registered mode) on `state`, as `decode_chunk` compiles it
    (same body, key fields and donation; the real target's and drafter's graphs swapped in)."""
    prog = engine.chunk_program(mode, sp)
    prog = dataclasses.replace(
        prog, target=am.graphdef, drafter=am.dgraphdef if prog.drafter is not None else None
    )
    rep = NamedSharding(engine.mesh, P())
    scalar = sds((), jnp.int32, rep)
    dparams = am.dparams if prog.drafter is not None else None
    args = (am.params, dparams, state, sds((2,), jnp.int32, rep), None, None, scalar, scalar)
    tv = prog.modes[0].strategy.tokens_to_verify if prog.modes else 1
    key = ("chunk", state.done.shape[0], state.cache.capacity, tv, tuple(m.name for m in prog.modes))
    return compile_info(key, engine._chunk_fn(prog), args, donate=(2, 4))


# ---- policy update ---------------------------------------------------------------------------------------


def abstract_trainer(config: mlc.ConfigDict, am: AbstractModels, mesh: Any) -> rtr.PolicyTrainer:
    """The learner's `PolicyTrainer` for the abstract target: its layouts and optimizer as the learner builds
    them, float32 masters and AdamW state as sharded `ShapeDtypeStruct`s (`PolicyTrainer.abstract`)."""
    job = config_schema.parse(config, check_paths=False, check_model=False)
    return abstract_policy_trainer(job, am.graphdef, am.params, am.cfg, mesh)


def abstract_micro(
    config: mlc.ConfigDict, mesh: Mesh, prompt_len: int, response_len: int
) -> tuple[TrainBatch, Any]:
    """One part of a mini-batch as `PolicyTrainer.put_micro` lays it out ([K, G/K, ...], groups over the
    data axis; sub-groups of micro_batch_size samples when that is less than a group: `batch.regroup`) and
    its per-micro-batch weights."""
    rl = config.rl
    micro = int(config.trainer.micro_batch_size)
    n = min(int(rl.samples_per_prompt), micro)
    k = int(rl.prompts_per_step) * int(rl.samples_per_prompt) // int(rl.mini_batches) // micro
    g = micro // n
    shapes = TrainBatch(
        prompt=((k, g, prompt_len), jnp.int32),
        prompt_len=((k, g), jnp.int32),
        response=((k, g, n, response_len), jnp.int32),
        response_mask=((k, g, n, response_len), jnp.float32),
        advantages=((k, g, n), jnp.float32),
        old_logp=((k, g, n, response_len), jnp.float32),
        ref_logp=((k, g, n, response_len), jnp.float32),
    )
    leaf = lambda sd: isinstance(sd, tuple) and isinstance(sd[0], tuple)  # noqa: E731
    batch = jax.tree.map(
        lambda sd: sds(sd[0], sd[1], rtr._micro_spec(mesh, jax.ShapeDtypeStruct(*sd))), shapes, is_leaf=leaf
    )
    return batch, sds((k,), jnp.float32, NamedSharding(mesh, P()))


def compile_update(
    config: mlc.ConfigDict,
    am: AbstractModels,
    mesh: Mesh,
    prompt_len: int,
    response_len: int,
    logprobs: bool = True,
    options: Mapping[str, object] | None = None,
) -> list[ProgramInfo]:
    """The policy update's programs: at `response_len` the accumulation over one part (forward + backward of
    every micro-batch, the gradient buffer donated) and (`logprobs`) the log-prob forward (old / reference
    log-probs); with response_len 0 the optimizer's apply. Each with the out-shardings `PolicyTrainer` gives
    it; `options`: `compile_info`'s."""
    t = abstract_trainer(config, am, mesh)
    masters, opt = t.params, t.opt_state
    pin = lambda tree: jax.lax.with_sharding_constraint(tree, t.param_shardings)  # noqa: E731

    def accum(p: Any, acc: Any, m: TrainBatch, w: Any) -> tuple:
        acc, aux = t._accum_fn(p, acc, m, w)
        return pin(acc), aux

    def apply(p: Any, o: Any, g: Any) -> tuple:
        p, o, norms = t._apply_fn(p, o, g)
        return pin(p), jax.lax.with_sharding_constraint(o, t.opt_shardings), norms

    if not response_len:
        return [compile_info(("update_apply",), apply, (masters, opt, masters), (0, 1), options=options)]
    micro, weights = abstract_micro(config, mesh, prompt_len, response_len)
    args = (masters, masters, micro, weights)
    out = [compile_info(("update_accum", response_len), accum, args, (1,), options=options)]
    if logprobs:
        key = ("logprobs", response_len)
        out.append(compile_info(key, t._logprobs_fn, (masters, micro), options=options))
    return out


def one_device_update(config: mlc.ConfigDict, rows: int = 2) -> mlc.ConfigDict:
    """A copy of `config` whose update runs on one device: one mini-batch of one prompt x `rows` samples,
    one micro-batch of `rows` rows; the trainer's layout (scan, remat, chunks, dtypes) as configured. The
    update micro-step a single GPU can hold at 7B (the GPU suite's `update_7b` runs it), so XLA:GPU's plan
    and its measured peak can be set beside XLA:CPU's plan of the same program (issue #45)."""
    c = mlc.ConfigDict(config.to_dict())
    c.mesh.data, c.mesh.model = 1, 1
    c.rl.prompts_per_step, c.rl.samples_per_prompt, c.rl.mini_batches = 1, rows, 1
    c.trainer.micro_batch_size = rows
    return c


def update_plan(
    config: mlc.ConfigDict, mesh: Mesh, prompt_len: int, response_lens: list[int]
) -> tuple[dict[tuple, ProgramInfo], dict[str, int]]:
    """The update's programs compiled at the model's full depth (the trainer's layers under `lax.scan`: no
    per-layer extrapolation) for each response length, the optimizer's apply, and the resident state."""
    cfg = model_config_from(config)
    am = abstract_models(cfg, mesh, spec=config_drafter_spec(config, cfg))
    infos = {("update_apply",): compile_update(config, am, mesh, prompt_len, 0)[0]}
    for nb in response_lens:
        infos.update({i.key: i for i in compile_update(config, am, mesh, prompt_len, nb)})
    return infos, resident(config, cfg, mesh)


def update_compile_seconds(
    config: mlc.ConfigDict, mesh: Mesh, prompt_len: int, response_len: int, layers: int, scan: bool
) -> float:
    """Seconds to trace, lower and compile the update's accumulation (one part of micro-steps) from abstract
    shapes at `layers` decoder layers, the layers scanned or unrolled (`trainer.scan_layers`)."""
    config = mlc.ConfigDict(config.to_dict())
    config.trainer.scan_layers = scan
    am = abstract_models(model_config_from(config), mesh, layers)
    return compile_update(config, am, mesh, prompt_len, response_len, logprobs=False)[0].compile_seconds


UPDATE_OUTSIDE = ("optimizer", "engine_params", "engine_drafter", "reference", "drafter_state")


def update_table(infos: dict[tuple, ProgramInfo], res: dict[str, int], limit_gib: float) -> tuple[list, dict]:
    """(table lines, RESULT items) of `update_plan`: per program GiB per device of arguments, outputs not
    aliased, temporaries and the need (those + code + the resident state outside its arguments: the engine's
    weights and drafter, the reference, the drafter's train state, and AdamW's moments except in the apply,
    which takes them); `fits_72gib` when every need is within `limit_gib`."""
    g = lambda b: b / 2**30  # noqa: E731
    lines = [f"{'program':<24} {'args':>7} {'out':>7} {'temp':>7} {'resident':>8} {'need':>7}"]
    out: dict[str, object] = {}
    for key, i in infos.items():
        outside = [k for k in UPDATE_OUTSIDE if not (key[0] == "update_apply" and k == "optimizer")]
        rest = sum(res[k] for k in outside)
        need = i.argument_bytes + i.footprint_bytes + rest
        fresh = max(i.output_bytes - i.alias_bytes, 0)
        lines.append(
            f"{label(key):<24} {g(i.argument_bytes):7.2f} {g(fresh):7.2f} {g(i.temp_bytes):7.2f} "
            f"{g(rest):8.2f} {g(need):7.2f}"
        )
        out["_".join(map(str, key)) + "_gib"] = round(g(need), 2)
    lines.append("resident per device (GiB): " + ", ".join(f"{k} {g(v):.2f}" for k, v in res.items()))
    out["fits_72gib"] = "yes" if max(v for v in out.values()) <= limit_gib else "no"
    return lines, out


# ---- drafter ---------------------------------------------------------------------------------------------


def compile_drafter_step(config: mlc.ConfigDict, am: AbstractModels, mesh: Mesh) -> ProgramInfo:
    """One optimizer step of the spot trainer on one packed micro-batch (`config.spot` shapes): the drafter's
    train state replicated, the target's embedding and head as the engine holds them."""
    spot = config_schema.section(config, "spot")
    tx, loss_cfg = spot.optimizer(), spot.loss_config()
    rep = NamedSharding(mesh, P())

    def init(p: Any) -> dtr.TrainState:
        return dtr.TrainState(jnp.zeros((), jnp.int32), p, tx.init(p), jax.random.key(0))

    state = with_shardings(jax.eval_shape(init, am.dparams), rep)
    r, s, h = spot.rows, spot.seq_len, states_width(am.cfg.hidden_size, am.aux_layers)  # [aux ; final]
    batch = PackedBatch(
        tokens=sds((r, s), jnp.int32, rep),
        hidden=sds((r, s, h), jnp.float32, rep),
        segment_ids=sds((r, s), jnp.int32, rep),
        positions=sds((r, s), jnp.int32, rep),
        loss_mask=sds((r, s), jnp.bool_, rep),
    )
    embed = jax.tree.leaves(am.params["embed"])[0]
    head = embed if am.cfg.tie_embeddings else jax.tree.leaves(am.params["lm_head"])[0]
    fn = functools.partial(dtr.train_step, graphdef=am.dgraphdef, tx=tx, loss_cfg=loss_cfg)
    return compile_info(("drafter_step", r, s), fn, (state, batch, embed, head), (0,))


# ---- resident state ----------------------------------------------------------------------------------


def resident(config: mlc.ConfigDict, cfg: Any, mesh: Any) -> dict[str, int]:
    """Per-device bytes of the state that lives through a whole step, at full depth (exact: abstract
    shardings): the engine's weights (bf16, its layout) and drafter, the trainer's float32 masters, AdamW
    moments and (with a KL term) reference weights, the spot trainer's
    drafter state (replicated)."""
    am = abstract_models(cfg, mesh, spec=config_drafter_spec(config, cfg))
    t = abstract_trainer(config, am, mesh)
    masters, opt = t.params, t.opt_state
    embed = jax.tree.leaves(am.params["embed"])
    head = [] if cfg.tie_embeddings else jax.tree.leaves(am.params["lm_head"])
    spot = config_schema.section(config, "spot")
    rep = NamedSharding(mesh, P())
    dstate = jax.eval_shape(lambda p: (p, spot.optimizer().init(p)), am.dparams)
    ref = bytes_per_device(masters) * jnp.dtype(cfg.dtype).itemsize // 4
    return {
        "engine_params": bytes_per_device(am.params),
        "engine_rest": bytes_per_device(am.params) - bytes_per_device(embed + head),
        "engine_drafter": bytes_per_device(am.dparams),
        "masters": bytes_per_device(masters),
        "optimizer": bytes_per_device(opt),
        "reference": ref if float(config.rl.kl_coef) > 0 or float(config.rl.reward_kl_coef) > 0 else 0,
        "drafter_state": bytes_per_device(with_shardings(dstate, rep)),
    }


def resident_gib(config: mlc.ConfigDict, data: int, model: int) -> float:
    """GiB per device of the resident state (`resident`; the engine's weights counted once) of the config's
    architecture on an abstract data x model mesh: computed from shapes, no device needed."""
    mesh = AbstractMesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    r = resident(config, model_config_from(config), mesh)
    return sum(v for k, v in r.items() if k != "engine_rest") / 2**30


def best_mesh(config: mlc.ConfigDict, devices: int) -> tuple[float, int, int]:
    """(GiB per device, data, model) of the `devices`-chip mesh with the least resident state; the model axis
    divides the KV heads (and the chips). What a slice too small for the config is refused with."""
    heads = model_config_from(config).num_kv_heads
    axes = [m for m in range(1, devices + 1) if devices % m == 0 and heads % m == 0]
    return min((resident_gib(config, devices // m, m), devices // m, m) for m in axes)


# ---- reporting ---------------------------------------------------------------------------------------


def label(key: tuple) -> str:
    """A readable program name."""
    if key[0] == "prefill":
        return f"prefill {key[3]} prompts x {key[4]} -> {key[1]} rows, cache {key[2]}"
    if key[0] == "chunk":
        what = "plain" if not key[4] else f"sd tv={key[3]} {'+'.join(key[4])}"
        return f"{what} b={key[1]} cache={key[2]}"
    return " ".join(str(k) for k in key)


def dump(name: str, out: pathlib.Path, measured: dict) -> None:
    """The raw XLA accounting of every compile (dtype, layers, program) as JSON in --out."""
    rows = [
        {"dtype": dt, "layers": depth, "program": label(k), **dataclasses.asdict(i) | {"key": repr(k)}}
        for (dt, depth), infos in measured.items()
        for k, i in infos.items()
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"measured_{name}.json").write_text(json.dumps(rows, indent=1))
