"""EAGLE-3 drafters in SGLang's / vLLM's layout (tlt_jax.drafter.eagle3_format): a synthetic checkpoint
written with the tensor names and config keys those loaders read (SGLang llama_eagle3.py @ d737979c, vLLM
llama_eagle3.py @ 583507d1) loads into our drafter and computes what the loaders' forward computes (a numpy
transcription of SGLang's LlamaDecoderLayer.forward and LlamaModel.forward there); our export writes those
names and shapes back bit for bit; what does not fit the policy is refused; the directory starts a run's
drafter through `config.drafter.init_from`. The capture ids: each loader's reading transcribed from its
source (SGLang 0.5.23, vLLM 0.34.0: `sglang_capture_points`, `vllm_capture_points`) takes our export to our
capture points, and a checkpoint's ids import as the loader reading its key reads them."""

import json

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from tlt_jax.config_sections import DrafterSection
from tlt_jax.drafter.eagle3_format import (
    expected_eagle3_tensors,
    load_eagle3_drafter,
    to_eagle3,
    write_eagle3_dir,
)
from tlt_jax.models.config import tiny_config
from tlt_jax.models.eagle3 import Eagle3Drafter
from tlt_jax.rl.speculation import resolve_drafter

POLICY = tiny_config("qwen2", num_layers=8, vocab_size=96)  # a Qwen2 target: EAGLE-3's layer has no biases
VOCAB = np.arange(0, 96, 3, dtype=np.int64)  # 32 draft tokens
# the names SGLang's load_weights maps (stacked q/k/v and gate/up shards, "model." prefixed unless lm_head,
# d2t as hot-token offsets, t2d skipped) and vLLM's (midlayer. -> layers.0.)
NAMES = [
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
]


