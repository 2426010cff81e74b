"""The rollout forward with the layers under `lax.scan` (`tlt_jax.models.scan_decode`) vs the unrolled
`Transformer.__call__`, and what experiments/models/scan_rollout.py found decisive: XLA materialises every
per-layer slice of a stacked cache or weight (a copy of each layer's K/V cache and weights per step), which
the unrolled loop over per-layer buffers never does. So the rollout keeps the unrolled stack (issue #35)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from experiments.models import scan_rollout as sr
from tlt_jax.models import scan_decode as sd
from tlt_jax.models.config import tiny_config
from tlt_jax.models.kv_cache import StackedKVCache
from tlt_jax.models.llama import Transformer

TOL = 1e-5  # float32; the programs differ only in fusion and summation order (measured: ~1e-7)
B, S = 2, 32
CFG = tiny_config("qwen2", num_layers=3, vocab_size=96, linear_impl="xla")  # vocab != any layer's shape


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer(CFG, nnx.Rngs(0))


@pytest.mark.parametrize("t", [1, 4], ids=["decode_t1", "verify_t4_tree"])
def test_scanned_step_equals_unrolled(model: Transformer, t: int) -> None:
    """Both cache modes give the unrolled logits, hidden states and updated caches (a tree mask at T=4;
    rows at different lengths, so the per-row cache write is exercised)."""
    cache, tok, pos, mask = sr.tiny_inputs(CFG, batch=B, seq=S, t=t)
    graphdef, state = nnx.split(model)
    ref = jax.jit(lambda p, *a: nnx.merge(graphdef, p)(*a))(state, tok, pos, cache, mask)
    defs, params = sd.split_for_scan(model)
    stacked = StackedKVCache.from_cache(cache)
    for mode in sd.CACHE_MODES:
        step = jax.jit(lambda p, *a, mode=mode: sd.scan_forward(defs, p, *a, cache_mode=mode))
        logits, hidden, got = step(params, tok, pos, stacked, mask)
        assert logits.shape == ref.logits.shape == (B, t, CFG.vocab_size)
        assert float(jnp.max(jnp.abs(logits - ref.logits))) < TOL, mode
        assert float(jnp.max(jnp.abs(hidden - ref.hidden))) < TOL, mode
        assert float(jnp.max(jnp.abs(got.k - jnp.stack(ref.cache.k)))) < TOL, mode
        assert float(jnp.max(jnp.abs(got.v - jnp.stack(ref.cache.v)))) < TOL, mode
        assert (got.lengths == cache.lengths).all()


def _copies(variant: str, t: int) -> dict[str, dict[str, float]]:
    """Per-layer-shaped buffers one compiled f32 step (reference attention, XLA dots) materialises."""
    r = sr.compile_step(CFG, variant, "reference", B, S, t)
    return sr.materialised(r["hlo"], sr.layer_shapes(CFG, B, S), CFG.num_layers)


def test_unrolled_step_materialises_no_layer_cache_or_weight() -> None:
    """Today's rollout step: each layer's cache buffer is written in place and read where it is; no copy."""
    mat = _copies("unrolled", 4)
    assert all(rec["count"] == 0 for rec in mat.values()), mat


@pytest.mark.parametrize("variant", ["carry", "xs"])
def test_scanned_step_copies_every_layer_cache_and_weight(variant: str) -> None:
    """The decisive finding: under `lax.scan` over the stacked cache, each step materialises every layer's K
    and V cache slice (a dynamic-slice: as many bytes as the whole cache, written and read again) and every
    layer's four weight matrices. If XLA ever reads the slices in place this fails, and scanning the rollout
    should be measured again (experiments/models/scan_rollout.py)."""
    mat = _copies(variant, 1)
    assert mat["cache"]["count"] == 2 * CFG.num_layers, mat["cache"]
    assert mat["cache"].get("dynamic-slice", 0) == 2 * CFG.num_layers, mat["cache"]
    weights = [mat[k]["count"] for k in mat if k.startswith("w_")]
    assert weights == [CFG.num_layers] * 4, mat
