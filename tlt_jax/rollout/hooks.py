"""The rollout engine's hooks: what a caller sees and decides while a rollout runs.

One protocol (`RolloutHooks`, every method optional) for everything that plugs into the host scheduler:
- `choose_mode(running, batch_bucket)` before each chunk: "plain" or a registered speculative mode (None: no
  opinion). A strategy selector chooses here (`adaptive.AdaptivePolicy`: BEG-MAB and its baselines); the
  chunks no hook chose get the paper's threshold switch, `ThresholdPolicy` built from `SpecConfig.threshold`
  / `min_steps_below` (the one implementation of that switch; the scheduler appends it last).
- `on_chunk(view)` after each chunk: the chunk's record (mode, seconds, tokens, accept counts, whether it
  compiled) and which rows and which data-axis devices are still live (a device with no live row is idle:
  the spot trainer's opportunity).
- `on_finished(seqs)` whenever sequences finish, while the rollout is still running: their tokens, log-probs
  and, with `EngineConfig.record_hidden`, a bounded span of the target's hidden states (drafter data).
- `idle_work(live_per_shard)` before each chunk: work for the data-axis devices that have no live row, fused
  into the chunk's program (ONE SPMD program in `shard_map` in which busy devices decode and idle devices
  run the work: the spot trainer's drafter micro-steps). None: plain chunk.
- `on_start(info)` / `on_end(rollout)` around a rollout.
`HookList` composes several hooks (the first non-None mode choice wins).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Protocol

import numpy as np

from tlt_jax.rollout.history import HistoryStore
from tlt_jax.rollout.types import ChunkRecord, Rollout


@dataclasses.dataclass(frozen=True)
class RolloutInfo:
    """What a rollout is about to do (given to `on_start`)."""

    num_prompts: int
    group_size: int
    max_new_tokens: int
    data_shards: int
    modes: tuple[str, ...]  # the registered speculative modes
    history: HistoryStore | None = None  # the history drafter's store (read its size and counters)

    @property
    def num_sequences(self) -> int:
        return self.num_prompts * self.group_size


@dataclasses.dataclass(frozen=True)
class ChunkView:
    """The scheduler's picture after a chunk: its record and the live rows per data-axis shard."""

    record: ChunkRecord
    live_per_shard: tuple[int, ...]
    finished: int  # sequences finished so far

    @property
    def live_rows(self) -> int:
        return sum(self.live_per_shard)

    @property
    def idle_shards(self) -> tuple[int, ...]:
        """Data-axis devices with no live row (free for drafter training while the others decode)."""
        return tuple(i for i, n in enumerate(self.live_per_shard) if n == 0)


@dataclasses.dataclass(frozen=True)
class FinishedSequences:
    """Sequences that finished since the last report (sequence ids index the final `Rollout`'s rows).

    hidden[i]: [<= min(len_i - 1, W), H] the target's final hidden states of the response's recorded span
    (`EngineConfig.hidden_span`): response token hidden_offset[i] + j's state at row j (the newest token has
    none), or None without `record_hidden`. hidden_offset: [n] those spans' first response positions (0 for
    "first": the span follows the prompt). prompt_hidden[i]: [len(prompt), H] the prompt's states (shared by
    the samples of a prompt) or None.
    """

    seq_ids: np.ndarray
    prompt_index: np.ndarray
    prompt_tokens: list[list[int]]
    tokens: list[np.ndarray]
    logprobs: list[np.ndarray]
    finish_reason: list[str]
    hidden: list[np.ndarray] | None = None
    prompt_hidden: list[np.ndarray] | None = None
    hidden_offset: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.seq_ids)


@dataclasses.dataclass(frozen=True)
class IdleWork:
    """Work for the idle data-axis devices, fused into the next chunk's SPMD program.

    fn(operands, active) runs on EVERY data group inside `jax.shard_map` over the mesh's "data" axis
    (collectives over "data" allowed outside per-group branches; on a model axis > 1 the model axis stays
    automatic, so a group's devices run it together); `active` is true on groups with no live row. Its
    operands and outputs are laid out by `in_specs` / `out_specs` (PartitionSpec pytree prefixes naming
    "data" only). `key` names the work's static shapes (part of the program's cache key);
    `on_done(outputs, seconds)` receives the outputs on the host after the fused chunk ran.
    """

    key: Hashable
    fn: Callable[[Any, Any], Any]
    operands: Any
    in_specs: Any
    out_specs: Any
    on_done: Callable[[Any, float], None]


