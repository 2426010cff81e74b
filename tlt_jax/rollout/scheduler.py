"""The rollout engine's host scheduler: the loop between device chunks, talking to the hooks.

Per iteration: harvest the rows that finished (streamed to `on_finished`), compact the live rows into the
smallest batch bucket WITHIN each data-axis shard (rows never move between devices, so a device whose rows
have all finished becomes idle: `ChunkView.idle_shards`), ask the hooks for the chunk's mode (default: the
`SpecConfig` threshold switch), grow the cache bucket just enough, run the chunk (which exits early once
compaction would pay), record its timeline and report it (`on_chunk`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from tlt_jax.rollout.harvest import Harvester
from tlt_jax.rollout.hooks import ChunkView, RolloutHooks, RolloutInfo, ThresholdPolicy, as_hooks
from tlt_jax.rollout.ngram import NgramBank
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.types import Rollout, RolloutStats


def generate(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    *,
    n: int,
    key: jax.Array,
    sampling: SamplingParams,
    max_new_tokens: int | None,
    hooks: RolloutHooks | Iterable[RolloutHooks | None] | None,
) -> Rollout:
    """Sample `n` responses for each prompt with `engine` (a `RolloutEngine`, which calls this; see the module
    docstring)."""
    cfg = engine.config
    max_new = max_new_tokens or cfg.max_new_tokens
    t_start = time.perf_counter()
    stats = RolloutStats()
    default = None
    if engine.spec_mode is not None:
        s = cfg.spec
        default = ThresholdPolicy(engine.spec_mode, s.threshold, s.min_steps_below)
    hook = as_hooks(hooks, default)
    num_p = len(prompts)
    hook.on_start(RolloutInfo(num_p, n, max_new, engine.data_size, tuple(engine.modes)))

    t0 = time.perf_counter()
    dparams = engine.drafter_params  # one snapshot of the drafter for the whole rollout
    state, prompt_h = engine.prefill(
        prompts, n=n, key=key, sampling=sampling, max_new_tokens=max_new, drafter_params=dparams
    )
    jax.block_until_ready(state)
    prompt_hidden = None
    if prompt_h is not None:
        ph = np.asarray(jax.device_get(prompt_h))
        prompt_hidden = [ph[i, : len(p)] for i, p in enumerate(prompts)]
    harvest = Harvester(engine, prompts, n, max_new, prompt_hidden, hook)
    seq_ids = np.where(np.arange(state.done.shape[0]) >= num_p * n, -1, np.arange(state.done.shape[0]))
    bank = NgramBank.empty(num_p * n, n, max_new) if engine.needs()[1] else None
    if bank is not None:
        bank = jax.device_put(bank, engine.replicated)
    stats.add_time("prefill", time.perf_counter() - t0)
    max_total = int(max(len(p) for p in prompts)) + max_new

    while True:
        t0 = time.perf_counter()
        state, done, lengths = harvest.collect(state, seq_ids)
        d = engine.data_size
        b_local = state.done.shape[0] // d
        live_shard = (~done).reshape(d, b_local).sum(axis=1)
        if live_shard.sum() == 0:
            break
        new_local = engine.local_bucket(int(live_shard.max()))
        if cfg.compact and new_local < b_local:
            if bank is not None:
                bank = engine.update_bank(bank, state)
            sel, pad = _shard_selection((~done).reshape(d, b_local), new_local)
            state = engine.gather_rows(state, sel, pad.reshape(-1))
            glob = (np.arange(d)[:, None] * b_local + sel.reshape(d, new_local)).reshape(-1)
            seq_ids = np.where(pad.reshape(-1), -1, seq_ids[glob])
            done, lengths = done[glob] | pad.reshape(-1), lengths[glob]
            b_local = new_local
        n_live = int(live_shard.sum())
        mode = hook.choose_mode(n_live, state.done.shape[0]) or "plain"
        if mode != "plain" and mode not in engine.modes:
            raise KeyError(
                f"a hook chose mode {mode!r}: registered modes {sorted(engine.modes)} (and 'plain')"
            )
        per_step, ahead = (
            (1, 1) if mode == "plain" else (engine.modes[mode].tokens_per_step, engine.modes[mode].lookahead)
        )
        need = min(int(lengths[~done].max()) + cfg.chunk_steps * per_step + ahead, max_total + ahead)
        s_new = engine.cache_bucket(need)
        if s_new != state.cache.capacity:
            state = engine.resize_cache(state, s_new)
        stats.add_time("host", time.perf_counter() - t0)

        exit_live = b_local // 2 if cfg.compact and b_local > 1 else -1
        before = harvest.tokens_so_far(state, seq_ids)
        work = hook.idle_work(tuple(int(x) for x in (~done).reshape(d, -1).sum(axis=1))) if d > 1 else None
        state, record, bank = engine.decode_chunk(state, mode, sampling, bank, exit_live, dparams, work)
        record = dataclasses.replace(record, new_tokens=harvest.tokens_so_far(state, seq_ids) - before)
        stats.add_time("decode" if mode == "plain" else "speculative", record.seconds)
        if record.compiled:
            stats.add_time("compile", record.compile_seconds)
        stats.running_per_step.extend(record.running)
        stats.sd_per_step.extend([mode != "plain"] * record.steps)
        stats.seconds_per_step.extend([record.seconds / max(record.steps, 1)] * record.steps)
        stats.chunks.append(record)
        done_now = np.asarray(jax.device_get(state.done)).reshape(d, -1)
        hook.on_chunk(ChunkView(record, tuple(int(x) for x in (~done_now).sum(axis=1)), harvest.num_finished))

    rollout = harvest.rollout(stats)
    stats.wall_seconds = time.perf_counter() - t_start
    hook.on_end(rollout)
    return rollout


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
