"""Speculative rounds drafted on the host by the history drafter (`rollout.history`): one device call a round.

A history chunk alternates host and device: the host matches each live row's last tokens against its
prompt's history and drafts a tree (`HistoryStore.draft`), the device verifies it with the same coupled
verification as every draft (`tree_verify.verify_round`; the root is the row's last committed token, filled
in on the device) and returns each row's last `max_match` response tokens, done flag and length (one small
transfer a round) for the next draft. The chunk runs up to `chunk_steps` rounds and, like a device chunk,
stops once the fullest data shard has at most `exit_live` live rows. Its seconds count the host's drafting
too, so a selector rewards the history arm with what it really costs; the drafting time alone goes to
`HistoryStore.stats.draft_seconds`. One program per (batch bucket, cache bucket, tokens_to_verify): the tree
is an operand, so every history strategy of one tokens_to_verify shares it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh

from tlt_jax import sharding as shd
from tlt_jax.rollout import decode
from tlt_jax.rollout.history import HistoryStore, PromptHistory, TreeShape
from tlt_jax.rollout.hooks import FinishedSequences, RolloutHooks
from tlt_jax.rollout.programs import ProgramCache
from tlt_jax.rollout.tree_verify import RoundStats
from tlt_jax.rollout.types import DecodeState, DraftTree, Rollout

PAD_TAIL = -1  # tail positions before the response starts


def response_tail(state: DecodeState, k: int) -> jax.Array:
    """[B, k] int32: each row's last k response tokens (PAD_TAIL before its first)."""
    idx = state.num_generated[:, None] - k + jnp.arange(k, dtype=jnp.int32)[None, :]
    tok = jnp.take_along_axis(state.out_tokens, jnp.clip(idx, 0, state.out_tokens.shape[1] - 1), axis=1)
    return jnp.where(idx >= 0, tok, PAD_TAIL).astype(jnp.int32)


def history_round(
    prog: decode.ChunkProgram,
    k: int,
    params: Any,
    dparams: Any,
    state: DecodeState,
    eos_ids: jax.Array,
    tokens_bn: jax.Array,
    parents_bn: jax.Array,
    depth_bn: jax.Array,
) -> tuple[DecodeState, RoundStats, tuple[jax.Array, jax.Array, jax.Array]]:
    """Verify the host's draft trees ([B, N] each; the root's token is the row's last committed one) and
    return the new state, the round's counts and (tail [B, k], done [B], num_generated [B])."""
    chex.assert_equal_shape([tokens_bn, parents_bn, depth_bn])
    m = decode.round_models(prog, params, dparams, None)
    tree = DraftTree(tokens=tokens_bn.at[:, 0].set(state.last_token), parents=parents_bn, depth=depth_bn)
    st, rs = decode.verify_tree(prog, m, state, tree, eos_ids)
    return st, rs, (response_tail(st, k), st.done, st.num_generated)


@dataclasses.dataclass(frozen=True)
class HistoryRows:
    """The host's view of a chunk's rows: each slot's prompt history (None: padding or finished) and its
    prompt's tail (the context before the response starts)."""

    histories: Sequence[PromptHistory | None]
    prompt_tails: Sequence[np.ndarray]

    def contexts(self, tail_bk: np.ndarray) -> list[np.ndarray]:
        """Each row's context: its prompt's tail, then its response's last tokens."""
        out = []
        for p, t in zip(self.prompt_tails, tail_bk, strict=True):
            out.append(np.concatenate([p, t[t != PAD_TAIL]]) if (t == PAD_TAIL).any() else t)
        return out


class HistoryRecorder(RolloutHooks):
    """Keeps every finished response in the store as it finishes (the current group's finished siblings are
    then a source for the rows still running, and every response one for the next epochs); the scheduler
    adds it to every rollout of an engine with a history store. Hidden states are not read."""

    def __init__(self, store: HistoryStore):
        self.store = store

    def on_finished(self, seqs: FinishedSequences) -> None:
        for prompt, tokens in zip(seqs.prompt_tokens, seqs.tokens, strict=True):
            self.store.add(prompt, tokens)

    def on_end(self, rollout: Rollout) -> None:
        del rollout
        self.store.end_rollout()
        m = self.store.metrics()
        logging.info(
            "history drafter: %d prompts, %d responses, %d tokens kept (%.2f MiB host); %d evicted in all",
            m["history/prompts"], m["history/responses"], m["history/tokens"], m["history/host_mib"],
            self.store.evicted_total,
        )  # fmt: skip


