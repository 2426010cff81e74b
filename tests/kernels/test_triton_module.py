"""The tree-attention kernel's Triton modules pass the MLIR verifier, for every kernel variant, anywhere.

Lowering for CUDA on a CPU runs Pallas's Triton lowering but never parses the module it serializes: that
happens only when XLA compiles the program on a GPU, where a module the Triton dialect rejects fails (issue
#23: split-K's `scf.for` with an i1 upper bound beside i32 lower bound and step). These tests parse and
verify each module with jaxlib's MLIR and Triton bindings (`tlt_jax.kernels.triton_check`): ~0.1 s a case.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tlt_jax.kernels import tree_attention as ta
from tlt_jax.kernels import tree_attention_blocks as tab
from tlt_jax.kernels import triton_check

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")


def lower_or_skip(fn: functools.partial, *args: jax.ShapeDtypeStruct) -> jax.stages.Lowered:
    """`triton_check.lower_for_cuda`, skipped where this jax cannot lower Pallas for CUDA without a GPU, or
    where it runs Triton's compiler itself while lowering (then lowering at all means Triton took the module,
    and the program carries PTX, not the module)."""
    try:
        lowered = triton_check.lower_for_cuda(fn, *args)
    except RuntimeError as e:
        if ON_GPU or "No supported GPU devices" not in str(e):
            raise
        pytest.skip(f"jax {jax.__version__} lowers Pallas for CUDA only with a GPU present")
    if "triton_kernel_call_ffi" in lowered.as_text():
        pytest.skip(f"jax {jax.__version__} compiled the Triton module while lowering it")
    return lowered


def specs(b: int, t: int, s: int, hq: int, hkv: int, d: int, dtype: jnp.dtype) -> list[jax.ShapeDtypeStruct]:
    """Abstract kernel inputs (lowering needs shapes only): q, k, v, lengths, tree_mask."""
    kv = jax.ShapeDtypeStruct((b, hkv, s, d), dtype)
    q = jax.ShapeDtypeStruct((b, t, hq, d), dtype)
    return [q, kv, kv, jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b, t, t), jnp.bool_)]


# decode (T=1) and verify (T=16, 64) at tiny heads; kv_splits 1 (no merge), 2 and 4 (split-K); both dtypes
VARIANTS = [
    pytest.param(t, splits, dtype, id=f"T{t}-splits{splits}-{jnp.dtype(dtype).name}")
    for t, splits, dtype in itertools.product((1, 16, 64), (1, 2, 4), (jnp.float32, jnp.bfloat16))
]


@pytest.mark.parametrize(("t", "kv_splits", "dtype"), VARIANTS)
def test_kernel_triton_module_verifies(t: int, kv_splits: int, dtype: jnp.dtype) -> None:
    bs = tab.BlockSizes(block_q=32, block_k=32, kv_splits=kv_splits)
    fn = functools.partial(ta.tree_attention_pallas, block_sizes=bs, interpret=False)
    [module] = triton_check.verify_triton_modules(lower_or_skip(fn, *specs(2, t, 128, 6, 2, 32, dtype)))
    # the prefix loop, then the tree loop: 2 chunks of 32 tree tokens at T=64 (a while loop when split)
    assert module.count("scf.for") == 2


@pytest.mark.parametrize("kv_splits", [1, 3, 0])
def test_qwen_heads_with_padding_verify(kv_splits: int) -> None:
    """Qwen-7B heads (GQA 7, D=128; kv_splits=0 picks 4 splits at B=1, S=1024) and shapes that need padding
    (S=80, D=48)."""
    bs = tab.BlockSizes(kv_splits=kv_splits)
    fn = functools.partial(ta.tree_attention_pallas, block_sizes=bs, interpret=False)
    for shape in ((1, 48, 1024, 28, 4, 128), (3, 8, 80, 9, 3, 48)):
        lowered = lower_or_skip(fn, *specs(*shape, jnp.bfloat16))
        assert len(triton_check.verify_triton_modules(lowered)) == 1


def _split_tree_loop_kernel(x_ref: jax.Array, o_ref: jax.Array) -> None:
    """The pre-fix kernel's tree loop in miniature: `where` over two Python ints as a loop bound."""
    n = jnp.where(pl.program_id(0) == 1, 2, 0)
    o_ref[...] = lax.fori_loop(0, n, lambda i, acc: acc + x_ref[...], jnp.zeros_like(x_ref[...]))


def test_verifier_rejects_the_split_k_loop_bound() -> None:
    """The check is not vacuous: the bound that broke split-K on the GPU fails here, with Triton's message
    (a jax whose lowering compiles Triton itself raises it while lowering, which counts too)."""
    call = pl.pallas_call(
        _split_tree_loop_kernel,
        out_shape=jax.ShapeDtypeStruct((2, 16), jnp.float32),
        grid=(2,),
        in_specs=[pl.BlockSpec((None, 16), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((None, 16), lambda i: (i, 0)),
        compiler_params=plgpu.CompilerParams(),  # the Triton lowering, as the kernel asks
    )
    with pytest.raises(Exception, match=r"'scf.for' op failed to verify .* have same type"):
        lowered = lower_or_skip(call, jax.ShapeDtypeStruct((2, 16), jnp.float32))
        triton_check.verify_triton_modules(lowered)
