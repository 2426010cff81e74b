"""What the rollout engine's clients see: its settings (`EngineConfig`), the members they use (`EngineLike`).

`RolloutEngine` (`rollout/engine.py`) satisfies `EngineLike`. The engine's clients type their `engine`
parameter with this Protocol rather than with the class: the host loop (`scheduler.generate`) and the
`Harvester`, which engine.py itself imports (importing the class back would be a cycle), the adaptive policy
(`adaptive.build_policy`) and the spot trainer (`drafter.spot_trainer.SpotTrainer`). It is runtime-checkable,
so a test asserts `isinstance(engine, EngineLike)` on a real engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from tlt_jax.kernels.tree_attention import IMPLS as ATTN_IMPLS
from tlt_jax.models.build import TextCodec
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.decode import PromptCache
from tlt_jax.rollout.history import HistoryStore
from tlt_jax.rollout.history_rounds import HistoryRows
from tlt_jax.rollout.hooks import IdleWork
from tlt_jax.rollout.ngram import NgramBank
from tlt_jax.rollout.programs import MATMUL_PRECISIONS
from tlt_jax.rollout.record import HIDDEN_SPANS
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.strategy import AcceptRule, SpecConfig, SpecMode, Strategy
from tlt_jax.rollout.types import ChunkRecord, DecodeState, RowSummary


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The rollout engine's settings (frozen: hashable); `config_lib.engine_config_from` builds one."""

    max_new_tokens: int = 256
    max_cache_len: int = 2048  # prompt + response must fit; longer prompts are rejected with a clear error
    chunk_steps: int = 16  # decode steps (or verify rounds) per device call (host decisions happen between)
    min_cache_bucket: int = 64  # cache-length buckets are powers of two from here up to max_cache_len
    prompt_bucket: int = 16  # prompt lengths are padded to powers of two >= this
    compact: bool = True  # compact live rows into smaller batch buckets as sequences finish
    # continuous batching (`rollout.admission`): at most this many running rows per data shard (a power of
    # two), the rest queued and inserted into slots as rows finish; 0: from kv_budget_gib (0 too: no cap)
    max_running_rows: int = 0
    kv_budget_gib: float = 0.0  # per-device KV-cache budget (GiB) that picks max_running_rows when it is 0
    # "auto" | "reference" | "pallas" | "pallas_tpu" | "cpu_ffi" (see tlt_jax.kernels.tree_attention)
    attn_impl: str = "auto"
    stop_strings: tuple[str, ...] = ()
    spec: SpecConfig = SpecConfig()  # speculative rollouts (off by default)
    # also return the target's final hidden states of the prompt and of `hidden_window` response positions of
    # every sequence (`Rollout.features`, `FinishedSequences.hidden`): drafter training data from the
    # rollout with no second target forward; the window bounds device and host memory. hidden_span: which
    # positions, "first" | "random" (a window at a per-row random depth) | "last" (`rollout.record`).
    # keep_hidden=False: the states only stream to the hooks as rows finish (`on_finished`), Rollout.hidden
    # stays None and the host holds no rollout's worth of them
    record_hidden: bool = False
    hidden_window: int = 512
    hidden_span: str = "first"
    keep_hidden: bool = True
    # strategies with the same tokens_to_verify share one program per (batch bucket, cache bucket): the
    # strategy is a runtime operand (`RolloutEngine.mode_group`); False: one program per strategy
    share_programs: bool = True
    # dots in every rollout program: "auto" = "highest" for float32 models, the process default for bf16
    matmul_precision: str = "auto"  # (rollout.programs.program_precision)

    def __post_init__(self) -> None:
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision={self.matmul_precision!r}: use one of {MATMUL_PRECISIONS}.")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={self.attn_impl!r}: use one of {ATTN_IMPLS} (rollout.attn_impl).")
        for name in ("max_new_tokens", "chunk_steps", "hidden_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1 (config.rollout.{name}).")
        if self.hidden_span not in HIDDEN_SPANS:
            raise ValueError(f"hidden_span={self.hidden_span!r}: use one of {HIDDEN_SPANS} (config.rollout).")
        r = self.max_running_rows
        if r < 0 or (r & (r - 1)) or self.kv_budget_gib < 0:
            raise ValueError(
                f"max_running_rows={r} / kv_budget_gib={self.kv_budget_gib}: need a power of two (or 0) and "
                "a budget >= 0 (config.rollout.max_running_rows / kv_budget_gib)."
            )
        if self.max_new_tokens >= self.max_cache_len:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} leaves no room for a prompt in max_cache_len="
                f"{self.max_cache_len}: raise max_cache_len or lower max_new_tokens."
            )


@runtime_checkable
class EngineLike(Protocol):
    """The rollout engine as the host loop, the harvester, the adaptive policy and the spot trainer use it:
    exactly the `RolloutEngine` members they read or call (see there for what each does)."""

    config: EngineConfig
    mesh: Mesh
    data_size: int  # devices on the mesh's data axis
    replicated: NamedSharding  # replicated over the mesh
    tokenizer: TextCodec | None  # decodes responses for stop strings (None without stop strings)
    eos_ids: jax.Array
    modes: dict[str, SpecMode]  # the registered speculative modes by name
    spec_mode: str | None  # the mode `config.spec` registered, if enabled
    drafter_params: Any  # the EAGLE drafter's current weights (None without a drafter)
    max_running_rows: int  # continuous batching's cap per data shard (0: none)
    compile_seconds: float  # seconds spent compiling the engine's programs so far
    draft_vocab: jax.Array | None  # the drafter head's reduced vocabulary
    history: HistoryStore | None  # the history drafter's store (a "history" mode registered)

    def model(self, params: Any | None = None) -> Transformer: ...

    def add_mode(
        self,
        drafter: str,
        strategy: str | Strategy,
        *,
        acceptance: str | None = None,
        accept_rule: AcceptRule | None = None,
        label: str = "",
    ) -> str: ...

    def needs(self) -> tuple[bool, bool]: ...

    def local_bucket(self, n: int) -> int: ...

    def cache_bucket(self, need: int) -> int: ...

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
    ) -> tuple[DecodeState, jax.Array | None]: ...

    def prompt_cache(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        params: Any | None = None,
        drafter_params: Any | None = None,
    ) -> PromptCache: ...

    def start_rows(
        self,
        pc: PromptCache,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        seq_ids: np.ndarray,
        seq_keys: np.ndarray,
        sampling: SamplingParams,
        max_new_tokens: int,
    ) -> DecodeState: ...

    def insert(self, state: DecodeState, new: DecodeState, slots: np.ndarray) -> DecodeState: ...

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
    ) -> tuple[DecodeState, ChunkRecord, NgramBank | None, RowSummary]: ...

    def history_chunk(
        self,
        state: DecodeState,
        mode: str,
        sampling: SamplingParams,
        rows: HistoryRows,
        exit_live: int = -1,
        drafter_params: Any | None = None,
        params: Any | None = None,
    ) -> tuple[DecodeState, ChunkRecord, RowSummary]: ...

    def row_summary(self, state: DecodeState) -> RowSummary: ...

    def fetch_rows(
        self, state: DecodeState, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]: ...

    def gather_rows(self, state: DecodeState, sel: np.ndarray, pad: np.ndarray) -> DecodeState: ...

    def resize_cache(self, state: DecodeState, seq_len: int) -> DecodeState: ...

    def update_bank(self, bank: NgramBank, state: DecodeState) -> NgramBank: ...
