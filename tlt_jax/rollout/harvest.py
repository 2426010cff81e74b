"""Host-side bookkeeping of a rollout: finished sequences leave the device state as they finish.

Between chunks the engine calls `Harvester.collect` with the rows' summary the chunk fetched: it applies
stop strings (host-side, incrementally: the response ends with the token that completes a stop string),
copies the rows that finished since the last call, and only those, to host arrays (tokens, log-probs and
the recorded span of hidden states, unrolled from the device's ring by `record.kept_positions`;
`RolloutEngine.fetch_rows`) BEFORE compaction or an insert can drop them, and streams them to the hooks
(`on_finished`) while the rest of the rollout is still decoding. `rollout()` assembles the final `Rollout` in
sequence order. With `keep_hidden=False` (`EngineConfig.keep_hidden`) the hidden states only stream: none is
kept for the `Rollout`, and a prompt's states are dropped once its last sample has been reported, so the host
holds the states of one harvest at a time instead of a whole rollout's (at the paper's shapes, 512 rows x
8,192 x 3,584 x bf16 = 28 GiB per process).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from tlt_jax import sharding as shd
from tlt_jax.rollout.hooks import FinishedSequences, RolloutHooks
from tlt_jax.rollout.interface import EngineLike
from tlt_jax.rollout.record import kept_positions
from tlt_jax.rollout.types import DecodeState, Rollout, RolloutStats, RowSummary


class Harvester:
    """Collects finished sequences of one rollout (see the module docstring)."""

    def __init__(
        self,
        engine: EngineLike,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new: int,
        record_hidden: bool,
        hooks: RolloutHooks,
        keep_hidden: bool = True,
    ):
        self.tokenizer = engine.tokenizer
        self.stop_strings = tuple(engine.config.stop_strings)
        self.eos = set(shd.to_host(engine.eos_ids).tolist())
        self.prompts, self.n, self.max_new = prompts, n, max_new
        total = len(prompts) * n
        self.prompt_index = np.repeat(np.arange(len(prompts)), n)
        self.tokens = np.zeros((total, max_new), np.int32)
        self.logp = np.zeros((total, max_new), np.float32)
        self.lengths = np.zeros((total,), np.int32)
        self.reason = ["length"] * total
        self.harvested = np.zeros((total,), bool)
        self.stop_cut: dict[int, int] = {}
        self.scanned = np.zeros((total,), np.int64)  # tokens of each sequence checked for stop strings
        self.engine = engine
        # the prompts' hidden states arrive with each prefill (`add_prompt_hidden`), before their rows run
        self.prompt_hidden: list[np.ndarray] | None = [None] * len(prompts) if record_hidden else None  # type: ignore[list-item]
        self.keep_hidden = record_hidden and keep_hidden
        self.hidden: list[np.ndarray | None] | None = [None] * total if self.keep_hidden else None
        self.hidden_offset = np.zeros((total,), np.int64) if record_hidden else None
        self.unreported = np.full((len(prompts),), n, np.int64)  # samples of each prompt not yet reported
        self.hooks = hooks

    def add_prompt_hidden(self, prompt_ids: np.ndarray, hidden: jax.Array | None) -> None:
        """Keep a prefill's prompt hidden states [P_bucket, T, H] (row j: prompt `prompt_ids[j]`)."""
        if self.prompt_hidden is None or hidden is None:
            return
        h = shd.to_host(hidden)
        for j, i in enumerate(prompt_ids):
            if self.prompt_hidden[int(i)] is None and self.unreported[int(i)]:
                # a copy: a view would keep the whole padded [P_bucket, T, H] array alive
                self.prompt_hidden[int(i)] = h[j, : len(self.prompts[int(i)])].copy()

    @property
    def num_finished(self) -> int:
        return int(self.harvested.sum())

    def collect(
        self, state: DecodeState, seq_ids: np.ndarray, rows: RowSummary
    ) -> tuple[DecodeState, RowSummary]:
        """Apply stop strings, harvest newly finished rows and report them; returns the state and the rows'
        summary (done flags with the stop strings' rows added)."""
        done = rows.done
        if self.stop_strings:
            newly = self._stop_strings(state, rows, seq_ids)
            if newly.any():
                done = done | newly
                state = state.replace(done=jax.device_put(done, state.done.sharding))
                rows = dataclasses.replace(rows, done=done)
        fresh = done & (seq_ids >= 0)
        fresh[fresh] = ~self.harvested[seq_ids[fresh]]
        if fresh.any():
            self._harvest(state, np.nonzero(fresh)[0], seq_ids, rows.num_generated)
        return state, rows

    def _harvest(self, state: DecodeState, rows: np.ndarray, seq_ids: np.ndarray, num: np.ndarray) -> None:
        toks, lps, hid = self.engine.fetch_rows(state, rows)  # only these rows leave the device
        if self.hidden_offset is None:
            hid = None
        ends = None if hid is None or state.hidden_end is None else shd.to_host(state.hidden_end)[rows]
        sids, spans = [], []
        for j, r in enumerate(rows):
            sid = int(seq_ids[r])
            ln = self.stop_cut.get(sid, int(num[r]))
            self.tokens[sid, :ln] = toks[j, :ln]
            self.logp[sid, :ln] = lps[j, :ln]
            self.lengths[sid] = ln
            if sid in self.stop_cut:
                self.reason[sid] = "stop"
            elif ln > 0 and int(toks[j, ln - 1]) in self.eos:
                self.reason[sid] = "eos"
            if hid is not None:
                end = None if ends is None else int(ends[j])
                offset, slots = kept_positions(int(num[r]) - 1, ln, hid.shape[1], end)
                self.hidden_offset[sid] = offset  # type: ignore[index]
                spans.append(hid[j, slots])  # a copy (fancy index): the fetched block is freed
            self.harvested[sid] = True
            sids.append(sid)
        ids = np.asarray(sids, np.int64)
        self.hooks.on_finished(self._report(ids, spans if hid is not None else None))

    def _report(self, ids: np.ndarray, spans: list[np.ndarray] | None) -> FinishedSequences:
        """The sequences `ids` as reported to the hooks (their recorded spans `spans`); kept for the
        `Rollout` unless the states only stream (then a prompt's states go once its samples are out)."""
        prompts, ph = self.prompt_index[ids], self.prompt_hidden
        seqs = FinishedSequences(
            seq_ids=ids,
            prompt_index=prompts,
            prompt_tokens=[list(self.prompts[int(p)]) for p in prompts],
            tokens=[self.tokens[i, : self.lengths[i]].copy() for i in ids],
            logprobs=[self.logp[i, : self.lengths[i]].copy() for i in ids],
            finish_reason=[self.reason[i] for i in ids],
            hidden=spans,
            prompt_hidden=None if ph is None else [ph[int(p)] for p in prompts],
            hidden_offset=None if self.hidden_offset is None else self.hidden_offset[ids].copy(),
        )
        if self.hidden is not None and spans is not None:
            for i, h in zip(ids, spans, strict=True):
                self.hidden[int(i)] = h
        np.subtract.at(self.unreported, prompts, 1)
        if self.prompt_hidden is not None and not self.keep_hidden:
            for p in np.unique(prompts[self.unreported[prompts] == 0]):
                self.prompt_hidden[int(p)] = None  # the hooks hold what they keep
        return seqs

    def _stop_strings(self, state: DecodeState, rows: RowSummary, seq_ids: np.ndarray) -> np.ndarray:
        """Rows whose response now contains a stop string (cut after the token that completes it).

        Incremental: each sequence's tokens are scanned once, from where the last check ended (less a margin
        of the longest stop string's length in tokens, enough since every token decodes to >= 1 character or
        to part of one), so a check decodes the chunk's new tokens, not the whole response. The token array
        itself is fetched whole: stop strings are for small runs; at scale EOS ends the rows."""
        live = np.nonzero(~rows.done & (seq_ids >= 0))[0]
        newly = np.zeros_like(rows.done)
        if not len(live):
            return newly
        toks = shd.to_host(state.out_tokens)
        margin = max(len(s) for s in self.stop_strings) + 4
        for r in live:
            sid, num = int(seq_ids[r]), int(rows.num_generated[r])
            start = max(self.scanned[sid] - margin, 0)
            self.scanned[sid] = num
            ids = toks[r, start:num].tolist()
            if not any(s in self.tokenizer.decode(ids) for s in self.stop_strings):
                continue
            for cut in range(1, len(ids) + 1):  # the first prefix that contains a stop string
                if any(s in self.tokenizer.decode(ids[:cut]) for s in self.stop_strings):
                    self.stop_cut[sid] = start + cut
                    newly[r] = True
                    break
        return newly

    def rollout(self, stats: RolloutStats) -> Rollout:
        """The finished rollout in sequence order (every sequence must have been harvested)."""
        if not self.harvested.all():
            raise RuntimeError(f"{int((~self.harvested).sum())} sequences were never harvested (engine bug)")
        stats.num_tokens = int(self.lengths.sum())
        return Rollout(
            prompt_tokens=[list(self.prompts[i]) for i in self.prompt_index],
            prompt_index=self.prompt_index.copy(),
            tokens=self.tokens,
            logprobs=self.logp,
            lengths=self.lengths,
            finish_reason=self.reason,
            stats=stats,
            prompt_hidden=self.prompt_hidden if self.keep_hidden else None,
            hidden=self.hidden,  # type: ignore[arg-type]
            hidden_offset=self.hidden_offset if self.keep_hidden else None,
        )
