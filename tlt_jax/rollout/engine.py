"""Rollout engine: batched prompts -> sampled responses, with speculative modes, over a device mesh.

The engine owns the weights (policy and EAGLE drafter), the registered speculative modes, the buckets and the
device programs: the pure bodies of `rollout.decode` (prefill, plain and speculative chunks), compiled once
per shape by `rollout.programs.ProgramCache` (strategies with the same tokens_to_verify share a program), and
the data-axis programs of `rollout.spmd`. The host loop between chunks is `rollout.scheduler.generate`:
streamed harvest of finished sequences, compaction within each data shard, the hooks' mode choice and idle-
device work, cache growth. Each sequence owns a PRNG stream and verification is coupled to it
(`SpecConfig.acceptance = "coupled"`), so compaction, sharding and speculation leave every sample unchanged
(up to float rounding between a verify pass and a decode step).

    engine = RolloutEngine(model, EngineConfig(spec=SpecConfig(enabled=True, drafter="eagle",
                           strategy="3_1_4", threshold=32)), eos_ids, drafter=drafter)
    out = engine.generate(prompts, n=8, key=key, sampling=SamplingParams(0.9), hooks=[...])
    out.stats.mean_accept_length, out.stats.summary(), engine.programs.summary()
More modes: `name = engine.add_mode("eagle" | "ngram" | "history", "4_2_8")`, chosen by a hook's `choose_mode`
("history" modes draft on the host between device rounds: `history_chunk`; the store, `engine.history`, lives
across rollouts).
Its settings (`EngineConfig`) and the members its clients use (`EngineLike`) are in `rollout.interface`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax import sharding as shd
from tlt_jax.kernels import small_m_linear
from tlt_jax.models.build import TextCodec
from tlt_jax.models.eagle3 import AnyDrafter, drafter_aux_layers, states_width
from tlt_jax.models.layouts import unrolled
from tlt_jax.models.llama import Transformer, with_aux_layers
from tlt_jax.rollout import admission, decode, history_rounds, scheduler, spmd
from tlt_jax.rollout.history import HistoryStore
from tlt_jax.rollout.hooks import IdleWork, RolloutHooks
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.ngram import NgramBank, NgramParams
from tlt_jax.rollout.programs import ProgramCache, pow2_at_least, program_precision
from tlt_jax.rollout.row_programs import RowPrograms
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.strategy import AcceptRule, SpecMode, Strategy, resolve_acceptance
from tlt_jax.rollout.types import ChunkRecord, DecodeState, Rollout, RowSummary

CACHE_ALIGN = 512  # the top cache bucket is a multiple of this (key blocks of the attention kernels)


def _drafter_weight_dtype(name: str, model: Transformer) -> jnp.dtype | None:
    """SpecConfig.drafter_weight_dtype -> the dtype to cast the drafter's matrices to (None: leave them)."""
    if name == "auto":
        return jnp.dtype(jnp.bfloat16) if small_m_linear.kernel_enabled(model.cfg.linear_impl) else None
    return jnp.dtype(name)


def _aux_layers(model: Transformer, drafter: AnyDrafter | None) -> tuple[int, ...]:
    """The target layers whose states the rollout returns: the EAGLE-3 drafter's, else the model's own
    (`with_aux_layers`: EAGLE-3 training data recorded without a drafter); they must agree."""
    mine, theirs = tuple(getattr(model, "aux_layers", ())), drafter_aux_layers(drafter)
    if mine and theirs and mine != theirs:
        raise ValueError(f"the target records aux layers {mine}, the EAGLE-3 drafter reads {theirs}")
    return theirs or mine


