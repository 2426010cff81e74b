"""Tree attention: the Pallas kernel against the jnp reference, and the reference against a naive numpy loop.

On CPU the kernel runs in Pallas interpret mode (inside jax.jit); on a GPU the same tests compile it with
Triton (and check that the program holds the Triton custom call). `TLT_PALLAS_INTERPRET=0|1` forces the mode
(gpu/suite.py sets 0 on the GPU, so a JAX that silently fell back to the CPU fails loudly instead
of passing interpreted). Tolerances are per dtype (`ATOL`). The kernel cases are a hand-picked cover of the
shape grid (T in {1, 8, 16, 48}, S in {64, 256}, Hq/Hkv in {4/4, 6/2, 8/2}, D in {32, 64}, plus
block/split/padding variants) rather than the full product: each distinct shape is one XLA compile of the
interpreted kernel (~1-3 s)."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.kernels import tree_attention as ta
from tlt_jax.kernels import tree_attention_blocks as tab
from tlt_jax.kernels import triton_check
from tlt_jax.kernels.tree_attention_reference import tree_attention_reference

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")
_MODE = os.environ.get("TLT_PALLAS_INTERPRET", "auto")
INTERPRET = {"0": False, "1": True}.get(_MODE, not ON_GPU)
TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call Pallas's Triton lowering emits
cpu_only = pytest.mark.skipif(ON_GPU, reason="the CPU FFI kernel runs on the CPU backend only")
ATOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# Interpreted kernels are big while-loop programs: the XLA CPU backend compiles them ~40% faster at -O0, and
# only their numbers matter here.
_FAST_COMPILE = {"xla_backend_optimization_level": 0} if INTERPRET else None


def random_tree_mask(rng: np.random.Generator, t: int) -> np.ndarray:
    """[T, T] bool of a random forest in topological order: node i sees itself and all its ancestors."""
    mask = np.zeros((t, t), dtype=bool)
    for i in range(t):
        parent = int(rng.integers(-1, i)) if i > 0 else -1
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def make_inputs(
    seed: int, b: int, t: int, s: int, hq: int, hkv: int, d: int, dtype: jnp.dtype
) -> tuple[jax.Array, ...]:
    """Random q/k/v with ragged lengths: row 0 is a prefill (length 0, causal mask), the last row fills S
    exactly, the rest are random; middle rows get random valid trees. Cache slots past lengths+T hold large
    values, so any read of a dead slot shows up in the output."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, hq, d), dtype=np.float32)
    k = rng.standard_normal((b, s, hkv, d), dtype=np.float32)
    v = rng.standard_normal((b, s, hkv, d), dtype=np.float32)
    lengths = rng.integers(1, s - t + 1, size=b).astype(np.int32)
    lengths[0], lengths[-1] = 0, s - t
    masks = np.stack([random_tree_mask(rng, t) for _ in range(b)])
    masks[0] = np.tril(np.ones((t, t), dtype=bool))
    for row in range(b):
        dead = slice(lengths[row] + t, s)
        k[row, dead] *= 50.0
        v[row, dead] = 1e3
    cast = lambda x: jnp.asarray(x, dtype)
    # the cache contract is [B, Hkv, S, D]
    return (
        cast(q),
        cast(k.transpose(0, 2, 1, 3)),
        cast(v.transpose(0, 2, 1, 3)),
        jnp.asarray(lengths),
        jnp.asarray(masks),
    )


def reference(*args: jax.Array) -> jax.Array:
    """The oracle at full fp32 matmul precision (on GPUs XLA's default fp32 matmul is TF32)."""
    with jax.default_matmul_precision("highest"):
        return jax.jit(tree_attention_reference)(*args)


def run_kernel(args: tuple[jax.Array, ...], block_sizes: tab.BlockSizes | None) -> jax.Array:
    """The public entry with impl="pallas", jitted (as callers do), compiled once and run."""
    fn = jax.jit(
        functools.partial(ta.tree_attention, impl="pallas", interpret=INTERPRET, block_sizes=block_sizes)
    )
    lowered = fn.lower(*args)
    if not INTERPRET:  # compiled: the kernel must be a Triton call in the program, not an interpreted loop
        assert TRITON_CALL in lowered.as_text()
    return lowered.compile(_FAST_COMPILE)(*args)


