"""The drafter exported as an EAGLE-1 checkpoint (config.json + model.safetensors) reads back, with plain
safetensors + json and with a HF Llama/Qwen2 decoder layer in torch, as the same drafter; the export command
works on warm-up and RL workdirs; `drafter.init_from` starts the rollout drafter and its spot trainer from an
export; drafters that do not fit the policy are refused, naming both shapes."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file

from tlt_jax import config_lib, config_schema
from tlt_jax.drafter import eagle_format as ef
from tlt_jax.drafter.loss import LossConfig
from tlt_jax.drafter.token_map import read_token_map
from tlt_jax.drafter.trainer import TRAIN_STATE_DIR, DrafterTrainer
from tlt_jax.export_drafter import main as export_main
from tlt_jax.models.config import ModelConfig, tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.utils.checkpoint import Checkpointer
from tlt_jax.utils.drafter_checkpoint import DrafterCheckpointer

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
VOCAB = np.array([0, 3, 4, 17, 40, 41, 99, 127])  # a reduced draft vocabulary of tiny_config's 128 tokens


def random_drafter(cfg: ModelConfig, seed: int) -> Drafter:
    """A drafter whose every weight (norm and biases included) is random: a wrong mapping shows."""
    drafter = Drafter(cfg, nnx.Rngs(seed))
    state = nnx.state(drafter, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    nnx.update(drafter, jax.tree.map(lambda x: 0.2 * jax.random.normal(next(keys), x.shape, x.dtype), state))
    return drafter


def params_of(drafter: Drafter) -> dict:
    return nnx.to_pure_dict(nnx.state(drafter, nnx.Param))


def inputs(target: Transformer, seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(token embeddings, target features, positions) of a [2, 7] batch."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    toks = jax.random.randint(k1, (2, 7), 0, target.cfg.vocab_size)
    hid = jax.random.normal(k2, (2, 7, target.cfg.hidden_size))
    return target.embed_tokens(toks), hid, jnp.broadcast_to(jnp.arange(1, 8), (2, 7))


def logits(drafter: Drafter, target: Transformer, vocab: np.ndarray | None) -> np.ndarray:
    """The drafter's next-token logits over its (draft) vocabulary: the target's head rows."""
    h = drafter(*inputs(target))[0]
    head = target.head_weight() if vocab is None else target.head_weight()[jnp.asarray(vocab)]
    return np.asarray(h @ head.T)


@pytest.mark.parametrize("arch,vocab", [("llama", None), ("qwen2", VOCAB)])
def test_export_reads_back_as_the_same_drafter(tmp_path, arch, vocab) -> None:
    cfg = tiny_config(arch)
    target, drafter = Transformer(cfg, nnx.Rngs(0)), random_drafter(cfg, 1)
    out = ef.write_eagle_dir(tmp_path / "eagle", ef.to_eagle(params_of(drafter), cfg, vocab))
    maps = ["token_map.pt"] if vocab is not None else []  # a reduced vocabulary: SGLang's token map
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", *maps]

    st = load_file(str(out / "model.safetensors"))  # plain safetensors + json, not our reader
    conf = json.loads((out / "config.json").read_text())
    h, heads, kv = conf["hidden_size"], conf["num_attention_heads"], conf["num_key_value_heads"]
    d, f = conf["head_dim"], conf["intermediate_size"]
    assert (conf["num_hidden_layers"], conf["model_type"], conf["vocab_size"]) == (1, arch, 128)
    assert conf["architectures"][0] == ("Qwen2" if arch == "qwen2" else "Llama") + "ForCausalLMEagle"
    assert conf["tlt_drafter"]["layout"] == "eagle1" and "NOT EAGLE-3" in conf["tlt_drafter"]["fc_input"]
    p = "layers.0."
    want = {
        "fc.weight": (h, 2 * h),
        "fc.bias": (h,),
        p + "self_attn.q_proj.weight": (heads * d, h),
        p + "self_attn.k_proj.weight": (kv * d, h),
        p + "self_attn.v_proj.weight": (kv * d, h),
        p + "self_attn.o_proj.weight": (h, heads * d),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (f, h),
        p + "mlp.up_proj.weight": (f, h),
        p + "mlp.down_proj.weight": (h, f),
    }
    if arch == "qwen2":
        want.update(
            {
                p + f"self_attn.{n}_proj.bias": (s,)
                for n, s in (("q", heads * d), ("k", kv * d), ("v", kv * d))
            }
        )
        assert conf["draft_vocab_size"] == VOCAB.size
        np.testing.assert_array_equal(read_token_map(out / "token_map.pt"), VOCAB)
    else:
        assert "draft_vocab_size" not in conf
    assert {k: v.shape for k, v in st.items()} == want
    assert not np.any(st["fc.bias"]) and st["fc.weight"].dtype == np.float32

    params, got_vocab = ef.from_eagle(*ef.read_eagle_dir(out), cfg)  # the token map read as d2t/t2d
    rebuilt = ef.build_drafter(params, cfg)
    jax.tree.map(np.testing.assert_array_equal, params_of(rebuilt), params_of(drafter))
    np.testing.assert_array_equal(logits(rebuilt, target, got_vocab), logits(drafter, target, vocab))
    assert (got_vocab is None) == (vocab is None)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_torch_hf_decoder_layer_computes_what_the_drafter_does(tmp_path, arch) -> None:
    """Load the export as SGLang/vLLM do: HF Llama/Qwen2 layer 0 without its input norm, after fc."""
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip(f"transformers.models.{arch}.modeling_{arch}")
    from safetensors.torch import load_file as torch_load
    from transformers import AutoConfig

    cfg = tiny_config(arch, num_heads=4, num_kv_heads=1)  # GQA groups of 4
    target, drafter = Transformer(cfg, nnx.Rngs(0)), random_drafter(cfg, 2)
    out = ef.write_eagle_dir(tmp_path / "eagle", ef.to_eagle(params_of(drafter), cfg))
    conf = json.loads((out / "config.json").read_text())
    st = torch_load(str(out / "model.safetensors"))
    hf = AutoConfig.for_model(**{k: v for k, v in conf.items() if k not in ("architectures", "tlt_drafter")})
    hf._attn_implementation = "eager"
    assert st["layers.0.self_attn.q_proj.weight"].shape == (
        hf.num_attention_heads * hf.head_dim,
        hf.hidden_size,
    )
    assert st["layers.0.self_attn.k_proj.weight"].shape == (
        hf.num_key_value_heads * hf.head_dim,
        hf.hidden_size,
    )
    prefix = "Qwen2" if arch == "qwen2" else "Llama"
    layer = getattr(modeling, f"{prefix}DecoderLayer")(hf, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()  # EAGLE-1's first layer
    layer.load_state_dict(
        {k.removeprefix("layers.0."): v for k, v in st.items() if k.startswith("layers.0.")}
    )
    rotary = getattr(modeling, f"{prefix}RotaryEmbedding")(config=hf)

    emb, hid, pos = inputs(target)
    with torch.no_grad():
        x = torch.nn.functional.linear(
            torch.cat([torch.tensor(np.asarray(emb)), torch.tensor(np.asarray(hid))], -1),
            st["fc.weight"],
            st["fc.bias"],
        )
        position_ids = torch.tensor(np.asarray(pos))
        t = x.shape[1]
        causal = torch.full((t, t), float("-inf")).triu(1)[None, None].expand(x.shape[0], 1, t, t)
        y = layer(
            x, attention_mask=causal, position_ids=position_ids, position_embeddings=rotary(x, position_ids)
        )
    y = y[0] if isinstance(y, tuple) else y
    np.testing.assert_allclose(y.numpy(), np.asarray(drafter(emb, hid, pos)[0]), rtol=1e-4, atol=1e-5)

    # a bfloat16 export is bfloat16 in torch and says so in config.json
    out16 = ef.write_eagle_dir(tmp_path / "bf16", ef.to_eagle(params_of(drafter), cfg, dtype="bfloat16"))
    assert torch_load(str(out16 / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    assert json.loads((out16 / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_drafters_that_do_not_fit_are_refused(tmp_path) -> None:
    cfg = tiny_config("llama")
    export = ef.to_eagle(params_of(random_drafter(cfg, 3)), cfg)
    tensors, conf = export.tensors, export.config
    with pytest.raises(ValueError, match=r"hidden_size 64 vs 32"):
        ef.from_eagle(tensors, conf, tiny_config("llama", hidden_size=32, head_dim=8))
    with pytest.raises(ValueError, match=r"vocab_size 128 vs 256"):
        ef.from_eagle(tensors, conf, tiny_config("llama", vocab_size=256))
    bad = dict(
        conf, hidden_size=32, head_dim=8
    )  # config.json says it fits, the weights do not: both shapes named
    with pytest.raises(ValueError, match=r"fc.weight \(64, 128\) vs \(32, 64\)"):
        ef.from_eagle(tensors, bad, tiny_config("llama", hidden_size=32, head_dim=8))
    qwen = ef.to_eagle(params_of(random_drafter(tiny_config("qwen2"), 3)), tiny_config("qwen2"))
    qwen_tensors, qwen_conf = qwen.tensors, qwen.config
    with pytest.raises(ValueError, match=r"unexpected .*q_proj.bias.* \(q/k/v biases: a Qwen2 drafter\)"):
        ef.from_eagle(qwen_tensors, {**qwen_conf, "rope_theta": cfg.rope_theta}, cfg)
    with pytest.raises(ValueError, match=r"nonzero fc.bias"):
        ef.from_eagle({**tensors, "fc.bias": np.ones(64, np.float32)}, conf, cfg)
    with pytest.raises(ValueError, match=r"EAGLE-3"):
        ef.from_eagle({**tensors, "midlayer.hidden_norm.weight": np.ones(64)}, conf, cfg)
    with pytest.raises(ValueError, match=r"layer/attn/qkv \(128, 64\) vs \(192, 64\)"):  # wrong target config
        ef.to_eagle(params_of(random_drafter(cfg, 3)), tiny_config("llama", num_kv_heads=4))
    with pytest.raises(FileNotFoundError, match=r"tlt_jax.export_drafter"):
        ef.read_eagle_dir(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError, match=r"not empty: pass --force"):
        ef.write_eagle_dir(tmp_path / "full", export)
    assert (tmp_path / "full" / "x").exists()


def test_export_command_on_a_warmup_workdir(tmp_path, capsys) -> None:
    config = config_lib.load_config_file(CONFIGS / "drafter_warmup.py", "tiny")
    cfg = ModelConfig(**dict(config.model.random), dtype=config.model.dtype)
    wd, out = tmp_path / "wd", tmp_path / "export"
    with pytest.raises(SystemExit, match=r"config.json does not exist: --workdir must be"):
        export_main(["--workdir", str(wd), "--out", str(out)])
    wd.mkdir()
    (wd / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(SystemExit, match=r"has no drafter checkpoint \(looked for checkpoints/<step>"):
        export_main(["--workdir", str(wd), "--out", str(out)])
    drafter = random_drafter(cfg, 4)
    with DrafterCheckpointer(wd / "drafter", async_save=False) as ckpt:
        ckpt.save(6, params_of(drafter), meta={"target": dataclasses.asdict(cfg)})
    vocab = np.arange(0, cfg.vocab_size, 3, dtype=np.int32)
    np.save(wd / "drafter" / "draft_vocab.npy", vocab)

    export_main(["--workdir", str(wd), "--out", str(out)])
    assert "step 6" in capsys.readouterr().out
    conf = json.loads((out / "config.json").read_text())
    params, got_vocab = ef.from_eagle(*ef.read_eagle_dir(out), cfg)
    jax.tree.map(np.testing.assert_array_equal, params, params_of(drafter))
    np.testing.assert_array_equal(got_vocab, vocab)
    assert "drafter step 6" in conf["tlt_drafter"]["source"]["what"]
    with pytest.raises(SystemExit, match=r"is not empty: pass --force"):
        export_main(["--workdir", str(wd), "--out", str(out)])
    export_main(["--workdir", str(wd), "--out", str(out), "--force", "--dtype", "bfloat16", "--full-vocab"])
    conf = json.loads((out / "config.json").read_text())
    assert conf["torch_dtype"] == "bfloat16" and "draft_vocab_size" not in conf
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "wd"]  # no temporary folder left

    # a warm-up training on past its drafter/ step: the newer train state is the one exported
    newer = random_drafter(cfg, 6)
    trainer = DrafterTrainer(optax.sgd(0.1), LossConfig(), seed=0)
    with Checkpointer(wd / TRAIN_STATE_DIR) as ckpt:
        trainer.save(ckpt, trainer.init_state(newer).replace(step=jnp.asarray(8, jnp.int32)))
    export_main(["--workdir", str(wd), "--out", str(out), "--force"])
    conf = json.loads((out / "config.json").read_text())
    params, _ = ef.from_eagle(load_file(str(out / "model.safetensors")), conf, cfg)
    jax.tree.map(np.testing.assert_array_equal, params, params_of(newer))
    assert "train_state step 8" in conf["tlt_drafter"]["source"]["what"]

    # an RL run that drafted without an EAGLE drafter and trained none has nothing to export
    rl = tmp_path / "rl"
    with Checkpointer(rl / "checkpoints") as ckpt:
        ckpt.save(2, {"params": {"w": np.ones(3, np.float32)}, "drafter": None, "spot": None}, {"step": 2})
    (rl / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(SystemExit, match=r"step 2 holds no EAGLE drafter"):
        export_main(["--workdir", str(rl), "--out", str(tmp_path / "rl_export")])


def spot_config(init_from: str) -> ml_collections.ConfigDict:
    """The smoke run drafting with an imported EAGLE drafter that a spot trainer trains on."""
    c = config_lib.load_config_file(CONFIGS / "smoke.py", "steps=2")
    c.drafter.kind, c.drafter.init_from = "eagle", init_from
    c.spot.mode = "after_rollout"
    c.spot.window, c.spot.context, c.spot.ce_tokens = 16, 8, 16
    c.spot.ttt_steps, c.spot.ttt_positions, c.spot.eval_samples = 1, 8, 4
    return c


def test_init_from_starts_the_spot_trainer_and_the_run_exports_back(tmp_path) -> None:
    """... and the learner's periodic export (`rl/exports.py`, config.export_every) of the same state, from
    memory with the trainer's layers stored stacked (gathered one layer at a time), equals what the two
    export commands write from its checkpoint: the policy tensor for tensor, the drafter with its token map;
    no vLLM drafter with a reduced vocabulary."""
    from tlt_jax import export_policy
    from tlt_jax.rl import exports
    from tlt_jax.rl.learner import Learner
    from tlt_jax.rl.speculation import resolve_drafter

    c = spot_config(str(tmp_path / "eagle"))
    c.trainer.scan_layers, c.export_every = True, 2
    policy = ModelConfig(**dict(c.model.random), dtype=c.model.dtype)
    vocab = np.arange(1, policy.vocab_size, 5)
    assert any("holds no config.json" in p for p in config_schema.collect(c)[1])
    drafter = random_drafter(policy, 5)
    ef.write_eagle_dir(tmp_path / "eagle", ef.to_eagle(params_of(drafter), policy, vocab))
    assert config_schema.collect(c)[1] == []
    c.drafter.kind = "ngram"
    assert any("set kind=eagle" in p for p in config_schema.collect(c)[1])
    c.drafter.kind = "eagle"
    with pytest.raises(ValueError, match=r"hidden_size 64 vs 32"):
        resolve_drafter(config_schema.section(c, "drafter"), policy.replace(hidden_size=32, head_dim=8))

    learner = Learner(c, str(tmp_path / "run"))
    try:
        assert learner.rollout_drafter.kind == "eagle" and learner.spot is not None
        np.testing.assert_array_equal(np.asarray(learner.engine.draft_vocab), vocab)
        jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(learner.spot.params), params_of(drafter))
        trained = jax.tree.map(
            lambda x: x + 0.25, learner.spot.state.params
        )  # as if the spot trainer moved it
        learner.spot.state = learner.spot.state.replace(params=trained)
        learner.save()
        assert [exports.export_due(2, s, 5) for s in range(6)] == [False, False, True, False, True, True]
        assert exports.after_step(learner) is None  # step 0: not due (export_every=2)
        periodic = exports.export_step(learner)
    finally:
        learner.close()
    out = tmp_path / "export"
    export_main(["--workdir", str(tmp_path / "run"), "--out", str(out)])
    params, got_vocab = ef.from_eagle(*ef.read_eagle_dir(out), policy)
    jax.tree.map(np.testing.assert_array_equal, params, nnx.to_pure_dict(trained))
    np.testing.assert_array_equal(got_vocab, vocab)

    assert periodic == tmp_path / "run" / "exports" / "step_0"
    assert sorted(p.name for p in periodic.iterdir()) == ["drafter", "policy"]  # reduced vocab: no vLLM one
    assert sorted(p.name for p in (tmp_path / "run" / "exports").iterdir()) == ["step_0"]  # no temporary left
    assert_same_dir(periodic / "drafter", out, skip=("source",))
    policy_out, _, _ = export_policy.export_policy(tmp_path / "run", tmp_path / "policy")
    assert_same_dir(periodic / "policy", policy_out)


def assert_same_dir(a: pathlib.Path, b: pathlib.Path, skip: tuple[str, ...] = ()) -> None:
    """Two export folders hold the same files: equal tensors, equal JSON (but `skip`'s keys of the drafter's
    tlt_drafter section), equal other bytes."""
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for f in a.iterdir():
        if f.suffix == ".safetensors":
            x, y = load_file(str(f)), load_file(str(b / f.name))
            assert x.keys() == y.keys()
            for k in x:
                np.testing.assert_array_equal(x[k], y[k], err_msg=f"{f.name} {k}")
        elif f.suffix == ".json":
            x, y = json.loads(f.read_text()), json.loads((b / f.name).read_text())
            for conf in (x, y):
                for k in skip:
                    conf.get("tlt_drafter", {}).pop(k, None)
            assert x == y, f.name
        else:
            assert f.read_bytes() == (b / f.name).read_bytes(), f.name
