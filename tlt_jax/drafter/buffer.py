"""TLT's online drafter buffer: this RL step's finished sequences plus the PREVIOUS step's, long ones too.

What it holds. The spot trainer trains the drafter while a rollout is still running, so the sequences
available at that moment are the ones that finished early, i.e. the short ones. Training only on them biases
the drafter towards short answers, exactly where speculative decoding matters least (SD runs in the long
tail). TLT therefore trains on the current step's finished sequences together with the step before's
("one-step offset"; the reference keeps the last two steps' samples): those include the long sequences that
finished too late to be trained on in their own step. So:
- `add(samples, step)` with the current step appends: sequences stream in as they finish, in any number
  of calls per step;
- `add` with the next step (step + 1) rotates: the current step's samples become the previous step's, and
  the old previous step is dropped; a jump of more than one step drops both (that data is stale);
- an older step is an error.

Windowing (at `add`, per sample). Each sample keeps ONE window of at most `window` response tokens (default
512, the reference's choice) plus the `context` tokens right before it (attention-only context, no loss;
the prompt's last tokens when the window starts at the response, else the response tokens before it), cut
contiguously so relative positions stay exact. A sample then holds at most context + window tokens and
carries at most `window` loss pairs (the first window token's pair needs context >= 1), which bounds both
host memory ([L, H] hidden states per sample) and the static per-batch loss budget. The window starts at the
response when the response fits; otherwise its start is drawn UNIFORMLY over the response, with a generator
seeded by (seed, arrival index), so it is deterministic given the seed and the order of `add` calls. Why
random rather than the first or last window: SD runs in the long tail, i.e. at every depth of the long
responses, and reasoning text changes along a response (set-up, derivation, checking, answer); a random
window covers all of it over many samples, while the first window repeats what the short responses already
teach (the reference, which anchors long responses at their end, trains only on endings).

Memory budget. `max_tokens` bounds the tokens held (context + window tokens of every sample). The previous
step is guaranteed up to `prev_share * max_tokens` and may use whatever the current step leaves free; when
it must shrink it drops its SHORTEST sequences first (by full response length before windowing: the long
ones are what the current step lacks). The current step gets the rest and drops its OLDEST samples first
(the ones that finished earliest in the rollout, i.e. again the short end).

Sampling. `sample_packed` packs the held samples in a uniformly random order (the caller's generator)
first-fit into a static [rows, seq_len] batch with segment ids (no attention across samples, positions
restarting per sample) under the step's loss-position budget: every held sample is equally likely to be
trained on, current and previous step alike. `state_dict` / `save` and `load_state_dict` / `load` restore
the buffer exactly (an atomic npz), so a resumed run trains on the same data.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tlt_jax.drafter.packing import DrafterSample, PackedBatch, pack_samples

BUFFER_FILE = "drafter_buffer.npz"


def window_sample(
    sample: DrafterSample, window: int, context: int, rng: np.random.Generator
) -> DrafterSample:
    """`sample` cut to one window of <= `window` response tokens plus the <= `context` tokens before it.

    The window starts at the response if the response has <= `window` tokens, else at a uniformly random
    response position that leaves a full window. Loss mask: the window's response tokens only. The arrays
    are copies (a view would keep the whole original hidden array alive). Raises on a sample without
    response tokens.
    """
    resp = np.flatnonzero(sample.loss_mask)
    if resp.size == 0:
        raise ValueError("window_sample: the sample has no response (loss) tokens")
    r0, r1 = int(resp[0]), int(resp[-1]) + 1
    start = r0 if r1 - r0 <= window else r0 + int(rng.integers(0, r1 - r0 - window + 1))
    end = min(start + window, r1)
    first = max(0, start - context)
    mask = np.zeros((end - first,), bool)
    mask[start - first :] = sample.loss_mask[start:end]
    return DrafterSample(
        tokens=np.array(sample.tokens[first:end], np.int32),
        hidden=np.array(sample.hidden[first:end]),
        loss_mask=mask,
    )


@dataclasses.dataclass
class _Entry:
    sample: DrafterSample  # windowed
    step: int
    order: int  # arrival index (FIFO eviction within the current step; seeds the window)
    response_len: int  # full response length before windowing (long-first priority of the previous step)


class DrafterBuffer:
    """Online drafter training buffer with TLT's one-step offset (see the module docstring)."""

    def __init__(
        self,
        max_tokens: int,
        window: int = 512,
        context: int = 128,
        prev_share: float = 0.5,
        seed: int = 0,
    ):
        if window < 1 or context < 0:
            raise ValueError(f"need window >= 1 and context >= 0, got {window}, {context}")
        if max_tokens < window + context:
            raise ValueError(
                f"max_tokens={max_tokens} is below one sample's context + window = {context + window} tokens"
            )
        if not 0.0 <= prev_share <= 1.0:
            raise ValueError(f"prev_share must be in [0, 1], got {prev_share}")
        self.max_tokens, self.window, self.context = int(max_tokens), int(window), int(context)
        self.prev_share, self.seed = float(prev_share), int(seed)
        self.step: int | None = None  # the current step
        self.prev_step: int | None = None
        self._current: list[_Entry] = []
        self._prev: list[_Entry] = []
        self._counter = 0
        self.evicted = 0
        self.skipped = 0  # samples without response tokens (nothing to train on)

    # ---- adding -----------------------------------------------------------------------------------------
    def add(
        self, samples: Iterable[DrafterSample], step: int, response_lens: Sequence[int] | None = None
    ) -> None:
        """Add finished sequences of RL step `step` (see the module docstring for the rotation rule).
        response_lens: their whole responses' lengths (the previous step's eviction order) when the samples
        hold part of them (a recorded span); default each sample's response tokens."""
        step = int(step)
        if self.step is not None and step < self.step:
            raise ValueError(
                f"add got step {step} after step {self.step}: steps must not go back (one buffer per run)"
            )
        if self.step is not None and step > self.step:
            adjacent = step == self.step + 1
            self._prev = self._current if adjacent else []
            self.prev_step = self.step if adjacent else None
            self._current = []
        self.step = step
        samples = list(samples)
        lens = [s.num_response for s in samples] if response_lens is None else list(response_lens)
        if len(lens) != len(samples):
            raise ValueError(f"add: {len(samples)} samples but {len(lens)} response lengths")
        for s, n in zip(samples, lens, strict=True):
            if s.num_response == 0:
                self.skipped += 1
                continue
            rng = np.random.default_rng([self.seed, self._counter])
            w = window_sample(s, self.window, self.context, rng)
            self._current.append(_Entry(w, step, self._counter, int(n)))
            self._counter += 1
        self._enforce_budget()

    def _enforce_budget(self) -> None:
        prev_tokens = sum(e.sample.length for e in self._prev)
        cur_cap = self.max_tokens - min(prev_tokens, int(self.prev_share * self.max_tokens))
        cur_tokens = sum(e.sample.length for e in self._current)
        while self._current and cur_tokens > cur_cap:  # oldest first
            cur_tokens -= self._current.pop(0).sample.length
            self.evicted += 1
        self._prev.sort(key=lambda e: (-e.response_len, e.order))
        while self._prev and prev_tokens > self.max_tokens - cur_tokens:  # shortest first
            prev_tokens -= self._prev.pop().sample.length
            self.evicted += 1

    # ---- reading ----------------------------------------------------------------------------------------
    def samples(self) -> list[DrafterSample]:
        """The training view: the current step's samples (arrival order), then the previous step's (longest
        first)."""
        return [e.sample for e in self._current] + [e.sample for e in self._prev]

    def steps(self) -> list[int]:
        """The RL step each sample of `samples()` came from (same order)."""
        return [e.step for e in self._current] + [e.step for e in self._prev]

    def __len__(self) -> int:
        return len(self._current) + len(self._prev)

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.samples())

    @property
    def nbytes(self) -> int:
        """Host bytes of the held tokens, hidden states and masks."""
        return sum(s.tokens.nbytes + s.hidden.nbytes + s.loss_mask.nbytes for s in self.samples())

    def stats(self) -> dict[str, float]:
        """Buffer composition for logging."""
        return {
            "buffer/samples_current": float(len(self._current)),
            "buffer/samples_prev": float(len(self._prev)),
            "buffer/tokens": float(self.num_tokens),
            "buffer/loss_tokens": float(sum(s.num_response for s in self.samples())),
            "buffer/mbytes": self.nbytes / 2**20,
            "buffer/evicted": float(self.evicted),
        }

    def sample_packed(
        self,
        seq_len: int,
        rows: int,
        rng: np.random.Generator,
        max_loss_tokens: int | None = None,
    ) -> tuple[PackedBatch, list[int]]:
        """A packed batch of held samples in uniformly random order (first-fit): (batch, indices into
        `samples()`).

        Static shapes [rows, seq_len] whatever the buffer holds (choose seq_len >= context + window, else
        samples are truncated to their first seq_len tokens); `max_loss_tokens` is the train step's
        loss-position budget (`LossConfig.max_loss_tokens`; >= window admits any sample). An empty buffer,
        or a budget that admits no sample, is an error (train only once there is data).
        """
        view = self.samples()
        if not view:
            raise ValueError("sample_packed on an empty drafter buffer: add some samples first")
        order = rng.permutation(len(view))
        batch, packed = pack_samples([view[i] for i in order], seq_len, rows, max_loss_tokens=max_loss_tokens)
        if not packed:
            raise ValueError(f"no buffer sample fits max_loss_tokens={max_loss_tokens}: use >= {self.window}")
        return batch, [int(order[j]) for j in packed]

    # ---- state ------------------------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        keys = ("max_tokens", "window", "context", "prev_share", "seed")
        return {k: getattr(self, k) for k in keys}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Everything needed to restore the buffer exactly, as numpy arrays (npz-ready)."""
        entries = self._current + self._prev
        samples = [e.sample for e in entries]
        hidden_size = samples[0].hidden_size if samples else 0
        return {
            "config": np.asarray(json.dumps(self._config(), sort_keys=True)),
            "counters": np.asarray(
                [
                    -1 if self.step is None else self.step,
                    -1 if self.prev_step is None else self.prev_step,
                    self._counter,
                    self.evicted,
                    self.skipped,
                ],
                np.int64,
            ),
            "lengths": np.asarray([s.length for s in samples], np.int64),
            "steps": np.asarray([e.step for e in entries], np.int64),
            "orders": np.asarray([e.order for e in entries], np.int64),
            "response_lens": np.asarray([e.response_len for e in entries], np.int64),
            "is_prev": np.asarray([False] * len(self._current) + [True] * len(self._prev), bool),
            "tokens": np.concatenate([s.tokens for s in samples]) if samples else np.zeros((0,), np.int32),
            "hidden": (
                np.concatenate([s.hidden for s in samples])
                if samples
                else np.zeros((0, hidden_size), np.float32)
            ),
            "loss_mask": np.concatenate([s.loss_mask for s in samples]) if samples else np.zeros((0,), bool),
        }

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Restore from `state_dict()`; the buffer's settings must equal the saved ones."""
        saved = json.loads(str(state["config"]))
        if saved != json.loads(json.dumps(self._config(), sort_keys=True)):
            raise ValueError(f"buffer state was saved with {saved}, this buffer has {self._config()}")
        step, prev_step, self._counter, self.evicted, self.skipped = (int(x) for x in state["counters"])
        self.step = None if step < 0 else step
        self.prev_step = None if prev_step < 0 else prev_step
        bounds = np.concatenate([[0], np.cumsum(state["lengths"])]).astype(np.int64)
        self._current, self._prev = [], []
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            sample = DrafterSample(
                tokens=np.array(state["tokens"][a:b]),
                hidden=np.array(state["hidden"][a:b]),
                loss_mask=np.array(state["loss_mask"][a:b]),
            )
            entry = _Entry(
                sample, int(state["steps"][i]), int(state["orders"][i]), int(state["response_lens"][i])
            )
            (self._prev if state["is_prev"][i] else self._current).append(entry)

    def save(self, directory: str | os.PathLike) -> pathlib.Path:
        """Write `state_dict()` to `directory/drafter_buffer.npz` atomically (temp file + rename)."""
        path = pathlib.Path(directory) / BUFFER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **self.state_dict())
        os.replace(tmp, path)
        return path

    def load(self, directory: str | os.PathLike) -> None:
        """Restore what `save(directory)` wrote."""
        with np.load(pathlib.Path(directory) / BUFFER_FILE) as z:
            self.load_state_dict({k: z[k] for k in z.files})
