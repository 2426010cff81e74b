"""Continuous batching: at most `max_running_rows` rows decode per data shard; the rest of the step's rows
wait in a queue and are inserted into the slots of rows that finished.

The paper's step is 512 rows of up to 32K tokens; SGLang runs it with a bounded running batch. Here the
running batch is a static array of slots per data shard (no ragged shapes): the host loop harvests finished
rows after every chunk, then `plan_insert` assigns queued rows, in sequence order, to the free slots of every
shard (rows never move between devices, so a shard with no live row and an empty queue is idle for the spot
trainer). The engine starts the inserted rows from the rollout's prompt cache (every prompt's forward, once)
and writes them into their slots (`RolloutEngine.start_rows`, `insert`).
Once the queue is empty the tail compacts into smaller buckets as before. Each row's samples derive from
(rollout key, sequence id, token position) only (`types.row_keys`), so the cap changes the schedule, never
the tokens.

`running_rows_cap` picks the cap from a per-device budget of what a running row holds: the dense cache of one
row at the top cache bucket, over the model axis (KV heads are sharded over it), plus the EAGLE drafter's
one-layer cache, plus the row's recorded hidden states when the rollout records them (`hidden_bytes_per_row`:
[min(hidden_window, max_new_tokens), H], replicated over the model axis; 56 MiB per row for Qwen2.5-7B at
8,192 tokens, a tenth of its KV at the 32K bucket under TP 4).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models.config import ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, model_axis: int, drafter_layers: int = 0) -> int:
    """Bytes of K and V per cached token of one row on one device (KV heads split over the model axis)."""
    heads = -(-cfg.num_kv_heads // model_axis)
    itemsize = jnp.dtype(cfg.dtype).itemsize
    return (cfg.num_layers + drafter_layers) * 2 * heads * cfg.head_dim * itemsize


def hidden_bytes_per_row(window: int, max_new_tokens: int, hidden_size: int, dtype: str) -> int:
    """Bytes of one row's recorded hidden states (`decode.start_rows`: [min(window, max_new), H] in the
    model's dtype; replicated over the model axis, so per device as well)."""
    return min(window, max_new_tokens) * hidden_size * jnp.dtype(dtype).itemsize


def running_rows_cap(
    max_running_rows: int,
    kv_budget_gib: float,
    per_token_bytes: int,
    top_cache: int,
    hidden_row_bytes: int = 0,
) -> tuple[int, str]:
    """(rows per data shard, or 0 for no cap; the start-up line that says why): `max_running_rows` when set,
    else the largest power of two whose dense caches at the top bucket and recorded hidden states
    (`hidden_row_bytes` per row) fit `kv_budget_gib`."""
    kv_gib, hid_gib = per_token_bytes * top_cache / 2**30, hidden_row_bytes / 2**30
    row_gib = kv_gib + hid_gib
    what = f"KV {kv_gib:.3f} GiB" + (f" + recorded states {hid_gib:.3f} GiB" if hidden_row_bytes else "")
    if max_running_rows > 0:
        return max_running_rows, (
            f"rollout: at most {max_running_rows} running rows per data shard (config; {what} per row per "
            f"device at cache {top_cache}: {max_running_rows * row_gib:.2f} GiB)"
        )
    if kv_budget_gib <= 0:
        return 0, "rollout: every row of a step runs at once (no rollout.max_running_rows, no kv_budget_gib)"
    fit = int(kv_budget_gib // row_gib)
    if fit < 1:
        raise ValueError(
            f"rollout.kv_budget_gib={kv_budget_gib} holds no row: one row's {what} at {top_cache} tokens "
            f"per device: raise the budget, lower max_cache_len (or rollout.hidden_window) or add model "
            "devices."
        )
    cap = 1 << (fit.bit_length() - 1)
    return cap, (
        f"rollout: at most {cap} running rows per data shard (kv_budget_gib={kv_budget_gib}: {what} per row "
        f"per device at cache {top_cache}; {cap * row_gib:.2f} GiB in use)"
    )


def sequence_keys(key: jax.Array, total: int) -> np.ndarray:
    """[total, 2] raw key data of every sequence's PRNG stream (`split(key, total)`), computed once per
    rollout: a row samples with its sequence's stream whatever batch it starts in."""
    return np.asarray(jax.random.key_data(jax.random.split(key, total)))


def unique_prompts(seq_ids: np.ndarray, n: int) -> np.ndarray:
    """The sorted prompt indices of a batch's rows (sequence i belongs to prompt i // n; -1: padding)."""
    ids = np.asarray(seq_ids)
    return np.unique(ids[ids >= 0] // n)


@dataclasses.dataclass
class RowQueue:
    """The sequences of a rollout not yet running: ids next, next + 1, ... total - 1 (sequence order)."""

    next: int
    total: int

    def __len__(self) -> int:
        return self.total - self.next

    def take(self, k: int) -> np.ndarray:
        ids = np.arange(self.next, min(self.next + k, self.total))
        self.next += len(ids)
        return ids


@dataclasses.dataclass(frozen=True)
class InsertPlan:
    """Queued rows to prefill, shard-major `[D * k]` (k = rows per shard, a power of two): each row's
    sequence id (-1: padding) and the LOCAL slot it goes to in its shard (padding rows: out of range)."""

    seq_ids: np.ndarray
    slots: np.ndarray

    @property
    def count(self) -> int:
        return int((self.seq_ids >= 0).sum())


def plan_insert(slot_seq: np.ndarray, done: np.ndarray, shards: int, queue: RowQueue) -> InsertPlan | None:
    """Assign queued rows to free slots (done, or never filled) shard by shard, in sequence order; None when
    the queue is empty or no slot is free. `slot_seq` [D * R] is each slot's sequence id (-1: empty)."""
    if not len(queue):
        return None
    free = (done | (slot_seq < 0)).reshape(shards, -1)
    per_shard = []
    for i in range(shards):
        slots = np.nonzero(free[i])[0]
        per_shard.append((slots, queue.take(len(slots))))
    most = max(len(ids) for _, ids in per_shard)
    if most == 0:
        return None
    k = 1 << (most - 1).bit_length()
    local = free.shape[1]
    seq = np.full((shards, k), -1, np.int64)
    dst = np.full((shards, k), local, np.int32)
    for i, (slots, ids) in enumerate(per_shard):
        seq[i, : len(ids)] = ids
        dst[i, : len(ids)] = slots[: len(ids)]
    return InsertPlan(seq_ids=seq.reshape(-1), slots=dst.reshape(-1))
