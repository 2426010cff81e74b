"""The Pallas TPU (Mosaic) tree-attention kernel, on CPU: its numbers in interpret mode against the jnp
reference, and its lowering for the TPU.

Numbers: Pallas's generic interpreter (`interpret=True`) over the GPU kernel tests' shapes (T from 1 to 64,
ragged lengths with a prefill row and a full row, GQA 1-4, bf16 and f32, one and several query / KV blocks,
a padded cache), plus TPU-interpreter runs (`pltpu.InterpretParams`: NaN-filled VMEM scratch, out-of-bounds
reads raise). Tolerances: f32 1e-5 (abs and rel; both sides are float32 on the CPU), bf16 2e-2 (the kernel
feeds the MXU bf16 probabilities; the reference is float32 throughout), as in test_tree_attention.py.
Lowering: `lower(lowering_platforms=("tpu",))` runs the Mosaic lowering, which enforces the TPU block tiling
rules, on this CPU; the program must hold exactly one `tpu_custom_call`, whose Mosaic module (decoded from
its backend config) has the intended grid, VMEM windows and dot precision. libtpu's own passes (vector
layouts, VMEM budget) need a TPU and are not run here.
"""

from __future__ import annotations

import base64
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir
from jax.experimental.pallas import tpu as pltpu
from jaxlib.mlir import ir
from jaxlib.mlir.passmanager import PassManager
from jaxlib.mosaic.python import tpu as mosaic_tpu

from tlt_jax.kernels import tree_attention as ta
from tlt_jax.kernels import tree_attention_tpu as tpu
from tlt_jax.kernels.tree_attention_blocks import BlockSizes
from tlt_jax.kernels.tree_attention_reference import tree_attention_reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
_FAST_COMPILE = {"xla_backend_optimization_level": 0}  # interpreted kernels: only their numbers matter


