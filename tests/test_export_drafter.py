"""`python -m tlt_jax.export_drafter` on an EAGLE-3 drafter: a warm-up workdir exports in the EAGLE-3 layout
SGLang and vLLM read (eagle3_format), which loads back as the drafter the warm-up saved (its own head, draft
vocabulary and capture points); what cannot be exported is refused with the fix. (EAGLE-1 exports:
tests/drafter/test_eagle_format.py.)"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from tlt_jax import config_lib
from tlt_jax.drafter.draft_vocab import FILENAME as VOCAB_FILE
from tlt_jax.drafter.eagle3_format import load_eagle3_drafter
from tlt_jax.export_drafter import find_drafter, workdir_capture_points
from tlt_jax.export_drafter import main as export_main
from tlt_jax.models.config import ModelConfig, tiny_config
from tlt_jax.models.eagle3 import Eagle3Drafter, drafter_spec
from tlt_jax.utils.drafter_checkpoint import DrafterCheckpointer

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
AUX = (1, 2, 3)  # a 5-layer target: capture points both loaders can name (not 0, not L)


def _warmup_workdir(wd: pathlib.Path, vocab: np.ndarray | None) -> tuple[ModelConfig, dict]:
    """A warm-up workdir as `drafter.warmup` leaves it for an EAGLE-3 drafter with random weights:
    config.json, drafter/<step> (selective checkpoint with the drafter's own head, spec in meta) and
    draft_vocab.npy."""
    config = config_lib.load_config_file(CONFIGS / "drafter_warmup.py", "tiny")
    config.model.random.num_layers = 5
    config.arch, config.aux_layers = "eagle3", AUX
    cfg = tiny_config(**{**dict(config.model.random), "dtype": "float32"})
    size = cfg.vocab_size if vocab is None else len(vocab)
    drafter = Eagle3Drafter(cfg, nnx.Rngs(7), draft_vocab_size=size, aux_layers=AUX)
    state = nnx.state(drafter, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(7), 32))  # every weight random, norms too: a wrong map shows
    nnx.update(drafter, jax.tree.map(lambda x: 0.2 * jax.random.normal(next(keys), x.shape, x.dtype), state))
    params = jax.device_get(nnx.to_pure_dict(nnx.state(drafter, nnx.Param)))
    wd.mkdir(parents=True)
    (wd / "config.json").write_text(json.dumps(config.to_dict()))
    with DrafterCheckpointer(wd / "drafter", async_save=False, own_head=True) as ckpt:
        ckpt.save(3, params, meta={"target": dataclasses.asdict(cfg), "drafter": drafter_spec(drafter)})
    if vocab is not None:
        np.save(wd / "drafter" / VOCAB_FILE, vocab)
    return cfg, params


def test_an_eagle3_warmup_exports_in_the_eagle3_layout_and_loads_back(tmp_path, capsys) -> None:
    vocab = np.arange(0, 264, 3, dtype=np.int32)  # 88 of the tiny tokenizer's 264 tokens
    wd, out = tmp_path / "wd", tmp_path / "export"
    cfg, params = _warmup_workdir(wd, vocab)
    export_main(["--workdir", str(wd), "--out", str(out), "--engine", "vllm"])
    assert "EAGLE-3 drafter for sglang and vllm" in capsys.readouterr().out
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["draft_vocab_size"] == len(vocab)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # d2t in the weights
    back, got_vocab = load_eagle3_drafter(out, cfg)
    assert back.aux_layers == AUX
    np.testing.assert_array_equal(got_vocab, vocab)
    got = jax.device_get(nnx.to_pure_dict(nnx.state(back, nnx.Param)))
    jax.tree.map(np.testing.assert_array_equal, got, params)  # lm_head included: the drafter's own

    export_main(["--workdir", str(wd), "--out", str(out), "--force", "--dtype", "bfloat16"])
    conf = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert conf["torch_dtype"] == "bfloat16" and str(tensors["lm_head.weight"].dtype) == "bfloat16"
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == bool

    with pytest.raises(SystemExit, match=r"--full-vocab cannot drop it"):
        export_main(["--workdir", str(wd), "--out", str(tmp_path / "full"), "--full-vocab"])
    with pytest.raises(SystemExit, match=r"EAGLE-3 export: SGLang and vLLM both read it as it is"):
        export_main(["--from-dir", str(out), "--out", str(tmp_path / "conv"), "--engine", "vllm"])
    (wd / "drafter" / VOCAB_FILE).unlink()
    with pytest.raises(
        SystemExit, match=r"the EAGLE-3 head has 88 rows but the workdir's draft vocabulary is none"
    ):
        export_main(["--workdir", str(wd), "--out", str(tmp_path / "novocab")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "wd"]  # no half-written export left


def test_capture_points_of_an_rl_run_follow_its_drafter(tmp_path) -> None:
    """An RL workdir's checkpoint meta has no drafter spec: the capture points are those of the drafter the
    run started from (drafter.path's warm-up), else config.drafter.aux_layers, else EAGLE-3's default."""
    cfg, _ = _warmup_workdir(tmp_path / "warm", None)
    src = dataclasses.replace(find_drafter(tmp_path / "warm"), meta={})
    rl = ml_collections.ConfigDict(
        {"drafter": {"kind": "eagle", "path": str(tmp_path / "warm"), "init_from": ""}}
    )
    assert workdir_capture_points(rl, src, cfg) == AUX
    rl.drafter.path, rl.drafter.aux_layers = "", (1, 3, 4)
    assert workdir_capture_points(rl, src, cfg) == (1, 3, 4)
    rl.drafter.aux_layers = ()
    assert workdir_capture_points(rl, src, cfg) == (2, 2, 2)  # (2, L // 2, L - 3) at L = 5
