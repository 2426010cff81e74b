"""tlt_jax: adaptive speculative rollouts for reasoning-model RL (TLT) in JAX/Flax."""

from setuptools import find_packages, setup

# JAX and flax as ranges that hold both tested stacks; the exact versions are pip constraints:
# requirements/jax-cpu.txt (`make setup`: jax 0.10.2, flax 0.12.8, this CPU's tests) and
# requirements/jax-gpu.txt (`make setup-gpu`: jax 0.11.2, flax 0.12.10, what every GPU run used).
# flax 0.12.8 does not import on jax 0.11.
JAX_RANGE = ">=0.10.2,<0.12"
CORE = [
    f"jax{JAX_RANGE}",
    f"jaxlib{JAX_RANGE}",
    "flax>=0.12.8,<0.13",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "chex==0.1.92",
    "ml-collections==1.1.0",
    "absl-py>=2.1",
    "wandb==0.31.0",
    "tokenizers>=0.23,<0.24",
    "safetensors==0.8.0",
    "gguf==0.19.0",
    "reasoning-gym==0.1.25",
    "tqdm>=4.66",
    "jinja2>=3.1",
    "numpy>=1.26",
    "matplotlib>=3.8",
    # data files and rewards (tlt_jax.tasks): parquet reading; HF math-verify with the LaTeX parser and
    # ANTLR runtime it was tested with
    "pyarrow==26.0.1",
    "math-verify==0.9.0",
    "latex2sympy2_extended==1.11.0",
    "antlr4-python3-runtime==4.13.2",
    "sympy==1.14.0",
]
# VeRL's own code, the tests' oracle (tests/verl_oracle): its pure-Python wheel WITHOUT its dependencies (ray,
# vLLM, tensordict, ...), which `make setup` installs with `pip install --no-deps --target .cache/verl` (the
# Makefile reads this pin; tests/verl_oracle/wheel.py says why not into the venv); `pip install
# .[verl-oracle]` would pull them all.
VERL_ORACLE = "verl==0.9.1"

setup(
    name="tlt_jax",
    version="0.1.0",
    description="TLT (Taming the Long Tail): GRPO with adaptive speculative rollouts in JAX/Flax",
    packages=find_packages(include=["tlt_jax", "tlt_jax.*"]),
    # the CPU kernels' C++ sources ship with the package; compiled on first use or by `make setup`
    package_data={"tlt_jax.kernels": ["cpu/*.cc", "cpu/*.h"]},
    python_requires=">=3.11",
    install_requires=CORE,
    extras_require={
        # pytest-xdist: `make test` runs two workers (XLA compilation is mostly single-threaded)
        # nbclient, nbformat, ipykernel: tests/test_notebook.py runs notebooks/quickstart.ipynb
        "dev": [
            "pytest>=8",
            "pytest-xdist==3.8.0",
            "ruff>=0.6",
            "nbclient==0.11.0",
            "nbformat==5.11.1",
            "ipykernel==7.4.0",
        ],
        # GPU clusters (`make setup-gpu`): jax's CUDA plugin for CUDA 12 or 13 drivers, its version the
        # constraints file's (requirements/jax-gpu.txt, or jax-cpu.txt with JAX=cpu-pins)
        "cuda12": [f"jax[cuda12]{JAX_RANGE}"],
        "cuda13": [f"jax[cuda13]{JAX_RANGE}"],
        # Parity tests against HF transformers. torch is pinned: an unpinned torch pulls GBs of CUDA wheels.
        "parity": ["torch==2.13.0", "transformers==5.23.0", "accelerate>=1.0"],
        # the VeRL oracle of the reward, loss, advantage, KL and eval-metric tests (install it --no-deps)
        "verl-oracle": [VERL_ORACLE],
    },
)