@pytest.mark.skipif(_MODE != "0", reason="only when TLT_PALLAS_INTERPRET=0 asks for the compiled kernel")
def test_compiled_mode_has_a_gpu() -> None:
    """TLT_PALLAS_INTERPRET=0 means "compile the kernel": that needs JAX on a GPU backend."""
    assert ON_GPU, f"TLT_PALLAS_INTERPRET=0 but JAX's backend is {jax.default_backend()!r} (no GPU found)"


KERNEL_CASES = [
    # (T, S, Hq, Hkv, D, dtype, block_sizes)
    pytest.param(1, 256, 8, 2, 64, jnp.float32, None, id="decode-T1-S256-gqa4-f32"),
    pytest.param(8, 64, 6, 2, 32, jnp.float32, None, id="verify-T8-S64-gqa3-f32"),
    pytest.param(16, 256, 4, 4, 64, jnp.bfloat16, None, id="verify-T16-S256-mha-bf16"),
    pytest.param(
        48, 256, 6, 2, 32, jnp.float32, tab.BlockSizes(block_q=32, block_k=32), id="T48-S256-2treechunks-f32"
    ),
    pytest.param(16, 256, 8, 2, 64, jnp.float32, tab.BlockSizes(kv_splits=3), id="T16-S256-kvsplit3-f32"),
    pytest.param(48, 64, 8, 2, 64, jnp.bfloat16, None, id="T48-S64-gqa4-bf16"),
    pytest.param(  # kv_splits=0 picks 4 splits here (18 programs -> 64); the last takes 2 tree chunks
        48,
        256,
        6,
        2,
        32,
        jnp.float32,
        tab.BlockSizes(block_k=32, kv_splits=0, target_programs=64, min_split_blocks=1),
        id="T48-auto4",
    ),
    pytest.param(8, 80, 6, 2, 48, jnp.float32, None, id="pad-S80-D48-f32"),
    pytest.param(
        1, 64, 4, 4, 32, jnp.bfloat16, tab.BlockSizes(block_k=16, kv_splits=2), id="decode-T1-kvsplit2-bf16"
    ),
]


@pytest.mark.parametrize(("t", "s", "hq", "hkv", "d", "dtype", "block_sizes"), KERNEL_CASES)
def test_kernel_matches_reference(
    t: int, s: int, hq: int, hkv: int, d: int, dtype: jnp.dtype, block_sizes: tab.BlockSizes | None
) -> None:
    args = make_inputs(seed=t * 1000 + s + d, b=3, t=t, s=s, hq=hq, hkv=hkv, d=d, dtype=dtype)
    out = run_kernel(args, block_sizes)
    want = reference(*args)
    assert out.shape == (3, t, hq, d) and out.dtype == dtype
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(want, np.float32), atol=ATOL[dtype], rtol=RTOL[dtype]
    )


@pytest.mark.parametrize(
    ("t", "s", "hq", "hkv", "d", "dtype", "block_sizes"),
    [(16, 1024, 28, 4, 128, jnp.bfloat16, None), (8, 80, 9, 3, 48, jnp.float32, tab.BlockSizes(kv_splits=2))],
)
def test_kernel_lowers_to_triton(
    t: int, s: int, hq: int, hkv: int, d: int, dtype: jnp.dtype, block_sizes: tab.BlockSizes | None
) -> None:
    """Lowering for CUDA needs no GPU and runs Pallas's Triton lowering, which rejects what Triton cannot
    take (non-power-of-two tiles, unsupported ops); the MLIR verifier then checks the Triton module as XLA
    would on the GPU (tests/kernels/test_triton_module.py covers every variant): a cheap guard on CPU CI."""
    args = make_inputs(seed=1, b=2, t=t, s=s, hq=hq, hkv=hkv, d=d, dtype=dtype)
    fn = functools.partial(ta.tree_attention_pallas, block_sizes=block_sizes, interpret=False)
    try:
        lowered = triton_check.lower_for_cuda(fn, *args)
    except RuntimeError as e:  # jax 0.11 reads the GPU's compute capability while lowering for CUDA
        if ON_GPU or "No supported GPU devices" not in str(e):
            raise
        pytest.skip(f"jax {jax.__version__} lowers Pallas for CUDA only with a GPU present")
    assert TRITON_CALL in lowered.as_text()
    assert len(triton_check.verify_triton_modules(lowered)) == 1