def make_inputs(seed: int, b: int, t: int, s: int, hq: int, hkv: int, d: int, dtype: jnp.dtype) -> tuple:
    """Ragged rows as in test_tree_attention.py: row 0 a prefill (length 0, causal mask), the last row fills
    S, the rest random lengths and random trees (node i sees itself and its parent's view); dead cache slots
    (past lengths + T) hold large values, so reading one shows in the output."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, hq, d), dtype=np.float32)
    k = rng.standard_normal((b, hkv, s, d), dtype=np.float32)
    v = rng.standard_normal((b, hkv, s, d), dtype=np.float32)
    lengths = rng.integers(1, s - t + 1, size=b).astype(np.int32)
    lengths[0], lengths[-1] = 0, s - t
    masks = np.zeros((b, t, t), dtype=bool)
    for row in range(b):
        for i in range(t):
            parent = int(rng.integers(-1, i)) if i > 0 else -1
            if parent >= 0:
                masks[row, i] = masks[row, parent]
            masks[row, i, i] = True
        k[row, :, lengths[row] + t :] *= 50.0
        v[row, :, lengths[row] + t :] = 1e3
    masks[0] = np.tril(np.ones((t, t), dtype=bool))
    cast = functools.partial(jnp.asarray, dtype=dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(lengths), jnp.asarray(masks)


def reference(*args: jax.Array) -> jax.Array:
    with jax.default_matmul_precision("highest"):
        return jax.jit(tree_attention_reference)(*args)


def run_kernel(
    args: tuple, block_sizes: BlockSizes | None, interpret: bool | pltpu.InterpretParams
) -> jax.Array:
    fn = jax.jit(functools.partial(tpu.tree_attention_tpu, block_sizes=block_sizes, interpret=interpret))
    return fn.lower(*args).compile(_FAST_COMPILE)(*args)


def assert_close(got: jax.Array, want: jax.Array, dtype: jnp.dtype) -> None:
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


CASES = [
    # (T, S, Hq, Hkv, D, dtype, block_sizes); key blocks are multiples of 128, so S < 128 is padded to 128
    pytest.param(1, 256, 8, 2, 64, jnp.float32, BlockSizes(block_k=128), id="decode-T1-2kvblk-gqa4-f32"),
    pytest.param(8, 64, 6, 2, 32, jnp.float32, None, id="verify-T8-padS64-gqa3-f32"),
    pytest.param(16, 256, 4, 4, 64, jnp.bfloat16, None, id="verify-T16-S256-mha-bf16"),
    pytest.param(
        48, 512, 6, 2, 32, jnp.float32, BlockSizes(block_q=32, block_k=32), id="T48-5qblk-4kvblk-f32"
    ),
    pytest.param(64, 256, 8, 2, 64, jnp.bfloat16, BlockSizes(block_k=64), id="T64-4qblk-2kvblk-bf16"),
    pytest.param(8, 384, 6, 2, 48, jnp.float32, BlockSizes(block_k=256), id="S384-3kvblk-D48-f32"),
    pytest.param(1, 640, 4, 4, 32, jnp.bfloat16, None, id="decode-T1-S640-5kvblk-bf16"),
    pytest.param(5, 100, 8, 2, 16, jnp.float32, None, id="T5-padS100-f32"),
    pytest.param(48, 64, 8, 2, 64, jnp.bfloat16, None, id="prefill-like-T48-S64-2qblk-bf16"),
]


@pytest.mark.parametrize(("t", "s", "hq", "hkv", "d", "dtype", "block_sizes"), CASES)
def test_kernel_matches_reference(
    t: int, s: int, hq: int, hkv: int, d: int, dtype: jnp.dtype, block_sizes: BlockSizes | None
) -> None:
    args = make_inputs(seed=t * 1000 + s + d, b=3, t=t, s=s, hq=hq, hkv=hkv, d=d, dtype=dtype)
    # on a TPU the compiled kernel (what `impl="auto"` runs there), elsewhere Pallas's interpreter
    compiled = jax.default_backend() == "tpu"
    assert_close(run_kernel(args, block_sizes, interpret=not compiled), reference(*args), dtype)


@pytest.mark.parametrize(
    ("t", "s", "dtype", "block_sizes"),
    [(8, 256, jnp.float32, BlockSizes(block_q=16, block_k=128)), (4, 48, jnp.bfloat16, None)],
)
def test_tpu_interpreter_matches_reference(t: int, s: int, dtype: jnp.dtype, block_sizes: BlockSizes) -> None:
    """The TPU interpreter simulates VMEM and the block DMAs: scratch starts as NaN (so the j == 0 init must
    cover it) and a block index outside the array raises."""
    args = make_inputs(seed=t + s, b=2, t=t, s=s, hq=4, hkv=2, d=16, dtype=dtype)
    got = run_kernel(args, block_sizes, interpret=pltpu.InterpretParams())
    assert_close(got, reference(*args), dtype)


def _shapes(b: int, t: int, s: int, hq: int, hkv: int, d: int, dtype: jnp.dtype) -> tuple:
    kv = jax.ShapeDtypeStruct((b, hkv, s, d), dtype)
    q = jax.ShapeDtypeStruct((b, t, hq, d), dtype)
    return q, kv, kv, jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b, t, t), jnp.bool_)


def _lower_for_tpu(shapes: tuple, block_sizes: BlockSizes | None) -> str:
    fn = jax.jit(functools.partial(tpu.tree_attention_tpu, block_sizes=block_sizes))
    return fn.trace(*shapes).lower(lowering_platforms=("tpu",)).as_text()


def _mosaic_module(hlo_text: str) -> str:
    """The Mosaic MLIR inside the program's tpu_custom_call (its backend config holds it as base64
    bytecode), as text: what libtpu would compile."""
    body = re.search(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22", hlo_text).group(1)
    ctx = mlir.make_ir_context()
    mosaic_tpu.register_dialect(ctx)
    with ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(base64.b64decode(body))
        PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
        return str(module)


@pytest.mark.parametrize(
    ("t", "s", "hq", "hkv", "d", "dtype", "block_sizes"),
    [
        pytest.param(16, 2048, 28, 4, 128, jnp.bfloat16, None, id="qwen-heads-bf16-default"),
        pytest.param(
            64, 1024, 32, 8, 128, jnp.bfloat16, BlockSizes(block_q=128, block_k=256), id="T64-2qblk"
        ),
        pytest.param(1, 640, 9, 3, 64, jnp.float32, None, id="decode-S640-k128-f32"),
        pytest.param(8, 80, 9, 3, 48, jnp.float32, BlockSizes(block_q=16, block_k=32), id="pad-S80-D48-f32"),
        pytest.param(5, 40, 6, 2, 16, jnp.bfloat16, BlockSizes(block_q=16, block_k=16), id="tiny-bf16"),
    ],
)
def test_kernel_lowers_for_tpu(
    t: int, s: int, hq: int, hkv: int, d: int, dtype: jnp.dtype, block_sizes: BlockSizes | None
) -> None:
    """Mosaic's lowering (no TPU needed) accepts the block shapes: one `tpu_custom_call` in the program."""
    text = _lower_for_tpu(_shapes(2, t, s, hq, hkv, d, dtype), block_sizes)
    assert text.count("tpu_custom_call") == 1


