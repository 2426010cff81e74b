"""The rollout engine's host scheduler: the loop between device chunks, talking to the hooks.

Per iteration: harvest the rows that finished (streamed to `on_finished`), compact the live rows into the
smallest batch bucket WITHIN each data-axis shard (rows never move between devices, so a device whose rows
have all finished becomes idle: `ChunkView.idle_shards`), ask the hooks for the chunk's mode (the caller's,
e.g. a strategy selector, first; the chunks none of them chose: the paper's threshold switch, the one built
from `SpecConfig`, `hooks.ThresholdPolicy`), grow the cache bucket just enough, run the chunk (which exits
early once compaction would pay), record its timeline and report it (`on_chunk`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from tlt_jax import sharding as shd
from tlt_jax.rollout.admission import RowQueue, plan_insert, sequence_keys, unique_prompts
from tlt_jax.rollout.decode import PromptCache
from tlt_jax.rollout.harvest import Harvester
from tlt_jax.rollout.history_rounds import HistoryRecorder, history_rows
from tlt_jax.rollout.hooks import ChunkView, HookList, RolloutHooks, RolloutInfo, ThresholdPolicy, as_hooks
from tlt_jax.rollout.interface import EngineLike
from tlt_jax.rollout.ngram import NgramBank
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.types import DecodeState, Rollout, RolloutStats, RowSummary


def generate(
    engine: EngineLike,
    prompts: Sequence[Sequence[int]],
    *,
    n: int,
    key: jax.Array,
    sampling: SamplingParams,
    max_new_tokens: int | None,
    hooks: RolloutHooks | Iterable[RolloutHooks | None] | None,
    weights: tuple[Any, Any],
) -> Rollout:
    """Sample `n` responses for each prompt with `engine` (a `RolloutEngine`, which calls this; see the module
    docstring) and `weights` (policy, drafter: `RolloutEngine.rollout_weights`): prefill, then one
    `_HostLoop.step` per chunk until every sequence has finished."""
    max_new = max_new_tokens or engine.config.max_new_tokens
    t_start = time.perf_counter()
    stats = RolloutStats()
    hook = _rollout_hooks(engine, hooks)
    info = RolloutInfo(len(prompts), n, max_new, engine.data_size, tuple(engine.modes), engine.history)
    hook.on_start(info)
    max_total = int(max(len(p) for p in prompts)) + max_new
    rollout = _Rollout(prompts, n, key, sampling, max_new, *weights, max_total)
    loop = _prefill(engine, prompts, rollout, hook, stats)
    while loop.step():
        pass
    rollout = loop.harvest.rollout(stats)
    stats.wall_seconds = time.perf_counter() - t_start
    hook.on_end(rollout)
    return rollout


def _rollout_hooks(
    engine: EngineLike, hooks: RolloutHooks | Iterable[RolloutHooks | None] | None
) -> HookList:
    """The caller's hooks, then (when `config.spec` registered a mode) the one threshold switch,
    `ThresholdPolicy(SpecConfig.threshold, min_steps_below)`: it chooses the mode of the chunks no earlier
    hook (e.g. a strategy selector) chose, so without a selector it decides every chunk. With a history store
    (a "history" mode), first a `HistoryRecorder`: every finished response goes into the store."""
    default = None
    if engine.spec_mode is not None:
        s = engine.config.spec
        default = ThresholdPolicy(engine.spec_mode, s.threshold, s.min_steps_below)
    out = as_hooks(hooks, default)
    if engine.history is not None:
        out.hooks.insert(0, HistoryRecorder(engine.history))
    return out


def _prefill(
    engine: EngineLike, prompts: Sequence[Sequence[int]], r: _Rollout, hook: RolloutHooks, stats: RolloutStats
) -> _HostLoop:
    """Prefill the first rows (all of them, or `max_running_rows` per data shard with the rest queued) with
    the rollout's weights and set up the loop: the harvester, each slot's sequence id (-1: padding) and, for
    n-gram modes, the sibling bank."""
    t0, c0 = time.perf_counter(), engine.compile_seconds
    n, d = r.n, engine.data_size
    total = len(prompts) * n
    local = engine.local_bucket(-(-total // d))
    if engine.max_running_rows:
        local = min(local, engine.max_running_rows)
    first = min(total, local * d)
    seq_ids = np.where(np.arange(local * d) < first, np.arange(local * d), -1)
    ec = engine.config  # keep_hidden=False: the recorded states only stream to the hooks (the spot trainer)
    harvest = Harvester(engine, prompts, n, r.max_new, ec.record_hidden, hook, keep_hidden=ec.keep_hidden)
    if first < total:  # rows will queue: every prompt once into the cache the inserts start rows from
        pc = engine.prompt_cache(prompts, r.max_new, r.params, r.dparams)
        r = dataclasses.replace(r, prompts_kv=pc, seq_keys=sequence_keys(r.key, total))
        harvest.add_prompt_hidden(np.arange(len(prompts)), r.prompts_kv.prompt_hidden)
        state = r.start(engine, seq_ids)
    else:
        state, prompt_h = engine.prefill(
            prompts, n=n, key=r.key, sampling=r.sampling, max_new_tokens=r.max_new, drafter_params=r.dparams,
            seq_ids=seq_ids, params=r.params,
        )  # fmt: skip
        harvest.add_prompt_hidden(unique_prompts(seq_ids, n), prompt_h)
    rows = engine.row_summary(state)
    bank = NgramBank.empty(total, n, r.max_new) if engine.needs()[1] else None
    if bank is not None:
        bank = shd.put_global(bank, engine.replicated)
    _add_timed(stats, "prefill", time.perf_counter() - t0, engine.compile_seconds - c0)
    queue = RowQueue(first, total)
    return _HostLoop(engine, hook, harvest, stats, r, state, rows, seq_ids, bank, queue)


@dataclasses.dataclass(frozen=True)
class _Rollout:
    """What is fixed for one rollout: its prompts, samples per prompt, key, sampling, token budget, the
    policy's and the drafter's weights (one snapshot for the whole rollout) and the longest sequence it can
    reach (no row's cache needs more)."""

    prompts: Sequence[Sequence[int]]
    n: int
    key: jax.Array
    sampling: SamplingParams
    max_new: int
    params: Any
    dparams: Any
    max_total: int
    prompts_kv: PromptCache | None = None  # with a queue: every prompt's forward, kept for the inserts
    seq_keys: np.ndarray | None = None  # with a queue: every sequence's key data (`admission.sequence_keys`)

    def start(self, engine: EngineLike, seq_ids: np.ndarray) -> DecodeState:
        """Rows `seq_ids` started from the prompt cache (continuous batching)."""
        return engine.start_rows(
            self.prompts_kv, self.prompts, n=self.n, seq_ids=seq_ids, seq_keys=self.seq_keys,
            sampling=self.sampling, max_new_tokens=self.max_new,
        )  # fmt: skip


@dataclasses.dataclass
class _HostLoop:
    """The rollout between chunks: the device state, its rows' summary (`RowSummary`: fetched once per chunk,
    with the chunk's counters), each slot's sequence id (-1: padding or empty), the n-gram bank and the queue
    of rows not yet running change every chunk. `step` runs one iteration."""

    engine: EngineLike
    hook: RolloutHooks
    harvest: Harvester
    stats: RolloutStats
    rollout: _Rollout
    state: DecodeState
    rows: RowSummary
    seq_ids: np.ndarray
    bank: NgramBank | None
    queue: RowQueue

    def step(self) -> bool:
        """Harvest, insert queued rows or compact, choose the mode, grow the cache, run one chunk; False once
        all have finished. While rows wait in the queue the chunk decodes plain (the queue is pressure: SD
        only pays once few rows run, as in the paper) and the hooks are not asked."""
        t0 = time.perf_counter()
        self.state, self.rows = self.harvest.collect(self.state, self.seq_ids, self.rows)
        if len(self.queue):
            t_insert = time.perf_counter()
            self._insert()
            t0 += time.perf_counter() - t_insert  # the insert has its own phase
        d = self.engine.data_size
        b_local = self.state.done.shape[0] // d
        live_shard = (~self.rows.done).reshape(d, b_local).sum(axis=1)
        if live_shard.sum() == 0:  # inserted rows may all end at their first token: harvest them next step
            return self.harvest.num_finished < len(self.harvest.harvested)
        queued = len(self.queue) > 0
        if not queued:
            b_local = self._compact(live_shard, b_local)
        mode = "plain" if queued else self._choose_mode(int(live_shard.sum()))
        self._grow_cache(mode)
        self.stats.add_time("host", time.perf_counter() - t0)
        self._run_chunk(mode, b_local, early_exit=not queued)
        return True

    def _insert(self) -> None:
        """Prefill queued rows into the free slots of every shard (`admission.plan_insert`)."""
        plan = plan_insert(self.seq_ids, self.rows.done, self.engine.data_size, self.queue)
        if plan is None:
            return
        t0, c0 = time.perf_counter(), self.engine.compile_seconds
        new = self.rollout.start(self.engine, plan.seq_ids)
        self.state = self.engine.insert(self.state, new, plan.slots)
        d = self.engine.data_size
        local, sids, slots = (x.reshape(d, -1) for x in (self.seq_ids, plan.seq_ids, plan.slots))
        for i in range(d):
            keep = sids[i] >= 0
            local[i, slots[i, keep]] = sids[i, keep]
        self.seq_ids = local.reshape(-1)
        self.rows = self.engine.row_summary(self.state)
        _add_timed(self.stats, "insert", time.perf_counter() - t0, self.engine.compile_seconds - c0)

    def _compact(self, live_shard: np.ndarray, b_local: int) -> int:
        """Gather each shard's live rows into the smallest local bucket that holds the fullest shard (when
        `config.compact` and it is smaller); returns the local bucket."""
        engine, d = self.engine, self.engine.data_size
        new_local = engine.local_bucket(int(live_shard.max()))
        if engine.config.compact and new_local < b_local:
            if self.bank is not None:
                self.bank = engine.update_bank(self.bank, self.state)
            sel, pad = _shard_selection((~self.rows.done).reshape(d, b_local), new_local)
            self.state = engine.gather_rows(self.state, sel, pad.reshape(-1))
            glob = (np.arange(d)[:, None] * b_local + sel.reshape(d, new_local)).reshape(-1)
            self.seq_ids = np.where(pad.reshape(-1), -1, self.seq_ids[glob])
            self.rows = self.rows.take(glob, pad.reshape(-1))
            b_local = new_local
        return b_local

    def _choose_mode(self, n_live: int) -> str:
        """The hooks' mode for the next chunk ("plain" when none chooses); it must be a registered mode."""
        mode = self.hook.choose_mode(n_live, self.state.done.shape[0]) or "plain"
        if mode != "plain" and mode not in self.engine.modes:
            raise KeyError(
                f"a hook chose mode {mode!r}: registered modes {sorted(self.engine.modes)} (and 'plain')"
            )
        return mode

    def _grow_cache(self, mode: str) -> None:
        """Resize the cache to the bucket the chunk needs: the longest live row plus the chunk's tokens and
        lookahead, capped at the longest sequence the rollout can reach."""
        engine = self.engine
        per_step, ahead = (
            (1, 1) if mode == "plain" else (engine.modes[mode].tokens_per_step, engine.modes[mode].lookahead)
        )
        need = min(
            int(self.rows.lengths[~self.rows.done].max()) + engine.config.chunk_steps * per_step + ahead,
            self.rollout.max_total + ahead,
        )
        s_new = engine.cache_bucket(need)
        if s_new != self.state.cache.capacity:
            self.state = engine.resize_cache(self.state, s_new)

    def _run_chunk(self, mode: str, b_local: int, early_exit: bool) -> None:
        """Run the chunk (exiting early once half the local bucket has finished, when compacting and
        `early_exit`; with idle work from the hooks fused in on a data axis > 1), record its timeline and
        report it to the hooks."""
        engine, stats, d = self.engine, self.stats, self.engine.data_size
        exit_live = b_local // 2 if early_exit and engine.config.compact and b_local > 1 else -1
        before = self.rows.tokens(self.seq_ids)
        live_before = (~self.rows.done).reshape(d, -1).sum(axis=1)
        if mode != "plain" and engine.modes[mode].drafter == "history":  # drafted on the host, no idle work
            rows = history_rows(engine.history, self.rollout.prompts, self.rollout.n, self.seq_ids)
            self.state, record, self.rows = engine.history_chunk(
                self.state, mode, self.rollout.sampling, rows, exit_live, self.rollout.dparams,
                self.rollout.params,
            )  # fmt: skip
        else:
            work = self.hook.idle_work(tuple(int(x) for x in live_before)) if d > 1 else None
            self.state, record, self.bank, self.rows = engine.decode_chunk(
                self.state, mode, self.rollout.sampling, self.bank, exit_live, self.rollout.dparams, work,
                self.rollout.params,
            )  # fmt: skip
        record = dataclasses.replace(record, new_tokens=self.rows.tokens(self.seq_ids) - before)
        stats.add_time("decode" if mode == "plain" else "speculative", record.seconds)
        if record.compiled:
            stats.add_time("compile", record.compile_seconds)
        stats.running_per_step.extend(record.running)
        stats.sd_per_step.extend([mode != "plain"] * record.steps)
        stats.seconds_per_step.extend([record.seconds / max(record.steps, 1)] * record.steps)
        stats.chunks.append(record)
        live = tuple(int(x) for x in (~self.rows.done).reshape(d, -1).sum(axis=1))
        self.hook.on_chunk(ChunkView(record, live, self.harvest.num_finished))


def _add_timed(stats: RolloutStats, phase: str, seconds: float, compile_seconds: float) -> None:
    """Add a phase's seconds, less the compilation inside it (which goes to "compile")."""
    stats.add_time(phase, seconds - compile_seconds)
    if compile_seconds > 0:
        stats.add_time("compile", compile_seconds)


def _shard_selection(live_db: np.ndarray, new_local: int) -> tuple[np.ndarray, np.ndarray]:
    """Per shard, the LOCAL indices of its live rows padded to `new_local` (padding repeats a row of the same
    shard and is marked in the mask): ([D * new_local] indices, [D, new_local] padding mask)."""
    d, _ = live_db.shape
    sel = np.zeros((d, new_local), np.int32)
    pad = np.ones((d, new_local), bool)
    for i in range(d):
        keep = np.nonzero(live_db[i])[0]
        sel[i, : len(keep)] = keep
        sel[i, len(keep) :] = keep[0] if len(keep) else 0
        pad[i, : len(keep)] = False
    return sel.reshape(-1), pad
