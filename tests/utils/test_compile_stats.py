"""The compile-time accountant: JAX's compile events summed per kind, scopes, deltas, cache resolution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.utils import compile_stats


def test_compilations_are_attributed_to_the_innermost_scope():
    log = compile_stats.compile_log()
    x = np.ones((7, 5), np.float32)  # host inputs: no eager device op compiles a program of its own
    before = log.snapshot()

    def scale_and_shift(x):  # noqa: ANN001, ANN202
        return x * 3.0 + 1.0

    with compile_stats.scope("update"):
        jax.jit(scale_and_shift)(x)
        with compile_stats.scope("rollout/chunk"):
            jax.jit(lambda x: jnp.sin(x) @ x.T)(x)
    jax.jit(lambda x: x - 2.0)(x)  # outside every scope
    d = log.snapshot().delta(before)
    assert d.programs == {"update": 1, "rollout/chunk": 1, "other": 1}
    for kind in d.programs:
        assert d.seconds[(kind, "backend")] > 0 and d.seconds[(kind, "trace")] > 0
    assert any(r["kind"] == "update" and "scale_and_shift" in r["name"] for r in log.programs_by_name())
    m = d.metrics()
    assert m["compile/programs"] == 3
    assert m["compile/update_programs"] == 1
    parts = m["compile/trace_s"] + m["compile/lower_s"] + m["compile/backend_s"]
    assert m["compile/total_s"] == pytest.approx(parts)
    assert m["compile/total_s"] == pytest.approx(
        m["compile/update_s"] + m["compile/rollout/chunk_s"] + m["compile/other_s"]
    )


def test_a_cached_program_compiles_nothing_new():
    f, x = jax.jit(lambda x: x * 5.0), np.ones((3, 11), np.float32)
    f(x)
    before = compile_stats.compile_log().snapshot()
    f(x)  # jit's in-memory cache: no trace, no lowering, no backend compile
    assert compile_stats.compile_log().snapshot().delta(before).total() == 0.0


def test_cache_dir_resolution(monkeypatch, tmp_path):
    assert compile_stats.resolve_cache_dir("") == ""
    assert compile_stats.resolve_cache_dir(str(tmp_path / "x")) == str(tmp_path / "x")
    monkeypatch.setenv(compile_stats.CACHE_ENV, str(tmp_path / "env"))
    assert compile_stats.resolve_cache_dir("auto") == str(tmp_path / "env")
    monkeypatch.delenv(compile_stats.CACHE_ENV)
    # the test session's cache (tests/conftest.py) is one the process was already given: "auto" keeps it
    assert compile_stats.resolve_cache_dir("auto") == jax.config.jax_compilation_cache_dir
