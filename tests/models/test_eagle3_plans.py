"""The memory plans count EAGLE-3's recorded states: [three layers ; final] = 4H values per token for
config.drafter.arch=eagle3, on the 7B and 32B configs (arithmetic and the abstract drafter step's batch)."""

import jax
import pytest

from tests.rl.test_learner_eagle3 import CONFIGS
from tlt_jax import config_lib, rollout_memory_plan
from tlt_jax import memory_plan as mpp
from tlt_jax import sharding as shd
from tlt_jax.models.build import model_config_from
from tlt_jax.models.config import tiny_config
from tlt_jax.models.eagle3 import config_drafter_spec


@pytest.mark.parametrize("name,layers", [("qwen2_5_7b.py", (2, 14, 25)), ("qwen2_5_32b.py", (2, 32, 61))])
def test_recorded_span_and_cap_count_three_layers(name, layers):
    config = config_lib.load_config_file(CONFIGS / name, None)
    config.spot.mode = "between_chunks"
    cfg = model_config_from(config)
    eagle = rollout_memory_plan.recorded_bytes_per_row(config, cfg)
    config.drafter.arch = "eagle3"
    assert config_drafter_spec(config, cfg) == {"arch": "eagle3", "aux_layers": list(layers)}
    assert rollout_memory_plan.recorded_bytes_per_row(config, cfg) == 4 * eagle > 0
    config.drafter.aux_layers = (3, 5)  # two capture points: [a ; b ; final]
    assert rollout_memory_plan.recorded_bytes_per_row(config, cfg) == 3 * eagle


def test_abstract_drafter_step_reads_the_states_width():
    """The plan's abstract EAGLE-3 (fc over 3H, its own head) and the target returning its states."""
    cfg = tiny_config(num_layers=4)
    mesh = shd.make_mesh(1, 1, jax.devices()[:1])
    am = mpp.abstract_models(cfg, mesh, spec={"arch": "eagle3", "aux_layers": [1, 2, 4]})
    assert am.aux_layers == (1, 2, 4) and am.dparams["fc"].shape == (64, 192)
    assert am.dparams["lm_head"].shape == (cfg.vocab_size, 64)
    assert mpp.abstract_models(cfg, mesh).aux_layers == ()
