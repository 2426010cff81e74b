"""Llama / Qwen2-family decoder in flax.nnx with explicit positions, KV cache and attention mask.

`Transformer(tokens, positions, cache, mask)` returns logits AND the final (normed) hidden states: the EAGLE
drafter consumes the latter. The attention mask is explicit ([B, T, T] over the new tokens, see
`tlt_jax.kernels.tree_attention`), so prefill (causal), decode (T=1) and speculative tree verification (a tree
mask) are one code path. The trainer's forward instead names a causal implementation (`causal_impl`,
`tlt_jax.kernels.flash_attention`: O(T x block) memory, no [T, S] scores) and may rematerialise each layer
in the backward pass (`remat`, a `jax.checkpoint_policies` name).

Two layouts of the decoder stack: unrolled (`layers` a list of `DecoderLayer`, each weight its own array: the
rollout's, whose decode loop reads each layer's weights and cache in place) and stacked (`stacked=True`:
`layers` one `DecoderLayer` whose every weight leads with [L], run as one `lax.scan`: the trainer's, whose
programs then hold one array per weight whatever the depth). `tlt_jax.models.layouts` converts between them;
loaders build the unrolled layout.

Layouts (chosen by measurement on XLA:CPU, where a decode step is a chain of M=1..64 matmuls):
- every weight is a 2-D [out, in] matrix (HF layout). Multi-dimensional weights made XLA copy (transpose)
  each weight inside the decode loop on every step, 10x slower at batch 1 (see docs/benchmarks.md);
- q/k/v are one fused projection whose output rows are ordered per KV group, [Hkv, G + 2, D]: group k holds
  its G query heads, then its key head, then its value head, so a contiguous split of the rows (tensor
  parallelism over the model axis) hands whole GQA groups to each device;
- gate/up are fused with rows ordered [F, 2] (unit f's gate then its up), so a contiguous split keeps pairs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.kernels import flash_attention as fa
from tlt_jax.kernels import tree_attention as ta
from tlt_jax.kernels.small_m_linear import linear
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import KVCache, StackedKVCache, write_rows

# per-layer rematerialisation in the backward pass: "none", or a policy of `jax.checkpoint_policies` (what a
# layer keeps for the backward pass: nothing_saveable recomputes the whole layer, dots_saveable keeps matmuls)
REMAT_POLICIES = ("none", "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")
CAUSAL_IMPLS = fa.FLASH_IMPLS  # the trainer's attention (`Transformer(..., causal_impl=)`)


def _dtype(cfg: ModelConfig) -> jnp.dtype:
    return jnp.dtype(cfg.dtype)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32 (as HF does), scaled by a learned weight."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_cos_sin(positions_bt: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """HF-style (rotate-half) rotary tables for explicit positions: cos, sin [B, T, D] float32."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    freqs = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos_btd: jax.Array, sin_btd: jax.Array) -> jax.Array:
    """Rotate x [B, T, ..., D] by position; cos/sin broadcast over the head axes."""
    extra = x.ndim - 3
    cos = cos_btd.reshape(cos_btd.shape[:2] + (1,) * extra + cos_btd.shape[-1:])
    sin = sin_btd.reshape(sin_btd.shape[:2] + (1,) * extra + sin_btd.shape[-1:])
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