def history_rows(
    store: HistoryStore, prompts: Sequence[Sequence[int]], n: int, seq_ids: np.ndarray
) -> HistoryRows:
    """The chunk's rows for `history_chunk`: slot i runs sequence seq_ids[i] (-1: padding) of prompt
    seq_ids[i] // n."""
    k = store.params.max_match
    hs, tails = [], []
    for sid in seq_ids:
        p = prompts[int(sid) // n] if sid >= 0 else None
        hs.append(None if p is None else store.prompt(p))
        tails.append(np.zeros((0,), np.int32) if p is None else np.asarray(p[-k:], np.int32))
    return HistoryRows(hs, tails)


def tree_shape(prog: decode.ChunkProgram, mode_index: int) -> TreeShape:
    """The tree a mode of a history program may draft (its nodes padded to the program's tokens_to_verify)."""
    s = prog.modes[mode_index].strategy
    return TreeShape(depth=s.max_depth, topk=s.topk, nodes=s.tokens_to_verify - 1, internal=s.draft_slots)


class HistoryEngine(Protocol):
    """What a history chunk uses of the engine (`RolloutEngine`)."""

    history: HistoryStore | None
    mesh: Mesh
    data_size: int
    programs: ProgramCache


@dataclasses.dataclass
class HistoryChunk:
    """One chunk of history rounds (see the module docstring): its compiled round and tail programs."""

    store: HistoryStore
    program: Any
    tails: Any
    prog: decode.ChunkProgram
    shape: TreeShape
    rows: HistoryRows
    batch_sharding: jax.sharding.Sharding
    shards: int
    compiled: bool

    @classmethod
    def prepare(
        cls,
        engine: HistoryEngine,
        prog: decode.ChunkProgram,
        mode: str,
        rows: HistoryRows,
        args: tuple,
        constrain: Callable[[DecodeState], DecodeState],
    ) -> HistoryChunk:
        """Compile (once per bucket) the round program of `prog` for `args` (params, dparams, state, eos_ids)
        and the tail program that starts the chunk."""
        store = engine.history
        if store is None:
            raise ValueError(f"mode {mode!r}: the engine has no history store (register a 'history' mode)")
        state, k = args[2], store.params.max_match
        b, tv = state.done.shape[0], prog.modes[0].strategy.tokens_to_verify
        names, sp = tuple(m.name for m in prog.modes), dataclasses.astuple(prog.sampling)
        key = ("history", b, state.cache.capacity, tv, names, sp, state.out_tokens.shape[1],
               prog.drafter is not None, state.out_hidden is not None)  # fmt: skip

        def fn(params, dparams, st, eos_ids, tok, par, dep):  # noqa: ANN001, ANN202
            st, rs, small = history_round(prog, k, params, dparams, st, eos_ids, tok, par, dep)
            return constrain(st), rs, small

        bs = shd.batch_sharding(engine.mesh, 2, b)
        tree0 = shd.put_global(np.zeros((b, tv), np.int32), bs)  # every process holds every row
        program, compiled = engine.programs.prepare(key, fn, (*args, tree0, tree0, tree0), donate=(2,))
        tail_fn = lambda st: (response_tail(st, k), st.done)  # noqa: E731
        tails, _ = engine.programs.prepare(("tail", b, state.out_tokens.shape[1], k), tail_fn, (state,))
        arm = [m.name for m in prog.modes].index(mode)
        shape = tree_shape(prog, arm)
        return cls(store, program, tails, prog, shape, rows, bs, engine.data_size, compiled)

    def run(self, args: tuple, exit_live: int, steps: int) -> tuple[DecodeState, tuple[Any, ...]]:
        """Up to `steps` rounds from `args` (params, dparams, state, eos_ids); returns the state and the
        chunk's (running per round, emitted tokens, row-rounds, accept histogram)."""
        params, dparams, state, eos_ids = args
        tail, done = shd.to_host_tree(self.tails(state))
        running = np.full((steps,), -1, np.int32)
        emitted, rounds = 0, 0
        hist = np.zeros((self.prog.max_depth + 2,), np.int64)
        for i in range(steps):
            live = ~done
            running[i] = int(live.sum())
            t0 = time.perf_counter()
            hs = [h if ok else None for h, ok in zip(self.rows.histories, live, strict=True)]
            tree = self._pad(*self.store.draft(hs, self.rows.contexts(tail), self.shape))
            self.store.stats.draft_seconds += time.perf_counter() - t0
            tree = shd.put_global(tree, self.batch_sharding)
            state, rs, small = self.program(params, dparams, state, eos_ids, *tree)
            (tail, done, _), counts = shd.to_host_tree((small, (rs.emitted, rs.rows, rs.hist)))
            emitted, rounds = emitted + int(counts[0]), rounds + int(counts[1])
            hist += np.asarray(counts[2])
            live_max = (~done).reshape(self.shards, -1).sum(axis=1).max()
            if live_max == 0 or live_max <= exit_live:
                break
        return state, (running, emitted, rounds, hist)

    def _pad(self, tok: np.ndarray, par: np.ndarray, dep: np.ndarray) -> tuple[np.ndarray, ...]:
        """The trees padded to the program's tokens_to_verify nodes (padding: parent -2)."""
        n = self.prog.modes[0].strategy.tokens_to_verify
        extra = n - tok.shape[1]
        if extra <= 0:
            return tok, par, dep
        b = tok.shape[0]
        z, p2 = np.zeros((b, extra), np.int32), np.full((b, extra), -2, np.int32)
        return np.hstack([tok, z]), np.hstack([par, p2]), np.hstack([dep, z])
