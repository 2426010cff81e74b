"""Rollout engine: batched prompts -> sampled responses, as a host loop over device-side decode chunks.

Device work is a few jit-compiled programs with static shapes: a bucketed prefill, and a decode chunk that runs
up to `chunk_steps` steps in a `lax.while_loop` (stopping early once every row is done). Between chunks the
host looks at cheap summaries (which rows finished) and
- compacts the live rows into the smallest batch bucket that holds them, so the long tail runs at a small
  batch (that is where speculative decoding pays; see `tlt_jax.rollout.speculative`);
- grows the cache-length bucket just enough for the next chunk, so attention reads only the live part of
  the cache (a batch-64 step over 1024 slots is >10x slower than over 32 on CPU);
- checks stop strings, updates the progress bar and records the running-batch timeline.
The set of programs is finite (batch bucket x cache bucket) and cached: after warm-up nothing recompiles.

Each sequence owns a PRNG stream (its key folded with its token index), so a sequence's samples do not depend
on the batch it runs in: compaction, sharding and speculative decoding leave them unchanged.
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
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.sampling import SamplingParams, sample_rows
from tlt_jax.rollout.types import ChunkRecord, Rollout, RolloutStats


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_new_tokens: int = 256
    max_cache_len: int = 2048  # prompt + response must fit; longer prompts are rejected with a clear error
    chunk_steps: int = 16  # decode steps per device call (host decisions happen between chunks)
    min_cache_bucket: int = 64  # cache-length buckets are powers of two from here up to max_cache_len
    prompt_bucket: int = 16  # prompt lengths are padded to powers of two >= this
    compact: bool = True  # compact live rows into smaller batch buckets as sequences finish
    attn_impl: str = "reference"  # "reference" | "pallas" | "auto" (see tlt_jax.kernels.tree_attention)
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.chunk_steps < 1:
            raise ValueError("max_new_tokens and chunk_steps must be >= 1")
        if self.max_new_tokens >= self.max_cache_len:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} leaves no room for a prompt in max_cache_len="
                f"{self.max_cache_len}: raise max_cache_len or lower max_new_tokens."
            )


@flax.struct.dataclass
class DecodeState:
    """Everything a decode chunk carries, batch-major so compaction is one gather."""

    cache: KVCache
    last_token: jax.Array  # [B] the newest token (sampled, not yet written to the cache)
    out_tokens: jax.Array  # [B, N]
    out_logp: jax.Array  # [B, N]
    num_generated: jax.Array  # [B]
    done: jax.Array  # [B] bool
    seq_keys: jax.Array  # [B, 2] uint32 raw key data of each sequence's PRNG stream
    max_new: jax.Array  # [B] per-row token budget (<= N)


class Progress(Protocol):
    def update(self, running: int, finished: int, new_tokens: int) -> None: ...


def _pow2_at_least(x: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


def _row_keys(state: DecodeState) -> jax.Array:
    keys = jax.random.wrap_key_data(state.seq_keys)
    return jax.vmap(jax.random.fold_in)(keys, state.num_generated)


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
    model: Transformer, state: DecodeState, eos_ids: jax.Array, sp: SamplingParams, attn_impl: str
) -> DecodeState:
    """One target step for every row: feed the last token, sample the next."""
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
    tok, lp = sample_rows(_row_keys(state), out.logits[:, 0], sp)
    return record_tokens(state.replace(cache=cache), tok, lp, live, eos_ids)


class RolloutEngine:
    """Generates `n` samples per prompt with a Transformer; see the module docstring."""

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig,
        eos_ids: Sequence[int],
        *,
        mesh: Mesh | None = None,
        tokenizer: Any | None = None,
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
        self.extra_modes: dict[str, Any] = {}  # speculative strategies register here

    # ---- params -------------------------------------------------------------------------------------
    def set_params(self, params: Any) -> None:
        """Swap in new policy weights (same shapes/shardings: no recompilation)."""
        self.params = jax.device_put(params, self._param_shardings)

    def model(self, params: Any | None = None) -> Transformer:
        return nnx.merge(self.graphdef, self.params if params is None else params)

    # ---- compiled programs ----------------------------------------------------------------------------
    def _state_shardings(self, state: DecodeState) -> Any:
        return shd.shard_pytree_batch(state, self.mesh)

    def _jit(self, key: Any, fn: Callable, donate: tuple[int, ...] = ()) -> Callable:
        """Cache one jitted program per static key (shapes are keyed by the caller)."""
        if key not in self._compiled:
            self.compile_count += 1
            self._compiled[key] = jax.jit(fn, donate_argnums=donate)
        return self._compiled[key]

    def _prefill_fn(self, sp: SamplingParams, cache_len: int, max_new: int) -> Callable:
        cfg, attn_impl, graphdef = self.model_config, self.config.attn_impl, self.graphdef

        def prefill(params, tokens_pt, lens_p, rows_b, keys_b, budget_b, pad_b):  # noqa: ANN001, ANN202
            model = nnx.merge(graphdef, params)
            p, t = tokens_pt.shape
            cache = KVCache.init(cfg, p, cache_len)
            pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (p, t))
            out = model(tokens_pt, pos, cache, logits_index_bk=(lens_p - 1)[:, None], attn_impl=attn_impl)
            cache = out.cache.advance(lens_p).take_rows(rows_b)
            b = rows_b.shape[0]
            state = DecodeState(
                cache=cache,
                last_token=jnp.zeros((b,), jnp.int32),
                out_tokens=jnp.zeros((b, max_new), jnp.int32),
                out_logp=jnp.zeros((b, max_new), jnp.float32),
                num_generated=jnp.zeros((b,), jnp.int32),
                done=pad_b,
                seq_keys=keys_b,
                max_new=budget_b,
            )
            tok, lp = sample_rows(_row_keys(state), out.logits[rows_b, 0], sp)
            state = record_tokens(state, tok, lp, ~pad_b, self.eos_ids)
            return jax.lax.with_sharding_constraint(state, self._state_shardings(state))

        return prefill

    def _chunk_fn(self, sp: SamplingParams) -> Callable:
        graphdef, attn_impl, steps = self.graphdef, self.config.attn_impl, self.config.chunk_steps

        def chunk(params, state, eos_ids):  # noqa: ANN001, ANN202
            model = nnx.merge(graphdef, params)

            def cond(c):  # noqa: ANN001, ANN202
                i, st, _ = c
                return (i < steps) & jnp.any(~st.done)

            def body(c):  # noqa: ANN001, ANN202
                i, st, running = c
                running = running.at[i].set(jnp.sum(~st.done))
                return i + 1, plain_decode_step(model, st, eos_ids, sp, attn_impl), running

            _, state, running = jax.lax.while_loop(cond, body, (0, state, jnp.full((steps,), -1, jnp.int32)))
            return jax.lax.with_sharding_constraint(state, self._state_shardings(state)), running

        return chunk

    def _gather_fn(self) -> Callable:
        def gather(state, rows, pad):  # noqa: ANN001, ANN202
            state = jax.tree_util.tree_map(lambda x: x[rows], state)
            state = state.replace(done=state.done | pad)
            return jax.lax.with_sharding_constraint(state, self._state_shardings(state))

        return gather

    def _resize_fn(self, seq_len: int) -> Callable:
        def resize(state):  # noqa: ANN001, ANN202
            state = state.replace(cache=state.cache.resize(seq_len))
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
        cap = self.config.max_cache_len
        return min(_pow2_at_least(need, self.config.min_cache_bucket), _pow2_at_least(cap))

    # ---- the host loop --------------------------------------------------------------------------------
    def validate_prompts(self, prompts: Sequence[Sequence[int]], max_new: int) -> None:
        if not prompts:
            raise ValueError("generate() got no prompts")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token (e.g. BOS).")
            if len(p) + max_new > self.config.max_cache_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new} it needs {len(p) + max_new} "
                    f"cache slots but max_cache_len={self.config.max_cache_len}. Shorten the prompt, lower "
                    "max_new_tokens, or raise max_cache_len in the engine config."
                )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        key: jax.Array,
        sampling: SamplingParams,
        max_new_tokens: int | None = None,
        progress: Progress | None = None,
        mode_selector: Callable[[int], str] | None = None,
    ) -> Rollout:
        """Sample `n` responses for each prompt. `mode_selector(running)` picks "plain" or a registered
        speculative mode before each chunk (None: plain decoding throughout)."""
        cfg = self.config
        max_new = max_new_tokens or cfg.max_new_tokens
        self.validate_prompts(prompts, max_new)
        t_start = time.perf_counter()
        stats = RolloutStats()
        num_p, total = len(prompts), len(prompts) * n
        prompt_lens = np.asarray([len(p) for p in prompts], np.int32)
        max_total = int(prompt_lens.max()) + max_new

        # -- prefill unique prompts once, then repeat their cache rows n times
        t0 = time.perf_counter()
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
        seq_ids = np.where(pad, -1, np.arange(b))
        base = jax.random.key_data(jax.random.split(key, total))
        keys = np.zeros((b, 2), np.uint32)
        keys[:total] = np.asarray(base)
        s = self.cache_bucket(min(max(tb, int(prompt_lens.max()) + cfg.chunk_steps + 1), max_total))
        s = max(s, self.cache_bucket(tb))
        fn = self._jit(
            ("prefill", sp_key(sampling), pb, tb, b, s, max_new), self._prefill_fn(sampling, s, max_new)
        )
        bs = shd.batch_sharding(self.mesh, 1, b)
        state = fn(
            self.params,
            jnp.asarray(tokens),
            jnp.asarray(lens),
            jax.device_put(rows, bs),
            jax.device_put(keys, shd.batch_sharding(self.mesh, 2, b)),
            jax.device_put(np.full((b,), max_new, np.int32), bs),
            jax.device_put(pad, bs),
        )
        jax.block_until_ready(state)
        stats.add_time("prefill", time.perf_counter() - t0)

        out_tokens = np.zeros((total, max_new), np.int32)
        out_logp = np.zeros((total, max_new), np.float32)
        out_len = np.zeros((total,), np.int32)
        reason = ["length"] * total
        stop_cut: dict[int, int] = {}
        harvested = np.zeros((total,), bool)
        all_prompt_lens = np.repeat(prompt_lens, n)

        def harvest(st: DecodeState, which: np.ndarray) -> None:
            """Copy finished rows' outputs to the host before their rows are dropped."""
            toks, lps, num = jax.device_get((st.out_tokens, st.out_logp, st.num_generated))
            for r in np.nonzero(which)[0]:
                sid = seq_ids[r]
                if sid < 0 or harvested[sid]:
                    continue
                ln = stop_cut.get(sid, int(num[r]))
                out_tokens[sid, :ln] = toks[r, :ln]
                out_logp[sid, :ln] = lps[r, :ln]
                out_len[sid] = ln
                if sid in stop_cut:
                    reason[sid] = "stop"
                elif ln > 0 and int(toks[r, ln - 1]) in set(np.asarray(self.eos_ids).tolist()):
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
                keep = np.nonzero(live)[0]
                sel = np.concatenate([keep, np.full(new_b - len(keep), keep[0])]).astype(np.int32)
                padm = np.arange(new_b) >= len(keep)
                g = self._jit(("gather", cur_b, new_b, state.cache.capacity), self._gather_fn())
                state = g(state, jnp.asarray(sel), jnp.asarray(padm))
                seq_ids = np.where(padm, -1, seq_ids[sel])
                lengths, live = lengths[sel], ~padm
            cur_b = state.done.shape[0]
            mode = mode_selector(n_live) if mode_selector is not None else "plain"
            per_step = 1 if mode == "plain" else self.extra_modes[mode].tokens_per_step
            need = min(int(lengths[live].max()) + cfg.chunk_steps * per_step + 1, max_total + per_step)
            s_new = self.cache_bucket(need)
            if s_new != state.cache.capacity:
                r = self._jit(("resize", cur_b, state.cache.capacity, s_new), self._resize_fn(s_new))
                state = r(state)
            stats.add_time("host", time.perf_counter() - t0)

            t0 = time.perf_counter()
            before = int(np.asarray(jax.device_get(state.num_generated))[seq_ids >= 0].sum())
            if mode == "plain":
                c = self._jit(
                    ("chunk", sp_key(sampling), cur_b, state.cache.capacity, max_new),
                    self._chunk_fn(sampling),
                    donate=(1,),
                )
                state, running = c(self.params, state, self.eos_ids)
                extra = {}
            else:
                state, running, extra = self.extra_modes[mode].run_chunk(self, state, sampling, max_new)
            running = np.asarray(jax.device_get(running))
            running = running[running >= 0]
            dt = time.perf_counter() - t0
            stats.add_time("decode" if mode == "plain" else "speculative", dt)
            stats.running_per_step.extend(running.tolist())
            stats.sd_per_step.extend([mode != "plain"] * len(running))
            stats.chunks.append(
                ChunkRecord(
                    mode=mode,
                    batch_bucket=cur_b,
                    cache_bucket=state.cache.capacity,
                    steps=len(running),
                    running_start=n_live,
                    seconds=dt,
                    **extra,
                )
            )
            if progress is not None:
                after = int(np.asarray(jax.device_get(state.num_generated))[seq_ids >= 0].sum())
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
        )

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


def sp_key(sp: SamplingParams) -> tuple:
    return dataclasses.astuple(sp)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
