"""`python -m tlt_jax.export_policy`: an RL workdir's policy as a HF checkpoint that transformers loads.

Each workdir is what a run leaves: config.json as the learner writes it, and a checkpoint made by the
learner's own `checkpoint_state` from a `PolicyTrainer` whose trainable parameters were moved (a trained
policy). The export, loaded with `transformers.AutoModelForCausalLM`, must give the logits of that trainer's
model on a few token sequences: float32 both sides, |difference| <= 1e-4 + 1e-4 |logit| (measured: ~3e-7).
Llama (tied embeddings, the top layer trained: the frozen ones rebuilt from config.json's model) and Qwen2
(q/k/v biases, untied head, every layer trained), its layers stored unrolled and stacked (scan_layers).
"""

from __future__ import annotations

import json
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from tlt_jax import config_lib, export_policy
from tlt_jax.rl import config as rl_config
from tlt_jax.rl.checkpointing import CHECKPOINT_DIR, checkpoint_state
from tlt_jax.utils.checkpoint import Checkpointer
from tlt_jax.utils.plain import plain_dict
from tlt_jax.utils.tracking import CONFIG_FILE

SMOKE = pathlib.Path(__file__).resolve().parents[1] / "configs" / "smoke.py"
TOKENS = np.array([[256, 72, 105, 33, 10, 260, 7, 200], [1, 2, 3, 4, 5, 6, 7, 8]])


def run_workdir(
    root: pathlib.Path,
    arch: str,
    train_layers: int,
    steps: tuple[int, ...] = (1,),
    model_path: str = "",
    scan_layers: bool = False,
) -> tuple[pathlib.Path, np.ndarray]:
    """A workdir holding checkpoints of a "trained" tiny policy (a random model, or the HF directory
    `model_path`); returns (workdir, the trainer's logits)."""
    c = config_lib.load_config_file(SMOKE)
    if model_path:
        c.model.path, c.model.random = model_path, {}
    else:
        c.model.random = config_lib.tiny_random_model(arch)
    c.trainer.train_layers, c.trainer.scan_layers = train_layers, scan_layers
    wd = root / (arch + "_from_dir" * bool(model_path) + "_stacked" * scan_layers)
    wd.mkdir()
    (wd / CONFIG_FILE).write_text(json.dumps(plain_dict(c), indent=2, sort_keys=True, default=str))
    job = rl_config.validate_grpo(c)
    mesh = config_lib.build_mesh(c)
    model, _ = config_lib.build_model(c, mesh)
    trainer = rl_config.policy_trainer(job, model, mesh)
    # no drafter, no history store: the engine fields a checkpoint reads
    engine = types.SimpleNamespace(drafter_params=None, history=None)
    with Checkpointer(wd / CHECKPOINT_DIR) as ckpt:
        for step in steps:  # each step moves every trained parameter (the frozen ones never change)
            trainer.params = jax.tree.map(
                lambda t, x: x * 1.05 + 0.01 if t else x, trainer.trainable, trainer.params
            )
            state = checkpoint_state(trainer, engine, None, None, jax.random.key(0))
            ckpt.save(step, state, {"step": step, "data_position": 0}, force=True)
    ours = trainer.model(trainer.compute_params())
    positions = np.broadcast_to(np.arange(TOKENS.shape[1]), TOKENS.shape)
    return wd, np.asarray(ours(jnp.asarray(TOKENS), jnp.asarray(positions)).logits)


def hf_logits(out: pathlib.Path) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


@pytest.mark.parametrize(
    "arch, train_layers, scan", [("llama", 1, False), ("qwen2", 0, False), ("qwen2", 0, True)]
)
def test_export_matches_our_logits(tmp_path: pathlib.Path, arch: str, train_layers: int, scan: bool) -> None:
    wd, ours = run_workdir(tmp_path, arch, train_layers, scan_layers=scan)
    out, src, tokenizer = export_policy.export_policy(wd, tmp_path / "export")
    assert src.step == 1 and bool(src.frozen) == (train_layers > 0)
    np.testing.assert_allclose(hf_logits(out), ours, rtol=1e-4, atol=1e-4)
    cfg = json.loads((out / "config.json").read_text())
    family = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert cfg["architectures"] == [family] and cfg["tie_word_embeddings"] == (arch == "llama")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    assert ("lm_head.weight" in index["weight_map"]) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_proj.bias" in index["weight_map"]) == (arch == "qwen2")
    assert tokenizer == "the run's ByteTokenizer"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("Hi!")["input_ids"] == [256, 72, 105, 33]  # <bos> then one id per byte, as ours
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [257, 260] and gen["bos_token_id"] == 256


def test_cli_step_dtype_force_and_errors(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    wd, _ = run_workdir(tmp_path, "qwen2", 0, steps=(1, 2))
    out = tmp_path / "export"
    export_policy.main(["--workdir", str(wd), "--out", str(out), "--step", "1", "--dtype", "bfloat16"])
    assert "Qwen2ForCausalLM from" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tlt_jax_export"]["step"] == 1
    raw = (out / "model-00001-of-00001.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}

    def error(*args: str) -> str:
        with pytest.raises(SystemExit) as e:
            export_policy.main(["--workdir", str(wd), "--out", str(out), *args])
        return str(e.value)

    assert "is not empty: pass --force" in error()
    assert "has no checkpoint step 7; it has [1, 2]" in error("--step", "7", "--force")
    export_policy.main(["--workdir", str(wd), "--out", str(out), "--force"])  # the newest step, replaced
    assert json.loads((out / "config.json").read_text())["tlt_jax_export"]["step"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]  # no temporary folders left
    empty = tmp_path / "empty"
    empty.mkdir()
    wd = empty
    assert "config.json does not exist" in error("--force")
    (empty / CONFIG_FILE).write_text((tmp_path / "qwen2" / CONFIG_FILE).read_text())
    assert "holds no finalised checkpoint" in error("--force")


def test_frozen_layers_from_another_model_are_refused(tmp_path: pathlib.Path) -> None:
    wd, _ = run_workdir(tmp_path, "llama", 1)
    cfg = json.loads((wd / CONFIG_FILE).read_text())
    cfg["seed"] = 1  # the random model the frozen layers are rebuilt from is another one now
    (wd / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"frozen layers rebuilt from config.model differ .* at embed"):
        export_policy.export_policy(wd, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_a_run_from_a_hf_directory_keeps_its_files(tmp_path: pathlib.Path) -> None:
    """config.model.path a HF directory (here an export): its config.json and tokenizer files are copied
    (torch_dtype set to the export's), its frozen layers rebuilt from it."""
    wd, _ = run_workdir(tmp_path, "qwen2", 0)
    base, _, _ = export_policy.export_policy(wd, tmp_path / "base")
    (base / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    wd, ours = run_workdir(tmp_path, "qwen2", 1, model_path=str(base))
    out, src, tokenizer = export_policy.export_policy(wd, tmp_path / "export", dtype="float32")
    assert src.frozen and tokenizer == f"tokenizer files copied from {base}"
    np.testing.assert_allclose(hf_logits(out), ours, rtol=1e-4, atol=1e-4)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    cfg, source = (json.loads((d / "config.json").read_text()) for d in (out, base))
    assert cfg["tlt_jax_export"]["step"] == 1 and cfg["tlt_jax_export"]["workdir"] == str(wd.resolve())
    assert {k: v for k, v in cfg.items() if k != "tlt_jax_export"} == {
        k: v for k, v in source.items() if k != "tlt_jax_export"
    }
