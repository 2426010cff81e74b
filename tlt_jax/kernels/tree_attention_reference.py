"""Tree-verification attention's contract in plain jnp: the oracle every kernel is tested against.

`tree_attention_reference` is the math (float32, any backend); `check_inputs` the shapes and dtypes every
entry point accepts; `with_reference_grad` gives a forward-only kernel (`pallas_call` has no autodiff rule)
exact gradients by differentiating the reference. The GPU (Triton) kernel in `tree_attention` and the TPU
(Mosaic) kernel in `tree_attention_tpu` share them, so there is one statement of the contract.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp

from tlt_jax.kernels.tree_attention_sharding import partitioned

_Arrays5 = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]


def visibility_mask(lengths_b: jax.Array, tree_mask_btt: jax.Array, seq_len: int) -> jax.Array:
    """[B, T, S] bool: which cache positions each new token may attend to."""
    t = tree_mask_btt.shape[1]
    j = jnp.arange(seq_len, dtype=jnp.int32)[None, :]  # [1, S]
    rel = j - lengths_b[:, None]  # [B, S]
    prefix = (rel < 0)[:, None, :]  # [B, 1, S]
    in_tree = (rel >= 0) & (rel < t)
    rel_idx = jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], (rel.shape[0], t, seq_len))
    tree_vis = jnp.take_along_axis(tree_mask_btt, rel_idx, axis=2)
    return prefix | (in_tree[:, None, :] & tree_vis)


def tree_attention_reference(
    q_bthd: jax.Array,
    k_bhsd: jax.Array,
    v_bhsd: jax.Array,
    lengths_b: jax.Array,
    tree_mask_btt: jax.Array,
) -> jax.Array:
    """Reference (jnp) tree attention; see the module docstring for the contract.

    Computed in float32 whatever the input dtype: it is the oracle, and XLA's CPU dot has no
    bf16 x bf16 -> f32 path for this (transpose-free) layout.
    """
    b, t, hq, d = q_bthd.shape
    hkv, s = k_bhsd.shape[1], k_bhsd.shape[2]
    g = hq // hkv
    q = q_bthd.reshape(b, t, hkv, g, d).astype(jnp.float32)
    k_bhsd, v_bhsd = k_bhsd.astype(jnp.float32), v_bhsd.astype(jnp.float32)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k_bhsd)
    scores = scores * (1.0 / jnp.sqrt(jnp.float32(d)))
    vis = visibility_mask(lengths_b, tree_mask_btt, s)[:, None, None, :, :]  # [B,1,1,T,S]
    scores = jnp.where(vis, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v_bhsd)
    return out.reshape(b, t, hq, d).astype(q_bthd.dtype)


def check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tree_mask: jax.Array) -> None:
    """Shape/dtype contract of every entry point (raises at trace time)."""
    chex.assert_rank([q, k, v, lengths, tree_mask], [4, 4, 4, 1, 3])
    b, t, hq, d = q.shape
    chex.assert_equal_shape([k, v])
    chex.assert_axis_dimension(k, 0, b)
    chex.assert_axis_dimension(k, 3, d)
    chex.assert_shape(lengths, (b,))
    chex.assert_shape(tree_mask, (b, t, t))
    chex.assert_type(lengths, int)
    chex.assert_type(tree_mask, bool)
    chex.assert_is_divisible(hq, k.shape[1])
    chex.assert_axis_dimension_gteq(k, 2, t)


def with_reference_grad(forward: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """`forward(q, k, v, lengths, tree_mask, block_sizes, interpret)` with a VJP that recomputes the same
    math through `tree_attention_reference` (exact gradients for a forward-only kernel), and split over a
    device mesh by rows and heads (`tree_attention_sharding.partitioned`, inside the VJP: there is no
    differentiation rule for `custom_partitioning`)."""

    def sharded(*args: Any) -> jax.Array:
        *arrays, block_sizes, interpret = args
        if not isinstance(interpret, bool):  # the TPU interpreter (host callbacks) runs as one device
            return forward(*args)
        return partitioned(lambda *a: forward(*a, block_sizes, interpret))(*arrays)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
    def with_grad(
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        lengths: jax.Array,
        tree_mask: jax.Array,
        block_sizes: Any,
        interpret: Any,
    ) -> jax.Array:
        return sharded(q, k, v, lengths, tree_mask, block_sizes, interpret)

    def fwd(*args: Any) -> tuple[jax.Array, _Arrays5]:
        return sharded(*args), args[:5]

    def bwd(
        block_sizes: Any, interpret: Any, res: _Arrays5, g_out: jax.Array
    ) -> tuple[jax.Array | None, ...]:
        del block_sizes, interpret
        q, k, v, lengths, tree_mask = res
        _, vjp = jax.vjp(lambda q_, k_, v_: tree_attention_reference(q_, k_, v_, lengths, tree_mask), q, k, v)
        return (*vjp(g_out), None, None)

    with_grad.defvjp(fwd, bwd)
    return with_grad