class Attention(nnx.Module):
    """GQA self-attention with a fused per-group QKV projection, writing its K/V into the cache."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = _dtype(cfg)
        self.cfg = cfg
        g = cfg.num_heads // cfg.num_kv_heads
        h, kv, d = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
        self.qkv = _normal(rngs, (kv * (g + 2) * d, h), dt)
        self.qkv_bias = nnx.Param(jnp.zeros((kv * (g + 2) * d,), dt)) if cfg.qkv_bias else nnx.data(None)
        self.o_proj = _normal(rngs, (h, cfg.num_heads * d), dt)

    def __call__(
        self,
        x_bth: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        k_cache: jax.Array | None,
        v_cache: jax.Array | None,
        lengths_b: jax.Array,
        mask_btt: jax.Array | None,
        attn_impl: str,
        causal_impl: str | None = None,
    ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """causal_impl None: tree attention under `mask_btt` by `attn_impl` (rollout programs); else causal
        attention of the new tokens at [lengths, lengths + T) by `flash_attention(impl=causal_impl)`."""
        g = self.cfg.num_heads // self.cfg.num_kv_heads
        b, t = x_bth.shape[:2]
        qkv = linear(x_bth, self.qkv[...], self.cfg.linear_impl)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias[...]
        qkv = qkv.reshape(b, t, self.cfg.num_kv_heads, g + 2, self.cfg.head_dim)
        q = apply_rope(qkv[:, :, :, :g], cos, sin)  # [B, T, Hkv, G, D]
        k = apply_rope(qkv[:, :, :, g], cos, sin)  # [B, T, Hkv, D]
        v = qkv[:, :, :, g + 1]
        q = q.reshape(b, t, self.cfg.num_heads, self.cfg.head_dim)
        if k_cache is None:  # no cache (trainer forward): the new tokens are the whole sequence
            k_all, v_all = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # cache layout [B, Hkv, T, D]
        else:
            k_all = k_cache = write_rows(k_cache, k, lengths_b)
            v_all = v_cache = write_rows(v_cache, v, lengths_b)
        if causal_impl is None:
            out = ta.tree_attention(q, k_all, v_all, lengths_b, mask_btt, impl=attn_impl)
        else:
            out = fa.flash_attention(q, k_all, v_all, lengths_b, lengths_b + t, impl=causal_impl)
        out = out.reshape(b, t, self.cfg.num_heads * self.cfg.head_dim)
        return linear(out, self.o_proj[...], self.cfg.linear_impl), k_cache, v_cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate/up fused as [2F, H], rows ordered [F, 2]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = _dtype(cfg)
        self.cfg = cfg
        self.gate_up = _normal(rngs, (2 * cfg.intermediate_size, cfg.hidden_size), dt)
        self.down = _normal(rngs, (cfg.hidden_size, cfg.intermediate_size), dt)

    def __call__(self, x_bth: jax.Array) -> jax.Array:
        gu = linear(x_bth, self.gate_up[...], self.cfg.linear_impl)
        gu = gu.reshape(gu.shape[:2] + (-1, 2))
        act = jax.nn.silu(gu[..., 0]) * gu[..., 1]
        return linear(act, self.down[...], self.cfg.linear_impl)


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer. `input_norm=False` drops the input RMSNorm (the EAGLE drafter's layer)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, input_norm: bool = True):
        dt = _dtype(cfg)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt) if input_norm else nnx.data(None)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.mlp = MLP(cfg, rngs)

    def __call__(
        self, x, cos, sin, k_cache, v_cache, lengths, mask, attn_impl, causal_impl=None, mlp_chunk=0
    ):  # noqa: ANN001
        h = self.input_norm(x) if self.input_norm is not None else x
        a, k_cache, v_cache = self.attn(h, cos, sin, k_cache, v_cache, lengths, mask, attn_impl, causal_impl)
        x = x + a
        x = x + tiled(self.mlp, self.post_attn_norm(x), mlp_chunk)
        return x, k_cache, v_cache


def tiled(fn: Callable[[jax.Array], jax.Array], x_bth: jax.Array, chunk: int) -> jax.Array:
    """A token-wise `fn` on [B, T, H] in token chunks under `jax.checkpoint` (the last chunk zero-padded), so
    a long sequence never holds the MLP's [B, T, 2F] intermediates at once (ALST's tiled MLP); chunk 0 or
    T <= chunk: at once."""
    b, t, hd = x_bth.shape
    if not chunk or t <= chunk:
        return fn(x_bth)
    c = -(-t // chunk)
    xc = jnp.moveaxis(jnp.pad(x_bth, ((0, 0), (0, c * chunk - t), (0, 0))).reshape(b, c, chunk, hd), 1, 0)
    out = jax.lax.map(jax.checkpoint(fn), xc)
    return jnp.moveaxis(out, 0, 1).reshape(b, c * chunk, -1)[:, :t]


@flax.struct.dataclass
class ModelOutput:
    logits: jax.Array | None  # [B, T or K, V] float32
    hidden: jax.Array  # [B, T, H]: final normed hidden states
    cache: KVCache | StackedKVCache | None
    # [B, T, K * H]: the states of `Transformer.aux_layers` (EAGLE-3), or None
    aux_hidden: jax.Array | None = None

    @property
    def drafter_states(self) -> jax.Array:
        """What the drafter (and its recorded training data) reads per token: the final normed hidden state
        [B, T, H] (EAGLE-1), or with aux layers [aux ; final] [B, T, (K + 1) * H]: EAGLE-3 drafts from the K
        layers' states and its loss's target distribution is the final state's (`tlt_jax.models.eagle3`)."""
        if self.aux_hidden is None:
            return self.hidden
        return jnp.concatenate([self.aux_hidden, self.hidden.astype(self.aux_hidden.dtype)], axis=-1)


