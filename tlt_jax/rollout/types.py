"""Rollout data types: the device-side decode state, and what a rollout returns (sequences, the engine's
log-probs and the per-step timeline the paper plots)."""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import numpy as np

from tlt_jax.models.kv_cache import KVCache


@flax.struct.dataclass
class SpecAux:
    """Per-row state that only speculative decoding needs (batch-major: compaction gathers it like the rest).

    A field is None when no configured mode needs it, so plain decoding carries nothing extra.
    drafter_cache: the EAGLE drafter's one-layer KV cache. Invariant at every chunk boundary: it holds the
        pairs (x_{t+1}, h_t) for t < L - 1 (L = the target cache's length), i.e. length L - 1; the pending
        pair (last_token, hidden) is written at the start of the next step or round.
    hidden: [B, H] the target's final hidden state h_{L-1} at the last committed position.
    prompt: [B, Tp] prompt tokens (left-aligned), prompt_len [B]: the n-gram drafter's history.
    seq_id: [B] the sequence index (prompt index * n + sample index; -1 for padding rows): finds siblings.
    """

    drafter_cache: KVCache | None = None
    hidden: jax.Array | None = None
    prompt: jax.Array | None = None
    prompt_len: jax.Array | None = None
    seq_id: jax.Array | None = None


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
    aux: SpecAux | None = None  # speculative-decoding state (None: plain decoding only)
    # [B, W, H] the target's final hidden state of response token i < W, written when the token is fed back
    # (so the newest token has none yet); only with EngineConfig.record_hidden (`record.record_hidden`)
    out_hidden: jax.Array | None = None


@flax.struct.dataclass
class DraftTree:
    """A draft tree per row in `acceptance.py`'s layout (static N per strategy).

    tokens: [B, N] int32; node 0 is the root (the row's last committed token), nodes 1.. are drafts.
    parents: [B, N] int32; -1 for the root, < i for draft i, -2 for padding.
    depth: [B, N] int32; 0 for the root (and padding); a draft's position is the committed length + depth.
    draft_probs: [B, N - 1, V] float32 or None. Set only for a chain whose drafts were SAMPLED from these
        drafter distributions (node i + 1 ~ draft_probs[:, i]); verification then uses rejection sampling
        (`chain_accept_rejection`) instead of target-only tree sampling.
    """

    tokens: jax.Array
    parents: jax.Array
    depth: jax.Array
    draft_probs: jax.Array | None = None


def row_keys(state: DecodeState) -> jax.Array:
    """One PRNG key per row for the token at index num_generated: the sequence's key folded with its token
    index, so a row's randomness does not depend on its batch, its bucket or how many tokens a step emits."""
    keys = jax.random.wrap_key_data(state.seq_keys)
    return jax.vmap(jax.random.fold_in)(keys, state.num_generated)


@dataclasses.dataclass
class ChunkRecord:
    """One device call of the engine (a chunk of decode steps or speculative rounds)."""

    mode: str  # "plain" or a speculative mode name like "8_4_48" (EAGLE) / "ngram_4_1_4"
    batch_bucket: int
    cache_bucket: int
    steps: int  # decode steps (plain) or verify rounds (speculative) the chunk ran
    running_start: int
    seconds: float
    accepted_tokens: int = 0  # tokens emitted by speculative rounds (accepted drafts + bonus)
    verify_rounds: int = 0  # per-row verify rounds (sum over rows)
    new_tokens: int = 0  # tokens emitted by the chunk (any mode)
    strategy: str = ""  # the speculative strategy "depth_topk_verify" ("" for plain)
    accept_hist: tuple[int, ...] = ()  # [i] = row-rounds that emitted i tokens (i = 0..depth+1)
    running: tuple[int, ...] = ()  # running rows at the start of each step/round
    compiled: bool = False  # this chunk's call compiled its program first (not in `seconds`)
    compile_seconds: float = 0.0  # that compilation's seconds (0 when nothing compiled)

    @property
    def tokens_per_second(self) -> float:
        """Tokens emitted per second of this chunk (the paper's reward)."""
        return self.new_tokens / max(self.seconds, 1e-9)

    @property
    def rate_at_start_rows(self) -> float:
        """The adaptive engine's reward: tokens per second scaled to the rows the chunk started with
        (`tokens_per_second * running_start / mean running rows over its steps`). A row that finishes inside
        a chunk leaves the rest of it at fewer rows; at 2 running rows that halves tokens/s, and an SD chunk
        (more tokens per step) ends inside more often, so unscaled rates of one (bucket, arm) spread by up to
        2x with where rows happened to end. Exact while a step's cost does not depend on the rows (few-row
        decoding on CPU and GPU); at many rows a finishing row is a small fraction."""
        mean_rows = sum(self.running) / len(self.running) if self.running else self.running_start
        return self.tokens_per_second * self.running_start / max(mean_rows, 1e-9)

    @property
    def accept_length(self) -> float:
        """Mean tokens emitted per row per verify round (accepted drafts + 1); 0 for plain chunks."""
        return self.accepted_tokens / self.verify_rounds if self.verify_rounds else 0.0


