"""The offline warm-up with `arch=eagle3` (tiny config): the data records [three layers ; final] states, the
drafter trains with its own head over the generated draft vocabulary, and the saved checkpoint names its
architecture and holds that head, so `load_drafter` (the RL loop's `drafter.kind=eagle`) rebuilds the drafter
the warm-up trained, weight for weight."""

import json
import pathlib

import numpy as np
import pytest
from flax import nnx

from tlt_jax import config_schema
from tlt_jax.config_lib import load_config_file
from tlt_jax.drafter import warmup
from tlt_jax.drafter.heldout import heldout_acceptance
from tlt_jax.drafter.trainer import TRAIN_STATE_DIR
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.eagle3 import Eagle3Drafter
from tlt_jax.utils.checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_eagle3_warmup_end_to_end(tmp_path):
    config = load_config_file(ROOT / "configs" / "drafter_warmup.py", "tiny")
    config.arch, config.aux_layers, config.draft_vocab_size = "eagle3", (0, 1, 2), 40
    wd = tmp_path / "wd"
    assert warmup.run_warmup(config_schema.parse(config), wd) == "done"
    result = json.loads((wd / warmup.RESULT_FILE).read_text())
    assert result["complete"] and result["after"]["num_positions"] > 0
    h = config.model.random.hidden_size
    data = np.load(wd / "data" / "train_000.npz")
    assert data["hidden"].shape[1] == 4 * h  # [aux layers 0, 1, 2 ; final]
    vocab = np.load(wd / "drafter" / "draft_vocab.npy")
    target_cfg = ModelConfig(**dict(config.model.random), dtype=config.model.dtype)
    loaded = warmup.load_drafter(wd, target_cfg)
    assert isinstance(loaded, Eagle3Drafter) and loaded.aux_layers == (0, 1, 2)
    assert loaded.draft_vocab_size == len(vocab) <= 41  # 40 most frequent + EOS
    params = nnx.to_pure_dict(nnx.state(loaded, nnx.Param))
    assert set(params) == {"fc", "layer", "norm", "lm_head"}
    with Checkpointer(wd / TRAIN_STATE_DIR) as ckpt:  # the trainer's last state: every weight it trained
        trained = ckpt.restore(config.train.steps)[0]["params"]
    flat = dict(nnx.traversals.flatten_mapping(params))
    for path, want in nnx.traversals.flatten_mapping(trained).items():
        path = path[:-1] if path[-1] == "value" else path
        np.testing.assert_array_equal(np.asarray(flat[path]), np.asarray(want), err_msg=str(path))
    rows = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses and all(np.isfinite(losses)) and all(r.get("train/feat_loss", 0.0) == 0.0 for r in rows)
    # the held-out reader (Table 7's "after spot training" numbers) measures the warm-up's own drafter as the
    # warm-up did, and refuses weights of another shape
    job = config_schema.parse(config)
    again = heldout_acceptance(job, wd, params)
    assert again.accept_length == pytest.approx(result["after"]["accept_length"], rel=1e-9)
    assert again.sampled_accept_length == pytest.approx(result["after"]["sampled_accept_length"], rel=1e-6)
    assert again.num_positions == result["after"]["num_positions"]
    wide = {**params, "lm_head": {"kernel": np.zeros((h, len(vocab) + 1), np.float32)}}
    with pytest.raises(ValueError, match="do not fit the warm-up in .*lm_head/kernel"):
        heldout_acceptance(job, wd, wide)