def test_kernel_gradient_matches_reference() -> None:
    """The kernel's custom VJP (backward through the reference) gives the reference's gradients."""
    q, k, v, lengths, mask = make_inputs(seed=7, b=2, t=8, s=64, hq=4, hkv=2, d=32, dtype=jnp.float32)
    w = jax.random.normal(jax.random.key(0), q.shape)

    def loss(impl: str, q_: jax.Array, k_: jax.Array, v_: jax.Array) -> jax.Array:
        out = ta.tree_attention(q_, k_, v_, lengths, mask, impl=impl, interpret=INTERPRET)
        return jnp.sum(out * w)

    with jax.default_matmul_precision("highest"):
        grad_kernel = jax.jit(jax.grad(functools.partial(loss, "pallas"), argnums=(0, 1, 2)))
        got = grad_kernel.lower(q, k, v).compile(_FAST_COMPILE)(q, k, v)
        want = jax.jit(jax.grad(functools.partial(loss, "reference"), argnums=(0, 1, 2)))(q, k, v)
    for g_got, g_want in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_want), atol=1e-5, rtol=1e-5)


def _has_pallas_call(fn: functools.partial, *args: jax.Array) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.skipif(ON_GPU, reason="auto picks the kernel on GPUs")
def test_auto_on_cpu_is_the_reference() -> None:
    args = make_inputs(seed=3, b=2, t=4, s=32, hq=6, hkv=2, d=16, dtype=jnp.float32)
    auto = functools.partial(ta.tree_attention, impl="auto")
    assert not _has_pallas_call(auto, *args)
    assert _has_pallas_call(functools.partial(ta.tree_attention, impl="pallas"), *args)
    want = jax.jit(tree_attention_reference)(*args)
    np.testing.assert_array_equal(np.asarray(auto(*args)), np.asarray(want))


@pytest.mark.parametrize("impl", ["triton", "", "Pallas"])
def test_bad_impl_raises(impl: str) -> None:
    args = make_inputs(seed=5, b=1, t=2, s=16, hq=2, hkv=1, d=16, dtype=jnp.float32)
    with pytest.raises(ValueError, match="impl must be one of"):
        ta.tree_attention(*args, impl=impl)


def test_bad_block_sizes_raise() -> None:
    with pytest.raises(ValueError, match="power of two"):
        tab.BlockSizes(block_k=24)
    with pytest.raises(ValueError, match="kv_splits"):
        tab.BlockSizes(kv_splits=-1)
    with pytest.raises(ValueError, match="target_programs"):
        tab.BlockSizes(kv_splits=0, target_programs=0)
    with pytest.raises(ValueError, match="min_split_blocks"):
        tab.BlockSizes(min_split_blocks=0)
    with pytest.raises(ValueError, match="unknown fields"):
        tab.BlockSizes.from_dict({"block_q": 32, "blockk": 32})


