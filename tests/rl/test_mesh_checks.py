"""Layouts known to deadlock are refused when the config is validated (tlt_jax/rl/mesh_checks.py): a model
axis that splits a KV head with the spot trainer on idle devices, the heads read from every kind of model
source (a tiny random model, a named architecture, a HF directory's config.json, a GGUF header), with the
rule and the fix; the layouts that work pass."""

from __future__ import annotations

import json

import pytest

from tlt_jax import config_lib
from tlt_jax.rl import config as rl_config
from tlt_jax.rl.mesh_checks import layout_problems, model_kv_heads


def smoke(kv_heads: int, model: int, mode: str = "idle_devices"):
    c = config_lib.load_config_file("configs/smoke.py", None)
    c.model.random.num_kv_heads = kv_heads
    c.mesh.data, c.mesh.model, c.spot.mode = 2, model, mode
    return c


def test_a_model_axis_splitting_kv_heads_under_idle_devices_is_refused_with_the_rule_and_fix() -> None:
    with pytest.raises(ValueError) as e:
        rl_config.validate_grpo(smoke(kv_heads=2, model=4))
    text = str(e.value)
    assert "config.mesh.model=4 splits the policy's 2 KV head(s)" in text and "deadlocks" in text
    assert "--config.mesh.model= one of [1, 2]" in text and "--config.spot.mode=between_chunks" in text
    assert layout_problems(smoke(kv_heads=1, model=2))  # one head on two devices
    for ok in (smoke(kv_heads=4, model=2), smoke(kv_heads=2, model=2), smoke(kv_heads=1, model=1)):
        assert layout_problems(ok) == []
    for mode in ("between_chunks", "after_rollout", "off"):  # no fused tick: not refused
        assert layout_problems(smoke(kv_heads=2, model=4, mode=mode)) == []


def test_kv_heads_read_from_every_model_source(tmp_path, smollm_gguf_path) -> None:
    c = config_lib.load_config_file("configs/qwen2_5_7b.py", None)
    assert model_kv_heads(c) == 4  # the named architecture (4 KV heads: the paper's TP 4 divides them)
    c.spot.mode, c.mesh.model = "idle_devices", 8
    assert "splits the policy's 4 KV head(s)" in layout_problems(c)[0]
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"num_attention_heads": 12, "num_key_value_heads": 2}))
    c = smoke(kv_heads=4, model=4)
    c.model.path, c.model.random = str(hf), {}
    assert model_kv_heads(c) == 2 and layout_problems(c)
    assert model_kv_heads(c, check_paths=False) is None  # cluster configs checked on a laptop: no read
    c.model.path = str(smollm_gguf_path)  # SmolLM2-135M: 3 KV heads
    assert model_kv_heads(c) == 3
    c.model.path = str(tmp_path / "missing.gguf")  # the model's own checks name it; this one is silent
    assert model_kv_heads(c) is None and layout_problems(c) == []


def test_a_model_source_that_cannot_be_read_is_a_named_problem_not_a_pass(tmp_path) -> None:
    """The check never switches itself off: a config.json without a head count, broken JSON or a file that
    is not GGUF is reported with the file and the fix (before: None, and the deadlocking layout passed)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    c = smoke(kv_heads=4, model=4)
    c.model.path, c.model.random = str(hf), {}
    for text in ('{"hidden_size": 64}', "{not json"):
        (hf / "config.json").write_text(text)
        with pytest.raises(ValueError, match=r"reading it from .*hf/config.json failed"):
            model_kv_heads(c)
        (problem,) = layout_problems(c)
        assert "config.json failed" in problem and "--config.spot.mode=between_chunks" in problem
    c.model.path = str(tmp_path / "fake.gguf")
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file at all")
    assert "fake.gguf failed" in layout_problems(c)[0]
    with pytest.raises(ValueError, match="fake.gguf failed"):
        rl_config.validate_grpo(c)
