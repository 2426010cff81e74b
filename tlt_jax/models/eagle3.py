"""EAGLE-3 drafter (Li et al., 2025): fc over three target layers' states, one decoder layer whose attention
reads [embedding ; feature], its own final norm and a head over a reduced draft vocabulary.

The layout is SGLang's `LlamaForCausalLMEagle3` (python/sglang/srt/models/llama_eagle3.py) and vLLM's
`Eagle3LlamaForCausalLM`:

    f    = fc(concat(a_low, a_mid, a_high))          (3H -> H, no bias; skipped for the drafter's own feature)
    x    = concat(input_norm(embed(x_{t+1})), hidden_norm(f))      (2H: q/k/v read both side by side)
    r    = f + attn(x)
    h    = r + mlp(post_attn_norm(r))                 (the next chain step's feature, before the final norm)
    p    = softmax(lm_head(norm(h)))                  (over the Vd draft tokens; d2t maps them to target ids)

The target's states are the residual stream entering layers `aux_layers` (default SGLang's and vLLM's
(2, L // 2, L - 3)); a chain's first step reads them, every later step the drafter's own `h` (width H), as
SGLang's draft loop does. The embedding is the target's, shared as in EAGLE-1; the head and its vocabulary
are the drafter's own: `lm_head` [Vd, H] is a parameter, and the token ids of its rows (the d2t map, kept
beside the weights as `draft_vocab.npy`, `tlt_jax.drafter.draft_vocab`) are passed at call time, as EAGLE-1's
reduced vocabulary is. The drafter consumes `ModelOutput.drafter_states` ([aux ; final], (K + 1) H wide):
`project` reads the aux part; the final part is the loss's target distribution (`tlt_jax.drafter.loss`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.kernels.small_m_linear import linear
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import Drafter, drafter_config
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import DecoderLayer, RMSNorm, _normal, causal_mask, check_aux_layers, rope_cos_sin

DRAFTER_ARCHS = ("eagle", "eagle3")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's capture points for an L-layer target: (2, L // 2, L - 3), the stream entering those layers
    (SGLang `set_eagle3_layers_to_capture`, vLLM `get_eagle3_aux_hidden_state_layers`)."""
    if num_layers < 3:
        raise ValueError(
            f"EAGLE-3's default layers (2, L // 2, L - 3) need a target of >= 3 layers, got {num_layers}: "
            "set drafter.aux_layers to capture points in [0, L]"
        )
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Layer(DecoderLayer):
    """The drafter's decoder layer: `input_norm` on the embedding, `hidden_norm` on the feature, q/k/v over
    both (2H), the target family's attention output, post-attention norm and MLP."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs, input_norm=True)
        dt = jnp.dtype(cfg.dtype)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.attn.qkv = _normal(rngs, (self.attn.qkv.shape[0], 2 * cfg.hidden_size), dt)


class Eagle3Drafter(nnx.Module):
    """EAGLE-3 drafter (see the module docstring). Same call signature as EAGLE-1's `Drafter`."""

    arch = "eagle3"

    def __init__(
        self,
        target_cfg: ModelConfig,
        rngs: nnx.Rngs,
        *,
        draft_vocab_size: int | None = None,
        aux_layers: tuple[int, ...] | None = None,
    ):
        # SGLang's and vLLM's EAGLE-3 layer is Llama's without biases, whatever the target's family
        self.cfg = drafter_config(target_cfg).replace(qkv_bias=False)
        layers = default_aux_layers(target_cfg.num_layers) if aux_layers is None else aux_layers
        self.aux_layers = check_aux_layers(target_cfg, layers)
        h, k = self.cfg.hidden_size, len(self.aux_layers)
        vd = target_cfg.vocab_size if draft_vocab_size is None else int(draft_vocab_size)
        if not 0 < vd <= target_cfg.vocab_size:
            raise ValueError(f"draft_vocab_size={vd}: must be in [1, {target_cfg.vocab_size}]")
        dt = jnp.dtype(self.cfg.dtype)
        self.fc = _normal(rngs, (h, k * h), dt)
        self.layer = Eagle3Layer(self.cfg, rngs)
        self.norm = RMSNorm(h, self.cfg.rms_norm_eps, dt)
        self.lm_head = _normal(rngs, (vd, h), dt)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    @property
    def feature_width(self) -> int:
        """Width of the target states the first chain step reads: K * H."""
        return int(self.fc.shape[1])

    def project(self, feats: jax.Array, impl: str | None = None) -> jax.Array:
        """The feature f of a chain step: fc over the target's aux states (the first K * H of
        `drafter_states`), or the drafter's own previous output (width H) as it is."""
        h, w = self.cfg.hidden_size, feats.shape[-1]
        if w == h:
            return feats
        if w < self.feature_width:
            raise ValueError(
                f"EAGLE-3 drafter: features of width {w}; expected the target's {len(self.aux_layers)} aux "
                f"states (>= {self.feature_width}: a target built with `with_aux_layers`) or its own ({h})"
            )
        f = feats[..., : self.feature_width]
        if impl is None:
            return jnp.einsum("...i,hi->...h", f.astype(self.fc.dtype), self.fc[...])
        return linear(f.astype(self.fc.dtype), self.fc[...], impl)

    def layer_inputs(
        self, embeds: jax.Array, feats: jax.Array, impl: str | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """(attention input [.., 2H], residual [.., H]) of the decoder layer for these tokens and features."""
        f = self.project(feats, impl)
        x = jnp.concatenate(
            [self.layer.input_norm(embeds), self.layer.hidden_norm(f.astype(embeds.dtype))], -1
        )
        return x, f.astype(embeds.dtype)

    def head_hidden(self, h: jax.Array) -> jax.Array:
        """What the head reads: the drafter's own final norm of its output."""
        return self.norm(h)

    def logits(self, h: jax.Array, impl: str | None = None) -> jax.Array:
        """float32 logits over the draft vocabulary [.., Vd]."""
        x = self.head_hidden(h)
        if impl is None:
            return jnp.einsum("...h,vh->...v", x, self.lm_head[...], preferred_element_type=jnp.float32)
        return linear(x, self.lm_head[...], impl, preferred_element_type=jnp.float32)

    def init_cache(self, batch: int, seq_len: int) -> KVCache:
        return KVCache.init(self.cfg, batch, seq_len)

    def __call__(
        self,
        token_embeds_bth: jax.Array,
        feats_btf: jax.Array,
        positions_bt: jax.Array,
        cache: KVCache | None = None,
        mask_btt: jax.Array | None = None,
        *,
        attn_impl: str = "reference",
    ) -> tuple[jax.Array, KVCache | None]:
        """The drafter's output h [B, T, H] (before its final norm) and the cache with the T entries written
        (lengths not advanced), as `Drafter.__call__`; feats are the target's states or its own outputs."""
        b, t, _ = token_embeds_bth.shape
        chex.assert_shape(feats_btf, (b, t, None))
        mask_btt = causal_mask(b, t) if mask_btt is None else mask_btt
        x, resid = self.layer_inputs(token_embeds_bth, feats_btf, self.cfg.linear_impl)
        cos, sin = rope_cos_sin(positions_bt, self.cfg.head_dim, self.cfg.rope_theta)
        lengths = cache.lengths if cache is not None else jnp.zeros((b,), jnp.int32)
        kc = cache.k[0] if cache is not None else None
        vc = cache.v[0] if cache is not None else None
        a, kc, vc = self.layer.attn(x, cos, sin, kc, vc, lengths, mask_btt, attn_impl)
        out = resid + a
        out = out + self.layer.mlp(self.layer.post_attn_norm(out))
        new_cache = None if cache is None else KVCache(k=(kc,), v=(vc,), lengths=cache.lengths)
        return out, new_cache


AnyDrafter = Drafter | Eagle3Drafter


def make_drafter(
    arch: str,
    target_cfg: ModelConfig,
    rngs: nnx.Rngs,
    *,
    draft_vocab_size: int | None = None,
    aux_layers: tuple[int, ...] | None = None,
) -> AnyDrafter:
    """A drafter of `arch` ("eagle": EAGLE-1, the target's head; "eagle3": its own head over
    `draft_vocab_size` tokens, reading the target's `aux_layers` states) for a target of `target_cfg`."""
    if arch == "eagle":
        return Drafter(target_cfg, rngs)
    if arch == "eagle3":
        return Eagle3Drafter(target_cfg, rngs, draft_vocab_size=draft_vocab_size, aux_layers=aux_layers)
    raise ValueError(f"drafter.arch={arch!r}: use one of {DRAFTER_ARCHS}")


def drafter_spec(drafter: AnyDrafter) -> dict[str, Any]:
    """What rebuilds `drafter`'s architecture beside its weights (a checkpoint's meta "drafter")."""
    if drafter.arch == "eagle":
        return {"arch": "eagle"}
    return {
        "arch": "eagle3",
        "aux_layers": list(drafter.aux_layers),
        "draft_vocab_size": drafter.draft_vocab_size,
    }


def drafter_from_spec(spec: Mapping[str, Any], target_cfg: ModelConfig, rngs: nnx.Rngs) -> AnyDrafter:
    """The drafter a `drafter_spec` describes, for a target of `target_cfg` (fresh weights)."""
    aux = spec.get("aux_layers")
    return make_drafter(
        str(spec.get("arch", "eagle")),
        target_cfg,
        rngs,
        draft_vocab_size=spec.get("draft_vocab_size"),
        aux_layers=tuple(aux) if aux else None,
    )


def config_drafter_spec(config: Mapping[str, Any], target_cfg: ModelConfig) -> dict[str, Any]:
    """The drafter spec a run config asks for (`config.drafter.arch` / `aux_layers`; EAGLE-1 when the config
    has no such keys), EAGLE-3's capture points resolved for `target_cfg`: what the memory plans size."""
    section = config.get("drafter") if hasattr(config, "get") else None
    arch = str(section.get("arch", "eagle")) if section is not None else "eagle"
    if arch != "eagle3":
        return {"arch": arch}
    aux = tuple(section.get("aux_layers", ()) or ()) or default_aux_layers(target_cfg.num_layers)
    return {"arch": "eagle3", "aux_layers": list(check_aux_layers(target_cfg, aux))}


def spec_aux_layers(spec: Mapping[str, Any] | None) -> tuple[int, ...]:
    """The target capture points a drafter spec reads (none for EAGLE-1)."""
    return tuple((spec or {}).get("aux_layers") or ())


def states_width(hidden_size: int, aux_layers: tuple[int, ...]) -> int:
    """Width of one token's drafter states (`ModelOutput.drafter_states`): H, or (K + 1) H with K aux layers:
    what the recorded spans, the spot trainer's buffer and the memory plans hold per token."""
    return hidden_size * (len(aux_layers) + 1 if aux_layers else 1)


def drafter_aux_layers(drafter: AnyDrafter | None) -> tuple[int, ...]:
    """The target capture points a drafter reads (none for EAGLE-1 or no drafter)."""
    return tuple(getattr(drafter, "aux_layers", ()) or ())
