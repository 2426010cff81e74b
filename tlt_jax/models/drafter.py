"""EAGLE-1 drafter: fc(concat(embed(token), h_target)) -> one decoder layer (no input norm) -> target LM head.

The drafter owns only `fc` [H, 2H] (no bias) and one decoder layer of the target's family. The embedding and
LM head are the TARGET's, passed in at call time (shared, frozen for the drafter), so they follow the policy
as RL updates it and are never copied into the drafter's parameters or checkpoints.

Alignment (EAGLE): the input at position t pairs the target's feature h_t (final normed hidden state of the
target at t) with the token x_{t+1} sampled from it; the output is the drafter's prediction of h_{t+1}, and
`target.logits(h_draft)` the distribution of x_{t+2}. The drafter has its own one-layer KV cache whose
positions follow the target's (position t+1 for the pair (x_{t+1}, h_t)).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.kernels.small_m_linear import linear
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import DecoderLayer, _normal, causal_mask, rope_cos_sin


def drafter_config(target: ModelConfig) -> ModelConfig:
    """The drafter's config: the target's, with one layer."""
    return target.replace(num_layers=1)


class Drafter(nnx.Module):
    """EAGLE-1 drafter head (see module docstring)."""

    arch = "eagle"
    aux_layers: tuple[int, ...] = ()  # reads the target's final state only (EAGLE-3 reads several layers')

    def __init__(self, target_cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = drafter_config(target_cfg)
        h = self.cfg.hidden_size
        self.fc = _normal(rngs, (h, 2 * h), jnp.dtype(self.cfg.dtype))
        self.layer = DecoderLayer(self.cfg, rngs, input_norm=False)

    def layer_inputs(
        self, embeds: jax.Array, feats: jax.Array, impl: str | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """(attention input, residual) of the decoder layer: both x = fc(concat(embed, feature)) (the layer
        has no input norm). impl: the projection's `linear` implementation (None: an einsum, for training)."""
        x = jnp.concatenate([embeds, feats.astype(embeds.dtype)], axis=-1)
        x = jnp.einsum("...i,hi->...h", x, self.fc[...]) if impl is None else linear(x, self.fc[...], impl)
        return x, x

    def head_hidden(self, h: jax.Array) -> jax.Array:
        """What the (target's) head reads: the output itself (EAGLE-1 has no final norm)."""
        return h

    def init_cache(self, batch: int, seq_len: int) -> KVCache:
        return KVCache.init(self.cfg, batch, seq_len)

    def __call__(
        self,
        token_embeds_bth: jax.Array,
        target_hidden_bth: jax.Array,
        positions_bt: jax.Array,
        cache: KVCache | None = None,
        mask_btt: jax.Array | None = None,
        *,
        attn_impl: str = "reference",
    ) -> tuple[jax.Array, KVCache | None]:
        """Predict the next target features. Returns (h_draft [B, T, H], cache with the T entries written).

        token_embeds: `target.embed_tokens(x_{t+1})`; target_hidden: h_t. Like the target, the cache's lengths
        are not advanced here. With cache=None the T positions are the whole (possibly packed) sequence and
        mask_btt says who attends to whom (a block-diagonal causal mask for packed samples).
        """
        b, t, h = token_embeds_bth.shape
        chex.assert_shape(target_hidden_bth, (b, t, h))
        if mask_btt is None:
            mask_btt = causal_mask(b, t)
        x = jnp.concatenate([token_embeds_bth, target_hidden_bth.astype(token_embeds_bth.dtype)], axis=-1)
        x = linear(x, self.fc[...], self.cfg.linear_impl)
        cos, sin = rope_cos_sin(positions_bt, self.cfg.head_dim, self.cfg.rope_theta)
        lengths = cache.lengths if cache is not None else jnp.zeros((b,), jnp.int32)
        kc = cache.k[0] if cache is not None else None
        vc = cache.v[0] if cache is not None else None
        out, kc, vc = self.layer(x, cos, sin, kc, vc, lengths, mask_btt, attn_impl)
        new_cache = None if cache is None else KVCache(k=(kc,), v=(vc,), lengths=cache.lengths)
        return out, new_cache
