"""Verify the Triton modules of a program lowered for CUDA, on any machine (no GPU needed).

Pallas's Triton lowering writes each kernel's `tt` module as MLIR bytecode into the `ir` entry of its
`__gpu$xla.gpu.triton` custom call, and nothing parses that bytecode until XLA compiles the program on a GPU.
A module that the Triton dialect's verifier rejects (for instance an `scf.for` whose bounds have different
integer types) therefore lowers without complaint on CPU and fails only on the GPU. `verify_triton_modules`
runs that first GPU-side step here: it parses each module in an MLIR context with the Triton dialect that
jaxlib ships (parsing runs the MLIR verifier) and verifies it again explicitly. What it cannot check on a
CPU: Triton's own passes (TTIR -> TTGIR -> LLVM -> PTX), which jaxlib does not carry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jaxlib.triton import dialect as tt_dialect

TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call Pallas's Triton lowering emits


class TritonModuleError(ValueError):
    """A Triton module that the MLIR verifier (or parser) rejects; the message holds its diagnostics."""


def _ops(op: ir.Operation) -> Iterator[ir.Operation]:
    """Every operation nested under `op` (pre-order)."""
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child.operation
                yield from _ops(child.operation)


def lower_for_cuda(fn: Callable[..., Any], *args: Any) -> jax.stages.Lowered:
    """`jax.jit(fn)` lowered for CUDA whatever the local backend (args: arrays or ShapeDtypeStructs).
    jax 0.11 reads the GPU's compute capability while lowering Pallas for CUDA, so there this raises a
    RuntimeError ("No supported GPU devices") on a machine without one."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def triton_module_bytecode(lowered: jax.stages.Lowered) -> list[bytes]:
    """The serialized `tt` module of every Pallas Triton call in `lowered` (a program lowered for CUDA)."""
    modules = []
    for op in _ops(lowered.compiler_ir("stablehlo").operation):
        if op.name != "stablehlo.custom_call":
            continue
        if ir.StringAttr(op.attributes["call_target_name"]).value != TRITON_CALL:
            continue
        config = ir.DictAttr(op.attributes["mhlo.backend_config"])
        modules.append(ir.StringAttr(config["ir"]).value_bytes)
    return modules


def _triton_context() -> ir.Context:
    """An MLIR context with the upstream dialects and Triton's, as Pallas's Triton lowering builds it."""
    ctx = mlir.make_ir_context()
    tt_dialect.register_dialect(ctx)
    ctx.load_all_available_dialects()
    return ctx


def verify_triton_module(bytecode: bytes) -> str:
    """Parse and verify one serialized Triton module; return its text. Raises TritonModuleError."""
    with _triton_context():
        try:
            module = ir.Module.parse(bytecode)  # the parser runs the verifier
            module.operation.verify()
        except ir.MLIRError as e:
            raise TritonModuleError(str(e)) from e
        return str(module)


def verify_triton_modules(lowered: jax.stages.Lowered) -> list[str]:
    """Verify every Triton module in `lowered`; return their texts (an empty list: no Triton call found)."""
    return [verify_triton_module(b) for b in triton_module_bytecode(lowered)]