class RolloutHooks:
    """Base class of the hooks protocol: every method is a no-op; override what you need."""

    def on_start(self, info: RolloutInfo) -> None:
        del info

    def choose_mode(self, running: int, batch_bucket: int) -> str | None:
        del running, batch_bucket
        return None

    def idle_work(self, live_per_shard: tuple[int, ...]) -> IdleWork | None:
        del live_per_shard
        return None

    def on_chunk(self, view: ChunkView) -> None:
        del view

    def on_finished(self, seqs: FinishedSequences) -> None:
        del seqs

    def on_end(self, rollout: Rollout) -> None:
        del rollout


class HookList(RolloutHooks):
    """Several hooks as one: events go to all in order; the first non-None `choose_mode` wins."""

    def __init__(self, hooks: Iterable[RolloutHooks | None]):
        self.hooks = [h for h in hooks if h is not None]

    def on_start(self, info: RolloutInfo) -> None:
        for h in self.hooks:
            h.on_start(info)

    def choose_mode(self, running: int, batch_bucket: int) -> str | None:
        for h in self.hooks:
            mode = h.choose_mode(running, batch_bucket)
            if mode is not None:
                return mode
        return None

    def idle_work(self, live_per_shard: tuple[int, ...]) -> IdleWork | None:
        for h in self.hooks:
            work = h.idle_work(live_per_shard)
            if work is not None:
                return work
        return None

    def on_chunk(self, view: ChunkView) -> None:
        for h in self.hooks:
            h.on_chunk(view)

    def on_finished(self, seqs: FinishedSequences) -> None:
        for h in self.hooks:
            h.on_finished(seqs)

    def on_end(self, rollout: Rollout) -> None:
        for h in self.hooks:
            h.on_end(rollout)


class ThresholdPolicy(RolloutHooks):
    """The paper's threshold switch, the one implementation of it: plain decoding until at most `threshold`
    rows have been running for `min_steps_below` consecutive decode steps, then `mode` for the rest of the
    rollout, even if the running count rose again (reset per rollout by `on_start`).

    Steps are counted per decode step (`ChunkRecord.running`), a step above `threshold` restarting the count;
    the switch turns on at a chunk boundary: after a chunk that ended with the count reached, or before a
    chunk at <= `threshold` rows with the count reached (with `min_steps_below` = 0: the first such chunk).
    The scheduler adds one, built from `SpecConfig`, after the caller's hooks: it decides the chunks that no
    strategy selector chose (`config.bandit.algorithm=off`: all of them).
    """

    def __init__(self, mode: str, threshold: int, min_steps_below: int = 0):
        self.mode, self.threshold, self.min_steps_below = mode, threshold, min_steps_below
        self.steps_below, self.on = 0, False

    def on_start(self, info: RolloutInfo) -> None:
        del info
        self.steps_below, self.on = 0, False

    def choose_mode(self, running: int, batch_bucket: int) -> str:
        del batch_bucket
        if not self.on and running <= self.threshold and self.steps_below >= self.min_steps_below:
            self.on = True
        return self.mode if self.on else "plain"

    def on_chunk(self, view: ChunkView) -> None:
        for r in view.record.running:
            self.steps_below = self.steps_below + 1 if r <= self.threshold else 0
        if self.steps_below and self.steps_below >= self.min_steps_below:
            self.on = True


class FixedMode(RolloutHooks):
    """Always the same mode ("plain" or a registered speculative mode)."""

    def __init__(self, mode: str):
        self.mode = mode

    def choose_mode(self, running: int, batch_bucket: int) -> str:
        del running, batch_bucket
        return self.mode


class Progress(Protocol):
    def update(self, running: int, finished: int, new_tokens: int) -> None: ...


class ProgressHook(RolloutHooks):
    """Feeds a progress bar (`utils.tracking.RolloutProgress`) after every chunk."""

    def __init__(self, bar: Progress):
        self.bar = bar

    def on_chunk(self, view: ChunkView) -> None:
        self.bar.update(view.live_rows, view.finished, view.record.new_tokens)


def as_hooks(
    hooks: RolloutHooks | Iterable[RolloutHooks | None] | None, extra: RolloutHooks | None = None
) -> HookList:
    """Normalise a hooks argument (one, several or None) into a HookList (with `extra` appended)."""
    if hooks is None:
        items: list[RolloutHooks | None] = []
    elif isinstance(hooks, RolloutHooks):
        items = [hooks]
    else:
        items = list(hooks)
    return HookList([*items, extra])
