"""Named architectures with random weights: the presets' shapes and parameter counts, weights born sharded
on the devices from the modules' own init, the config option (`config.model.arch` + `init=random`) and its
refusals: text jobs at validation, every text method of the stand-in tokenizer."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from tlt_jax import config_lib, config_schema
from tlt_jax import sharding as shd
from tlt_jax.models import presets
from tlt_jax.models.build import build_model_and_tokenizer, model_problems
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.models.random_init import (
    NoTextTokenizer,
    abstract_params,
    bytes_per_device,
    random_drafter,
    random_model,
)

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
TINY = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def random_7b_config(**overrides: object):
    """configs/qwen2_5_7b.py with random weights, tiny widths (the preset's other fields and the config's
    bfloat16 kept)."""
    c = config_lib.load_config_file(CONFIGS / "qwen2_5_7b.py")
    c.model.init = "random"
    c.model.random = {**TINY, "vocab_size": 512, **overrides}
    return c


@pytest.mark.parametrize("name", sorted(presets.ARCHS))
def test_presets_have_the_published_parameter_counts(name: str) -> None:
    """Qwen2.5 0.5B / 1.5B / 7B / 32B: 0.49B / 1.54B / 7.62B / 32.8B, exactly as their safetensors."""
    cfg = presets.arch_config(name)
    assert cfg.num_params() == presets.PUBLISHED_PARAMS[name]
    assert (cfg.architecture, cfg.qkv_bias, cfg.rope_theta, cfg.rms_norm_eps) == ("qwen2", True, 1e6, 1e-6)
    assert cfg.tie_embeddings == (name in ("qwen2_5_0_5b", "qwen2_5_1_5b"))
    assert cfg.hidden_size == cfg.num_heads * cfg.head_dim


@pytest.mark.parametrize("name", ["qwen2_5_0_5b", "qwen2_5_7b"])
def test_abstract_module_matches_the_count_and_shards_by_the_rules(name: str) -> None:
    """The module built abstractly (nothing allocated) holds num_params() parameters, and on a 2 x 4 mesh
    (an AbstractMesh: no devices) each device holds a quarter of every matrix and every norm whole."""
    cfg = presets.arch_config(name)
    mesh = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    _, params = abstract_params(lambda: Transformer(cfg, nnx.Rngs(0)), lambda p: shd.param_shardings(p, mesh))
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size  # replicated RMSNorm scales
    assert bytes_per_device(params) == ((cfg.num_params() - norms) // 4 + norms) * 2  # bfloat16


def test_random_weights_are_the_modules_init_born_sharded() -> None:
    """`random_model` draws what the eager constructor draws (same seed; up to float rounding: XLA fuses the
    normal's transform), but inside one jitted program whose outputs already carry the mesh's layout; the
    drafter likewise."""
    cfg = presets.arch_config("qwen2_5_7b", **TINY, vocab_size=512, dtype="float32")
    mesh = shd.make_mesh(2, 4)
    shard = lambda p: shd.param_shardings(p, mesh)  # noqa: E731
    model = random_model(cfg, seed=3, shard_fn=shard)
    params = nnx.state(model, nnx.Param)
    want = nnx.state(Transformer(cfg, nnx.Rngs(params=3)), nnx.Param)
    for got, ref, sharding in zip(
        jax.tree.leaves(params), jax.tree.leaves(want), jax.tree.leaves(shard(params)), strict=True
    ):
        assert got.sharding == sharding
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-9)
    assert model.layers[0].mlp.gate_up[...].sharding.spec == P("model", None)
    drafter = random_drafter(cfg, seed=5, shard_fn=shard)
    ref_fc = Drafter(cfg, nnx.Rngs(params=5)).fc[...]
    np.testing.assert_allclose(np.asarray(drafter.fc[...]), np.asarray(ref_fc), rtol=1e-6, atol=1e-9)


def test_config_builds_the_random_architecture_and_the_engine_runs_it() -> None:
    """`--config.model.init=random` on the 7B cluster config (tiny widths): the preset's fields, weights on
    the config's mesh, no text; the rollout engine generates token ids with it."""
    c = random_7b_config()
    c.mesh.data, c.mesh.model = 2, 4
    mesh = config_lib.build_mesh(c)
    model, tok = config_lib.build_model(c, mesh)
    assert model.cfg.rope_theta == 1e6 and model.cfg.qkv_bias and not model.cfg.tie_embeddings
    assert model.cfg.vocab_size == 512 and model.cfg.num_layers == 2
    assert model.lm_head[...].sharding.spec == P("model", None) and model.embed[...].dtype == jnp.bfloat16
    assert isinstance(tok, NoTextTokenizer) and tok.vocab_size == 512 and tok.eos_token_ids == (511,)
    c.rollout.max_new_tokens, c.rollout.max_cache_len, c.rollout.min_cache_bucket = 3, 16, 16
    c.rollout.chunk_steps, c.rollout.prompt_bucket = 4, 8
    engine = config_lib.build_engine(c, model, tok, mesh)
    sp = config_lib.sampling_from(c)
    out = engine.generate([[1, 2, 3]], n=2, key=jax.random.key(0), sampling=sp)
    assert out.tokens.shape[0] == 2 and (out.lengths >= 1).all()
    assert ((out.tokens >= 0) & (out.tokens < 512)).all()


@pytest.mark.parametrize("job", ["grpo", "drafter_warmup"])
def test_validation_refuses_text_jobs_on_random_weights(job: str) -> None:
    c = random_7b_config()
    c.job = job
    with pytest.raises(ValueError, match=f"config.job='{job}' needs meaningful text") as e:
        config_schema.parse(c, check_paths=False)
    assert "--config.model.path=/path/to/Qwen2.5-7B" in str(e.value)
    assert not model_problems(c, text_jobs=False)  # building it (to time it) is fine


def test_model_source_problems_name_the_fix() -> None:
    c = config_lib.load_config_file(CONFIGS / "qwen2_5_7b.py")
    (msg,) = model_problems(c, check_paths=False)  # an arch without weights
    assert msg.startswith("set exactly one of config.model.path") and "--config.model.init=random" in msg
    c.model.path = "/cluster/Qwen2.5-7B"
    assert not model_problems(c, check_paths=False)
    c.model.init = "random"  # random weights AND a path
    assert any("unset the path" in p for p in model_problems(c, check_paths=False, text_jobs=False))
    c.model.path, c.model.arch = None, "qwen3_7b"
    assert any("use one of ['qwen2_5_0_5b'" in p for p in model_problems(c, text_jobs=False))
    c.model.arch, c.model.init = "qwen2_5_7b", "pretrained"
    assert any("config.model.init='pretrained'" in p for p in model_problems(c))
    c.model.init, c.model.random = "auto", {"num_layers": 2}
    assert any("only with config.model.init=random" in p for p in model_problems(c, check_paths=False))


def test_a_checkpoint_that_is_not_the_named_architecture_is_named() -> None:
    smollm = presets.arch_config("qwen2_5_0_5b").replace(hidden_size=576, num_layers=30, architecture="llama")
    bad = presets.shape_mismatches("qwen2_5_0_5b", smollm)
    assert bad == [
        "hidden_size=576 (the preset has 896)",
        "num_layers=30 (the preset has 24)",
        "architecture='llama' (the preset has 'qwen2')",
    ]
    assert presets.shape_mismatches("qwen2_5_7b", presets.arch_config("qwen2_5_7b", dtype="float32")) == []


@pytest.fixture(scope="module")
def no_text_tokenizer() -> NoTextTokenizer:
    c = random_7b_config(num_layers=1)
    _, tok = build_model_and_tokenizer(c)
    return tok


@pytest.mark.parametrize(
    "call",
    [
        lambda t: t.encode("x"),
        lambda t: t.decode([1, 2]),
        lambda t: t.apply_chat_template([{"role": "user", "content": "x"}]),
        lambda t: t.encode_chat([{"role": "user", "content": "x"}]),
        lambda t: t.encode_batch(["x"]),
        lambda t: t.save("/tmp/never"),
    ],
)
def test_every_text_method_refuses_with_the_fix(call, no_text_tokenizer) -> None:
    with pytest.raises(
        ValueError, match=r"random weights \(config.model.init=random\) and no tokenizer"
    ) as e:
        call(no_text_tokenizer)
    assert "--config.model.path=/path/to/Qwen2.5-7B" in str(e.value)


@pytest.mark.parametrize("name", ["qwen2_5_0_5b", "qwen2_5_7b", "qwen2_5_32b"])
def test_cluster_configs_name_their_architecture(name: str) -> None:
    """The paper-family configs name their preset: a checkpoint path validates (its shapes are checked when
    loaded), random weights are refused for GRPO, and runlocal's tiny model carries no preset."""
    c = config_lib.load_config_file(CONFIGS / f"{name}.py")
    assert c.model.arch == name and c.model.init == "auto"
    c.model.path = f"/cluster/models/{presets.HF_NAMES[name]}"
    config_schema.parse(c, check_paths=False)
    c.model.path, c.model.init = None, "random"
    with pytest.raises(ValueError, match="needs meaningful text"):
        config_schema.parse(c, check_paths=False)
    small = config_lib.load_config_file(CONFIGS / f"{name}.py", "runlocal")
    assert small.model.arch == "" and small.model.random
    config_schema.parse(small)
