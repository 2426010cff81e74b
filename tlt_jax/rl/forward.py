"""The trainer's forward: response log-probs, entropies and hidden states of a GRPO batch
(`response_logprobs`), each prompt once and its samples on top of its KV cache, logits chunked at any length
(`chunked_logp_entropy`). See `tlt_jax.rl.trainer` for the batch layout and the programs that call it."""

from __future__ import annotations

from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import Transformer
from tlt_jax.rl.batch import TrainBatch


@flax.struct.dataclass
class ForwardOut:
    logp: jax.Array  # [G*n, Nb] log-prob of each response token under softmax(logits / temperature)
    entropy: jax.Array  # [G*n, Nb]
    hidden: jax.Array | None  # [G*n, Nb, H] final hidden state that predicts each response token (or None)


def _logp_entropy(model: Transformer, h_bnh: jax.Array, targets_bn: jax.Array, temperature: float):  # noqa: ANN202
    logits = model.logits(h_bnh) / temperature
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets_bn[..., None], axis=-1)[..., 0]
    probs = jnp.exp(logits - logz[..., None])
    return picked - logz, logz - jnp.sum(probs * logits, axis=-1)


def response_logprobs(
    model: Transformer,
    batch: TrainBatch,
    *,
    temperature: float,
    logits_chunk: int = 0,
    return_hidden: bool = False,
    attn_impl: str | None = "auto",
    remat: str = "none",
    scan_layers: bool = False,
    shard_rows: Any = None,
    gather_layer: Any = None,
    mlp_chunk: int = 0,
    shard_carry: Any = None,
) -> ForwardOut:
    """Trainer forward: each prompt once, then its n responses on top of the prompt's KV cache.

    The prompt pass writes the prompt's keys/values into a cache (as the engine's prefill does); its rows are
    repeated n times and the responses run as one causal block after each prompt's real length, so the
    prompt's cost is paid once per group, not once per sample, and gradients flow through the shared prompt
    activations (summed over its samples). Returns per-token log-probs of the responses [G*n, Nb].
    attn_impl: `flash_attention`'s implementation (auto | blockwise | reference | cudnn | pallas_tpu), or
    None for the rollout's tree attention under a causal mask (materialises [T, S] scores; tests compare).
    shard_rows: applied to the repeated response rows' cache, tokens and hidden states (the trainer's sharding
    constraint spreading the rows of a micro-batch over the data axis even when its groups cannot be);
    gather_layer: the trainer's FSDP all-gather of each scanned layer's parameters (`Transformer`);
    mlp_chunk: the MLP in token chunks of this size (`llama.tiled`; 0: at once); shard_carry: the residual
    stream's layout between scanned layers (`Transformer`).
    """
    g, tp = batch.prompt.shape
    n, nb = batch.group_size, batch.num_response
    chex.assert_shape(batch.prompt_len, (g,))
    chex.assert_shape([batch.response, batch.response_mask], (g, n, nb))
    cfg = model.cfg
    # causal attention (no mask given): the flash kernel, or (None) tree attention under a causal mask
    attn = dict(
        causal_impl=attn_impl,
        remat=remat,
        scan_layers=scan_layers,
        mlp_chunk=mlp_chunk,
        shard_carry=shard_carry,
        gather_layer=gather_layer,
        compute_logits=False,
    )
    # the prompt pass attends over exactly its Tp slots (query offset 0); the cache then grows for responses
    cache = KVCache.init(cfg, g, tp)
    pos_p = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (g, tp))
    out_p = model(batch.prompt, pos_p, cache, **attn)
    last = jnp.take_along_axis(out_p.hidden, (batch.prompt_len - 1)[:, None, None], axis=1)  # [G, 1, H]
    rows = jnp.repeat(jnp.arange(g), n)
    cache = out_p.cache.resize(tp + nb).advance(batch.prompt_len).take_rows(rows)
    resp = batch.rows(batch.response)
    if shard_rows is not None:
        cache, resp = shard_rows(cache), shard_rows(resp)
    pos_r = cache.lengths[:, None] + jnp.arange(nb, dtype=jnp.int32)[None, :]
    out_r = model(resp, pos_r, cache, **attn)
    h = jnp.concatenate([last[rows], out_r.hidden[:, :-1]], axis=1)  # [B, Nb, H]: predicts response[:, j]
    if shard_rows is not None:
        h = shard_rows(h)
    logp, ent = chunked_logp_entropy(model, h, resp, temperature, logits_chunk)
    return ForwardOut(logp=logp, entropy=ent, hidden=h if return_hidden else None)


def chunked_logp_entropy(
    model: Transformer, h_bnh: jax.Array, targets_bn: jax.Array, temperature: float, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropies [B, Nb] of the targets, the logits computed `chunk` columns at a time under
    `jax.checkpoint` (the backward pass recomputes each chunk's [B, chunk, V] logits, never holds [B, Nb, V]);
    the last chunk is zero-padded, so any Nb is chunked. chunk=0 (or Nb <= chunk): all columns at once."""
    b, nb = targets_bn.shape
    if not chunk or nb <= chunk:
        return _logp_entropy(model, h_bnh, targets_bn, temperature)
    c = -(-nb // chunk)
    h = jnp.pad(h_bnh, ((0, 0), (0, c * chunk - nb), (0, 0)))
    tgt = jnp.pad(targets_bn, ((0, 0), (0, c * chunk - nb)))
    hc = jnp.moveaxis(h.reshape(b, c, chunk, -1), 1, 0)
    tc = jnp.moveaxis(tgt.reshape(b, c, chunk), 1, 0)
    fn = jax.checkpoint(lambda x: _logp_entropy(model, x[0], x[1], temperature))
    logp, ent = jax.lax.map(fn, (hc, tc))
    return tuple(jnp.moveaxis(x, 0, 1).reshape(b, c * chunk)[:, :nb] for x in (logp, ent))