def test_auto_kv_splits_fill_the_grid() -> None:
    """kv_splits=0: the fewest splits that reach target_programs, each keeping min_split_blocks key blocks;
    else fixed. The default is the per-call rule (a fixed 1 starved the 7B batch-1 decode on the H200)."""
    auto = tab.BlockSizes(kv_splits=0, target_programs=256, min_split_blocks=1)
    assert auto.splits_for(programs=3, key_blocks=16) == 16  # SmolLM2 heads, B=1, T=16: 3 programs
    assert auto.splits_for(programs=24, key_blocks=16) == 11  # ceil(256 / 24)
    assert auto.splits_for(programs=96, key_blocks=16) == 3
    assert auto.splits_for(programs=768, key_blocks=16) == 1  # B=32 Qwen heads, T=64: no split
    assert tab.BlockSizes(kv_splits=2).splits_for(programs=768, key_blocks=16) == 2
    default = tab.BlockSizes()
    assert default.kv_splits == 0
    assert default.splits_for(programs=3, key_blocks=16) == 4  # S=1024: 4 blocks per split (H200 tuning)
    assert default.splits_for(programs=4, key_blocks=512) == 64  # Qwen 7B, B=1, 32K cache: 256 programs
    assert default.splits_for(programs=4, key_blocks=64) == 16  # ... 4K cache: 4 blocks (256 keys) per split
    assert default.splits_for(programs=128, key_blocks=512) == 2  # B=32 at 32K: the batch fills the grid
    assert default.splits_for(programs=4, key_blocks=3) == 1  # a short cache is never split


def test_tuned_block_sizes_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The tuning hook: $TLT_TREE_ATTENTION_BLOCK_SIZES (a file from bench_tree_attention.py --tune, or
    inline JSON) sets the sizes per dtype for callers that pass none; the kernel then runs with them."""
    tuned = tab.BlockSizes(block_q=16, block_k=32, kv_splits=2)
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"by_dtype": {"float32": tuned.to_dict()}, "device": "test"}))
    tab.default_block_sizes.cache_clear()
    try:
        monkeypatch.setenv(tab.BLOCK_SIZES_ENV, str(path))
        assert tab.default_block_sizes("float32") == tuned
        assert tab.default_block_sizes("bfloat16") == tab.BlockSizes()  # not tuned for this dtype
        args = make_inputs(seed=11, b=2, t=4, s=64, hq=4, hkv=2, d=16, dtype=jnp.float32)
        fn = jax.jit(functools.partial(ta.tree_attention_pallas, interpret=INTERPRET))
        # the traced kernel took the tuned sizes: a 4-D grid whose last axis is the 2 KV splits
        assert "grid=(2, 2, 1, 2)" in str(jax.make_jaxpr(fn)(*args))
        np.testing.assert_allclose(
            np.asarray(fn(*args)), np.asarray(reference(*args)), atol=ATOL[jnp.float32], rtol=1e-5
        )
        tab.default_block_sizes.cache_clear()
        monkeypatch.setenv(tab.BLOCK_SIZES_ENV, '{"by_dtype": {"float32": {"block_q": 24}}}')
        with pytest.raises(ValueError, match="power of two"):
            tab.default_block_sizes("float32")
    finally:
        tab.default_block_sizes.cache_clear()


def naive_tree_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, lengths: np.ndarray, mask: np.ndarray
) -> np.ndarray:
    """The contract spelled out with loops, in float64: one (row, query head, token) at a time."""
    k, v = np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2)  # [B, Hkv, S, D] -> [B, S, Hkv, D] for indexing
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    out = np.zeros((b, t, hq, d), np.float64)
    for row in range(b):
        for h in range(hq):
            kv_head = h // (hq // hkv)
            for i in range(t):
                keys = list(range(lengths[row]))
                keys += [lengths[row] + j for j in range(t) if mask[row, i, j]]
                scores = np.array([q[row, i, h] @ k[row, j, kv_head] for j in keys]) / np.sqrt(d)
                probs = np.exp(scores - scores.max())
                probs /= probs.sum()
                out[row, i, h] = probs @ v[row, keys, kv_head]
    return out


@pytest.mark.parametrize(
    ("seed", "b", "t", "s", "hq", "hkv", "d"),
    [(0, 3, 5, 24, 6, 2, 8), (1, 2, 1, 16, 4, 4, 16), (2, 4, 8, 20, 8, 2, 4)],
)
def test_reference_matches_naive_loop(seed: int, b: int, t: int, s: int, hq: int, hkv: int, d: int) -> None:
    """Checks the oracle itself: ragged lengths, random trees, GQA head mapping."""
    q, k, v, lengths, mask = make_inputs(seed, b, t, s, hq, hkv, d, jnp.float32)
    got = reference(q, k, v, lengths, mask)
    want = naive_tree_attention(*(np.asarray(x) for x in (q, k, v, lengths, mask)))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_random_tree_mask_is_ancestor_closed() -> None:
    """The generator's masks are valid trees: a node sees itself plus exactly what its parent sees."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        mask = random_tree_mask(rng, 12)
        assert mask.diagonal().all() and not np.triu(mask, 1).any()
        for i in range(1, 12):
            ancestors = mask[i].copy()
            ancestors[i] = False
            if ancestors.any():
                parent = int(np.flatnonzero(ancestors).max())
                np.testing.assert_array_equal(ancestors[: parent + 1], mask[parent, : parent + 1])


