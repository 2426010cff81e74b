"""Drafting chains over packed sequences: the drafter's later chain steps, run on its own features.

During rollout the EAGLE drafter drafts step 1 from the TARGET's feature h_t and every later step from its
own predicted feature. Two jobs need those later steps over a whole packed batch at once, with static
shapes: the acceptance evaluation (`evaluate.py`) and the drafter's "training-time test" (`loss.py`:
EAGLE-3 / HASS, train the chain steps on the drafter's own features so its accuracy does not collapse after
the first draft). Both use the helpers here.

Step j >= 2 at base index i of a row (pair (x_{i+1}, h_i), see `packing.eagle_inputs`) has input
(embed(token_j), h^_{j-1}) at drafter position pos_i + j - 1 and attends to the row's context, the true pairs
0..i of its segment (the block-diagonal causal mask row i, like the drafter's KV cache in rollout), plus the
chain's own earlier entries at i. `token_j` is the previous draft (evaluation of greedy chains) or the true
token x_{i+j} (teacher forcing: training, and the sampled-acceptance estimate, where an accepted draft is a
target sample). The drafter module's cache path cannot express a prefix per position, so the layer is
re-expressed here from the module's own weights; a brute-force test against `Drafter` keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tlt_jax.models.eagle3 import AnyDrafter
from tlt_jax.models.llama import Attention, DecoderLayer, apply_rope, rope_cos_sin


def shift_left(x: jax.Array, fill: Any) -> jax.Array:
    """x[:, i + 1] at index i along axis 1; the last index gets `fill`."""
    pad = jnp.full((x.shape[0], 1) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, 1:], pad], axis=1)


def shift_by(x: jax.Array, n: int, fill: Any) -> jax.Array:
    """x[:, i + n] at index i (fill past the row's end)."""
    for _ in range(n):
        x = shift_left(x, fill)
    return x


def take_rows(x: jax.Array, idx_rp: jax.Array) -> jax.Array:
    """x[r, idx[r, p], ...] for x [R, S, ...] -> [R, P, ...]."""
    idx = idx_rp.reshape(idx_rp.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def fuse_inputs(
    drafter: AnyDrafter, embed_w: jax.Array, tokens: jax.Array, feats: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The drafter layer's (attention input, residual) for these tokens and features: EAGLE-1's
    fc(concat(embed(tokens), feats)) twice, EAGLE-3's [input_norm(embed) ; hidden_norm(f)] and f."""
    return drafter.layer_inputs(jnp.take(embed_w, tokens, axis=0), feats)


def draft_logits(drafter: AnyDrafter, h: jax.Array, head_w: jax.Array) -> jax.Array:
    """float32 draft logits of the drafter's outputs: EAGLE-1 through the target's head `head_w` [V, H],
    EAGLE-3 through its own final norm and head (over its draft vocabulary; head_w unused)."""
    if drafter.arch == "eagle3":
        return drafter.logits(h)
    return jnp.einsum("...h,vh->...v", h, head_w, preferred_element_type=jnp.float32)


def project_qkv(attn: Attention, x_bnh: jax.Array, positions_bn: jax.Array) -> tuple[jax.Array, ...]:
    """The layer's fused QKV projection and RoPE: q [B, N, Hkv, G, D], k and v [B, N, Hkv, D].

    Mirrors `Attention.__call__` (rows of the fused weight ordered per KV group: G query heads, key, value);
    accepts the fused weight as [Hkv * (G + 2) * D, H] or [Hkv, G + 2, D, H]. The brute-force test against
    the Drafter module keeps the two in step.
    """
    cfg = attn.cfg
    kv, g, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    b, n = x_bnh.shape[:2]
    w = attn.qkv[...]
    qkv = jnp.einsum("bth,oh->bto", x_bnh, w.reshape(-1, w.shape[-1]))
    if attn.qkv_bias is not None:
        qkv = qkv + attn.qkv_bias[...].reshape(-1)
    qkv = qkv.reshape(b, n, kv, g + 2, d)
    cos, sin = rope_cos_sin(positions_bn, cfg.head_dim, cfg.rope_theta)
    return apply_rope(qkv[:, :, :, :g], cos, sin), apply_rope(qkv[:, :, :, g], cos, sin), qkv[:, :, :, g + 1]


def attend_with_chain(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    mask_ctx: jax.Array,
    k_chain: jax.Array | None,
    v_chain: jax.Array | None,
) -> jax.Array:
    """Query (b, t) attends to context keys s with mask_ctx[b, t, s] and to its own chain keys [b, t, :J]."""
    d = q.shape[-1]
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    s_ctx = jnp.einsum("btkgd,bskd->bkgts", q, k_ctx, preferred_element_type=jnp.float32) * scale
    s_ctx = jnp.where(mask_ctx[:, None, None], s_ctx, jnp.finfo(jnp.float32).min)
    n_ctx = s_ctx.shape[-1]
    if k_chain is None:
        p = jax.nn.softmax(s_ctx, axis=-1)
        return jnp.einsum(
            "bkgts,bskd->btkgd", p.astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32
        )
    s_ch = jnp.einsum("btkgd,btjkd->bkgtj", q, k_chain, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(jnp.concatenate([s_ctx, s_ch], axis=-1), axis=-1).astype(v_ctx.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", p[..., :n_ctx], v_ctx, preferred_element_type=jnp.float32)
    return out + jnp.einsum("bkgtj,btjkd->btkgd", p[..., n_ctx:], v_chain, preferred_element_type=jnp.float32)


def finish_layer(layer: DecoderLayer, x_bth: jax.Array, attn_btkgd: jax.Array) -> jax.Array:
    """Output projection, residual (x_bth: the layer's residual input) and MLP of the drafter's layer."""
    b, t = attn_btkgd.shape[:2]
    w = layer.attn.o_proj[...]
    a = jnp.einsum("bti,hi->bth", attn_btkgd.reshape(b, t, -1).astype(x_bth.dtype), w.reshape(w.shape[0], -1))
    x = x_bth + a
    return x + layer.mlp(layer.post_attn_norm(x))


class ChainContext:
    """Step 1 of every pair of a packed batch plus the context keys that the later chain steps attend to.

    `x` is the fused drafter input of each pair, `h` the drafter's predicted feature (step 1, [R, S, H]),
    `k`/`v` the context keys and values, `positions`/`mask` the drafter positions and block-diagonal mask.
    """

    def __init__(
        self,
        drafter: AnyDrafter,
        embed_w: jax.Array,
        next_tokens: jax.Array,
        hidden_in: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
    ):
        layer = drafter.layer
        self.drafter, self.embed_w = drafter, embed_w
        self.positions, self.mask = positions, mask
        x, resid = fuse_inputs(drafter, embed_w, next_tokens, hidden_in)
        q, self.k, self.v = project_qkv(layer.attn, x, positions)
        self.h = finish_layer(layer, resid, attend_with_chain(q, self.k, self.v, mask, None, None))

    def steps(
        self, idx_rp: jax.Array, depth: int, next_token: Callable[[int, jax.Array], jax.Array]
    ) -> list[jax.Array]:
        """Features of chain steps 1..depth at base indices idx [R, P]: a list of [R, P, H].

        `next_token(j, h_j)` gives step j + 1's input token ([R, P]) from step j's feature: the true token
        x_{i+j+1} (teacher forcing) or the drafter's own choice (drafting).
        """
        layer = self.drafter.layer
        h = take_rows(self.h, idx_rp)
        pos, mask = take_rows(self.positions, idx_rp), take_rows(self.mask, idx_rp)
        feats, k_ch, v_ch = [h], [], []
        for j in range(2, depth + 1):
            x, resid = fuse_inputs(self.drafter, self.embed_w, next_token(j - 1, h), h)
            q, k, v = project_qkv(layer.attn, x, pos + (j - 1))
            k_ch.append(k)
            v_ch.append(v)
            out = attend_with_chain(q, self.k, self.v, mask, jnp.stack(k_ch, axis=2), jnp.stack(v_ch, axis=2))
            h = finish_layer(layer, resid, out)
            feats.append(h)
        return feats

    def teacher_forced(self, next_tokens: jax.Array, idx_rp: jax.Array, depth: int) -> list[jax.Array]:
        """`steps` fed with the true tokens: step j's input token is x_{i+j} = next_tokens[i + j - 1]."""
        return self.steps(idx_rp, depth, lambda j, _: take_rows(shift_by(next_tokens, j, 0), idx_rp))
