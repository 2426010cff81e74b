"""Rollout engine: batched prompts -> sampled responses, as a host loop over device-side decode chunks.

Device work is a few jit-compiled programs with static shapes: a bucketed prefill, and a decode chunk that
runs up to `chunk_steps` steps (plain) or verify rounds (speculative) in a `lax.while_loop` (stopping early
once every row is done). Between chunks the host looks at cheap summaries (which rows finished) and
- compacts the live rows into the smallest batch bucket that holds them, so the long tail runs at a small
  batch (that is where speculative decoding pays; see `tlt_jax.rollout.speculative`);
- grows the cache-length bucket just enough for the next chunk, so attention reads only the live part of
  the cache (a batch-64 step over 1024 slots is >10x slower than over 32 on CPU);
- asks the mode selector for the next chunk's mode: "plain" or a registered speculative mode (the default
  selector switches SD on below `SpecConfig.threshold` running rows; the BEG-MAB bandit plugs in here);
- checks stop strings, updates the progress bar and records the running-batch timeline.
The set of programs is finite (batch bucket x cache bucket x mode) and cached: after warm-up nothing
recompiles.

Each sequence owns a PRNG stream (its key folded with its token index), so a sequence's samples do not depend
on the batch it runs in: compaction, sharding and speculative decoding leave greedy outputs unchanged and
sampled outputs exactly distributed.

Speculative decoding (API for benchmarks):
    engine = RolloutEngine(model, EngineConfig(spec=SpecConfig(enabled=True, drafter="eagle",
                           strategy="8_4_48", threshold=32)), eos_ids, drafter=drafter)
    out = engine.generate(prompts, n=8, key=key, sampling=SamplingParams(0.9))
    out.stats.mean_accept_length          # tokens per row per verify round (accepted drafts + 1)
    out.stats.mode_tokens_per_second()    # tok/s of speculative chunks; ("plain") of plain chunks
    out.stats.accept_histogram()          # row-rounds by tokens emitted
More strategies: `name = engine.add_mode("eagle" | "ngram", "4_2_8")`, then `generate(mode_selector=...)`
with a `speculative.ModeSelector` (or a `fn(running) -> name`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax import sharding as shd
from tlt_jax.kernels import small_m_linear
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout import ngram as ngram_lib
from tlt_jax.rollout import speculative as spec
from tlt_jax.rollout.sampling import SamplingParams, sample_rows
from tlt_jax.rollout.speculative import AcceptRule, SpecConfig, SpecMode, Strategy
from tlt_jax.rollout.types import ChunkRecord, DecodeState, Rollout, RolloutStats, SpecAux, row_keys

DRAFT_SALT = 0x0D5A  # folded into a row's token key for sampled drafts (acceptance uses the key itself)

__all__ = [
    "DecodeState",
    "EngineConfig",
    "NgramBank",
    "RolloutEngine",
    "SpecConfig",
    "plain_decode_step",
    "record_tokens",
]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_new_tokens: int = 256
    max_cache_len: int = 2048  # prompt + response must fit; longer prompts are rejected with a clear error
    chunk_steps: int = 16  # decode steps (or verify rounds) per device call (host decisions happen between)
    min_cache_bucket: int = 64  # cache-length buckets are powers of two from here up to max_cache_len
    prompt_bucket: int = 16  # prompt lengths are padded to powers of two >= this
    compact: bool = True  # compact live rows into smaller batch buckets as sequences finish
    # "auto" | "reference" | "pallas" | "cpu_ffi" (see tlt_jax.kernels.tree_attention)
    attn_impl: str = "auto"
    stop_strings: tuple[str, ...] = ()
    spec: SpecConfig = SpecConfig()  # speculative rollouts (off by default)
    # also return the target's final hidden states of every prompt and response position (`Rollout.features`):
    # drafter training data straight from the rollout, with no second target forward (plain and SD modes)
    record_hidden: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.chunk_steps < 1:
            raise ValueError("max_new_tokens and chunk_steps must be >= 1")
        if self.max_new_tokens >= self.max_cache_len:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} leaves no room for a prompt in max_cache_len="
                f"{self.max_cache_len}: raise max_cache_len or lower max_new_tokens."
            )


@flax.struct.dataclass
class NgramBank:
    """Every sequence's response so far, by sequence id (prompt index * n + sample index): the n-gram
    drafter's sibling corpus. It lives outside the decode state, so rows dropped by compaction stay in it."""

    tokens: jax.Array  # [R, N]
    lengths: jax.Array  # [R]
    group_size: int = flax.struct.field(pytree_node=False)


class Progress(Protocol):
    def update(self, running: int, finished: int, new_tokens: int) -> None: ...