class RolloutEngine(RowPrograms):
    """Generates `n` samples per prompt with a Transformer (optionally speculative); see the module docstring.

    drafter: an EAGLE `Drafter` or `Eagle3Drafter` for the "eagle" speculative modes (its weights:
    `set_drafter_params`).
    draft_vocab: token ids of the drafter head's reduced vocabulary (`drafter/draft_vocab.npy`).
    """

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig,
        eos_ids: Sequence[int],
        *,
        mesh: Mesh | None = None,
        tokenizer: TextCodec | None = None,
        drafter: AnyDrafter | None = None,
        draft_vocab: Sequence[int] | np.ndarray | None = None,
    ):
        if config.stop_strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer to decode responses: pass tokenizer=")
        self.config = config
        self.model_config = model.cfg
        self.tokenizer = tokenizer
        self.mesh = mesh if mesh is not None else shd.make_mesh(1, 1, jax.devices()[:1])
        self.data_size = self.mesh.shape["data"]
        self.aux_layers = _aux_layers(model, drafter)
        model = unrolled(model)  # the decode loop reads each layer's weights and cache in place
        if self.aux_layers:  # EAGLE-3: its programs also return these layers' states (a copy of the module)
            model = with_aux_layers(nnx.merge(*nnx.split(model)), self.aux_layers)
        self.graphdef, params = nnx.split(model, nnx.Param)
        self._param_shardings = shd.param_shardings(params, self.mesh)
        self.params = jax.device_put(params, self._param_shardings)
        self.replicated = NamedSharding(self.mesh, P())
        self.eos_ids = jax.device_put(np.asarray(list(eos_ids) or [-1], np.int32), self.replicated)
        self.programs = ProgramCache(program_precision(config.matmul_precision, model.cfg.dtype))
        self.drafter_graphdef, self.drafter_params = None, None
        self.drafter_weight_dtype = _drafter_weight_dtype(config.spec.drafter_weight_dtype, model)
        if drafter is not None:
            self.drafter_graphdef, dparams = nnx.split(drafter, nnx.Param)
            dparams = self._cast_drafter(dparams)
            self._drafter_shardings = shd.param_shardings(dparams, self.mesh)
            self.drafter_params = jax.device_put(dparams, self._drafter_shardings)
        self.draft_vocab = None  # the learned drafter's reduced LM-head vocabulary; None: the full head
        if draft_vocab is not None:
            ids = np.unique(np.asarray(draft_vocab, np.int64))
            if ids.size < 1 or ids[0] < 0 or ids[-1] >= model.cfg.vocab_size:
                raise ValueError(
                    f"draft_vocab: need token ids in [0, {model.cfg.vocab_size}), got {ids.size} ids in "
                    f"[{ids.min() if ids.size else '-'}, {ids.max() if ids.size else '-'}]"
                )
            self.draft_vocab = jax.device_put(ids.astype(np.int32), self.replicated)
        self.modes: dict[str, SpecMode] = {}
        self.history: HistoryStore | None = None  # the history drafter's store ("history" modes add it)
        self.spec_mode: str | None = None  # the mode SpecConfig configured (if enabled)
        if config.spec.enabled:
            self.spec_mode = self.add_mode(config.spec.drafter, config.spec.strategy)
        model_axis = self.mesh.shape["model"]
        per_token = admission.kv_bytes_per_token(model.cfg, model_axis, int(drafter is not None))
        hidden_row = config.record_hidden and admission.hidden_bytes_per_row(
            config.hidden_window,
            config.max_new_tokens,
            states_width(model.cfg.hidden_size, self.aux_layers),
            model.cfg.dtype,
        )  # the recorded states a running row holds beside its KV
        self.max_running_rows, self.admission_line = admission.running_rows_cap(
            config.max_running_rows, config.kv_budget_gib, per_token, self.top_cache_bucket(), int(hidden_row)
        )
        logging.info("%s", self.admission_line)

    # ---- params -------------------------------------------------------------------------------------
    def set_params(self, params: Any) -> None:
        """Swap in new policy weights (same shapes/shardings: no recompilation)."""
        self.params = jax.device_put(params, self._param_shardings)

    def set_drafter_params(self, params: Any) -> None:
        """Swap in new drafter weights (same shapes/shardings: no recompilation). They take effect at the next
        `generate`: a rollout drafts with one snapshot of the drafter throughout."""
        self.drafter_params = self.snapshot_drafter(params)

    def snapshot_drafter(self, params: Any) -> Any:
        """The drafter's weights cast and copied: their owner (the spot trainer) keeps training, and
        donating, the arrays it handed over."""
        if self.drafter_graphdef is None:
            raise ValueError("this engine has no drafter: pass RolloutEngine(..., drafter=Drafter(...))")
        return jax.device_put(self._cast_drafter(params), self._drafter_shardings, may_alias=False)

    def release_weights(self, drafter: bool) -> None:
        """Drop the engine's own policy weights (and the drafter's, with `drafter`): their owner (the
        learner's policy trainer, the spot trainer) passes them to every `generate` instead, so no second
        copy lives between rollouts. A drafter nobody trains stays the engine's."""
        self.params = None
        if drafter:
            self.drafter_params = None

    def rollout_weights(self, params: Any | None, drafter_params: Any | None) -> tuple[Any, Any]:
        """(policy, drafter) weights of one rollout: the ones given, else the engine's own. Given drafter
        weights are snapshotted (cast, and copied: their owner keeps training, and donating, them while the
        rollout drafts with the snapshot)."""
        policy = self.params if params is None else jax.device_put(params, self._param_shardings)
        if policy is None:
            raise ValueError("this engine released its weights (release_weights): pass generate(params=...)")
        draft = self.drafter_params
        if drafter_params is not None:
            if self.drafter_graphdef is None:
                raise ValueError("this engine has no drafter: pass RolloutEngine(..., drafter=Drafter(...))")
            draft = jax.device_put(
                self._cast_drafter(drafter_params), self._drafter_shardings, may_alias=False
            )
        return policy, draft

    def _cast_drafter(self, params: Any) -> Any:
        """The drafter's weight matrices in `drafter_weight_dtype` (norm scales and biases stay as is)."""
        dt = self.drafter_weight_dtype
        if dt is None:
            return params
        return jax.tree.map(lambda a: a.astype(dt) if a.ndim == 2 and a.dtype != dt else a, params)

    def model(self, params: Any | None = None) -> Transformer:
        return nnx.merge(self.graphdef, self.params if params is None else params)

    @property
    def compile_count(self) -> int:
        return self.programs.compile_count

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling this engine's programs so far."""
        return self.programs.compile_seconds

    # ---- speculative modes ----------------------------------------------------------------------------
    def add_mode(
        self,
        drafter: str,
        strategy: str | Strategy,
        *,
        acceptance: str | None = None,
        accept_rule: AcceptRule | None = None,
        label: str = "",
    ) -> str:
        """Register a speculative mode (drafter "eagle" or "ngram", strategy like "8_4_48"); returns its name.

        acceptance: default `config.spec.acceptance` ("rejection" then applies to EAGLE chains only; trees
        and n-gram drafts verify "coupled"). accept_rule: a replacement for the target-only walk (tests).
        Modes compile lazily, one chunk program per (batch bucket, cache bucket).
        """
        if drafter == "eagle" and self.drafter_graphdef is None:
            raise ValueError(
                "an 'eagle' speculative mode needs a learned drafter: RolloutEngine(..., drafter=)"
            )
        strat = Strategy.parse(strategy)
        if accept_rule is not None:
            acceptance = "target_only"
        elif acceptance is None:
            acceptance = resolve_acceptance(self.config.spec.acceptance, drafter, strat)
        mode = SpecMode(drafter, strat, acceptance=acceptance, accept_rule=accept_rule, label=label)
        if mode.name == "plain":
            raise ValueError("'plain' is reserved")
        if drafter == "history" and self.history is None:
            self.history = HistoryStore(self.config.spec.history_params())
        self.modes[mode.name] = mode
        return mode.name

    def needs(self) -> tuple[bool, bool]:
        """(carry the drafter cache, carry prompt tokens): only when a registered mode needs them."""
        use_drafter = self.drafter_graphdef is not None and any(
            m.drafter == "eagle" for m in self.modes.values()
        )
        use_prompt = any(m.drafter == "ngram" for m in self.modes.values())
        return use_drafter, use_prompt

    def _max_lookahead(self) -> int:
        return max([m.lookahead for m in self.modes.values()], default=0)

    # ---- buckets --------------------------------------------------------------------------------------
    def local_bucket(self, n: int) -> int:
        """Rows per data-axis shard for `n` live rows in the fullest shard (a power of two)."""
        return pow2_at_least(n)

    def batch_bucket(self, n: int) -> int:
        """Total rows of a batch whose rows are spread evenly over the data axis (a multiple of it)."""
        return self.local_bucket(-(-n // self.data_size)) * self.data_size

    def cache_bucket(self, need: int) -> int:
        """Power-of-two cache length >= need, up to the top bucket: max_cache_len + the slots a speculative
        round may write past a row's end (so verification never writes out of bounds), rounded up to a
        multiple of 512 (the attention kernels' key blocks; the power of two when that is smaller): at the
        paper's 34,816 that is 35,328, not 65,536."""
        return min(pow2_at_least(need, self.config.min_cache_bucket), self.top_cache_bucket())

    def top_cache_bucket(self) -> int:
        cap = self.config.max_cache_len + self._max_lookahead()
        return min(pow2_at_least(cap), -(-cap // CACHE_ALIGN) * CACHE_ALIGN)

    # ---- device programs ------------------------------------------------------------------------------
    def _constrain(self, tree: Any) -> Any:
        return jax.lax.with_sharding_constraint(tree, shd.shard_pytree_batch(tree, self.mesh))

    def _replicate(self, tree: Any) -> Any:
        return None if tree is None else jax.lax.with_sharding_constraint(tree, self.replicated)

    def chunk_program(
        self, mode: str, sampling: SamplingParams, shards: int | None = None
    ) -> decode.ChunkProgram:
        """The static description of a chunk of `mode` ("plain" or a registered mode); `shards=1` for the
        per-device body of a fused chunk."""
        use_drafter, _ = self.needs()
        if mode != "plain" and mode not in self.modes:
            raise KeyError(f"unknown mode {mode!r}: registered {sorted(self.modes)} (and 'plain')")
        s = self.config.spec
        return decode.ChunkProgram(
            target=self.graphdef,
            drafter=self.drafter_graphdef if use_drafter else None,
            sampling=sampling,
            attn_impl=self.config.attn_impl,
            steps=self.config.chunk_steps,
            modes=() if mode == "plain" else tuple(self.modes[m] for m in self.mode_group(mode)),
            ngram=NgramParams(s.ngram_max, s.ngram_min, s.ngram_siblings),
            shards=self.data_size if shards is None else shards,
            draft_dtype=self.drafter_weight_dtype,
        )

    def mode_group(self, mode: str) -> tuple[str, ...]:
        """The registered modes that share `mode`'s chunk programs: with `EngineConfig.share_programs`, every
        mode with the same tokens_to_verify and acceptance rule (rejection-sampled chains and custom rules
        compile alone), so a bucket needs one program per tokens_to_verify, not one per strategy (the
        paper's Table 5); the strategy is a runtime operand."""
        m = self.modes[mode]
        if not self.config.share_programs or m.rejection or m.accept_rule is not None:
            return (mode,)
        tv = m.strategy.tokens_to_verify
        return tuple(
            n
            for n, o in sorted(self.modes.items())
            if not o.rejection
            and o.accept_rule is None
            and o.acceptance == m.acceptance
            and o.strategy.tokens_to_verify == tv
            and (o.drafter == "history") == (m.drafter == "history")  # history rounds: a program of their own
        )

    def _chunk_fn(self, prog: decode.ChunkProgram) -> Any:
        def fn(params, dparams, state, eos_ids, bank, draft_vocab, exit_live, arm):  # noqa: ANN001, ANN202
            out = decode.run_chunk(prog, params, dparams, state, eos_ids, bank, draft_vocab, exit_live, arm)
            return out.replace(state=self._constrain(out.state), bank=self._replicate(out.bank))

        return fn

    def decode_chunk(
        self,
        state: DecodeState,
        mode: str,
        sampling: SamplingParams,
        bank: NgramBank | None = None,
        exit_live: int = -1,
        drafter_params: Any | None = None,
        work: IdleWork | None = None,
        params: Any | None = None,
    ) -> tuple[DecodeState, ChunkRecord, NgramBank | None, RowSummary]:
        """Run one chunk of `mode` on `state` (donated). The cache must already hold the chunk's growth
        (`generate` resizes between chunks). Returns the new state, the chunk's record (seconds included),
        the bank (n-gram modes need one: `NgramBank.empty`) and the rows' summary, fetched in the same
        single device-to-host transfer as the chunk's counters. drafter_params: the rollout's snapshot of
        the drafter's weights (default: the engine's current ones). work: idle-device work fused into the
        chunk's program (`hooks.IdleWork`); its outputs go to `work.on_done`."""
        prog = self.chunk_program(mode, sampling, shards=1 if work is not None else None)
        is_ngram = "ngram" in prog.uses
        if is_ngram and bank is None:
            raise ValueError("an n-gram mode needs the sibling bank: pass bank=NgramBank.empty(...)")
        bank_in = bank if is_ngram else None
        use_drafter = prog.drafter is not None
        b, cap = state.done.shape[0], state.cache.capacity
        key = (
            "chunk",
            b,
            cap,
            1 if not prog.modes else prog.modes[0].strategy.tokens_to_verify,
            tuple(m.name for m in prog.modes),
            dataclasses.astuple(sampling),
            state.out_tokens.shape[1],
            use_drafter,
            state.aux is not None and state.aux.prompt is not None,
            state.out_hidden is not None,
            None if bank_in is None else (bank_in.tokens.shape, bank_in.group_size),
        )
        uses_vocab = "eagle" in prog.uses
        arm = 0 if mode == "plain" else [m.name for m in prog.modes].index(mode)
        dparams = self.drafter_params if drafter_params is None else drafter_params
        args = (
            self.params if params is None else params,
            dparams if use_drafter else None,
            state,
            self.eos_ids,
            bank_in,
            self.draft_vocab if uses_vocab else None,
            jax.device_put(np.int32(exit_live), self.replicated),
            jax.device_put(np.int32(arm), self.replicated),
        )
        t_compile = time.perf_counter()
        if work is None:
            program, compiled = self.programs.prepare(key, self._chunk_fn(prog), args, donate=(2, 4))
        else:
            fused = spmd.tick_program(self.mesh, prog, work, state, bank_in is not None)
            args = (*args, work.operands)
            program, compiled = self.programs.prepare(("tick", *key[1:], work.key), fused, args, (2, 4))
        t0 = time.perf_counter()  # after compiling: the chunk's seconds are its execution only
        result = program(*args)
        out = result if work is None else result[0]  # the fused tick returns (chunk out, drafter work out)
        st = out.state
        # one transfer per chunk: the counters and the rows' summary (all processes' rows)
        fetched, rows = shd.to_host_tree(
            ((out.running, out.emitted, out.rows, out.hist), (st.done, st.cache.lengths, st.num_generated))
        )
        dt = time.perf_counter() - t0
        if work is not None:
            work.on_done(result[1], dt)
        compile_s = t0 - t_compile if compiled else 0.0
        record = self._chunk_record(mode, prog, (b, cap), fetched, dt, compiled, compile_s)
        return out.state, record, (out.bank if bank_in is not None else bank), RowSummary(*rows)

    def _chunk_record(
        self,
        mode: str,
        prog: decode.ChunkProgram,
        buckets: tuple[int, int],
        fetched: tuple[Any, Any, Any, Any],
        seconds: float,
        compiled: bool,
        compile_seconds: float,
    ) -> ChunkRecord:
        """The record of a chunk that ran, from its fetched (running per step, emitted tokens, verify rounds,
        accept histogram) and its (batch, cache) buckets: steps that ran are those where some device had a
        live row (-1 marks a step after the chunk's early exit)."""
        running, emitted, rows, hist = fetched
        per_step = np.asarray(running).reshape(-1, self.config.chunk_steps)  # [devices or 1, steps]
        steps = int((per_step >= 0).any(axis=0).sum())
        running = tuple(int(r) for r in np.maximum(per_step, 0).sum(axis=0)[:steps])
        return ChunkRecord(
            mode=mode,
            batch_bucket=buckets[0],
            cache_bucket=buckets[1],
            steps=len(running),
            running_start=running[0] if running else 0,
            seconds=seconds,
            accepted_tokens=int(emitted) if prog.modes else 0,
            verify_rounds=int(rows) if prog.modes else 0,
            strategy="" if mode == "plain" else self.modes[mode].strategy.name,
            accept_hist=tuple(int(x) for x in hist) if prog.modes else (),
            running=running,
            compiled=compiled,
            compile_seconds=compile_seconds,
        )

    def gather_rows(self, state: DecodeState, sel: np.ndarray, pad: np.ndarray) -> DecodeState:
        """Compaction within shards: `sel` holds each shard's kept rows as LOCAL indices (shard-major)."""
        fn = spmd.gather_program(self.mesh, state, self._constrain)
        bs = shd.batch_sharding(self.mesh, 1, len(sel))
        args = (state, jax.device_put(sel.astype(np.int32), bs), jax.device_put(pad, bs))
        key = ("gather", state.done.shape[0], len(sel), state.cache.capacity, self.needs())
        return self.programs.run(key, fn, args)[0]

    def resize_cache(self, state: DecodeState, seq_len: int) -> DecodeState:
        fn = lambda st: self._constrain(decode.resize_cache(st, seq_len))  # noqa: E731
        key = (
            "resize",
            state.done.shape[0],
            state.cache.capacity,
            seq_len,
            self.needs(),
            state.out_hidden is not None,
        )
        return self.programs.run(key, fn, (state,))[0]

    # ---- the host loop --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        key: jax.Array,
        sampling: SamplingParams,
        max_new_tokens: int | None = None,
        hooks: RolloutHooks | Iterable[RolloutHooks | None] | None = None,
        params: Any | None = None,
        drafter_params: Any | None = None,
    ) -> Rollout:
        """Sample `n` responses for each prompt; `hooks` observe the rollout and choose each chunk's mode
        (`rollout.scheduler.generate`: the host loop). params / drafter_params: this rollout's weights
        (default: the engine's own; `rollout_weights`). The drafter's weights are read once: the whole
        rollout drafts with one snapshot."""
        weights = self.rollout_weights(params, drafter_params)
        return scheduler.generate(
            self, prompts, n=n, key=key, sampling=sampling, max_new_tokens=max_new_tokens, hooks=hooks,
            weights=weights,
        )  # fmt: skip

    def history_chunk(
        self,
        state: DecodeState,
        mode: str,
        sampling: SamplingParams,
        rows: history_rounds.HistoryRows,
        exit_live: int = -1,
        drafter_params: Any | None = None,
        params: Any | None = None,
    ) -> tuple[DecodeState, ChunkRecord, RowSummary]:
        """One chunk of the history mode `mode` on `state` (donated): rounds drafted on the host from `rows`
        (each slot's prompt history), verified on the device (`rollout.history_rounds`). Returns the state,
        the chunk's record (its seconds include the host's drafting) and the rows' summary."""
        prog = self.chunk_program(mode, sampling)
        dparams = self.drafter_params if drafter_params is None else drafter_params
        policy = self.params if params is None else params
        args = (policy, dparams if prog.drafter is not None else None, state, self.eos_ids)
        t_compile = time.perf_counter()
        chunk = history_rounds.HistoryChunk.prepare(self, prog, mode, rows, args, self._constrain)
        t0 = time.perf_counter()
        st, fetched = chunk.run(args, exit_live, self.config.chunk_steps)
        summary = shd.to_host_tree((st.done, st.cache.lengths, st.num_generated))
        dt, buckets = time.perf_counter() - t0, (state.done.shape[0], state.cache.capacity)
        compile_s = t0 - t_compile if chunk.compiled else 0.0
        record = self._chunk_record(mode, prog, buckets, fetched, dt, chunk.compiled, compile_s)
        return st, record, RowSummary(*summary)

    def update_bank(self, bank: NgramBank, state: DecodeState) -> NgramBank:
        key = ("bank", bank.tokens.shape, bank.group_size, state.done.shape[0])
        fn = lambda bk, st: self._replicate(bk.update(st))  # noqa: E731
        return self.programs.run(key, fn, (bank, state))[0]