def causal_mask(batch: int, t: int) -> jax.Array:
    """[B, T, T] lower-triangular mask (prefill / trainer forward)."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


class Transformer(nnx.Module):
    """Llama/Qwen2 decoder: (tokens, positions, cache, mask) -> (logits, final hidden, cache)."""

    def __init__(
        self, cfg: ModelConfig, rngs: nnx.Rngs, stacked: bool = False, aux_layers: tuple[int, ...] = ()
    ):
        dt = _dtype(cfg)
        self.cfg = cfg
        self.aux_layers = check_aux_layers(cfg, aux_layers)
        self.embed = _normal(rngs, (cfg.vocab_size, cfg.hidden_size), dt)
        if stacked:  # one DecoderLayer with a leading [L] axis on every weight (see the module docstring)
            self.layers = _stacked_layers(cfg, rngs)
        else:
            self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.lm_head = (
            nnx.data(None) if cfg.tie_embeddings else _normal(rngs, (cfg.vocab_size, cfg.hidden_size), dt)
        )

    @property
    def stacked(self) -> bool:
        """The decoder stack's layout: stacked (one scanned `DecoderLayer`) or unrolled (a list)."""
        return isinstance(self.layers, DecoderLayer)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed[...], tokens, axis=0)

    def head_weight(self) -> jax.Array:
        return self.embed[...] if self.lm_head is None else self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """LM head (the tied embedding for SmolLM2), float32 logits."""
        return linear(hidden, self.head_weight(), self.cfg.linear_impl, preferred_element_type=jnp.float32)

    def __call__(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array,
        cache: KVCache | StackedKVCache | None = None,
        mask_btt: jax.Array | None = None,
        *,
        logits_index_bk: jax.Array | None = None,
        compute_logits: bool = True,
        attn_impl: str = "reference",
        causal_impl: str | None = None,
        remat: str = "none",
        mlp_chunk: int = 0,
    ) -> ModelOutput:
        """Forward T new tokens per row.

        cache: the T tokens are written at [cache.lengths, cache.lengths + T) (lengths are NOT advanced). With
        cache=None the T tokens are the whole sequence (trainer forward). mask_btt defaults to causal.
        logits_index_bk: compute logits only at these token indices ([B, K]); e.g. the last prompt token.
        causal_impl: attention is causal (no mask_btt) by `flash_attention(impl=causal_impl)` (the trainer;
        None: `tree_attention` by `attn_impl`). remat: per-layer rematerialisation policy (REMAT_POLICIES).
        A stacked model runs its layers as one `lax.scan` and takes a `StackedKVCache`.
        mlp_chunk (with causal_impl only): the MLP in token chunks of this size (`tiled`; 0: at once).
        """
        b, t = tokens_bt.shape
        chex.assert_shape(positions_bt, (b, t))
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat={remat!r}: use one of {REMAT_POLICIES}")
        if causal_impl is not None:
            if mask_btt is not None:
                raise ValueError("causal_impl is causal attention: pass no mask_btt (or causal_impl=None)")
        else:
            mask_btt = causal_mask(b, t) if mask_btt is None else mask_btt
            chex.assert_shape(mask_btt, (b, t, t))
        if cache is not None:
            chex.assert_equal(cache.batch_size, b)
            if isinstance(cache, StackedKVCache) != self.stacked:
                raise TypeError(
                    f"a {'stacked' if self.stacked else 'unrolled'} model takes a "
                    f"{'StackedKVCache' if self.stacked else 'KVCache'}, got {type(cache).__name__}"
                )
        lengths = cache.lengths if cache is not None else jnp.zeros((b,), jnp.int32)
        cos, sin = rope_cos_sin(positions_bt, self.cfg.head_dim, self.cfg.rope_theta)
        x = self.embed_tokens(tokens_bt)
        captured: dict[int, jax.Array] = {}
        if self.stacked:
            x, new_cache, captured = _scan_layers(
                self.layers,
                remat,
                (x, cos, sin, cache, lengths, mask_btt),
                (attn_impl, causal_impl, mlp_chunk),
                self.aux_layers,
            )
        else:
            new_k, new_v = [], []
            for i, layer in enumerate(self.layers):
                if i in self.aux_layers:
                    captured[i] = x
                kc = cache.k[i] if cache is not None else None
                vc = cache.v[i] if cache is not None else None
                x, kc, vc = _run_layer(
                    layer, remat, (x, cos, sin, kc, vc, lengths, mask_btt), attn_impl, causal_impl, mlp_chunk
                )
                new_k.append(kc)
                new_v.append(vc)
            new_cache = None if cache is None else cache.replace(k=tuple(new_k), v=tuple(new_v))
        captured[self.cfg.num_layers] = x
        aux = jnp.concatenate([captured[i] for i in self.aux_layers], axis=-1) if self.aux_layers else None
        hidden = self.norm(x)
        if not compute_logits:
            return ModelOutput(None, hidden, new_cache, aux)
        h = (
            hidden
            if logits_index_bk is None
            else jnp.take_along_axis(hidden, logits_index_bk[..., None], axis=1)
        )
        return ModelOutput(self.logits(h), hidden, new_cache, aux)


