"""config_lib: parse_arg, validation messages, builders; every config file builds and validates."""

from __future__ import annotations

import pathlib

import jax
import pytest

from tlt_jax import config_lib, config_schema
from tlt_jax.models.build import build_model_and_tokenizer
from tlt_jax.models.llama import Transformer
from tlt_jax.models.tokenizer import ByteTokenizer
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def load_config(name: str, arg: str | None = None):
    return config_lib.load_config_file(CONFIGS / f"{name}.py", arg)


# ----------------------------------------------------------------------------------------------------------
# parse_arg
# ----------------------------------------------------------------------------------------------------------


def test_parse_arg_types_flags_and_first_default() -> None:
    a = config_lib.parse_arg("runlocal,n=4,name=x,lr=0.5", n=1, runlocal=False, name="", lr=1.0)
    assert (a.n, a.runlocal, a.name, a.lr) == (4, True, "x", 0.5)
    assert isinstance(a.n, int) and isinstance(a.lr, float)
    assert config_lib.parse_arg("8", n=1, runlocal=False).n == 8  # a bare value sets the first default
    assert config_lib.parse_arg("runlocal", n=1, runlocal=False).runlocal is True
    assert config_lib.parse_arg("runlocal=false", runlocal=True).runlocal is False
    assert config_lib.parse_arg(None, n=3).n == 3 and config_lib.parse_arg("", n=3).n == 3


def test_parse_arg_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"unknown config arg 'stepz'.*\['runlocal', 'steps'\]"):
        config_lib.parse_arg("stepz=3", steps=1, runlocal=False)
    with pytest.raises(ValueError, match="steps='x': expected int"):
        config_lib.parse_arg("steps=x", steps=1)
    with pytest.raises(ValueError, match="expected a boolean"):
        config_lib.parse_arg("runlocal=maybe", runlocal=False)
    with pytest.raises(ValueError, match="needs a value: write steps=<value>"):
        config_lib.parse_arg("runlocal,steps", steps=1, runlocal=False)


# ----------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------


def test_validate_unknown_job_and_random_keys() -> None:
    c = load_config("smoke")
    c.job = "sft"
    c.model.random.unknown_field = 3  # the random dict is open (architecture fields)
    with pytest.raises(ValueError) as e:
        config_schema.parse(c)
    assert "config.job='sft'" in str(e.value) and "unknown keys ['unknown_field']" in str(e.value)


def test_config_is_locked_against_typos() -> None:
    c = load_config("smoke")
    c.lock()
    with pytest.raises(AttributeError, match="lrr"):
        c.rl.lrr = 1.0


# ----------------------------------------------------------------------------------------------------------
# builders
# ----------------------------------------------------------------------------------------------------------


def test_builders_on_the_smoke_config() -> None:
    c = load_config("smoke")
    model, tok = build_model_and_tokenizer(c)
    assert isinstance(model, Transformer) and isinstance(tok, ByteTokenizer)
    assert model.cfg.vocab_size >= tok.vocab_size
    ec = config_lib.engine_config_from(c)
    assert isinstance(ec, EngineConfig) and ec.max_new_tokens == c.rollout.max_new_tokens
    assert config_lib.sampling_from(c) == SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    mesh = config_lib.build_mesh(c)
    assert mesh.shape["data"] == len(jax.devices()) and mesh.shape["model"] == 1
    engine = config_lib.build_engine(c, model, tok, mesh)
    assert isinstance(engine, RolloutEngine)
    assert set(engine.eos_ids.tolist()) == set(tok.eos_token_ids)
    c.model.random.vocab_size = 100
    with pytest.raises(ValueError, match="vocab_size=100 is smaller than the ByteTokenizer's 261"):
        build_model_and_tokenizer(c)


def test_build_model_rejects_missing_path() -> None:
    c = load_config("smoke")
    c.model.random = {}
    c.model.path = "/nonexistent/dir"
    with pytest.raises(ValueError, match="--config.model.path"):
        build_model_and_tokenizer(c)


# ----------------------------------------------------------------------------------------------------------
# the config files
# ----------------------------------------------------------------------------------------------------------