def public_checkpoint(path, scale=0.2, seed=0, policy=POLICY, vocab=VOCAB, **config_over):
    """An EAGLE-3 directory as an EAGLE-3 trainer writes it for SGLang / vLLM (config keys they read), for a
    `policy` target with draft vocabulary `vocab` (token ids)."""
    rng = np.random.default_rng(seed)
    c = policy
    h, d, f = c.hidden_size, c.head_dim, c.intermediate_size
    shapes = {
        "fc.weight": (h, 3 * h),
        "midlayer.self_attn.q_proj.weight": (c.num_heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (c.num_kv_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (c.num_kv_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, c.num_heads * d),
        "midlayer.mlp.gate_proj.weight": (f, h),
        "midlayer.mlp.up_proj.weight": (f, h),
        "midlayer.mlp.down_proj.weight": (h, f),
        "lm_head.weight": (len(vocab), h),
    }
    t = {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    for k in (
        "midlayer.input_layernorm",
        "midlayer.hidden_norm",
        "midlayer.post_attention_layernorm",
        "norm",
    ):
        t[k + ".weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    t["d2t"] = vocab - np.arange(len(vocab))
    t2d = np.zeros(c.vocab_size, bool)
    t2d[vocab] = True
    t["t2d"] = t2d
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": f,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": d,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": len(vocab),
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]},
        **config_over,
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return t, config


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, theta):  # HF rotate-half, x [T, n, d]
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None]
    cos, sin = (
        np.cos(np.concatenate([ang, ang], -1))[:, None],
        np.sin(np.concatenate([ang, ang], -1))[:, None],
    )
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def loader_forward(t, emb, states, pos):
    """SGLang's EAGLE-3 forward (llama_eagle3.py): fc, midlayer (residual = fused feature; q/k/v over
    [input_layernorm(embeds) ; hidden_norm(hidden)]; causal GQA attention; post_attention_layernorm adds the
    residual; MLP), then norm(hidden, residual) -> logits over the draft vocabulary and the pre-norm state."""
    c, eps = POLICY, POLICY.rms_norm_eps
    f = states @ t["fc.weight"].T
    x = np.concatenate(
        [
            _rms(emb, t["midlayer.input_layernorm.weight"], eps),
            _rms(f, t["midlayer.hidden_norm.weight"], eps),
        ],
        -1,
    )
    n, d = len(pos), c.head_dim
    q = _rope((x @ t["midlayer.self_attn.q_proj.weight"].T).reshape(n, c.num_heads, d), pos, c.rope_theta)
    k = _rope((x @ t["midlayer.self_attn.k_proj.weight"].T).reshape(n, c.num_kv_heads, d), pos, c.rope_theta)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).reshape(n, c.num_kv_heads, d)
    rep = c.num_heads // c.num_kv_heads
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("tnd,snd->nts", q, k) / np.sqrt(d) + np.where(np.tril(np.ones((n, n))) > 0, 0, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    a = np.einsum("nts,snd->tnd", p / p.sum(-1, keepdims=True), v).reshape(n, -1)
    resid = a @ t["midlayer.self_attn.o_proj.weight"].T + f
    hmid = _rms(resid, t["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = hmid @ t["midlayer.mlp.gate_proj.weight"].T, hmid @ t["midlayer.mlp.up_proj.weight"].T
    prenorm = (gate / (1 + np.exp(-gate)) * up) @ t["midlayer.mlp.down_proj.weight"].T + resid
    return prenorm, _rms(prenorm, t["norm.weight"], eps) @ t["lm_head.weight"].T


def test_public_checkpoint_loads_and_computes_what_the_loaders_compute(tmp_path):
    t, _ = public_checkpoint(tmp_path / "pub")
    drafter, vocab = load_eagle3_drafter(tmp_path / "pub", POLICY)
    assert drafter.aux_layers == (2, 4, 6)  # the config's layer outputs 1, 3, 5: capture points + 1
    np.testing.assert_array_equal(vocab, VOCAB)
    rng = np.random.default_rng(1)
    h = POLICY.hidden_size
    emb, states = rng.standard_normal((7, h)), rng.standard_normal((7, 4 * h))  # [aux ; final]
    pos = np.arange(1, 8, dtype=np.float64)
    want_h, want_logits = loader_forward(
        {k: np.float64(v) for k, v in t.items()}, emb, states[:, : 3 * h], pos
    )
    got_h, _ = drafter(
        emb[None].astype(np.float32), states[None].astype(np.float32), pos[None].astype(np.int32)
    )
    np.testing.assert_allclose(np.asarray(got_h)[0], want_h, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(drafter.logits(got_h))[0], want_logits, rtol=1e-4, atol=1e-4)
    # vLLM's own naming of the layer (layers.0.) reads the same
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in t.items()}
    (tmp_path / "vllm").mkdir()
    save_file(renamed, str(tmp_path / "vllm" / "model.safetensors"))
    (tmp_path / "vllm" / "config.json").write_text((tmp_path / "pub" / "config.json").read_text())
    again, _ = load_eagle3_drafter(tmp_path / "vllm", POLICY)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(
            jax_leaves(nnx.state(again, nnx.Param)), jax_leaves(nnx.state(drafter, nnx.Param)), strict=True
        )
    )


def jax_leaves(state):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_export_round_trip_names_shapes_values(tmp_path):
    t, config = public_checkpoint(tmp_path / "pub")
    drafter, vocab = load_eagle3_drafter(tmp_path / "pub", POLICY)
    tensors, out_config = to_eagle3(
        nnx.to_pure_dict(nnx.state(drafter, nnx.Param)), POLICY, drafter.aux_layers, vocab
    )
    assert set(tensors) == set(NAMES) | {"d2t", "t2d"} == set(t)
    assert {k: v.shape for k, v in tensors.items() if k in NAMES} == expected_eagle3_tensors(
        POLICY, len(VOCAB)
    )
    for k in t:
        np.testing.assert_array_equal(tensors[k], t[k], err_msg=k)
    for key in ("architectures", "num_hidden_layers", "draft_vocab_size", "tie_word_embeddings"):
        assert out_config[key] == config[key], key
    assert out_config["norm_before_residual"] is False and out_config["norm_before_fc"] is False
    ids = out_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    write_eagle3_dir(tmp_path / "ours", tensors, out_config)
    back, _ = load_eagle3_drafter(tmp_path / "ours", POLICY)
    assert back.aux_layers == drafter.aux_layers


def test_what_does_not_fit_the_policy_is_refused(tmp_path):
    public_checkpoint(tmp_path / "wide")
    with pytest.raises(ValueError, match=r"fc.weight is \(64, 192\), the policy needs \(96, 288\)"):
        load_eagle3_drafter(
            tmp_path / "wide", POLICY.replace(hidden_size=96, intermediate_size=128, head_dim=24)
        )
    public_checkpoint(tmp_path / "two", num_hidden_layers=2)
    with pytest.raises(ValueError, match="has 2 decoder layers"):
        load_eagle3_drafter(tmp_path / "two", POLICY)
    params = nnx.to_pure_dict(nnx.state(Eagle3Drafter(POLICY, nnx.Rngs(0)), nnx.Param))
    for aux in ((0, 2, 4), (2, 4, 8)):  # the embedding (SGLang id -1); after the last layer (SGLang: never)
        with pytest.raises(ValueError, match=r"capture points in \[1, L - 1\] = \[1, 7\]"):
            to_eagle3(params, POLICY, aux, None)
    public_checkpoint(tmp_path / "deep", eagle_config={}, eagle_aux_hidden_state_layer_ids=[2, 4, 9])
    with pytest.raises(ValueError, match=r"trained for another target: aux layers \(2, 4, 9\)"):
        load_eagle3_drafter(tmp_path / "deep", POLICY)
    for flag in ("norm_before_residual", "norm_before_fc"):  # variants ours does not compute
        public_checkpoint(tmp_path / flag, **{flag: True})
        with pytest.raises(ValueError, match=rf"sets {{'{flag}': True}}: a drafter variant ours does not"):
            load_eagle3_drafter(tmp_path / flag, POLICY)


def test_a_public_checkpoint_starts_the_run_drafter(tmp_path):
    """config.drafter.init_from naming an EAGLE-3 directory resolves to an EAGLE-3 drafter with its draft
    vocabulary (the rollout drafter and the spot trainer's start)."""
    public_checkpoint(tmp_path / "pub")
    section = DrafterSection(kind="eagle", init_from=str(tmp_path / "pub"), arch="eagle3")
    resolved = resolve_drafter(section, POLICY)
    assert resolved.kind == "eagle" and resolved.drafter.arch == "eagle3"
    np.testing.assert_array_equal(resolved.draft_vocab, VOCAB)


# ---- which target states each loader feeds the drafter, as transcribed from its source --------------------
# Capture points are ours: i = the residual stream entering target layer i (tlt_jax.models.llama).


def sglang_capture_points(config: dict, num_layers: int) -> tuple[int, ...]:
    """SGLang 0.5.23 (PyPI wheel): model_runner_components/spec_aux_hidden_state.py
    `_resolve_eagle_aux_hidden_state` reads `eagle_config["eagle_aux_hidden_state_layer_ids"]` (any error:
    None); models/llama.py (and qwen2.py) `set_eagle3_layers_to_capture`: None -> layers_to_capture
    [2, num_layers // 2, num_layers - 3], else `[val + 1 for val in layer_ids]`; LlamaModel.forward passes
    `capture_output` to layer i for i in layers_to_capture, captured in the attention boundary's prepare:
    the stream entering layer i, for i in range(start_layer, end_layer) only."""
    try:
        ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    except (KeyError, TypeError):
        ids = None
    layers = [2, num_layers // 2, num_layers - 3] if ids is None else [v + 1 for v in ids]
    return tuple(i for i in range(num_layers) if i in layers)  # the loop's order, layers it reaches


def vllm_capture_points(config: dict, num_layers: int) -> tuple[int, ...]:
    """vLLM 0.34.0 (PyPI wheel, commit 62d4bc3c7): v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
    `get_eagle3_aux_layers_from_config` reads `getattr(hf_config, "eagle_aux_hidden_state_layer_ids")`, then
    (no dflash / dspark keys) `eagle_config.get("layer_ids")`; none -> interfaces.py
    `get_eagle3_default_aux_hidden_state_layers` (2, num_layers // 2, num_layers - 3); models/llama.py
    (and qwen2.py) LlamaModel.forward: `_maybe_add_hidden_state(aux, start_layer, h, r)` before the loop and
    `_maybe_add_hidden_state(aux, idx + 1, h, r)` after layer idx, appending `h + r` when the index is in
    the set: id k = the stream after k layers. (The older form at vllm-project/vllm@e06c9ba2 models/llama.py,
    `if idx in self.aux_hidden_state_layers: aux_hidden_states.append(hidden_states + residual)` before
    layer idx, reads the same.)"""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "layer_ids"
    )
    layers = tuple(ids) if ids else (2, num_layers // 2, num_layers - 3)
    return tuple(k for k in range(num_layers + 1) if k in layers)


def test_the_export_feeds_the_same_states_through_both_loaders(tmp_path):
    """Our export's config.json makes SGLang and vLLM capture our drafter's capture points (default or not),
    and reads back to them."""
    params = nnx.to_pure_dict(nnx.state(Eagle3Drafter(POLICY, nnx.Rngs(0)), nnx.Param))
    L = POLICY.num_layers
    for aux in ((2, 4, 5), (1, 3, 7), (4, 5, 6)):  # the default (2, L // 2, L - 3), and two others
        tensors, config = to_eagle3(params, POLICY, aux, None)
        config = json.loads(json.dumps(config))  # as the loaders get it
        assert sglang_capture_points(config, L) == vllm_capture_points(config, L) == tuple(sorted(aux)), aux
        write_eagle3_dir(tmp_path / str(aux), tensors, config)
        back, _ = load_eagle3_drafter(tmp_path / str(aux), POLICY)
        assert back.aux_layers == aux


def test_a_checkpoint_ids_are_read_as_the_loader_that_reads_its_key(tmp_path):
    """SpecForge-style (eagle_config ids only: SGLang's reading), speculators-style (top-level ids only:
    vLLM's reading), both agreeing, none (the default); both disagreeing is refused."""
    L = POLICY.num_layers
    cases = {
        "specforge": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}},
        "speculators": {"eagle_config": {}, "eagle_aux_hidden_state_layer_ids": [1, 3, 5]},
        "both": {
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 6]},
            "eagle_aux_hidden_state_layer_ids": [1, 3, 7],
        },
        "none": {"eagle_config": {}},
    }
    want = {"specforge": (2, 4, 6), "speculators": (1, 3, 5), "both": (1, 3, 7), "none": (2, 4, 5)}
    for name, over in cases.items():
        _, config = public_checkpoint(tmp_path / name, **over)
        served = sglang_capture_points(config, L) if name == "specforge" else vllm_capture_points(config, L)
        assert served == want[name], name  # what the checkpoint's engine feeds it
        drafter, _ = load_eagle3_drafter(tmp_path / name, POLICY)
        assert drafter.aux_layers == want[name], name
    public_checkpoint(
        tmp_path / "clash",
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5]},
        eagle_aux_hidden_state_layer_ids=[1, 3, 5],
    )
    with pytest.raises(
        ValueError, match=r"SGLang would feed it .* \(2, 4, 6\) .* vLLM those entering \(1, 3, 5\)"
    ):
        load_eagle3_drafter(tmp_path / "clash", POLICY)
