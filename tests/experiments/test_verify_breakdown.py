"""The kernel/loop counter behind `bench_verify_cost.py --breakdown`, on a program whose answer is known: a
5-trip `fori_loop` whose body holds a `lax.cond` with a cheap and a costly branch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from experiments.bench.verify_breakdown import hlo_counts  # noqa: E402


def _program(x: jax.Array) -> jax.Array:
    def body(i: jax.Array, acc: jax.Array) -> jax.Array:
        costly = lambda a: jnp.sort(jnp.tanh(a) * 2.0 + jnp.exp(a))  # noqa: E731
        return lax.cond(acc[0] > 100.0, costly, lambda a: a, acc) + i.astype(acc.dtype)

    return lax.fori_loop(0, 5, body, x)


def test_counts_loops_trips_and_the_costlier_branch():
    text = jax.jit(_program).lower(jnp.ones((16,), jnp.float32)).compile().as_text()
    c = hlo_counts(text)
    assert c.loops == 1 and c.trips == 5 and c.unknown == 0
    assert c.sorts == 5  # the costlier branch's sort, once per trip
    assert c.optional > 0  # kernels that run only when the costly branch is taken
    assert sum(c.where.values()) == 5
