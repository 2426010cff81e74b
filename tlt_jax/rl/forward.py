"""The trainer's forward: response log-probs, entropies and hidden states of a GRPO batch
(`response_logprobs`), each prompt once and its samples on top of its KV cache, logits chunked at any length
(`chunked_logp_entropy`). See `tlt_jax.rl.trainer` for the batch layout and the programs that call it.

Sequence parallelism (`attn_impl` a `flash_attention.SequenceParallel`): the prompt and response columns are
zero-padded on the right to multiples of the axis size n (causal attention: no real token sees a pad; their
outputs are cut off), attention splits the tokens over the axis, and the log-probs are chunked within each
device's token shard ([B, n, Nb / n], logits_chunk / n columns of every shard at a time), so the chunk loop
runs over local columns and never gathers a row's hidden states. The rest of the layout is the caller's
(`shard_rows`, `gather_layer`, `shard_carry`: the trainer's)."""

from __future__ import annotations

from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.kernels.flash_attention import SequenceParallel
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import Transformer, causal_mask, rope_cos_sin
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
    attn_impl: str | SequenceParallel | None = "auto",
    remat: str = "none",
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
    attn_impl: `flash_attention`'s implementation (auto | blockwise | reference | cudnn | pallas_tpu, or a
    `SequenceParallel`: see the module docstring), or None for the rollout's tree attention under a causal
    mask (materialises [T, S] scores; tests compare).
    shard_rows: applied to the repeated response rows' cache, tokens and hidden states (the trainer's sharding
    constraint spreading the rows of a micro-batch over the data axis even when its groups cannot be);
    mlp_chunk: the MLP in token chunks of this size (`llama.tiled`; 0: at once).
    A stacked model's layers run as one scan (`_joint_scan`): gather_layer is applied to each layer's
    parameters in it (the trainer's cast and FSDP all-gather), shard_carry to the residual stream between
    layers (its tokens split over the model axis: all the backward pass keeps of a layer under remat
    nothing_saveable). An unrolled model's two passes take neither.
    """
    g, tp = batch.prompt.shape
    n, nb = batch.group_size, batch.num_response
    chex.assert_shape(batch.prompt_len, (g,))
    chex.assert_shape([batch.response, batch.response_mask], (g, n, nb))
    seq = attn_impl.size if isinstance(attn_impl, SequenceParallel) else 1
    prompt, resp = _pad_columns(batch.prompt, seq), _pad_columns(batch.rows(batch.response), seq)
    nbp = resp.shape[1]
    # causal attention (no mask given): the flash kernel, or (None) tree attention under a causal mask
    attn = dict(causal_impl=attn_impl, remat=remat, mlp_chunk=mlp_chunk, compute_logits=False)
    rows = jnp.repeat(jnp.arange(g), n)
    if shard_rows is not None:
        resp = shard_rows(resp)
    tokens, hooks = (prompt, batch.prompt_len, resp, rows), (shard_rows, gather_layer, shard_carry)
    hidden_p, hidden_r = (_joint_scan if model.stacked else _two_passes)(model, tokens, attn, hooks)
    last = jnp.take_along_axis(hidden_p, (batch.prompt_len - 1)[:, None, None], axis=1)  # [G, 1, H]
    # h [B, Nb, H] predicts response[:, j]: the prompt's last hidden state (j = 0), else the response's at
    # j - 1. A roll and a select: `concatenate([last, hidden_r[:, :-1]])` got wrong gradients from XLA's SPMD
    # partitioner when the token axis is split over the model axis (tests/rl/test_trainer.py,
    # test_paper_layout_gradients_equal_one_device)
    first = (jnp.arange(nbp) == 0)[None, :, None]
    h = jnp.where(first, last[rows], jnp.roll(hidden_r, 1, axis=1))
    if shard_rows is not None:
        h = shard_rows(h)
    if seq == 1:
        logp, ent = chunked_logp_entropy(model, h, resp, temperature, logits_chunk)
        return ForwardOut(logp=logp, entropy=ent, hidden=h if return_hidden else None)
    # chunked within each device's token shard: [B, n, Nb / n] with n over the sequence axis, logits_chunk / n
    # columns of each shard at a time (a row's logits_chunk columns over the n devices: per device, the
    # [rows, chunk, V / n] logits of tensor parallelism's vocabulary split)
    b, hd = h.shape[0], h.shape[2]
    hs = attn_impl.shard(h.reshape(b, seq, nbp // seq, hd), 1)
    ts = attn_impl.shard(resp.reshape(b, seq, nbp // seq), 1)
    chunk = max(logits_chunk // seq, 1) if logits_chunk else 0
    logp, ent = chunked_logp_entropy(model, hs, ts, temperature, chunk)
    logp, ent = (x.reshape(b, nbp)[:, :nb] for x in (logp, ent))
    return ForwardOut(logp=logp, entropy=ent, hidden=h[:, :nb] if return_hidden else None)


def _two_passes(
    model: Transformer, tokens: tuple[jax.Array, ...], attn: dict[str, Any], hooks: tuple
) -> tuple[jax.Array, jax.Array]:
    """An unrolled model's prompt pass (attending over exactly its Tp slots: query offset 0), then its
    response pass on the prompt's cache grown for them (rows repeated per sample). Arguments and result as
    `_joint_scan`'s (of the hooks, only shard_rows applies)."""
    prompt, prompt_len, resp, rows = tokens
    shard_rows = hooks[0]
    (g, tp), nb = prompt.shape, resp.shape[1]
    pos_p = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (g, tp))
    out_p = model(prompt, pos_p, KVCache.init(model.cfg, g, tp), **attn)
    cache = out_p.cache.resize(tp + nb).advance(prompt_len).take_rows(rows)
    cache = cache if shard_rows is None else shard_rows(cache)
    pos_r = cache.lengths[:, None] + jnp.arange(nb, dtype=jnp.int32)[None, :]
    return out_p.hidden, model(resp, pos_r, cache, **attn).hidden