@pytest.mark.parametrize(
    ("t", "s", "hq", "hkv", "d", "dtype", "bounds", "windows"),
    [  # default blocks; windows: q rows, K, V, tree K, tree V, tree mask, output
        (
            8,
            640,
            9,
            3,
            64,
            jnp.float32,
            "2, 3, 1, 5",
            ["24, 64", "128, 64", "128, 64", "128, 64", "128, 64", "24, 128"],
        ),
        (16, 2048, 28, 4, 128, jnp.bfloat16, "2, 4, 1, 4", ["112, 128", "512, 128", "512, 128", "128, 128"]),
    ],
)
def test_mosaic_module_grid_blocks_and_precision(
    t: int, s: int, hq: int, hkv: int, d: int, dtype: jnp.dtype, bounds: str, windows: list[str]
) -> None:
    """The Mosaic kernel as libtpu would get it: grid (B, Hkv, query blocks, KV blocks) with only the KV axis
    sequential, the intended VMEM windows, and full-precision (fp32 contract) MXU dots for f32 only."""
    mosaic = _mosaic_module(_lower_for_tpu(_shapes(2, t, s, hq, hkv, d, dtype), None))
    assert f"iteration_bounds = array<i64: {bounds}>" in mosaic
    assert "[" + "#tpu.dimension_semantics<parallel>, " * 3 + "#tpu.dimension_semantics<arbitrary>]" in mosaic
    got = re.findall(r"window_bounds = array<i64: 1, (?:1, )?(\d+, \d+)>", mosaic)
    assert got[: len(windows)] == windows
    assert mosaic.count("tpu.matmul") == 4  # QK and PV for the prefix block and for the tree tokens
    assert ("contract_precision<fp32>" in mosaic) == (dtype == jnp.float32)


@pytest.mark.parametrize("itemsize", [4, 2])
@pytest.mark.parametrize(("t", "g", "s"), [(1, 1, 16), (5, 3, 40), (16, 7, 2048), (64, 4, 640), (8, 3, 1000)])
@pytest.mark.parametrize("block_sizes", [tpu.TPU_BLOCK_SIZES, BlockSizes(block_q=16, block_k=32)])
def test_tiles_are_mosaic_legal(t: int, g: int, s: int, itemsize: int, block_sizes: BlockSizes) -> None:
    """Query-row blocks are multiples of the sublane tile, key blocks (prefix and tree) of 128 lanes, blocks
    tile their padded extents, and the cache is padded only up to the next multiple of 128."""
    tiles = tpu.tpu_tiles(t, g, s, itemsize, block_sizes)
    sub = 8 * (4 // itemsize)
    assert tiles.block_m % sub == 0 and tiles.rows_pad % tiles.block_m == 0 and tiles.rows_pad >= t * g
    assert tiles.block_m <= block_sizes.block_q
    assert tiles.t_pad % 128 == 0 and tiles.t_pad >= t
    assert tiles.block_k % 128 == 0 and tiles.block_k <= max(block_sizes.block_k, 128)
    assert tiles.s_pad == -(-s // 128) * 128 and tiles.s_pad % tiles.block_k == 0


def test_live_block_never_leaves_the_live_prefix() -> None:
    """K/V block index per grid step: own block while live, then the last live block (no new DMA)."""
    steps = jnp.arange(6)
    got = {n: np.asarray(tpu.live_block(steps, jnp.int32(n), 32)).tolist() for n in (0, 1, 32, 33, 190)}
    assert got == {
        0: [0, 0, 0, 0, 0, 0],
        1: [0, 0, 0, 0, 0, 0],
        32: [0, 0, 0, 0, 0, 0],
        33: [0, 1, 1, 1, 1, 1],
        190: [0, 1, 2, 3, 4, 5],
    }


def test_gradient_matches_reference() -> None:
    """The custom VJP (backward through the module's jnp restatement) gives the reference's gradients."""
    q, k, v, lengths, mask = make_inputs(seed=7, b=2, t=8, s=64, hq=4, hkv=2, d=32, dtype=jnp.float32)
    w = jax.random.normal(jax.random.key(0), q.shape)

    def loss(fn: object, q_: jax.Array, k_: jax.Array, v_: jax.Array) -> jax.Array:
        return jnp.sum(fn(q_, k_, v_, lengths, mask) * w)

    kernel = functools.partial(tpu.tree_attention_tpu, interpret=True)
    with jax.default_matmul_precision("highest"):
        got = jax.jit(jax.grad(functools.partial(loss, kernel), argnums=(0, 1, 2)))
        got = got.lower(q, k, v).compile(_FAST_COMPILE)(q, k, v)
        want = jax.jit(jax.grad(functools.partial(loss, tree_attention_reference), argnums=(0, 1, 2)))(
            q, k, v
        )
    for g_got, g_want in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_want), atol=1e-5, rtol=1e-5)


