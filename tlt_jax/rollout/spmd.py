"""Programs over the mesh's data axis in `jax.shard_map`: per-device work with each device's own rows.

- `gather_program`: compaction WITHIN each data shard (local row indices), so rows never move between
  devices and a device whose rows have all finished becomes idle instead of receiving others' rows.
- `insert_program`: continuous batching's insert of prefilled rows into free slots, within each data shard.
- `tick_program`: the spot trainer's tick, ONE SPMD program in which the data groups (the model-axis devices
  of one data index) with live rows run the decode chunk and the others run idle-device work (drafter
  micro-steps). Each group takes its own branch of a per-group `lax.cond`; collectives over "data" (the
  work's gradient psum, the chunk's counters) stay outside it. On a model axis > 1 the program is manual over
  "data" only and GSPMD partitions each branch over the model axis: the policy keeps its tensor-parallel
  sharding (never gathered) and the branch's collectives run within the group, whose devices all take the
  same branch. Measured on the CPU backend: two programs dispatched on disjoint device sets serialise, one
  SPMD program with a per-device branch overlaps (docs/benchmarks.md).
  Limit (XLA:CPU, measured with jax 0.10.2): a collective-permute's rendezvous waits for EVERY device of the
  program, so one inside a group's branch deadlocks (aborts after 40 s). GSPMD emits them where the model
  axis splits a KV head (num_kv_heads not a multiple of the model axis), and emitted one for sampling
  while `sampling.categorical` reversed the vocabulary-sharded weights (it no longer does); with whole KV
  heads per device there are none. All-reduces and all-gathers wait only for their group and work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax import sharding as shd
from tlt_jax.rollout import decode
from tlt_jax.rollout.hooks import IdleWork
from tlt_jax.rollout.types import DecodeState


def state_specs(state: DecodeState, mesh: Mesh) -> Any:
    """The PartitionSpecs of a decode state's leaves (batch over "data", KV heads over "model")."""
    return jax.tree.map(lambda s: s.spec, shd.shard_pytree_batch(state, mesh))


def gather_program(mesh: Mesh, state: DecodeState, constrain: Callable[[Any], Any]) -> Callable:
    """(state, rows, pad) -> the state's rows `rows` (LOCAL indices per shard, shard-major), padding rows
    marked done; a plain gather on one data shard."""
    if mesh.shape["data"] == 1:
        return lambda st, rows, pad: constrain(decode.gather_rows(st, rows, pad))
    specs = state_specs(state, mesh)
    body = jax.shard_map(
        decode.gather_rows, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=specs
    )
    return lambda st, rows, pad: constrain(body(st, rows, pad))


def insert_program(
    mesh: Mesh, state: DecodeState, new: DecodeState, constrain: Callable[[Any], Any]
) -> Callable:
    """(state, new rows, slots) -> the state with `new`'s rows written at `slots` (LOCAL indices per shard,
    shard-major, as `new`'s rows are laid out): continuous batching's insert, within each data shard."""
    if mesh.shape["data"] == 1:
        return lambda st, nw, slots: constrain(decode.insert_rows(st, nw, slots))
    specs, new_specs = state_specs(state, mesh), state_specs(new, mesh)
    body = jax.shard_map(
        decode.insert_rows, mesh=mesh, in_specs=(specs, new_specs, P("data")), out_specs=specs
    )
    return lambda st, nw, slots: constrain(body(st, nw, slots))


def _data_only(spec: Any) -> Any:
    """A PartitionSpec with every mesh axis but "data" dropped (left to the automatic partitioner)."""

    def one(entry: Any) -> Any:
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n == "data")
        return kept[0] if len(kept) == 1 else (kept or None)

    return P(*(one(e) for e in spec))


def tick_program(
    mesh: Mesh, prog: decode.ChunkProgram, work: IdleWork, state: DecodeState, with_bank: bool
) -> Callable:
    """(params, dparams, state, eos_ids, bank, draft_vocab, exit_live, arm, work operands) -> (ChunkOut,
    work outputs): data groups with a live row run `decode.run_chunk` (per-group `prog`, shards=1), the
    others `work.fn`.

    Manual over "data" only: on a model axis > 1 the model axis stays automatic, so inside each data group
    GSPMD keeps the policy's tensor-parallel layout (params, KV heads) and partitions both branches over it
    (its collectives run within the group, whose devices all take the same branch). Specs here and in
    `work.in_specs` / `work.out_specs` name "data" only; the state leaves with its usual layout."""
    if mesh.shape["data"] < 2:
        raise ValueError("idle-device work needs a data axis of >= 2 devices (config.mesh.data)")
    full = state_specs(state, mesh)
    # model axis of 1: manual over every axis as before (a Pallas kernel is then called per device)
    manual = {"data"} if mesh.shape["model"] > 1 else set(mesh.axis_names)
    specs = full if len(manual) > 1 else jax.tree.map(_data_only, full, is_leaf=lambda x: isinstance(x, P))

    def per_group(params, dparams, st, eos_ids, bank, draft_vocab, exit_live, arm, operands):  # noqa: ANN001, ANN202
        live = jnp.any(~st.done)
        out = jax.lax.cond(
            live,
            lambda: decode.run_chunk(prog, params, dparams, st, eos_ids, bank, draft_vocab, exit_live, arm),
            lambda: decode.idle_chunk(prog, st, bank),
        )
        work_out = work.fn(operands, ~live)
        merged = None
        if bank is not None:  # each group updated its own sequences' rows: merge the deltas
            merged = jax.tree.map(lambda a, b: a + jax.lax.psum(b - a, "data"), bank, out.bank)
        emitted, rows, hist = (jax.lax.psum(x, "data") for x in (out.emitted, out.rows, out.hist))
        return out.replace(emitted=emitted, rows=rows, hist=hist, bank=merged), work_out

    out_specs = decode.ChunkOut(
        state=specs, running=P("data"), emitted=P(), rows=P(), hist=P(), bank=P() if with_bank else None
    )
    in_specs = (P(), P(), specs, P(), P(), P(), P(), P(), work.in_specs)
    body = jax.shard_map(
        per_group,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=(out_specs, work.out_specs),
        axis_names=manual,
        check_vma=False,
    )
    layout = jax.tree.map(lambda s: NamedSharding(mesh, s), full, is_leaf=lambda x: isinstance(x, P))

    def tick(*args: Any) -> tuple[decode.ChunkOut, Any]:
        out, work_out = body(*args)
        return out.replace(state=jax.lax.with_sharding_constraint(out.state, layout)), work_out

    return tick