@dataclasses.dataclass
class RolloutStats:
    running_per_step: list[int] = dataclasses.field(default_factory=list)  # long-tail curve (steps/rounds)
    sd_per_step: list[bool] = dataclasses.field(default_factory=list)  # SD on at that step
    seconds_per_step: list[float] = dataclasses.field(default_factory=list)  # its share of its chunk's time
    chunks: list[ChunkRecord] = dataclasses.field(default_factory=list)
    phase_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    num_tokens: int = 0
    wall_seconds: float = 0.0

    def add_time(self, phase: str, seconds: float) -> None:
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / max(self.wall_seconds, 1e-9)

    @property
    def mean_accept_length(self) -> float:
        """Mean tokens emitted per speculative verify round (accepted drafts + 1), 0 if SD never ran."""
        rounds = sum(c.verify_rounds for c in self.chunks)
        return sum(c.accepted_tokens for c in self.chunks) / rounds if rounds else 0.0

    @property
    def sd_seconds(self) -> float:
        return sum(c.seconds for c in self.chunks if c.mode != "plain")

    def mode_tokens_per_second(self, mode: str | None = None) -> float:
        """Tokens per second of device time in chunks of `mode` (None: all speculative chunks).

        Counts only chunk (decode) time, not prefill or host time: the number to compare plain with SD.
        """
        sel = [c for c in self.chunks if (c.mode != "plain" if mode is None else c.mode == mode)]
        return sum(c.new_tokens for c in sel) / max(sum(c.seconds for c in sel), 1e-9) if sel else 0.0

    def accept_histogram(self) -> np.ndarray:
        """Row-rounds by tokens emitted (index i = i tokens), summed over all speculative chunks."""
        hists = [np.asarray(c.accept_hist) for c in self.chunks if c.accept_hist]
        if not hists:
            return np.zeros((0,), np.int64)
        out = np.zeros((max(len(h) for h in hists),), np.int64)
        for h in hists:
            out[: len(h)] += h
        return out

    def seconds_at_running(self, at_most: int) -> float:
        """Decode time spent in steps/rounds with at most `at_most` running rows (the long tail)."""
        return float(
            sum(s for r, s in zip(self.running_per_step, self.seconds_per_step, strict=True) if r <= at_most)
        )

    @property
    def decode_seconds(self) -> float:
        return sum(c.seconds for c in self.chunks)

    def summary(self) -> dict[str, float]:
        """Per-rollout metrics: tokens, time, SD share and speeds, the running-batch curve's tail times."""
        decode = max(self.decode_seconds, 1e-9)
        out = {
            "rollout/tokens": float(self.num_tokens),
            "rollout/tok_per_s": self.tokens_per_second,
            "rollout/wall_s": self.wall_seconds,
            "rollout/decode_steps": float(len(self.running_per_step)),
            "rollout/sd_seconds": self.sd_seconds,
            "rollout/sd_share": self.sd_seconds / max(self.wall_seconds, 1e-9),
            "rollout/accept_len": self.mean_accept_length,
            "rollout/sd_tok_per_s": self.mode_tokens_per_second(None),
            "rollout/plain_tok_per_s": self.mode_tokens_per_second("plain"),
            "rollout/compiled_chunks": float(sum(c.compiled for c in self.chunks)),
            **{f"rollout/time_{k}": v for k, v in self.phase_seconds.items()},
        }
        for k in (32, 8, 2):
            out[f"rollout/time_running_le{k}"] = self.seconds_at_running(k)
            out[f"rollout/share_running_le{k}"] = self.seconds_at_running(k) / decode
        return out


@dataclasses.dataclass
class Rollout:
    """B = num_prompts * n sequences; row i belongs to prompt `prompt_index[i]` (groups are contiguous)."""

    prompt_tokens: list[list[int]]  # per sequence
    prompt_index: np.ndarray  # [B]
    tokens: np.ndarray  # [B, N] response tokens, padded with 0
    logprobs: np.ndarray  # [B, N] the engine's log-probs of the sampled tokens
    lengths: np.ndarray  # [B] response lengths (EOS included)
    finish_reason: list[str]  # "eos" | "stop" | "length"
    stats: RolloutStats
    # with EngineConfig.record_hidden: the target's final hidden states, per unique prompt [Lp, H] and per
    # response [min(len - 1, W), H] (response token i's state at row i; a response's last token has none;
    # W = EngineConfig.hidden_window bounds the memory of long responses)
    prompt_hidden: list[np.ndarray] | None = None
    hidden: list[np.ndarray] | None = None

    @property
    def mask(self) -> np.ndarray:
        return np.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]

    def response(self, i: int) -> list[int]:
        return self.tokens[i, : self.lengths[i]].tolist()

    def features(self, i: int) -> np.ndarray:
        """[len(prompt) + min(len(response) - 1, W), H]: the target's final hidden state h_t at every
        position of sequence i but the last (the newest token was never fed to the target), up to the window
        W: a drafter training sample's `hidden` for `(prompt + response)[:len]`, no second target forward."""
        if self.hidden is None or self.prompt_hidden is None:
            raise ValueError(
                "this rollout has no hidden states: generate with EngineConfig(record_hidden=True)"
            )
        return np.concatenate([self.prompt_hidden[int(self.prompt_index[i])], self.hidden[i]])
