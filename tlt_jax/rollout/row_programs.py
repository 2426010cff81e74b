"""The rollout engine's programs that start rows and bring finished ones back (a base of `RolloutEngine`).

- `prefill`: the rows' unique prompts through the target once, their cache rows repeated, each row's first
  token sampled with its own key: one program, for a batch that starts all at once.
- `prompt_cache` + `start_rows`: the same in two steps for continuous batching. Every unique prompt of the
  rollout is prefilled ONCE into a `decode.PromptCache`; queued rows start from it whenever slots free up
  (`start_rows`: repeat, grow, sample the first token: no forward pass), and `insert` writes them into
  their slots. Prefilling a prompt again for each insert of its siblings made the capped engine ~19% slower
  than the uncapped one at the cap on CPU (docs/benchmarks.md); its KV at the prompt bucket is small (the
  paper's 64 prompts x 1,024 tokens: 0.9 GiB per device at Qwen2.5-7B, TP 4).
- `row_summary` / `fetch_rows`: the rows' done flags and lengths, and the finished rows' outputs only.

Each row's PRNG stream is `split(key, len(prompts) * n)[sequence id]`, whatever batch it starts in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from tlt_jax import sharding as shd
from tlt_jax.rollout import admission, decode, spmd
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.programs import ProgramCache, pow2_at_least
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.types import DecodeState, RowSummary

FETCH_BLOCK = 8  # finished rows leave the device in gathers of this many rows (one program per batch bucket)


class RowPrograms:
    """Prefill, prompt cache, row starts, insert and fetches of `RolloutEngine` (which sets the attributes
    below and the methods `cache_bucket`, `batch_bucket`, `needs`, `resize_cache`, `_constrain`,
    `_replicate`)."""

    config: EngineConfig
    mesh: Mesh
    replicated: NamedSharding
    programs: ProgramCache
    graphdef: Any
    drafter_graphdef: Any
    params: Any
    drafter_params: Any
    eos_ids: jax.Array
    cache_bucket: Callable[[int], int]
    batch_bucket: Callable[[int], int]
    needs: Callable[[], tuple[bool, bool]]
    resize_cache: Callable[[DecodeState, int], DecodeState]
    _constrain: Callable[[Any], Any]
    _replicate: Callable[[Any], Any]

    # ---- prompts ----------------------------------------------------------------------------------------
    def validate_prompts(self, prompts: Sequence[Sequence[int]], max_new: int) -> None:
        if not prompts:
            raise ValueError("generate() got no prompts")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token (e.g. BOS).")
            if len(p) + max_new > self.config.max_cache_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new} it needs "
                    f"{len(p) + max_new} cache slots but max_cache_len={self.config.max_cache_len}. Raise "
                    f"config.rollout.max_cache_len to >= {len(p) + max_new}, lower "
                    "config.rollout.max_new_tokens, or shorten the prompt."
                )

    def prompt_bucket(self, prompts: Sequence[Sequence[int]]) -> int:
        """The padded prompt length of a rollout's prefills (every start of the rollout uses the same)."""
        longest = max(len(p) for p in prompts)
        return min(pow2_at_least(longest, self.config.prompt_bucket), self.config.max_cache_len)

    def _prompt_arrays(
        self, prompts: Sequence[Sequence[int]], uniq: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The prompts `uniq` as [P_bucket, T_bucket] tokens (T_bucket: the rollout's `prompt_bucket`) and
        their lengths [P_bucket] (padding prompts have length 1)."""
        pb, tb = pow2_at_least(len(uniq)), self.prompt_bucket(prompts)
        tokens = np.zeros((pb, tb), np.int32)
        lens = np.ones((pb,), np.int32)
        for j, i in enumerate(uniq):
            tokens[j, : len(prompts[i])] = prompts[i]
            lens[j] = len(prompts[i])
        return tokens, lens

    def _row_arrays(
        self, uniq: np.ndarray, n: int, seq_ids: np.ndarray, seq_keys: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per row of a start: its prompt's index in `uniq` and its PRNG key data (padding rows: zeros)."""
        live = seq_ids >= 0
        rows = np.zeros(seq_ids.shape, np.int32)
        rows[live] = np.searchsorted(uniq, seq_ids[live] // n)
        keys = np.zeros((len(seq_ids), 2), np.uint32)
        keys[live] = seq_keys[seq_ids[live]]
        return rows, keys

    def prefill_program(
        self, sampling: SamplingParams, cache_len: int, max_new: int
    ) -> decode.PrefillProgram:
        """The static description of a prefill, prompt cache or row start with this cache length."""
        cfg, (use_drafter, use_prompt) = self.config, self.needs()
        return decode.PrefillProgram(
            target=self.graphdef,
            drafter=self.drafter_graphdef if use_drafter else None,
            sampling=sampling,
            attn_impl=cfg.attn_impl,
            cache_len=cache_len,
            max_new=max_new,
            carry_prompt=use_prompt,
            hidden_window=cfg.hidden_window if cfg.record_hidden else 0,
            record_prompt_hidden=cfg.record_hidden,
            hidden_span=cfg.hidden_span,
        )

    def start_cache_len(self, longest: int, tb: int, max_new: int) -> int:
        """The cache bucket rows start in: their prompt plus a chunk (at most the whole response)."""
        s = self.cache_bucket(min(max(tb, longest + self.config.chunk_steps + 1), longest + max_new))
        return max(s, self.cache_bucket(tb))

    def _start_operands(self, seq_ids: np.ndarray, rows: np.ndarray, keys: np.ndarray, max_new: int) -> tuple:
        """(rows, keys, budget, padding, sequence ids) of a start, batch-sharded over the data axis."""
        b = len(seq_ids)
        put = lambda x: jax.device_put(x, shd.batch_sharding(self.mesh, np.ndim(x), b))  # noqa: E731
        budget = np.full((b,), max_new, np.int32)
        return tuple(put(x) for x in (rows, keys, budget, seq_ids < 0, seq_ids.astype(np.int32)))

    # ---- one program: prefill --------------------------------------------------------------------------
    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        key: jax.Array,
        sampling: SamplingParams,
        max_new_tokens: int,
        drafter_params: Any | None = None,
        seq_ids: np.ndarray | None = None,
        params: Any | None = None,
    ) -> tuple[DecodeState, jax.Array | None]:
        """Prefill the rows' unique prompts once, repeat their cache rows, sample each row's first token.

        seq_ids: the sequence of each row of the batch (sequence i = prompt i // n, sample i % n; -1: a
        padding row, done from the start), shard-major: row blocks of B / data_size rows live on one
        data-axis device each. Default: every sequence, padded to a batch bucket. With a drafter configured
        the drafter cache is prefilled too. Returns the state and, with `record_hidden`, the hidden states of
        the batch's unique prompts (`admission.unique_prompts(seq_ids, n)` order) [P_bucket, T_bucket, H].
        """
        self.validate_prompts(prompts, max_new_tokens)
        total = len(prompts) * n
        if seq_ids is None:
            slots = np.arange(self.batch_bucket(total))
            seq_ids = np.where(slots < total, slots, -1)
        seq_ids = np.asarray(seq_ids)
        uniq = admission.unique_prompts(seq_ids, n)
        tokens, lens = self._prompt_arrays(prompts, uniq)
        rows, keys = self._row_arrays(uniq, n, seq_ids, admission.sequence_keys(key, total))
        (pb, tb), b = tokens.shape, len(rows)
        s = self.start_cache_len(int(lens.max()), tb, max_new_tokens)
        prog = self.prefill_program(sampling, s, max_new_tokens)

        def fn(*args):  # noqa: ANN002, ANN202
            state, hidden = decode.prefill(prog, *args)
            return self._constrain(state), hidden

        args = (
            self.params if params is None else params,
            (self.drafter_params if drafter_params is None else drafter_params) if prog.drafter else None,
            jnp.asarray(tokens),
            jnp.asarray(lens),
            *self._start_operands(seq_ids, rows, keys, max_new_tokens),
            self.eos_ids,
        )
        key_ = ("prefill", dataclasses.astuple(sampling), pb, tb, b, s, max_new_tokens, *self.needs())
        return self.programs.run((*key_, self.config.record_hidden), fn, args)[0]

    # ---- continuous batching: the prompt cache, row starts, the insert ----------------------------------
    def prompt_cache(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        params: Any | None = None,
        drafter_params: Any | None = None,
    ) -> decode.PromptCache:
        """Every prompt of the rollout through the target once (replicated over the data axis, KV heads
        over the model axis): what `start_rows` starts rows from."""
        self.validate_prompts(prompts, max_new_tokens)
        tokens, lens = self._prompt_arrays(prompts, np.arange(len(prompts)))
        s_p = self.cache_bucket(tokens.shape[1])
        prog = self.prefill_program(SamplingParams(), s_p, max_new_tokens)
        rules = {**shd.DEFAULT_RULES, "batch": None}

        def fn(*args):  # noqa: ANN002, ANN202
            pc = decode.prefill_prompts(prog, *args)
            return jax.lax.with_sharding_constraint(pc, shd.shard_pytree_batch(pc, self.mesh, rules))

        args = (
            self.params if params is None else params,
            (self.drafter_params if drafter_params is None else drafter_params) if prog.drafter else None,
            jnp.asarray(tokens),
            jnp.asarray(lens),
        )
        key = ("prompts", *tokens.shape, s_p, *self.needs(), self.config.record_hidden)
        return self.programs.run(key, fn, args)[0]

    def start_rows(
        self,
        pc: decode.PromptCache,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        seq_ids: np.ndarray,
        seq_keys: np.ndarray,
        sampling: SamplingParams,
        max_new_tokens: int,
    ) -> DecodeState:
        """Rows `seq_ids` (shard-major, -1: padding) started from the prompt cache: no forward pass.
        seq_keys: every sequence's key data (`admission.sequence_keys`, once per rollout)."""
        seq_ids = np.asarray(seq_ids)
        rows, keys = self._row_arrays(np.arange(len(prompts)), n, seq_ids, seq_keys)
        longest = max((len(prompts[i]) for i in admission.unique_prompts(seq_ids, n)), default=1)
        s = self.start_cache_len(longest, pc.tokens.shape[1], max_new_tokens)
        prog = self.prefill_program(sampling, s, max_new_tokens)
        fn = lambda *args: self._constrain(decode.start_rows(prog, *args))  # noqa: E731
        args = (pc, *self._start_operands(seq_ids, rows, keys, max_new_tokens), self.eos_ids)
        key_ = ("start", dataclasses.astuple(sampling), len(seq_ids), s, max_new_tokens, *self.needs())
        return self.programs.run(key_, fn, args)[0]

    def insert(self, state: DecodeState, new: DecodeState, slots: np.ndarray) -> DecodeState:
        """Continuous batching: write the started rows `new` (shard-major, `slots` their LOCAL slot per
        shard; out-of-range slots: padding rows) into `state` (donated), growing its cache bucket first when
        the new rows' is larger."""
        if new.cache.capacity > state.cache.capacity:
            state = self.resize_cache(state, new.cache.capacity)
        fn = spmd.insert_program(self.mesh, state, new, self._constrain)
        bs = shd.batch_sharding(self.mesh, 1, len(slots))
        args = (state, new, jax.device_put(slots.astype(np.int32), bs))
        key = ("insert", state.done.shape[0], len(slots), state.cache.capacity, new.cache.capacity)
        return self.programs.run(key, fn, args, donate=(0,))[0]

    # ---- back to the host --------------------------------------------------------------------------------
    def row_summary(self, state: DecodeState) -> RowSummary:
        """The rows' done flags, lengths and token counts (one transfer; after a prefill or an insert)."""
        return RowSummary(*shd.to_host_tree((state.done, state.cache.lengths, state.num_generated)))

    def fetch_rows(
        self, state: DecodeState, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Tokens, log-probs and recorded hidden states (None without) of the rows `rows` only: a gather on
        the devices in blocks of FETCH_BLOCK rows, then a transfer of those rows (a finished row leaves the
        device without the whole batch's [B, N] tokens or [B, W, H] hidden states crossing)."""
        b = state.done.shape[0]
        k = min(FETCH_BLOCK, b)
        arrays = (state.out_tokens, state.out_logp, state.out_hidden)
        fn = lambda arr, idx: self._replicate(jax.tree.map(lambda x: x[idx], arr))  # noqa: E731
        parts = []
        for i in range(0, len(rows), k):
            idx = np.zeros((k,), np.int32)
            chunk = rows[i : i + k]
            idx[: len(chunk)] = chunk
            key = ("fetch", b, k, state.out_tokens.shape[1], state.out_hidden is not None)
            got = self.programs.run(key, fn, (arrays, jax.device_put(idx, self.replicated)))[0]
            n = len(chunk)
            parts.append(jax.tree.map(lambda x: x[:n], shd.to_host_tree(got)))  # noqa: B023
        toks, logp, hid = (
            None if parts[0][j] is None else np.concatenate([p[j] for p in parts]) for j in range(3)
        )
        return toks, logp, hid
