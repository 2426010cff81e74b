"""Every program one TLT RL step compiles lowers for a TPU (issue #28), checked on this CPU-only machine.

`jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",))` lowers without a TPU; an op, a custom call or a
sharding the TPU cannot take fails there (a CPU FFI kernel, a host callback, a Mosaic kernel GSPMD would have
to partition). Nothing is compiled or run: the arguments are abstract (`jax.ShapeDtypeStruct`s with the
shardings the run gives them) and the bodies are the library's own, built as
`tlt_jax/memory_plan.py` builds them for the memory plans (its `compile_info` swapped for a TPU
lowering): the smoke config's model over a data x model = 2 x 2 mesh of fake CPU devices; the rollout's
prefill, plain chunk and speculative chunks (EAGLE chain and tree, n-gram) from a layout engine; the policy
update's accumulation, apply and log-prob programs (`PolicyTrainer`); the spot trainer's optimizer step
(`drafter.trainer.train_step`). The spot trainer's fused tick (`rollout/spmd.py`: the decode chunk on busy
devices, drafter micro-steps on idle ones) needs a mesh without a model axis, so it lowers over data = 4.

Attention: "reference" (jnp) and "pallas_tpu" (the Mosaic kernel `tree_attention(impl="auto")` picks on a
TPU). Off a TPU the engine runs the Mosaic kernel in Pallas's interpreter, so the Pallas variant is traced
as on a TPU backend (`tree_attention._on_tpu` patched, in-memory traces cleared around it). Inside the tick's
`shard_map` the kernel is a `tpu_custom_call`; in the automatically partitioned prefill and chunk programs it
sits behind its partitioning rule (`kernels/tree_attention_sharding.py`: a `CustomSPMDPartitioning` call
whose per-device body, the Mosaic kernel on its rows and heads, XLA's partitioner asks JAX for when it
compiles); without that rule Mosaic refused to lower there ("Mosaic kernels cannot be automatically
partitioned").
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax import config_lib
from tlt_jax import memory_plan as mpp
from tlt_jax import sharding as shd
from tlt_jax.drafter.packing import DrafterSample
from tlt_jax.drafter.spot_trainer import SpotConfig, SpotTrainer
from tlt_jax.kernels import tree_attention as ta
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout import spmd
from tlt_jax.rollout.ngram import NgramBank

ROOT = pathlib.Path(__file__).resolve().parents[1]
STRATEGIES = ["3_1_4", "2_2_4", "ngram_3_1_4"]  # EAGLE chain, EAGLE tree, n-gram chain
ROWS, PROMPTS, PROMPT_LEN, RESPONSE_LEN = 4, 2, 8, 16
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([\w.$-]+)")
# CustomSPMDPartitioning: jax's custom_partitioning, expanded by the SPMD partitioner on any backend
_TPU_OK = {
    "tpu_custom_call",
    "CustomSPMDPartitioning",
    "Sharding",
    "SPMDFullToShardShape",
    "SPMDShardToFullShape",
}


def smoke(attn_impl: str, data: int, model: int) -> dict[str, Any]:
    """The smoke config (spot trainer on idle devices, tiny windows) over a data x model mesh of the first
    data * model devices: its model, the abstract target and drafter, a layout engine with every strategy."""
    config = config_lib.load_config_file(ROOT / "configs" / "smoke.py")
    config.mesh.data, config.mesh.model = data, model
    config.rollout.attn_impl = attn_impl
    config.spot.update(mode="idle_devices", window=16, context=16, ce_tokens=16, ttt_positions=8)
    mesh = shd.make_mesh(data=data, model=model, devices=jax.devices()[: data * model])
    # as `build_model_and_tokenizer` builds `config.model.random`; XLA projections (what a TPU runs)
    cfg = ModelConfig(**{**dict(config.model.random), "dtype": config.model.dtype, "linear_impl": "xla"})
    drafter = Drafter(cfg, nnx.Rngs(1))
    ecfg = config_lib.engine_config_from(config, "none")
    engine = mpp.layout_engine(
        "naive", Transformer(cfg, nnx.Rngs(0)), ecfg, STRATEGIES, STRATEGIES[0], drafter, mesh=mesh
    )
    am = mpp.abstract_models(cfg, mesh)
    sp = config_lib.sampling_from(config)
    state = mpp.abstract_state(engine, am, sp, ROWS, mpp.prefill_cache_bucket(engine, PROMPT_LEN), PROMPT_LEN)
    return dict(config=config, mesh=mesh, cfg=cfg, drafter=drafter, engine=engine, am=am, sp=sp, state=state)


class TpuLowering:
    """`mpp.compile_info`'s stand-in: lowers for a TPU and keeps {program key: StableHLO text}."""

    def __init__(self) -> None:
        self.texts: dict[tuple, str] = {}

    def __call__(
        self, key: tuple, fn: Any, args: tuple, donate: tuple[int, ...] = (), options: Any = None
    ) -> None:
        traced = jax.jit(fn, donate_argnums=donate).trace(*args)
        self.texts[key] = traced.lower(lowering_platforms=("tpu",)).as_text()