def _joint_scan(
    model: Transformer, tokens: tuple[jax.Array, ...], attn: dict[str, Any], hooks: tuple
) -> tuple[jax.Array, jax.Array]:
    """A stacked model's prompt and response passes as ONE scan over its layers: layer l runs the prompts
    [G, Tp], then the responses [B, Nb] on top of that layer's prompt keys / values (its rows repeated per
    sample). Equal to two passes over the stack; but the backward scan emits one [L, ...] gradient per weight,
    not one per pass, and no [L, B, Hkv, Tp + Nb, D] cache of every layer is built (by the memory plan, the
    32B update at 32K: 7.6 + ~3 GiB per device). `tokens`: (prompt [G, Tp], prompt_len [G], responses
    [B, Nb], rows [B]: each row's prompt); `attn`: `response_logprobs`' keyword arguments for the model;
    `hooks`: its (shard_rows, gather_layer, shard_carry). Returns the final normed hidden states (prompts
    [G, Tp, H], responses [B, Nb, H])."""
    cfg = model.cfg
    prompt, prompt_len, resp, rows = tokens
    (g, tp), (b, nb) = prompt.shape, resp.shape
    causal, remat = attn["causal_impl"], attn["remat"]
    shard_rows, gather, shard_carry = hooks
    pos_p = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (g, tp))
    pos_r = prompt_len[rows][:, None] + jnp.arange(nb, dtype=jnp.int32)[None, :]
    rope_p = rope_cos_sin(pos_p, cfg.head_dim, cfg.rope_theta)
    rope_r = rope_cos_sin(pos_r, cfg.head_dim, cfg.rope_theta)
    masks = (None, None) if causal is not None else (causal_mask(g, tp), causal_mask(b, nb))
    graphdef, stacked = nnx.split(model.layers)
    carry_layout = (lambda x: x) if shard_carry is None else shard_carry

    def body(xs: tuple[jax.Array, jax.Array], state: nnx.State) -> tuple[tuple[jax.Array, jax.Array], None]:
        layer = nnx.merge(graphdef, state if gather is None else gather(state))
        x_p, x_r = (carry_layout(x) for x in xs)
        empty = KVCache.init(cfg.replace(num_layers=1), g, tp, x_p.dtype)
        run = dict(attn_impl="reference", causal_impl=causal, mlp_chunk=attn["mlp_chunk"])
        x_p, kc, vc = layer(x_p, *rope_p, empty.k[0], empty.v[0], empty.lengths, masks[0], **run)
        cache = KVCache(k=(kc,), v=(vc,), lengths=empty.lengths)
        cache = cache.resize(tp + nb).advance(prompt_len).take_rows(rows)
        cache = cache if shard_rows is None else shard_rows(cache)
        x_r, _, _ = layer(x_r, *rope_r, cache.k[0], cache.v[0], cache.lengths, masks[1], **run)
        return (carry_layout(x_p), carry_layout(x_r)), None

    if remat != "none":
        body = jax.checkpoint(body, policy=getattr(jax.checkpoint_policies, remat), prevent_cse=False)
    (x_p, x_r), _ = jax.lax.scan(body, (model.embed_tokens(prompt), model.embed_tokens(resp)), stacked)
    return model.norm(x_p), model.norm(x_r)


def _pad_columns(x: jax.Array, multiple: int) -> jax.Array:
    """[R, T] tokens zero-padded on the right to a multiple of `multiple` columns (the same array at 1)."""
    pad = -x.shape[1] % multiple
    return x if not pad else jnp.pad(x, ((0, 0), (0, pad)))


def chunked_logp_entropy(
    model: Transformer, h_bnh: jax.Array, targets_bn: jax.Array, temperature: float, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropies [..., Nb] of the targets [..., Nb] (hidden states [..., Nb, H]), the logits
    computed `chunk` columns at a time under `jax.checkpoint` (the backward pass recomputes each chunk's
    [..., chunk, V] logits, never holds [..., Nb, V]); the last chunk is zero-padded, so any Nb is chunked.
    chunk=0 (or Nb <= chunk): all columns at once."""
    *lead, nb = targets_bn.shape
    if not chunk or nb <= chunk:
        return _logp_entropy(model, h_bnh, targets_bn, temperature)
    c, k = -(-nb // chunk), len(lead)
    pad = ((0, 0),) * k + ((0, c * chunk - nb),)
    h = jnp.pad(h_bnh, pad + ((0, 0),))
    tgt = jnp.pad(targets_bn, pad)
    hc = jnp.moveaxis(h.reshape(*lead, c, chunk, h.shape[-1]), k, 0)
    tc = jnp.moveaxis(tgt.reshape(*lead, c, chunk), k, 0)
    fn = jax.checkpoint(lambda x: _logp_entropy(model, x[0], x[1], temperature))
    logp, ent = jax.lax.map(fn, (hc, tc))
    return tuple(jnp.moveaxis(x, 0, k).reshape(*lead, c * chunk)[..., :nb] for x in (logp, ent))
