"""TLT's online drafter buffer: the current RL step's finished sequences plus the PREVIOUS step's long ones.

Why the one-step offset: the spot trainer trains the drafter while a rollout is still running, so the
sequences available at that moment are the ones that finished early, i.e. the short ones. Training only on
them biases the drafter towards short answers, exactly where speculative decoding matters least (the long
tail is where SD runs). TLT therefore keeps, next to the current step's sequences, the long sequences of the
step before: they finished too late to be trained on in their own step and are used one step later.

Semantics of `add_step(samples, step)`:
- `step` equal to the current step appends (sequences of one step may arrive in several calls);
- a newer `step` rotates: the current step becomes the previous one, of which only the LONG samples are
  kept (response length >= `long_min_tokens`, or else >= the `long_quantile` quantile of that step's
  response lengths); whatever was the previous step before is dropped;
- an older `step` is an error.

The buffer is bounded by token count (`max_tokens`, prompt + response tokens): the previous step's long
samples are guaranteed up to `prev_share * max_tokens` (longest first) and may use whatever the current step
leaves free; the current step gets the rest and, when over budget, drops its oldest samples first (the ones
that finished earliest in the rollout, i.e. again the short end).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from tlt_jax.drafter.train_step import DrafterSample, PackedBatch, pack_samples


@dataclasses.dataclass
class _Entry:
    sample: DrafterSample
    step: int
    order: int  # insertion counter (FIFO eviction within the current step)


class DrafterBuffer:
    """Online drafter training buffer with TLT's one-step offset (see the module docstring)."""

    def __init__(
        self,
        max_tokens: int,
        long_quantile: float = 0.5,
        long_min_tokens: int | None = None,
        prev_share: float = 0.5,
    ):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not 0.0 <= long_quantile <= 1.0:
            raise ValueError(f"long_quantile must be in [0, 1], got {long_quantile}")
        if not 0.0 <= prev_share <= 1.0:
            raise ValueError(f"prev_share must be in [0, 1], got {prev_share}")
        self.max_tokens = int(max_tokens)
        self.long_quantile = float(long_quantile)
        self.long_min_tokens = long_min_tokens
        self.prev_share = float(prev_share)
        self.step: int | None = None  # the current step
        self.prev_step: int | None = None
        self._current: list[_Entry] = []
        self._prev: list[_Entry] = []
        self._counter = 0
        self.evicted = 0

    # ---- adding -----------------------------------------------------------------------------------------
    def long_threshold(self, samples: Sequence[DrafterSample]) -> float:
        """Response length at or above which a sample of a finished step counts as long."""
        if self.long_min_tokens is not None:
            return float(self.long_min_tokens)
        if not samples:
            return float("inf")
        return float(np.quantile([s.num_response for s in samples], self.long_quantile))

    def add_step(self, samples: Iterable[DrafterSample], step: int) -> None:
        """Add finished sequences of RL step `step` (see the module docstring for the rotation rule)."""
        step = int(step)
        if self.step is not None and step < self.step:
            raise ValueError(
                f"add_step got step {step} after step {self.step}: "
                "steps must not go back (one buffer per run)"
            )
        if self.step is not None and step > self.step:
            finished = [e.sample for e in self._current]
            thr = self.long_threshold(finished)
            self._prev = [e for e in self._current if e.sample.num_response >= thr]
            self.prev_step = self.step
            self._current = []
        self.step = step
        for s in samples:
            self._current.append(_Entry(s, step, self._counter))
            self._counter += 1
        self._enforce_budget()

    def _enforce_budget(self) -> None:
        prev_tokens = sum(e.sample.length for e in self._prev)
        cur_cap = self.max_tokens - min(prev_tokens, int(self.prev_share * self.max_tokens))
        cur_tokens = sum(e.sample.length for e in self._current)
        while self._current and cur_tokens > cur_cap:  # oldest first
            cur_tokens -= self._current.pop(0).sample.length
            self.evicted += 1
        self._prev.sort(key=lambda e: (-e.sample.num_response, e.order))
        while self._prev and prev_tokens > self.max_tokens - cur_tokens:  # shortest first
            prev_tokens -= self._prev.pop().sample.length
            self.evicted += 1

    # ---- reading ----------------------------------------------------------------------------------------
    def samples(self) -> list[DrafterSample]:
        """The training view: the current step's samples, then the previous step's long samples."""
        return [e.sample for e in self._current] + [e.sample for e in self._prev]

    def steps(self) -> list[int]:
        """The RL step each sample of `samples()` came from (same order)."""
        return [e.step for e in self._current] + [e.step for e in self._prev]

    def __len__(self) -> int:
        return len(self._current) + len(self._prev)

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.samples())

    def stats(self) -> dict[str, float]:
        """Buffer composition for logging."""
        return {
            "buffer/samples_current": float(len(self._current)),
            "buffer/samples_prev_long": float(len(self._prev)),
            "buffer/tokens": float(self.num_tokens),
            "buffer/evicted": float(self.evicted),
        }

    def sample_packed(
        self,
        seq_len: int,
        rows: int,
        rng: np.random.Generator,
        max_loss_tokens: int | None = None,
    ) -> tuple[PackedBatch, list[int]]:
        """A packed batch of buffer samples in random order (first-fit): (batch, indices into `samples()`).

        Static shapes [rows, seq_len] whatever the buffer holds; `max_loss_tokens` is the train step's
        loss-position budget (`LossConfig.max_loss_tokens`). An empty buffer is an error (train only once
        there is data).
        """
        view = self.samples()
        if not view:
            raise ValueError("sample_packed on an empty drafter buffer: add_step some samples first")
        order = rng.permutation(len(view))
        batch, packed = pack_samples([view[i] for i in order], seq_len, rows, max_loss_tokens=max_loss_tokens)
        return batch, [int(order[j]) for j in packed]