# ---- the CPU FFI kernel (tlt_jax/kernels/cpu/tree_attention.cc) -------------------------------------------

# (b, t, s, hq, hkv, d): decode (T=1), verification trees, prefill, GQA 1..4, D = 12 (the scalar tail)
CPU_CASES = [
    (3, 1, 64, 9, 3, 64),
    (4, 8, 128, 6, 2, 16),
    (2, 16, 64, 4, 4, 32),
    (3, 5, 40, 8, 2, 12),
    (2, 32, 48, 2, 1, 64),
]


@cpu_only
@pytest.mark.parametrize("b,t,s,hq,hkv,d", CPU_CASES)
def test_cpu_kernel_matches_reference(b: int, t: int, s: int, hq: int, hkv: int, d: int) -> None:
    args = make_inputs(seed=b * 100 + t, b=b, t=t, s=s, hq=hq, hkv=hkv, d=d, dtype=jnp.float32)
    got = jax.jit(functools.partial(ta.tree_attention, impl="cpu_ffi"))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference(*args)), atol=1e-5, rtol=1e-5)


@cpu_only
def test_cpu_kernel_row_with_nothing_visible_matches_reference() -> None:
    """A padding row (length 0, all-False mask) gets the reference's answer: uniform over the cache bucket."""
    q, k, v, lengths, mask = make_inputs(seed=9, b=2, t=3, s=16, hq=2, hkv=1, d=8, dtype=jnp.float32)
    lengths, mask = lengths.at[1].set(0), mask.at[1].set(False)
    got = ta.tree_attention(q, k, v, lengths, mask, impl="cpu_ffi")
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(reference(q, k, v, lengths, mask)), atol=1e-5, rtol=1e-5
    )


@cpu_only
def test_cpu_kernel_gradient_and_dispatch() -> None:
    args = make_inputs(seed=4, b=2, t=4, s=32, hq=6, hkv=2, d=16, dtype=jnp.float32)

    def loss(impl: str):
        return lambda q, k, v: jnp.sum(jnp.sin(ta.tree_attention(q, k, v, *args[3:], impl=impl)))

    got = jax.grad(loss("cpu_ffi"), argnums=(0, 1, 2))(*args[:3])
    want = jax.grad(loss("reference"), argnums=(0, 1, 2))(*args[:3])
    for g_got, g_want in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_want), atol=1e-5, rtol=1e-5)
    text = jax.jit(functools.partial(ta.tree_attention, impl="cpu_ffi")).lower(*args).as_text()
    assert "tlt_tree_attention" in text
    # bf16 inputs take the reference; "auto" on this 8-device test session keeps XLA (SPMD-partitionable)
    bf16 = tuple(x.astype(jnp.bfloat16) for x in args[:3]) + args[3:]
    assert (
        "tlt_tree_attention"
        not in jax.jit(functools.partial(ta.tree_attention, impl="cpu_ffi")).lower(*bf16).as_text()
    )
    assert (
        "tlt_tree_attention"
        not in jax.jit(functools.partial(ta.tree_attention, impl="auto")).lower(*args).as_text()
    )