def test_default_config_validates_and_shrinks(smollm_gguf_path) -> None:
    c = load_config("default")
    config_schema.parse(c)
    assert pathlib.Path(c.model.path) == smollm_gguf_path
    assert c.task.name == "chain_sum" and c.rollout.temperature > 0
    small = load_config("default", "runlocal")
    config_schema.parse(small)
    assert small.num_steps < c.num_steps
    assert load_config("default", "seed=3").task.seed == 3


@pytest.mark.parametrize("name", ["qwen2_5_7b", "qwen2_5_7b_tpu", "qwen2_5_32b"])
def test_cluster_configs_validate_without_weights(name: str) -> None:
    c = load_config(name)
    with pytest.raises(ValueError, match="set exactly one of config.model.path"):
        config_schema.parse(c)  # the model path comes from the command line
    c.model.path = "/cluster/models/Qwen2.5"
    config_schema.parse(c, check_paths=False)
    rl, ro = c.rl, c.rollout
    # the paper's settings: 8 samples, T=0.9, low_var_kl 0.001, lr 1e-6, long responses
    assert (rl.samples_per_prompt, ro.temperature, rl.kl_coef, rl.lr) == (8, 0.9, 0.001, 1e-6)
    assert ro.max_new_tokens >= 16384 and c.model.dtype == "bfloat16"
    assert isinstance(config_lib.engine_config_from(c), EngineConfig)
    assert config_lib.sampling_from(c).temperature == 0.9
    if len(jax.devices()) % c.mesh.model == 0:
        assert config_lib.build_mesh(c).shape["model"] == c.mesh.model
    # runlocal: the same pipeline on a tiny random Qwen2-architecture model, on CPU
    small = load_config(name, "runlocal")
    config_schema.parse(small)
    model, _ = build_model_and_tokenizer(small)
    assert model.cfg.architecture == "qwen2" and model.cfg.qkv_bias
    assert small.model.dtype == "float32" and small.rollout.max_new_tokens <= 64
    assert small.rl.samples_per_prompt == c.rl.samples_per_prompt  # the algorithm is unchanged
    assert not small.multiprocess  # runlocal: one process; the 32B config is multi-host (7B: per slice)
    if name == "qwen2_5_32b":
        assert c.multiprocess


@pytest.mark.parametrize("name", ["qwen2_5_7b", "qwen2_5_32b"])
def test_paper_configs_run_tlt(name: str) -> None:
    """Issue 36 item 5: drafter auto (EAGLE from drafter_path / init_from, n-gram until then), the spot
    trainer on idle devices, BEG-MAB over plain and one EAGLE tree per paper bucket, a KV budget that caps
    the running rows; runlocal trains between chunks (one CPU device), drafter=none is the plain baseline."""
    c = load_config(name, "drafter_path=/ckpt/d")
    assert (c.drafter.kind, c.drafter.path, c.spot.mode) == ("auto", "/ckpt/d", "idle_devices")
    assert c.bandit.algorithm == "beg_mab" and not c.bandit.all_arms
    assert c.bandit.arms == ("plain", *config_lib.PAPER_STRATEGIES) and c.rollout.kv_budget_gib > 0
    assert config_lib.engine_config_from(c).record_hidden  # the spot trainer's data
    small = load_config(name, "runlocal")
    assert (small.spot.mode, small.rollout.kv_budget_gib) == ("between_chunks", 0.0)
    base = load_config(name, "drafter=none")
    assert (base.drafter.kind, base.spot.mode, base.bandit.algorithm) == ("none", "off", "off")


def test_drafter_warmup_takes_a_policy_directory() -> None:
    """configs/drafter_warmup.py:policy=DIR warms a drafter for configs/qwen2_5_7b.py's target: that HF
    directory in bfloat16, the paper config's task and temperature."""
    c = load_config("drafter_warmup", "policy=/models/Qwen2.5-7B")
    paper = load_config("qwen2_5_7b")
    job = config_schema.parse(c, check_paths=False, check_model=False)
    assert job.model.path == "/models/Qwen2.5-7B" and job.model.dtype == "bfloat16"
    assert c.task.to_dict() == paper.task.to_dict()
    assert job.generation.temperature == paper.rollout.temperature
    assert load_config("drafter_warmup", "tlt").model.path != c.model.path  # the presets are unchanged