def test_row_that_sees_nothing_is_zero() -> None:
    """A padding row (length 0, all-False mask) returns zeros, as the GPU kernel's does; other rows agree."""
    q, k, v, lengths, mask = make_inputs(seed=9, b=2, t=3, s=16, hq=2, hkv=1, d=8, dtype=jnp.float32)
    lengths, mask = lengths.at[1].set(0), mask.at[1].set(False)
    got = np.asarray(run_kernel((q, k, v, lengths, mask), None, interpret=True))
    np.testing.assert_array_equal(got[1], 0.0)
    np.testing.assert_allclose(got[0], np.asarray(reference(q, k, v, lengths, mask))[0], atol=1e-5, rtol=1e-5)


def test_dead_key_blocks_are_skipped() -> None:
    """Garbage past a row's live blocks never reaches the output: with NaN from the first 128-key block
    after both the prefix and the tree tokens, the output is finite and exact. Two guards make this (the
    K/V index map re-fetches the last live block, `pl.when` skips the step's compute); the test fails only
    when both go (test_live_block_never_leaves_the_live_prefix checks the first alone)."""
    q, k, v, _, mask = make_inputs(seed=12, b=2, t=4, s=512, hq=4, hkv=2, d=16, dtype=jnp.float32)
    lengths = jnp.asarray([0, 100], jnp.int32)
    live = np.arange(512)[None, None, :, None] < 128  # both rows: prefix and tree end inside block 0
    clean = reference(q, k, v, lengths, mask)
    k, v = (jnp.where(live, x, jnp.nan) for x in (k, v))
    got = run_kernel((q, k, v, lengths, mask), BlockSizes(block_k=128), interpret=True)
    assert_close(got, clean, jnp.float32)


def test_tree_attention_dispatches_to_the_mosaic_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """`impl="pallas_tpu"` runs this kernel (interpreted off-TPU) through the public `tree_attention`; on a
    TPU backend `auto` and `pallas` pick it (the Triton kernel cannot compile there); on CPU `auto` does
    not."""
    args = make_inputs(7, 2, 8, 128, 4, 2, 32, jnp.float32)
    got = ta.tree_attention(*args, impl="pallas_tpu")
    assert_close(got, reference(*args), jnp.float32)
    shapes = _shapes(2, 8, 128, 4, 2, 32, jnp.float32)
    on_cpu = ta.tree_attention.trace(*shapes, impl="auto").lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" not in on_cpu
    monkeypatch.setattr(ta, "_on_tpu", lambda: True)
    jax.clear_caches()  # the traces above were made with the CPU backend's choice
    try:
        for impl in ("auto", "pallas"):
            text = ta.tree_attention.trace(*shapes, impl=impl).lower(lowering_platforms=("tpu",)).as_text()
            assert text.count("tpu_custom_call") == 1, impl
    finally:
        jax.clear_caches()  # nor may later tests in this process meet the faked backend's traces
