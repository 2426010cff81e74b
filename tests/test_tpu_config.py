"""configs/qwen2_5_7b_tpu.py: each slice's mesh holds the 7B GRPO resident state, and the figures of its
docstring and of its refusal of a v5e-8 are the ones computed from abstract shapes (tlt_jax.memory_plan)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

from tlt_jax import config_lib
from tlt_jax import memory_plan as mp

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATH = ROOT / "configs" / "qwen2_5_7b_tpu.py"


def config_module():
    spec = importlib.util.spec_from_file_location("tpu_config", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stated(doc: str, pattern: str) -> float:
    """The GiB per chip the docstring states where `pattern` (a regex with one group, the number) matches."""
    return float(re.search(pattern, doc, flags=re.S).group(1))


def test_tpu_slices_hold_the_7b_trainer_state() -> None:
    """Each slice's mesh holds the resident state (engine weights, float32 masters, AdamW moments, reference,
    spot drafter state; abstract shapes, exact) in under 3/4 of a chip's HBM, at the GiB the docstring
    states; a v5e-8 is refused with the GiB of its best mesh, computed when the config loads, which no mesh of
    8 chips x 16 GiB brings under 16 GiB."""
    module = config_module()
    doc = module.__doc__
    for name, s in module.SLICES.items():
        c = config_lib.load_config_file(PATH, f"slice={name}")
        c.model.init = "random"
        assert c.mesh.data * c.mesh.model == s["devices"] and c.rollout.attn_impl == "pallas_tpu"
        gib = mp.resident_gib(c, c.mesh.data, c.mesh.model)
        assert gib < 0.75 * s["hbm_gib"], name
        assert round(gib, 1) == stated(doc, rf"{name} +\d+ chips.*?(\d+\.\d) GiB resident"), (name, gib)
    c = config_lib.load_config_file(PATH, "slice=v5e-16")
    c.trainer.fsdp = True  # v5e-8: every 8-chip mesh the heads allow (model 1, 2, 4), trainer state sharded
    gib, data, model = mp.best_mesh(c, 8)
    assert gib > module.TOO_SMALL["v5e-8"]["hbm_gib"] and (data, model) == (2, 4)
    assert gib == min(mp.resident_gib(c, 8 // m, m) for m in (1, 2, 4))
    assert round(gib, 1) == stated(doc, r"v5e-8 .*?needs (\d+\.\d) GiB per chip")
    with pytest.raises(ValueError, match=rf"v5e-8.* {gib:.1f} GiB per chip on its best mesh \(2 x 4, fsdp\)"):
        config_lib.load_config_file(PATH, "slice=v5e-8")