def chunk(s: dict[str, Any], mode: str, tick: bool) -> tuple[Any, tuple]:
    """A chunk program of `mode` and its abstract operands as `RolloutEngine.decode_chunk` passes them
    (`mpp.compile_chunk`'s, plus the n-gram bank, replicated, that n-gram modes read); tick: per device."""
    engine, am, rep = s["engine"], s["am"], s["engine"].replicated
    prog = engine.chunk_program(mode, s["sp"], shards=1 if tick else None)
    prog = dataclasses.replace(
        prog, target=am.graphdef, drafter=am.dgraphdef if prog.drafter is not None else None
    )
    bank = None
    if "ngram" in prog.uses:
        empty = lambda: NgramBank.empty(ROWS, ROWS // PROMPTS, engine.config.max_new_tokens)  # noqa: E731
        bank = mpp.with_shardings(jax.eval_shape(empty), rep)
    scalar = mpp.sds((), jnp.int32, rep)
    dparams = am.dparams if prog.drafter is not None else None
    return prog, (am.params, dparams, s["state"], mpp.sds((2,), jnp.int32, rep), bank, None, scalar, scalar)


def rollout_programs(s: dict[str, Any], lower: TpuLowering) -> None:
    mpp.compile_prefill(s["engine"], s["am"], s["sp"], ROWS, PROMPTS, PROMPT_LEN)
    for mode in ["plain", *STRATEGIES]:
        prog, args = chunk(s, mode, tick=False)
        lower(("chunk", mode), s["engine"]._chunk_fn(prog), args, (2, 4))


# what `rollout_programs` lowers: the prefill (keyed by `mpp.compile_prefill`) and one chunk per mode
ROLLOUT_KEYS = {("prefill", ROWS)} | {("chunk", m) for m in ["plain", *STRATEGIES]}


def check_texts(texts: dict[tuple, str], kernel: str | None, keys: set[tuple]) -> None:
    """The programs lowered are `keys` (each key's first two fields), each a StableHLO module; no custom call
    a TPU lacks (CPU FFI kernels, host callbacks); the attention kernel's call (`kernel`: "tpu_custom_call"
    in a shard_map, "CustomSPMDPartitioning" behind its partitioning rule) in every program iff given."""
    assert {k[:2] for k in texts} == keys and len(texts) == len(keys), sorted(map(str, texts))
    for key, text in texts.items():
        assert "stablehlo." in text and "func.func public @main" in text, f"{key}: no lowered module"
        targets = set(_CUSTOM_CALL.findall(text))
        assert targets <= _TPU_OK, f"{key}: custom calls a TPU cannot run: {sorted(targets - _TPU_OK)}"
        kernels = targets & {"tpu_custom_call", "CustomSPMDPartitioning"}
        assert kernels == ({kernel} if kernel else set()), f"{key}: custom calls {sorted(targets)}"


@pytest.fixture
def as_on_tpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`tree_attention` traced as on a TPU backend (impl pallas_tpu -> the Mosaic kernel, not its
    interpreter); in-memory traces cleared before and after, so none leaks into or out of this test."""
    jax.clear_caches()
    monkeypatch.setattr(ta, "_on_tpu", lambda: True)
    yield
    monkeypatch.undo()
    jax.clear_caches()


@pytest.fixture
def lower(monkeypatch: pytest.MonkeyPatch) -> TpuLowering:
    lowering = TpuLowering()
    monkeypatch.setattr(mpp, "compile_info", lowering)
    return lowering


@pytest.mark.devices(4)
def test_rl_step_programs_lower_for_tpu(lower: TpuLowering) -> None:
    """Prefill, plain / EAGLE chain / EAGLE tree / n-gram chunks, the policy update's accumulation, log-probs
    and apply, the drafter's optimizer step: data x model = 2 x 2, jnp attention."""
    s = smoke("reference", 2, 2)
    rollout_programs(s, lower)
    config, am, mesh = s["config"], s["am"], s["mesh"]
    mpp.compile_update(config, am, mesh, PROMPT_LEN, RESPONSE_LEN)
    mpp.compile_update(config, am, mesh, PROMPT_LEN, 0)
    mpp.compile_drafter_step(config, am, mesh)
    update = {("update_accum", RESPONSE_LEN), ("logprobs", RESPONSE_LEN), ("update_apply",)}
    cfg = config.spot
    check_texts(lower.texts, None, ROLLOUT_KEYS | update | {("drafter_step", cfg.rows)})


@pytest.mark.devices(4)
@pytest.mark.extended  # make test: the RL step's programs (jnp attention) and the Mosaic kernel in the tick
def test_rollout_programs_with_the_mosaic_kernel_lower_for_tpu(as_on_tpu: Any, lower: TpuLowering) -> None:
    """The prefill and chunks of the 2 x 2 mesh with the Mosaic tree-attention kernel behind its
    partitioning rule (each device: its rows and heads)."""
    s = smoke("pallas_tpu", 2, 2)
    rollout_programs(s, lower)
    check_texts(lower.texts, "CustomSPMDPartitioning", ROLLOUT_KEYS)


def spot_tick(s: dict[str, Any], lower: TpuLowering, mode: str) -> None:
    """The spot trainer's fused tick: devices 0 and 2 decode a `mode` chunk, 1 and 3 run its drafter
    micro-steps (`SpotTrainer.idle_work` over a buffer of random finished sequences)."""
    spot = SpotTrainer(SpotConfig(**dict(s["config"].spot)), s["drafter"], s["engine"])
    spot.begin_step(0)
    rng, n, h = np.random.default_rng(0), 24, s["cfg"].hidden_size
    samples = [
        DrafterSample(
            tokens=rng.integers(0, s["cfg"].vocab_size, n).astype(np.int32),
            hidden=rng.standard_normal((n, h)).astype(np.float16),
            loss_mask=np.arange(n) >= PROMPT_LEN,
        )
        for _ in range(4)
    ]
    spot.buffer.add(samples, 0)
    work = spot.idle_work((1, 0, 1, 0))
    assert work is not None
    prog, args = chunk(s, mode, tick=True)
    fused = spmd.tick_program(s["mesh"], prog, work, s["state"], args[4] is not None)
    lower(("tick", mode), fused, (*args, work.operands), (2, 4))


@pytest.mark.devices(4)
@pytest.mark.extended  # make test: the tick with the Mosaic kernel (below) and the RL step's jnp programs
def test_spot_tick_lowers_for_tpu(lower: TpuLowering) -> None:
    """Plain and EAGLE-chain ticks over data = 4 (the tick needs no model axis), jnp attention."""
    s = smoke("reference", 4, 1)
    for mode in ("plain", STRATEGIES[0]):
        spot_tick(s, lower, mode)
    check_texts(lower.texts, None, {("tick", "plain"), ("tick", STRATEGIES[0])})


@pytest.mark.devices(4)
def test_spot_tick_with_the_mosaic_kernel_lowers_for_tpu(as_on_tpu: Any, lower: TpuLowering) -> None:
    """The EAGLE-chain tick with the Mosaic kernel: in the tick's shard_map it lowers to a tpu_custom_call."""
    s = smoke("pallas_tpu", 4, 1)
    spot_tick(s, lower, STRATEGIES[0])
    check_texts(lower.texts, "tpu_custom_call", {("tick", STRATEGIES[0])})