def check_aux_layers(cfg: ModelConfig, aux_layers: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Validate EAGLE-3 capture points: i in [0, num_layers] is the residual stream ENTERING layer i (i = L:
    the last layer's output before the final norm), as SGLang's `layers_to_capture` / vLLM's
    `aux_hidden_state_layers`; a checkpoint's `eagle_aux_hidden_state_layer_ids` are these minus one in
    SGLang's `eagle_config` key and these as they are in vLLM's top-level one (`drafter.eagle3_format`)."""
    layers = tuple(int(i) for i in aux_layers)
    bad = [i for i in layers if not 0 <= i <= cfg.num_layers]
    if bad:
        raise ValueError(
            f"aux layers {layers}: {bad} outside [0, {cfg.num_layers}] for a {cfg.num_layers}-layer target "
            "(set drafter.aux_layers to capture points in that range)"
        )
    return layers


def with_aux_layers(model: Transformer, aux_layers: tuple[int, ...]) -> Transformer:
    """The target `model` made to also return the states of `aux_layers` (`ModelOutput.aux_hidden`), in
    place: the capture points are static (part of the graph definition), so a target without them compiles
    exactly the programs it did before."""
    model.aux_layers = check_aux_layers(model.cfg, aux_layers)
    return model


def _run_layer(
    layer: DecoderLayer,
    remat: str,
    arrays: tuple,
    attn_impl: str,
    causal_impl: str | None,
    mlp_chunk: int = 0,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """One decoder layer on `arrays` (x, cos, sin, k_cache, v_cache, lengths, mask); under `jax.checkpoint`
    with the named policy unless remat == "none" (the layer is split so its weights enter as arguments)."""
    if remat == "none":
        return layer(*arrays, attn_impl, causal_impl, mlp_chunk)
    graphdef, state = nnx.split(layer)

    @functools.partial(jax.checkpoint, policy=getattr(jax.checkpoint_policies, remat))
    def run(state: nnx.State, arrays: tuple) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        return nnx.merge(graphdef, state)(*arrays, attn_impl, causal_impl, mlp_chunk)

    return run(state, arrays)


def _scan_layers(
    layers: DecoderLayer,
    remat: str,
    arrays: tuple,
    impl: tuple[str, str | None, int],
    aux_layers: tuple[int, ...] = (),
) -> tuple[jax.Array, StackedKVCache | None, dict[int, jax.Array]]:
    """The stacked decoder stack as one `lax.scan` over its [L]-leading parameters and the cache's [L] axis
    (nothing is stacked here: the program's operations do not grow with depth); the body under
    `jax.checkpoint` with the named policy unless remat == "none". `arrays`: (x, cos, sin, cache, lengths,
    mask); `impl`: (attn_impl, causal_impl, mlp_chunk). aux_layers: capture the stream entering these layers
    (a [K, B, T, H] carry; none without them). Returns (x, the updated cache or None, {layer: captured x})."""
    x, cos, sin, cache, lengths, mask = arrays
    graphdef, stacked = nnx.split(layers)
    kv = None if cache is None else (cache.k, cache.v)
    inner = tuple(i for i in aux_layers if i < jax.tree.leaves(stacked)[0].shape[0])
    ids = jnp.asarray(inner, jnp.int32)

    def body(carry: tuple, xs: tuple) -> tuple[tuple, tuple | None]:
        x, acc = carry
        state, kv_l, i = xs
        if acc is not None:
            acc = jnp.where((ids == i)[:, None, None, None], x[None], acc)
        kc, vc = (None, None) if kv_l is None else kv_l
        x, kc, vc = nnx.merge(graphdef, state)(x, cos, sin, kc, vc, lengths, mask, *impl)
        return (x, acc), None if kv_l is None else (kc, vc)

    if remat != "none":
        body = jax.checkpoint(body, policy=getattr(jax.checkpoint_policies, remat), prevent_cse=False)
    acc0 = jnp.zeros((len(inner),) + x.shape, x.dtype) if inner else None
    n = jax.tree.leaves(stacked)[0].shape[0]
    (x, acc), kv = jax.lax.scan(body, (x, acc0), (stacked, kv, jnp.arange(n, dtype=jnp.int32)))
    captured = {i: acc[k] for k, i in enumerate(inner)}
    return x, None if kv is None else cache.replace(k=kv[0], v=kv[1]), captured


def _stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    """`cfg.num_layers` decoder layers initialised as one `DecoderLayer` with [L]-leading weights."""

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(cfg, rngs)

    return make(rngs)


# ----------------------------------------------------------------------------------------------------------
# HF-named tensors -> our layout.


def hf_to_params(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> dict:
    """HF Llama/Qwen2-named float tensors -> a nested dict matching `nnx.state(model, nnx.Param)`."""
    g, kv, d, h = cfg.num_heads // cfg.num_kv_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise KeyError(
                f"Missing tensor {name!r} for a {cfg.architecture} model with {cfg.num_layers} layers."
            )
        return np.asarray(tensors[name], np.float32)

    layers = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q = get(p + "self_attn.q_proj.weight").reshape(kv, g, d, h)
        k = get(p + "self_attn.k_proj.weight").reshape(kv, 1, d, h)
        v = get(p + "self_attn.v_proj.weight").reshape(kv, 1, d, h)
        attn = {
            "qkv": np.concatenate([q, k, v], axis=1).reshape(-1, h),
            "o_proj": get(p + "self_attn.o_proj.weight"),
        }
        if cfg.qkv_bias:
            attn["qkv_bias"] = np.concatenate(
                [
                    get(p + "self_attn.q_proj.bias").reshape(kv, g, d),
                    get(p + "self_attn.k_proj.bias").reshape(kv, 1, d),
                    get(p + "self_attn.v_proj.bias").reshape(kv, 1, d),
                ],
                axis=1,
            ).reshape(-1)
        layers[i] = {
            "input_norm": {"weight": get(p + "input_layernorm.weight")},
            "attn": attn,
            "post_attn_norm": {"weight": get(p + "post_attention_layernorm.weight")},
            "mlp": {
                "gate_up": np.stack(
                    [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], axis=1
                ).reshape(-1, h),
                "down": get(p + "mlp.down_proj.weight"),
            },
        }
    params = {
        "embed": get("model.embed_tokens.weight"),
        "layers": layers,
        "norm": {"weight": get("model.norm.weight")},
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = get("lm_head.weight")
    return params


def from_hf_tensors(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> Transformer:
    """Build a Transformer holding the given HF-named weights (no random init of the full model)."""
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    flat_new = _flatten(hf_to_params(cfg, tensors))
    dt = _dtype(cfg)

    def fill(path: tuple, var: nnx.Variable) -> nnx.Variable:
        key = tuple(str(p) for p in path)
        if key not in flat_new:
            raise KeyError(f"No weight for parameter {'/'.join(key)}")
        arr = flat_new[key]
        if tuple(arr.shape) != tuple(var.shape):
            raise ValueError(f"Parameter {'/'.join(key)}: expected shape {tuple(var.shape)}, got {arr.shape}")
        return var.replace(jnp.asarray(arr, dt))

    state = nnx.map_state(fill, state)
    nnx.update(model, state)
    return model


def _flatten(tree: dict, prefix: tuple = ()) -> dict[tuple, np.ndarray]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + (str(k),)))
        else:
            out[prefix + (str(k),)] = v
    return out