def _pow2_at_least(x: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


_row_keys = row_keys  # kept for callers of the old private name


def record_tokens(
    state: DecodeState, tok_b: jax.Array, logp_b: jax.Array, live_b: jax.Array, eos_ids: jax.Array
) -> DecodeState:
    """Append one token to each live row's output; mark rows that hit EOS or their budget as done."""
    b, n = state.out_tokens.shape
    rows = jnp.arange(b)
    idx = jnp.minimum(state.num_generated, n - 1)
    out_tokens = state.out_tokens.at[rows, idx].set(jnp.where(live_b, tok_b, state.out_tokens[rows, idx]))
    out_logp = state.out_logp.at[rows, idx].set(jnp.where(live_b, logp_b, state.out_logp[rows, idx]))
    num = state.num_generated + live_b.astype(jnp.int32)
    hit = jnp.any(tok_b[:, None] == eos_ids[None, :], axis=-1) | (num >= state.max_new)
    return state.replace(
        out_tokens=out_tokens,
        out_logp=out_logp,
        num_generated=num,
        done=state.done | (live_b & hit),
        last_token=jnp.where(live_b, tok_b, state.last_token),
    )


def plain_decode_step(
    model: Transformer,
    state: DecodeState,
    eos_ids: jax.Array,
    sp: SamplingParams,
    attn_impl: str,
    drafter: Drafter | None = None,
) -> DecodeState:
    """One target step for every row: feed the last token, sample the next.

    With a drafter (and a drafter cache in `state.aux`), also write the pending drafter pair
    (last_token, h_{L-1}) so the drafter cache stays one position behind the target (no LM head: cheap).
    """
    b = state.last_token.shape[0]
    live = ~state.done
    out = model(
        state.last_token[:, None],
        state.cache.lengths[:, None],
        state.cache,
        jnp.ones((b, 1, 1), bool),
        attn_impl=attn_impl,
    )
    cache = out.cache.advance(live.astype(jnp.int32))
    tok, lp = sample_rows(row_keys(state), out.logits[:, 0], sp)
    state = spec.record_hidden(state, out.hidden, live.astype(jnp.int32))
    if drafter is not None:
        aux = state.aux
        dcache = spec.drafter_advance(
            drafter,
            model,
            aux.drafter_cache,
            state.last_token[:, None],
            aux.hidden[:, None],
            live.astype(jnp.int32),
            attn_impl,
        )
        hidden = jnp.where(live[:, None], out.hidden[:, 0], aux.hidden)
        state = state.replace(aux=aux.replace(drafter_cache=dcache, hidden=hidden))
    return record_tokens(state.replace(cache=cache), tok, lp, live, eos_ids)


class RolloutEngine:
    """Generates `n` samples per prompt with a Transformer (optionally speculative); see the module docstring.

    drafter: an EAGLE `Drafter` for the "eagle" speculative modes (its weights: `set_drafter_params`).
    """

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig,
        eos_ids: Sequence[int],
        *,
        mesh: Mesh | None = None,
        tokenizer: Any | None = None,
        drafter: Drafter | None = None,
        draft_vocab: Sequence[int] | np.ndarray | None = None,
    ):
        if config.stop_strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer to decode responses: pass tokenizer=")
        self.config = config
        self.model_config = model.cfg
        self.tokenizer = tokenizer
        self.mesh = mesh if mesh is not None else shd.make_mesh(1, 1, jax.devices()[:1])
        self.data_size = self.mesh.shape["data"]
        self.graphdef, params = nnx.split(model, nnx.Param)
        self._param_shardings = shd.param_shardings(params, self.mesh)
        self.params = jax.device_put(params, self._param_shardings)
        self.eos_ids = jnp.asarray(list(eos_ids) or [-1], jnp.int32)
        self.compile_count = 0
        self._compiled: dict[Any, Callable] = {}
        self.drafter_graphdef, self.drafter_params = None, None
        self.drafter_weight_dtype = _drafter_weight_dtype(config.spec.drafter_weight_dtype, model)
        if drafter is not None:
            self.drafter_graphdef, dparams = nnx.split(drafter, nnx.Param)
            dparams = self._cast_drafter(dparams)
            self._drafter_shardings = shd.param_shardings(dparams, self.mesh)
            self.drafter_params = jax.device_put(dparams, self._drafter_shardings)
        # the learned drafter's reduced LM-head vocabulary (`speculative.eagle_draft`); None: the full head
        self.draft_vocab = None
        if draft_vocab is not None:
            ids = np.unique(np.asarray(draft_vocab, np.int64))
            if ids.size < 1 or ids[0] < 0 or ids[-1] >= model.cfg.vocab_size:
                raise ValueError(
                    f"draft_vocab: need token ids in [0, {model.cfg.vocab_size}), got {ids.size} ids in "
                    f"[{ids.min() if ids.size else '-'}, {ids.max() if ids.size else '-'}]"
                )
            self.draft_vocab = ids.astype(np.int32)
        self.modes: dict[str, SpecMode] = {}
        self.extra_modes = self.modes  # the registry under its earlier name
        self.spec_mode: str | None = None  # the mode SpecConfig configured (if enabled)
        if config.spec.enabled:
            self.spec_mode = self.add_mode(config.spec.drafter, config.spec.strategy)

    # ---- params -------------------------------------------------------------------------------------
    def set_params(self, params: Any) -> None:
        """Swap in new policy weights (same shapes/shardings: no recompilation)."""
        self.params = jax.device_put(params, self._param_shardings)

    def set_drafter_params(self, params: Any) -> None:
        """Swap in new drafter weights (same shapes/shardings: no recompilation)."""
        if self.drafter_graphdef is None:
            raise ValueError("this engine has no drafter: pass RolloutEngine(..., drafter=Drafter(...))")
        self.drafter_params = jax.device_put(self._cast_drafter(params), self._drafter_shardings)

    def _cast_drafter(self, params: Any) -> Any:
        """The drafter's weight matrices in `drafter_weight_dtype` (norm scales and biases stay as is)."""
        dt = self.drafter_weight_dtype
        if dt is None:
            return params
        return jax.tree.map(lambda a: a.astype(dt) if a.ndim == 2 and a.dtype != dt else a, params)

    def model(self, params: Any | None = None) -> Transformer:
        return nnx.merge(self.graphdef, self.params if params is None else params)

    # ---- speculative modes ----------------------------------------------------------------------------
    def add_mode(
        self,
        drafter: str,
        strategy: str | Strategy,
        *,
        accept_rule: AcceptRule | None = None,
        label: str = "",
        rejection: bool | None = None,
    ) -> str:
        """Register a speculative mode (drafter "eagle" or "ngram", strategy like "8_4_48"); returns its name.

        Modes compile lazily, one chunk program per (batch bucket, cache bucket). `accept_rule` replaces
        `tree_accept` at temperature > 0 (it must be lossless; tests use it to show their power).
        `rejection` (default `config.spec.chain_rejection`): learned-drafter chains sample their drafts and
        verify by rejection sampling at temperature > 0; ignored for trees, n-gram drafts or an accept_rule.
        """
        if drafter not in spec.DRAFTERS:
            raise ValueError(f"drafter must be one of {spec.DRAFTERS}, got {drafter!r}")
        if drafter == "eagle" and self.drafter_graphdef is None:
            raise ValueError(
                "an 'eagle' speculative mode needs a learned drafter: RolloutEngine(..., drafter=)"
            )
        strat = Strategy.parse(strategy)
        if rejection is None:
            rejection = self.config.spec.chain_rejection
        rejection = rejection and drafter == "eagle" and strat.is_chain and accept_rule is None
        mode = SpecMode(drafter, strat, accept_rule=accept_rule, label=label, rejection=rejection)
        if mode.name == "plain":
            raise ValueError("'plain' is reserved")
        self.modes[mode.name] = mode
        return mode.name

    def _aux_needs(self) -> tuple[bool, bool]:
        """(carry the drafter cache, carry prompt tokens): only when a registered mode needs them."""
        use_drafter = self.drafter_graphdef is not None and any(
            m.drafter == "eagle" for m in self.modes.values()
        )
        use_prompt = any(m.drafter == "ngram" for m in self.modes.values())
        return use_drafter, use_prompt

    def _max_lookahead(self) -> int:
        return max([m.lookahead for m in self.modes.values()], default=0)

    # ---- compiled programs ----------------------------------------------------------------------------
    def _state_shardings(self, state: DecodeState) -> Any:
        return shd.shard_pytree_batch(state, self.mesh)

    def _jit(self, key: Any, fn: Callable, donate: tuple[int, ...] = ()) -> Callable:
        """Cache one jitted program per static key (shapes are keyed by the caller)."""
        if key not in self._compiled:
            self.compile_count += 1
            self._compiled[key] = jax.jit(fn, donate_argnums=donate)
        return self._compiled[key]

    def _drafter(self, dparams: Any) -> Drafter | None:
        return None if dparams is None else nnx.merge(self.drafter_graphdef, dparams)

    def _prefill_fn(
        self, sp: SamplingParams, cache_len: int, max_new: int, needs: tuple[bool, bool]
    ) -> Callable:
        cfg, attn_impl, graphdef = self.model_config, self.config.attn_impl, self.graphdef
        use_drafter, use_prompt = needs
        record = self.config.record_hidden

        def prefill(params, dparams, tokens_pt, lens_p, rows_b, keys_b, budget_b, pad_b, seq_b):  # noqa: ANN001, ANN202
            model = nnx.merge(graphdef, params)
            p, t = tokens_pt.shape
            cache = KVCache.init(cfg, p, cache_len)
            pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (p, t))
            out = model(tokens_pt, pos, cache, logits_index_bk=(lens_p - 1)[:, None], attn_impl=attn_impl)
            cache = out.cache.advance(lens_p).take_rows(rows_b)
            b = rows_b.shape[0]
            aux = None
            if use_drafter or use_prompt:
                fields: dict[str, Any] = {"seq_id": seq_b}
                if use_drafter:
                    drafter = self._drafter(dparams)
                    dcache = spec.drafter_prefill(
                        drafter,
                        model,
                        drafter.init_cache(p, cache_len),
                        tokens_pt,
                        out.hidden,
                        lens_p,
                        attn_impl,
                    )
                    fields["drafter_cache"] = dcache.take_rows(rows_b)
                    fields["hidden"] = out.hidden[jnp.arange(p), lens_p - 1][rows_b]
                if use_prompt:
                    fields["prompt"] = tokens_pt[rows_b]
                    fields["prompt_len"] = lens_p[rows_b]
                aux = SpecAux(**fields)
            state = DecodeState(
                cache=cache,
                last_token=jnp.zeros((b,), jnp.int32),
                out_tokens=jnp.zeros((b, max_new), jnp.int32),
                out_logp=jnp.zeros((b, max_new), jnp.float32),
                num_generated=jnp.zeros((b,), jnp.int32),
                done=pad_b,
                seq_keys=keys_b,
                max_new=budget_b,
                aux=aux,
                out_hidden=jnp.zeros((b, max_new, cfg.hidden_size), out.hidden.dtype) if record else None,
            )
            tok, lp = sample_rows(row_keys(state), out.logits[rows_b, 0], sp)
            state = record_tokens(state, tok, lp, ~pad_b, self.eos_ids)
            state = jax.lax.with_sharding_constraint(state, self._state_shardings(state))
            return state, (out.hidden if record else None)

        return prefill

    def _chunk_fn(self, sp: SamplingParams) -> Callable:
        graphdef, attn_impl, steps = self.graphdef, self.config.attn_impl, self.config.chunk_steps

        def chunk(params, dparams, state, eos_ids):  # noqa: ANN001, ANN202
            model = nnx.merge(graphdef, params)
            drafter = self._drafter(dparams)

            def cond(c):  # noqa: ANN001, ANN202
                i, st, _ = c
                return (i < steps) & jnp.any(~st.done)

            def body(c):  # noqa: ANN001, ANN202
                i, st, running = c
                running = running.at[i].set(jnp.sum(~st.done))
                return i + 1, plain_decode_step(model, st, eos_ids, sp, attn_impl, drafter), running

            _, state, running = jax.lax.while_loop(cond, body, (0, state, jnp.full((steps,), -1, jnp.int32)))
            return jax.lax.with_sharding_constraint(state, self._state_shardings(state)), running

        return chunk

    def _spec_chunk_fn(self, mode: SpecMode, sp: SamplingParams) -> Callable:
        """Up to `chunk_steps` speculative rounds of `mode` (early exit when every row is done)."""
        graphdef, attn_impl, steps = self.graphdef, self.config.attn_impl, self.config.chunk_steps
        strat, scfg = mode.strategy, self.config.spec
        d = strat.max_depth

        draft_vocab = self.draft_vocab

        def chunk(params, dparams, state, eos_ids, bank):  # noqa: ANN001, ANN202
            model = nnx.merge(graphdef, params)
            drafter = self._drafter(dparams)
            # the draft vocabulary's rows of the shared head, gathered once per chunk (not per draft step)
            vocab = None if draft_vocab is None else jnp.asarray(draft_vocab)
            draft_head = None if vocab is None else jnp.take(model.head_weight(), vocab, axis=0)
            if draft_head is not None and self.drafter_weight_dtype is not None:
                draft_head = draft_head.astype(self.drafter_weight_dtype)

            def draft(st: DecodeState, bank: NgramBank | None) -> tuple[Any, KVCache | None]:
                if mode.drafter == "eagle":
                    aux = st.aux
                    sampled = mode.rejection and not sp.greedy
                    return spec.eagle_draft(
                        model,
                        drafter,
                        aux.drafter_cache,
                        st.last_token,
                        aux.hidden,
                        strat,
                        attn_impl,
                        # draft randomness: the row's token key folded with a salt, independent of the
                        # acceptance uniforms (drawn from the row's token key itself)
                        sample_keys=jax.vmap(jax.random.fold_in, (0, None))(row_keys(st), DRAFT_SALT)
                        if sampled
                        else None,
                        sp=sp if sampled else None,
                        draft_vocab=vocab,
                        draft_head=draft_head,
                    )
                aux = st.aux
                src, src_len, prio, query = ngram_lib.build_sources(
                    aux.prompt,
                    aux.prompt_len,
                    st.out_tokens,
                    st.num_generated,
                    aux.seq_id,
                    bank.tokens,
                    bank.lengths,
                    bank.group_size,
                    scfg.ngram_max,
                    scfg.ngram_siblings,
                )
                tree = ngram_lib.propose(
                    src,
                    src_len,
                    prio,
                    query,
                    st.last_token,
                    depth=d,
                    topk=strat.topk,
                    num_nodes=min(strat.tokens_to_verify, 1 + strat.topk * d),
                    min_ngram=scfg.ngram_min,
                )
                return tree, None

            def cond(c):  # noqa: ANN001, ANN202
                return (c[0] < steps) & jnp.any(~c[1].done)

            def body(c):  # noqa: ANN001, ANN202
                i, st, running, emitted, rows, hist, bank = c
                running = running.at[i].set(jnp.sum(~st.done))
                if bank is not None:
                    bank = _bank_update(bank, st)
                tree, dcache = draft(st, bank)
                st, rs = spec.verify_round(
                    model,
                    drafter,
                    st,
                    tree,
                    sp,
                    eos_ids,
                    max_depth=d,
                    attn_impl=attn_impl,
                    accept_rule=mode.accept_rule,
                    drafter_cache=dcache,
                )
                return i + 1, st, running, emitted + rs.emitted, rows + rs.rows, hist + rs.hist, bank

            zero = jnp.zeros((), jnp.int32)
            init = (
                0,
                state,
                jnp.full((steps,), -1, jnp.int32),
                zero,
                zero,
                jnp.zeros((d + 2,), jnp.int32),
                bank,
            )
            _, state, running, emitted, rows, hist, bank = jax.lax.while_loop(cond, body, init)
            if bank is not None:
                bank = _bank_update(bank, state)
            state = jax.lax.with_sharding_constraint(state, self._state_shardings(state))
            return state, running, (emitted, rows, hist), bank

        return chunk

    def _gather_fn(self) -> Callable:
        def gather(state, rows, pad):  # noqa: ANN001, ANN202
            state = jax.tree_util.tree_map(lambda x: x[rows], state)
            state = state.replace(done=state.done | pad)
            if state.aux is not None and state.aux.seq_id is not None:  # padding rows own no sequence
                state = state.replace(aux=state.aux.replace(seq_id=jnp.where(pad, -1, state.aux.seq_id)))
            return jax.lax.with_sharding_constraint(state, self._state_shardings(state))

        return gather

    def _resize_fn(self, seq_len: int) -> Callable:
        def resize(state):  # noqa: ANN001, ANN202
            state = state.replace(cache=state.cache.resize(seq_len))
            if state.aux is not None and state.aux.drafter_cache is not None:
                state = state.replace(
                    aux=state.aux.replace(drafter_cache=state.aux.drafter_cache.resize(seq_len))
                )
            return jax.lax.with_sharding_constraint(state, self._state_shardings(state))

        return resize

    # ---- buckets --------------------------------------------------------------------------------------
    def batch_bucket(self, n: int) -> int:
        b = _pow2_at_least(n)
        return (
            max(b, self.data_size)
            if b % self.data_size == 0
            else math.ceil(b / self.data_size) * self.data_size
        )

    def cache_bucket(self, need: int) -> int:
        """Power-of-two cache length >= need, capped at max_cache_len (+ the slots a speculative round may
        write past a row's end, so verification never writes out of bounds)."""
        cap = self.config.max_cache_len + self._max_lookahead()
        return min(_pow2_at_least(need, self.config.min_cache_bucket), _pow2_at_least(cap))

    # ---- prompts, prefill, chunks -----------------------------------------------------------------------
    def validate_prompts(self, prompts: Sequence[Sequence[int]], max_new: int) -> None:
        if not prompts:
            raise ValueError("generate() got no prompts")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token (e.g. BOS).")
            if len(p) + max_new > self.config.max_cache_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new} it needs "
                    f"{len(p) + max_new} cache slots but max_cache_len={self.config.max_cache_len}. "
                    "Shorten the prompt, lower max_new_tokens, or raise max_cache_len in the engine config."
                )

    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        key: jax.Array,
        sampling: SamplingParams,
        max_new_tokens: int,
    ) -> DecodeState:
        """Prefill unique prompts once, repeat their cache rows n times, sample each row's first token.

        Rows are sequence-major (row i = prompt i // n, sample i % n), padded to a batch bucket with done
        rows.
        With a drafter configured the drafter cache is prefilled too (pairs over the prompt).
        """
        return self._prefill(prompts, n=n, key=key, sampling=sampling, max_new_tokens=max_new_tokens)[0]

    def _prefill(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        key: jax.Array,
        sampling: SamplingParams,
        max_new_tokens: int,
    ) -> tuple[DecodeState, jax.Array | None]:
        """`prefill`, plus the prompts' hidden states [P_bucket, T_bucket, H] with `record_hidden`."""
        cfg = self.config
        max_new = max_new_tokens
        self.validate_prompts(prompts, max_new)
        num_p, total = len(prompts), len(prompts) * n
        prompt_lens = np.asarray([len(p) for p in prompts], np.int32)
        max_total = int(prompt_lens.max()) + max_new
        pb = self.batch_bucket(num_p)
        tb = min(_pow2_at_least(int(prompt_lens.max()), cfg.prompt_bucket), cfg.max_cache_len)
        tokens = np.zeros((pb, tb), np.int32)
        lens = np.ones((pb,), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
            lens[i] = len(p)
        b = self.batch_bucket(total)
        rows = np.zeros((b,), np.int32)
        rows[:total] = np.repeat(np.arange(num_p), n)
        pad = np.arange(b) >= total
        seq_ids = np.where(pad, -1, np.arange(b)).astype(np.int32)
        base = jax.random.key_data(jax.random.split(key, total))
        keys = np.zeros((b, 2), np.uint32)
        keys[:total] = np.asarray(base)
        s = self.cache_bucket(min(max(tb, int(prompt_lens.max()) + cfg.chunk_steps + 1), max_total))
        s = max(s, self.cache_bucket(tb))
        needs = self._aux_needs()
        fn = self._jit(
            ("prefill", sp_key(sampling), pb, tb, b, s, max_new, needs),
            self._prefill_fn(sampling, s, max_new, needs),
        )
        bs = shd.batch_sharding(self.mesh, 1, b)
        return fn(
            self.params,
            self.drafter_params if needs[0] else None,
            jnp.asarray(tokens),
            jnp.asarray(lens),
            jax.device_put(rows, bs),
            jax.device_put(keys, shd.batch_sharding(self.mesh, 2, b)),
            jax.device_put(np.full((b,), max_new, np.int32), bs),
            jax.device_put(pad, bs),
            jax.device_put(seq_ids, bs),
        )

    def new_bank(self, num_sequences: int, group_size: int, max_new_tokens: int) -> NgramBank:
        """An empty n-gram sibling bank for a rollout of num_sequences = prompts * group_size rows."""
        return NgramBank(
            tokens=jnp.zeros((num_sequences, max_new_tokens), jnp.int32),
            lengths=jnp.zeros((num_sequences,), jnp.int32),
            group_size=group_size,
        )

    def update_bank(self, bank: NgramBank, state: DecodeState) -> NgramBank:
        """Copy the state's responses into the bank (before compaction drops finished rows)."""
        fn = self._jit(("bank", bank.tokens.shape, bank.group_size, state.done.shape[0]), _bank_update)
        return fn(bank, state)

    def decode_chunk(
        self,
        state: DecodeState,
        mode: str,
        sampling: SamplingParams,
        max_new_tokens: int,
        bank: NgramBank | None = None,
    ) -> tuple[DecodeState, np.ndarray, dict[str, Any], NgramBank | None]:
        """Run one chunk of `mode` ("plain" or a registered mode) on `state` (donated).

        The cache must already hold the chunk's growth (`generate` resizes between chunks). Returns the new
        state, the running-row count per step/round (-1 past the end), ChunkRecord extras and the bank.
        """
        cur_b, cap = state.done.shape[0], state.cache.capacity
        needs = self._aux_needs()
        dparams = self.drafter_params if needs[0] else None
        if mode == "plain":
            c = self._jit(
                ("chunk", sp_key(sampling), cur_b, cap, max_new_tokens, needs),
                self._chunk_fn(sampling),
                donate=(2,),
            )
            state, running = c(self.params, dparams, state, self.eos_ids)
            return state, np.asarray(jax.device_get(running)), {}, bank
        if mode not in self.modes:
            raise KeyError(f"unknown mode {mode!r}: registered {sorted(self.modes)} (and 'plain')")
        m = self.modes[mode]
        if m.drafter == "ngram" and bank is None:
            raise ValueError("an n-gram mode needs the sibling bank: pass bank=engine.new_bank(...)")
        bank_in = bank if m.drafter == "ngram" else None
        bank_key = None if bank_in is None else (bank_in.tokens.shape, bank_in.group_size)
        c = self._jit(
            ("spec", mode, sp_key(sampling), cur_b, cap, max_new_tokens, needs, bank_key),
            self._spec_chunk_fn(m, sampling),
            donate=(2, 4),
        )
        state, running, counts, bank_out = c(self.params, dparams, state, self.eos_ids, bank_in)
        running, (emitted, rows, hist) = jax.device_get((running, counts))
        extra = {
            "accepted_tokens": int(emitted),
            "verify_rounds": int(rows),
            "strategy": m.strategy.name,
            "accept_hist": tuple(int(x) for x in hist),
        }
        return state, np.asarray(running), extra, (bank_out if bank_in is not None else bank)

    # ---- the host loop --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        key: jax.Array,
        sampling: SamplingParams,
        max_new_tokens: int | None = None,
        progress: Progress | None = None,
        mode_selector: spec.ModeSelector | Callable[[int], str] | None = None,
    ) -> Rollout:
        """Sample `n` responses for each prompt.

        mode_selector picks "plain" or a registered speculative mode before each chunk: a
        `speculative.ModeSelector` (select + observe, e.g. a bandit) or a `fn(running) -> mode`. None: the
        SpecConfig threshold switch when `config.spec.enabled`, else plain decoding throughout.
        """
        cfg = self.config
        max_new = max_new_tokens or cfg.max_new_tokens
        t_start = time.perf_counter()
        stats = RolloutStats()
        num_p, total = len(prompts), len(prompts) * n
        prompt_lens = np.asarray([len(p) for p in prompts], np.int32)
        max_total = int(prompt_lens.max()) + max_new if num_p else 0
        selector = self._selector(mode_selector)

        t0 = time.perf_counter()
        state, prompt_h = self._prefill(prompts, n=n, key=key, sampling=sampling, max_new_tokens=max_new)
        jax.block_until_ready(state)
        prompt_hidden = None
        if prompt_h is not None:
            ph = np.asarray(jax.device_get(prompt_h))
            prompt_hidden = [ph[i, : len(p)] for i, p in enumerate(prompts)]
        out_hidden = (
            None
            if state.out_hidden is None
            else np.zeros((total, max_new, state.out_hidden.shape[-1]), state.out_hidden.dtype)
        )
        b = state.done.shape[0]
        seq_ids = np.where(np.arange(b) >= total, -1, np.arange(b))
        bank = self.new_bank(total, n, max_new) if self._aux_needs()[1] else None
        stats.add_time("prefill", time.perf_counter() - t0)

        out_tokens = np.zeros((total, max_new), np.int32)
        out_logp = np.zeros((total, max_new), np.float32)
        out_len = np.zeros((total,), np.int32)
        reason = ["length"] * total
        stop_cut: dict[int, int] = {}
        harvested = np.zeros((total,), bool)
        eos_set = set(np.asarray(self.eos_ids).tolist())

        def harvest(st: DecodeState, which: np.ndarray) -> None:
            """Copy finished rows' outputs to the host before their rows are dropped."""
            toks, lps, num = jax.device_get((st.out_tokens, st.out_logp, st.num_generated))
            hid = None if out_hidden is None else np.asarray(jax.device_get(st.out_hidden))
            for r in np.nonzero(which)[0]:
                sid = seq_ids[r]
                if sid < 0 or harvested[sid]:
                    continue
                ln = stop_cut.get(sid, int(num[r]))
                out_tokens[sid, :ln] = toks[r, :ln]
                out_logp[sid, :ln] = lps[r, :ln]
                out_len[sid] = ln
                if hid is not None:
                    out_hidden[sid, :ln] = hid[r, :ln]
                if sid in stop_cut:
                    reason[sid] = "stop"
                elif ln > 0 and int(toks[r, ln - 1]) in eos_set:
                    reason[sid] = "eos"
                harvested[sid] = True

        while True:
            t0 = time.perf_counter()
            done, lengths, num = jax.device_get((state.done, state.cache.lengths, state.num_generated))
            if cfg.stop_strings:
                newly = self._check_stop_strings(state, done, seq_ids, stop_cut)
                if newly.any():
                    state = state.replace(done=jnp.asarray(done | newly))
                    done = done | newly
            live = ~done
            n_live = int(live.sum())
            if n_live == 0:
                break
            cur_b = state.done.shape[0]
            new_b = self.batch_bucket(n_live)
            if cfg.compact and new_b < cur_b:
                harvest(state, done)
                if bank is not None:
                    bank = self.update_bank(bank, state)
                keep = np.nonzero(live)[0]
                sel = np.concatenate([keep, np.full(new_b - len(keep), keep[0])]).astype(np.int32)
                padm = np.arange(new_b) >= len(keep)
                g = self._jit(
                    ("gather", cur_b, new_b, state.cache.capacity, self._aux_needs()), self._gather_fn()
                )
                state = g(state, jnp.asarray(sel), jnp.asarray(padm))
                seq_ids = np.where(padm, -1, seq_ids[sel])
                lengths, live, num = lengths[sel], ~padm, num[sel]
            cur_b = state.done.shape[0]
            mode = selector.select(n_live, cur_b)
            if mode == "plain":
                per_step, ahead = 1, 1
            elif mode in self.modes:
                per_step, ahead = self.modes[mode].tokens_per_step, self.modes[mode].lookahead
            else:
                raise KeyError(
                    f"mode selector chose {mode!r}: registered modes {sorted(self.modes)} (and 'plain')"
                )
            need = min(int(lengths[live].max()) + cfg.chunk_steps * per_step + ahead, max_total + ahead)
            s_new = self.cache_bucket(need)
            if s_new != state.cache.capacity:
                r = self._jit(
                    ("resize", cur_b, state.cache.capacity, s_new, self._aux_needs()), self._resize_fn(s_new)
                )
                state = r(state)
            stats.add_time("host", time.perf_counter() - t0)

            t0 = time.perf_counter()
            valid = seq_ids >= 0
            before = int(num[valid].sum())
            state, running, extra, bank = self.decode_chunk(state, mode, sampling, max_new, bank)
            after = int(np.asarray(jax.device_get(state.num_generated))[valid].sum())
            dt = time.perf_counter() - t0
            running = running[running >= 0]
            stats.add_time("decode" if mode == "plain" else "speculative", dt)
            stats.running_per_step.extend(running.tolist())
            stats.sd_per_step.extend([mode != "plain"] * len(running))
            record = ChunkRecord(
                mode=mode,
                batch_bucket=cur_b,
                cache_bucket=state.cache.capacity,
                steps=len(running),
                running_start=n_live,
                seconds=dt,
                new_tokens=after - before,
                **extra,
            )
            stats.chunks.append(record)
            selector.observe(record, running.tolist())
            if progress is not None:
                progress.update(
                    int(running[-1]) if len(running) else n_live, int(harvested.sum()), after - before
                )

        harvest(state, np.ones(state.done.shape[0], bool))
        stats.num_tokens = int(out_len.sum())
        stats.wall_seconds = time.perf_counter() - t_start
        return Rollout(
            prompt_tokens=[list(prompts[i]) for i in np.repeat(np.arange(num_p), n)],
            prompt_index=np.repeat(np.arange(num_p), n),
            tokens=out_tokens,
            logprobs=out_logp,
            lengths=out_len,
            finish_reason=reason,
            stats=stats,
            prompt_hidden=prompt_hidden,
            hidden=out_hidden,
        )

    def _selector(self, mode_selector: spec.ModeSelector | Callable[[int], str] | None) -> spec.ModeSelector:
        if mode_selector is None:
            if self.spec_mode is None:
                return spec.CallableSelector(lambda running: "plain")
            s = self.config.spec
            return spec.ThresholdSelector(self.spec_mode, s.threshold, s.min_steps_below)
        if hasattr(mode_selector, "select"):
            return mode_selector  # type: ignore[return-value]
        return spec.CallableSelector(mode_selector)  # type: ignore[arg-type]

    def _check_stop_strings(
        self, state: DecodeState, done: np.ndarray, seq_ids: np.ndarray, stop_cut: dict[int, int]
    ) -> np.ndarray:
        """Host-side stop strings: the response ends with the token that completes a stop string."""
        toks, num = jax.device_get((state.out_tokens, state.num_generated))
        newly = np.zeros_like(done)
        for r in np.nonzero(~done)[0]:
            sid = int(seq_ids[r])
            if sid < 0:
                continue
            ids = toks[r, : num[r]].tolist()
            text = self.tokenizer.decode(ids)
            if not any(s in text for s in self.config.stop_strings):
                continue
            for cut in range(1, len(ids) + 1):  # the first prefix that contains a stop string
                if any(s in self.tokenizer.decode(ids[:cut]) for s in self.config.stop_strings):
                    stop_cut[sid] = cut
                    newly[r] = True
                    break
        return newly


def _drafter_weight_dtype(name: str, model: Transformer) -> jnp.dtype | None:
    """SpecConfig.drafter_weight_dtype -> the dtype to cast the drafter's matrices to (None: leave them)."""
    if name == "auto":
        return jnp.dtype(jnp.bfloat16) if small_m_linear.kernel_enabled(model.cfg.linear_impl) else None
    return jnp.dtype(name)


def _bank_update(bank: NgramBank, state: DecodeState) -> NgramBank:
    tokens, lengths = ngram_lib.update_bank(
        bank.tokens, bank.lengths, state.out_tokens, state.num_generated, state.aux.seq_id
    )
    return bank.replace(tokens=tokens, lengths=lengths)


def sp_key(sp: SamplingParams) -> tuple:
    return dataclasses.astuple(sp)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
