"""The device bodies of a rollout: prefill and decode chunks (plain or speculative) as pure functions.

Every function here is a pure function of (static program description, params, state): no `self`, no mesh,
no host state. So the same body runs under `jit` over the whole mesh (the engine's programs, with sharding
constraints added around it by `programs.py`) and per device inside `shard_map` (the spot trainer's tick
program, where idle devices train the drafter while busy ones decode).

A chunk runs up to `steps` decode steps (plain) or verify rounds (speculative) in a `lax.while_loop` and
stops early when every row is done, or when the fullest data shard has at most `exit_live` live rows (the
host then compacts the live rows into a smaller batch bucket: a chunk never keeps running dead rows once
compaction would pay, which matters most for speculative chunks, whose rounds cover several tokens each).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.models.eagle3 import AnyDrafter
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout import ngram as ngram_lib
from tlt_jax.rollout.eagle_draft import drafter_advance, drafter_prefill, eagle_draft
from tlt_jax.rollout.record import record_hidden, record_tokens, span_ends
from tlt_jax.rollout.sampling import SamplingParams, sample_rows
from tlt_jax.rollout.strategy import SpecMode
from tlt_jax.rollout.tree_verify import RoundStats, verify_round
from tlt_jax.rollout.types import DecodeState, DraftTree, SpecAux, row_keys

DRAFT_SALT = 0x0D5A  # folded into a row's token key for sampled drafts (acceptance uses the key itself)


@dataclasses.dataclass(frozen=True)
class ChunkProgram:
    """Static description of one chunk body: what is compiled into it (the rest are runtime operands).

    target / drafter: graph definitions (`nnx.split`); drafter is set when the state carries the EAGLE
    drafter's cache (an "eagle" mode is registered), so plain chunks keep it in step for a later switch.
    modes: () for plain decoding, else the speculative modes this program can run, all with the same
    tokens_to_verify and acceptance rule: strategies with the same tokens_to_verify share one program (the
    paper's bucketed CUDA graphs), and the runtime `arm` operand picks the mode of a chunk's rounds.
    shards: rows are laid out as `shards` contiguous blocks (the data axis); the early exit looks at the
    fullest block. 1 inside `shard_map` (one device's rows).
    draft_dtype: the dtype of the reduced draft head (None: the target head's dtype).
    """

    target: Any
    drafter: Any
    sampling: SamplingParams
    attn_impl: str
    steps: int
    modes: tuple[SpecMode, ...] = ()
    ngram: ngram_lib.NgramParams | None = None
    shards: int = 1
    draft_dtype: Any = None

    @property
    def max_depth(self) -> int:
        """The deepest draft of the program's modes (0 for plain)."""
        return max((m.strategy.max_depth for m in self.modes), default=0)

    @property
    def uses(self) -> set[str]:
        """The drafter kinds ("eagle", "ngram") of the program's modes."""
        return {m.drafter for m in self.modes}


@flax.struct.dataclass
class ChunkOut:
    """What a chunk returns: the new state, the running-row count of each step/round (-1 past the end), the
    speculative counts (tokens emitted, live row-rounds, accept histogram; zeros for plain) and the bank."""

    state: DecodeState
    running: jax.Array  # [steps]
    emitted: jax.Array
    rows: jax.Array
    hist: jax.Array  # [max_depth + 2] (one zero for plain)
    bank: ngram_lib.NgramBank | None


def plain_step(
    target: Transformer,
    drafter: AnyDrafter | None,
    state: DecodeState,
    eos_ids: jax.Array,
    sp: SamplingParams,
    attn_impl: str,
) -> DecodeState:
    """One target step for every row: feed the last token, sample the next with the row's own key.

    With a drafter (and a drafter cache in `state.aux`), also write the pending drafter pair
    (last_token, h_{L-1}) so the drafter cache stays one position behind the target (no LM head: cheap).
    """
    b = state.last_token.shape[0]
    live = ~state.done
    out = target(
        state.last_token[:, None],
        state.cache.lengths[:, None],
        state.cache,
        jnp.ones((b, 1, 1), bool),
        attn_impl=attn_impl,
    )
    cache = out.cache.advance(live.astype(jnp.int32))
    tok, lp = sample_rows(row_keys(state), out.logits[:, 0], sp)
    feats = out.drafter_states  # the final state (EAGLE-3: [aux layers ; final])
    state = record_hidden(state, feats, live.astype(jnp.int32))
    if drafter is not None and state.aux is not None and state.aux.drafter_cache is not None:
        aux = state.aux
        dcache = drafter_advance(
            drafter,
            target,
            aux.drafter_cache,
            state.last_token[:, None],
            aux.hidden[:, None],
            live.astype(jnp.int32),
            attn_impl,
        )
        hidden = jnp.where(live[:, None], feats[:, 0], aux.hidden)
        state = state.replace(aux=aux.replace(drafter_cache=dcache, hidden=hidden))
    return record_tokens(
        state.replace(cache=cache), tok[:, None], lp[:, None], live.astype(jnp.int32), eos_ids
    )


def _live_in_fullest_shard(done: jax.Array, shards: int) -> jax.Array:
    return jnp.max(jnp.sum(~done.reshape(shards, -1), axis=1))


def draft_head_of(prog: ChunkProgram, target: Transformer, draft_vocab: jax.Array | None) -> jax.Array | None:
    """The draft vocabulary's rows of the shared head, gathered once per chunk (not per draft step)."""
    if draft_vocab is None:
        return None
    head = jnp.take(target.head_weight(), draft_vocab, axis=0)
    return head if prog.draft_dtype is None else head.astype(prog.draft_dtype)


def _pad_tree(tree: DraftTree, n: int) -> DraftTree:
    """Pad a draft tree to n nodes with padding nodes (parent -2), so trees of several strategies with the
    same tokens_to_verify have one shape."""
    extra = n - tree.tokens.shape[1]
    if extra <= 0:
        return tree
    b = tree.tokens.shape[0]
    pad = lambda x, v: jnp.concatenate([x, jnp.full((b, extra), v, jnp.int32)], axis=1)  # noqa: E731
    return tree.replace(tokens=pad(tree.tokens, 0), parents=pad(tree.parents, -2), depth=pad(tree.depth, 0))


@dataclasses.dataclass(frozen=True)
class RoundModels:
    """What one speculative round runs with, merged once per chunk: the target, the drafter (or None), the
    learned drafter's reduced vocabulary and its head rows (or None)."""

    target: Transformer
    drafter: AnyDrafter | None
    draft_vocab: jax.Array | None
    draft_head: jax.Array | None


def round_models(prog: ChunkProgram, params: Any, dparams: Any, draft_vocab: jax.Array | None) -> RoundModels:
    """Merge a chunk program's models (and gather the draft head) for `draft_round` / `spec_round`."""
    target = nnx.merge(prog.target, params)
    drafter = nnx.merge(prog.drafter, dparams) if prog.drafter is not None and dparams is not None else None
    own_head = drafter is not None and drafter.arch == "eagle3"  # EAGLE-3 drafts with its own head
    head = draft_head_of(prog, target, draft_vocab) if "eagle" in prog.uses and not own_head else None
    return RoundModels(target=target, drafter=drafter, draft_vocab=draft_vocab, draft_head=head)


def _draft_mode(
    prog: ChunkProgram, m: RoundModels, mode: SpecMode, st: DecodeState, bank: ngram_lib.NgramBank | None
) -> tuple[DraftTree, Any]:
    """One mode's draft tree (padded to its tokens_to_verify nodes) and the drafter cache it wrote."""
    strat, sp = mode.strategy, prog.sampling
    if mode.drafter == "eagle":
        sampled = mode.rejection and not sp.greedy
        return eagle_draft(
            m.target,
            m.drafter,
            st.aux.drafter_cache,
            st.last_token,
            st.aux.hidden,
            strat,
            prog.attn_impl,
            # draft randomness: the row's token key folded with a salt, independent of the acceptance
            # uniforms (drawn from the row's token key itself)
            sample_keys=jax.vmap(jax.random.fold_in, (0, None))(row_keys(st), DRAFT_SALT)
            if sampled
            else None,
            sp=sp if sampled else None,
            draft_vocab=m.draft_vocab,
            draft_head=m.draft_head,
        )
    num_nodes = min(strat.tokens_to_verify, 1 + strat.topk * strat.max_depth)
    tree = ngram_lib.draft_ngram(st, bank, strat.max_depth, strat.topk, num_nodes, prog.ngram)
    dcache = None if st.aux.drafter_cache is None else st.aux.drafter_cache
    return _pad_tree(tree, strat.tokens_to_verify), dcache


def draft_round(
    prog: ChunkProgram,
    m: RoundModels,
    state: DecodeState,
    bank: ngram_lib.NgramBank | None,
    arm: jax.Array | int = 0,
) -> tuple[DraftTree, Any]:
    """Phase 1 of a speculative round: the draft tree of mode `prog.modes[arm]` (a `lax.switch` when the
    program holds several modes) and the drafter cache it wrote."""
    branches = [functools.partial(_draft_mode, prog, m, mode) for mode in prog.modes]
    if len(branches) == 1:
        return branches[0](state, bank)
    return jax.lax.switch(arm, branches, state, bank)


def logit_nodes(prog: ChunkProgram) -> int | None:
    """How many tree nodes' logits a round computes (None: all). Coupled (and greedy) acceptance needs the
    target's distribution only at nodes with children, at most `draft_slots` per strategy (EAGLE expands
    topk nodes per depth, n-gram branches one node each), plus the node where the walk stops; a wide tree's
    leaves are most of it (8_3_64: 63 drafts, at most 22 with children), so its LM head and sampling run on
    those nodes only when that saves at least half the rows (the stop node may cost one more head row)."""
    lead = prog.modes[0]
    if lead.acceptance != "coupled" and not prog.sampling.greedy:
        return None
    n = lead.strategy.tokens_to_verify
    m = min(n - 1, max(mode.strategy.draft_slots for mode in prog.modes))
    return m if 2 * (m + 1) <= n else None


def spec_round(
    prog: ChunkProgram,
    m: RoundModels,
    state: DecodeState,
    bank: ngram_lib.NgramBank | None,
    eos_ids: jax.Array,
    arm: jax.Array | int = 0,
) -> tuple[DecodeState, RoundStats]:
    """One speculative round for every row: draft, verify forward, accept and sample, commit."""
    tree, dcache = draft_round(prog, m, state, bank, arm)
    return verify_tree(prog, m, state, tree, eos_ids, dcache)


def verify_tree(
    prog: ChunkProgram,
    m: RoundModels,
    state: DecodeState,
    tree: DraftTree,
    eos_ids: jax.Array,
    drafter_cache: KVCache | None = None,
) -> tuple[DecodeState, RoundStats]:
    """Verify a drafted tree for every row with the program's sampling, depth, attention and acceptance
    rule (its lead mode's): verify forward, accept and sample, commit."""
    lead = prog.modes[0]
    return verify_round(
        m.target,
        m.drafter,
        state,
        tree,
        prog.sampling,
        eos_ids,
        max_depth=prog.max_depth,
        attn_impl=prog.attn_impl,
        acceptance=lead.acceptance,
        accept_rule=lead.accept_rule,
        drafter_cache=drafter_cache,
        logit_nodes=logit_nodes(prog),
    )


def run_chunk(
    prog: ChunkProgram,
    params: Any,
    dparams: Any,
    state: DecodeState,
    eos_ids: jax.Array,
    bank: ngram_lib.NgramBank | None,
    draft_vocab: jax.Array | None,
    exit_live: jax.Array,
    arm: jax.Array | int = 0,
) -> ChunkOut:
    """Up to `prog.steps` plain steps or speculative rounds on `state` (see the module docstring).

    exit_live: int32 scalar; the chunk ends (after at least one step) once the fullest shard has at most
    this many live rows (-1: never). bank: the n-gram sibling bank (n-gram modes), updated every round.
    draft_vocab: [Vd] token ids of the learned drafter's reduced head (None: the full head). arm: int32
    scalar, which of `prog.modes` drafts this chunk's rounds.
    """
    m = round_models(prog, params, dparams, draft_vocab)
    depth = prog.max_depth

    def round_(st: DecodeState, bank: ngram_lib.NgramBank | None) -> tuple[DecodeState, Any]:
        if not prog.modes:
            return plain_step(m.target, m.drafter, st, eos_ids, prog.sampling, prog.attn_impl), None
        return spec_round(prog, m, st, bank, eos_ids, arm)

    def cond(c: tuple) -> jax.Array:
        i, st = c[0], c[1]
        live_max = _live_in_fullest_shard(st.done, prog.shards)
        return (i < prog.steps) & (live_max > 0) & ((i == 0) | (live_max > exit_live))

    def body(c: tuple) -> tuple:
        i, st, running, emitted, rows, hist, bank = c
        running = running.at[i].set(jnp.sum(~st.done))
        if bank is not None:
            bank = bank.update(st)
        st, rs = round_(st, bank)
        if rs is not None:
            emitted, rows, hist = emitted + rs.emitted, rows + rs.rows, hist + rs.hist
        return i + 1, st, running, emitted, rows, hist, bank

    zero = jnp.zeros((), jnp.int32)
    init = (
        zero,
        state,
        jnp.full((prog.steps,), -1, jnp.int32),
        zero,
        zero,
        jnp.zeros((depth + 2,), jnp.int32),
        bank,
    )
    _, state, running, emitted, rows, hist, bank = jax.lax.while_loop(cond, body, init)
    if bank is not None:
        bank = bank.update(state)
    return ChunkOut(state=state, running=running, emitted=emitted, rows=rows, hist=hist, bank=bank)


def idle_chunk(prog: ChunkProgram, state: DecodeState, bank: ngram_lib.NgramBank | None) -> ChunkOut:
    """What a device with no live row returns in a fused chunk: its state unchanged, no steps."""
    zero = jnp.zeros((), jnp.int32)
    running = jnp.full((prog.steps,), -1, jnp.int32)
    hist = jnp.zeros((prog.max_depth + 2,), jnp.int32)
    return ChunkOut(state=state, running=running, emitted=zero, rows=zero, hist=hist, bank=bank)


@dataclasses.dataclass(frozen=True)
class PrefillProgram:
    """Static description of the prefill: cache length, response budget, what the state must carry."""

    target: Any
    drafter: Any  # set: prefill the EAGLE drafter's cache too
    sampling: SamplingParams
    attn_impl: str
    cache_len: int
    max_new: int
    carry_prompt: bool  # n-gram modes need the prompt tokens in the state
    hidden_window: int  # > 0: record the target's hidden states of W response tokens per row
    record_prompt_hidden: bool
    hidden_span: str = "first"  # which W (`record.span_ends`; EngineConfig.hidden_span)


@flax.struct.dataclass
class PromptCache:
    """A rollout's unique prompts after their forward pass, kept so rows can start from it at any time
    (continuous batching inserts rows of a prompt whose siblings started long before, without a second
    forward): the KV cache [P, ...], the EAGLE drafter's cache (or None), the last position's hidden state
    [P, H] and logits [P, V], the tokens / lengths (the n-gram drafter's history) and, when recorded,
    the prompts' hidden states [P, T, H]."""

    cache: KVCache
    drafter_cache: KVCache | None
    hidden: jax.Array
    logits: jax.Array
    tokens: jax.Array
    lens: jax.Array
    prompt_hidden: jax.Array | None


def prefill_prompts(
    prog: PrefillProgram, params: Any, dparams: Any, tokens_pt: jax.Array, lens_p: jax.Array
) -> PromptCache:
    """The forward pass of the P unique prompts [P, T] (lengths [P]) into a cache of `prog.cache_len`."""
    model = nnx.merge(prog.target, params)
    p, t = tokens_pt.shape
    cache = KVCache.init(model.cfg, p, prog.cache_len)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (p, t))
    out = model(tokens_pt, pos, cache, logits_index_bk=(lens_p - 1)[:, None], attn_impl=prog.attn_impl)
    dcache = None
    feats = out.drafter_states  # the final states (EAGLE-3: [aux layers ; final])
    if prog.drafter is not None:
        drafter = nnx.merge(prog.drafter, dparams)
        init = drafter.init_cache(p, prog.cache_len)
        dcache = drafter_prefill(drafter, model, init, tokens_pt, feats, lens_p, prog.attn_impl)
    return PromptCache(
        cache=out.cache.advance(lens_p),
        drafter_cache=dcache,
        hidden=feats[jnp.arange(p), lens_p - 1],
        logits=out.logits[:, 0],
        tokens=tokens_pt,
        lens=lens_p,
        prompt_hidden=feats if prog.record_prompt_hidden else None,
    )


def start_rows(
    prog: PrefillProgram,
    pc: PromptCache,
    rows_b: jax.Array,
    keys_b: jax.Array,
    budget_b: jax.Array,
    pad_b: jax.Array,
    seq_b: jax.Array,
    eos_ids: jax.Array,
) -> DecodeState:
    """B rows starting from their prompts (`rows_b` indexes the prompt cache): the prompt's caches repeated
    and grown to `prog.cache_len`, each row's first token sampled with its own key."""
    b = rows_b.shape[0]
    aux = None
    if prog.drafter is not None or prog.carry_prompt:
        fields: dict[str, Any] = {"seq_id": seq_b}
        if prog.drafter is not None:
            fields["drafter_cache"] = pc.drafter_cache.take_rows(rows_b).resize(prog.cache_len)
            fields["hidden"] = pc.hidden[rows_b]
        if prog.carry_prompt:
            fields["prompt"] = pc.tokens[rows_b]
            fields["prompt_len"] = pc.lens[rows_b]
        aux = SpecAux(**fields)
    window = min(prog.hidden_window, prog.max_new)
    state = DecodeState(
        cache=pc.cache.take_rows(rows_b).resize(prog.cache_len),
        last_token=jnp.zeros((b,), jnp.int32),
        out_tokens=jnp.zeros((b, prog.max_new), jnp.int32),
        out_logp=jnp.zeros((b, prog.max_new), jnp.float32),
        num_generated=jnp.zeros((b,), jnp.int32),
        done=pad_b,
        seq_keys=keys_b,
        max_new=budget_b,
        aux=aux,
        out_hidden=jnp.zeros((b, window, pc.hidden.shape[-1]), pc.hidden.dtype) if window > 0 else None,
        hidden_end=span_ends(prog.hidden_span, keys_b, budget_b, window) if window > 0 else None,
    )
    tok, lp = sample_rows(row_keys(state), pc.logits[rows_b], prog.sampling)
    return record_tokens(state, tok[:, None], lp[:, None], (~pad_b).astype(jnp.int32), eos_ids)


def prefill(
    prog: PrefillProgram,
    params: Any,
    dparams: Any,
    tokens_pt: jax.Array,
    lens_p: jax.Array,
    rows_b: jax.Array,
    keys_b: jax.Array,
    budget_b: jax.Array,
    pad_b: jax.Array,
    seq_b: jax.Array,
    eos_ids: jax.Array,
) -> tuple[DecodeState, jax.Array | None]:
    """Prefill the P unique prompts once, repeat their cache rows into B rows (`rows_b`), sample each row's
    first token with its own key (`prefill_prompts`, then `start_rows`). Returns the state and, with
    `record_prompt_hidden`, the prompts' final hidden states [P, T, H]."""
    pc = prefill_prompts(prog, params, dparams, tokens_pt, lens_p)
    state = start_rows(prog, pc, rows_b, keys_b, budget_b, pad_b, seq_b, eos_ids)
    return state, pc.prompt_hidden


def gather_rows(state: DecodeState, rows: jax.Array, pad: jax.Array) -> DecodeState:
    """Compaction: the state's rows `rows` (padding rows marked done and owning no sequence)."""
    state = jax.tree_util.tree_map(lambda x: x[rows], state)
    state = state.replace(done=state.done | pad)
    if state.aux is not None and state.aux.seq_id is not None:
        state = state.replace(aux=state.aux.replace(seq_id=jnp.where(pad, -1, state.aux.seq_id)))
    return state


def insert_rows(state: DecodeState, new: DecodeState, slots: jax.Array) -> DecodeState:
    """Continuous batching: write the freshly started rows `new` into the state's rows `slots` (out-of-range
    slots: padding rows, dropped). Their caches (a smaller bucket) go into the first positions of their
    slots only: padding them to the running bucket first would cost k whole rows of temporaries (the 7B
    plan: 0.49 GiB per row per device at 35,328). Positions past a row's length are never attended to."""

    def rows(a: jax.Array, b: jax.Array) -> jax.Array:
        return a.at[slots].set(b.astype(a.dtype), mode="drop")

    def cache(big: KVCache, small: KVCache) -> KVCache:
        n = small.capacity
        put = lambda a, b: a.at[slots, :, :n].set(b.astype(a.dtype), mode="drop")  # noqa: E731
        return KVCache(k=tuple(map(put, big.k, small.k)), v=tuple(map(put, big.v, small.v)),
                       lengths=rows(big.lengths, small.lengths))  # fmt: skip

    def strip(st: DecodeState) -> DecodeState:
        aux = None if st.aux is None else st.aux.replace(drafter_cache=None)
        return st.replace(cache=None, aux=aux)

    out = jax.tree_util.tree_map(rows, strip(state), strip(new)).replace(cache=cache(state.cache, new.cache))
    if state.aux is not None and state.aux.drafter_cache is not None:
        dcache = cache(state.aux.drafter_cache, new.aux.drafter_cache)
        out = out.replace(aux=out.aux.replace(drafter_cache=dcache))
    return out


def resize_cache(state: DecodeState, seq_len: int) -> DecodeState:
    """Grow (or shrink) the target's and the drafter's cache-length bucket to `seq_len`."""
    state = state.replace(cache=state.cache.resize(seq_len))
    if state.aux is not None and state.aux.drafter_cache is not None:
        state = state.replace(aux=state.aux.replace(drafter_cache=state.aux.drafter_cache.resize(seq_len)))
    return state
