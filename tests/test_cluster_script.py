"""configs/cluster/slurm_grpo.sh: valid bash, and the command it runs parses: its config with the paper's
parquet recipe, the model and data overrides it passes, the multi-process flag (no cluster needed)."""

from __future__ import annotations

import pathlib
import re
import subprocess

from tlt_jax import config_lib
from tlt_jax.rl.config import validate_grpo

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "configs" / "cluster" / "slurm_grpo.sh"


def test_script_is_valid_bash_and_names_what_it_needs() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    for var in ("MODEL", "DATA", "WORKDIR", "LAYOUT", "TLT_JAX_LOCAL_DEVICE_IDS", "SLURM_PROCID"):
        assert var in text, f"{var} is not explained in {SCRIPT.name}"


def test_its_default_config_with_its_overrides_validates(tmp_path: pathlib.Path) -> None:
    default = re.search(r"CONFIG=\$\{CONFIG:-([^}]+)\}", SCRIPT.read_text()).group(1)
    path, _, arg = default.partition(":")
    c = config_lib.load_config_file(ROOT / path, arg)
    assert c.task.kind == "parquet" and c.task.reward == "math_verify"
    assert (c.rl.prompts_per_step, c.rl.samples_per_prompt, c.rollout.max_new_tokens) == (64, 8, 32768)
    assert (c.rl.lr, c.rl.kl_coef, c.rollout.temperature, c.spec.threshold) == (1e-6, 0.001, 0.9, 32)
    c.multiprocess = True
    c.model.path, c.task.path = str(tmp_path / "Qwen2.5-7B"), str(tmp_path / "train.parquet")
    validate_grpo(c, check_paths=False)
