"""The Pallas tree-attention kernel's tile and launch parameters (`BlockSizes`) and their tuning hook.

`tree_attention.tree_attention_pallas` takes a `BlockSizes`; with none it uses `default_block_sizes(cache
dtype)`: `BlockSizes()`, or the sizes tuned for that dtype on the device at hand, read from
`$TLT_TREE_ATTENTION_BLOCK_SIZES`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile and launch parameters of the Pallas kernel (static: hashable, used as a jit static argument).

    Attributes:
      block_q: query rows per program; a row is one (new token, query head of the KV group) pair. Clipped to
        the next power of two >= the row count (and >= 16, the smallest `tl.dot` tile).
      block_k: keys per inner step over the prefix, and the chunk size over the tree tokens.
      kv_splits: programs sharing one row's prefix (flash-decoding split-K); > 1 helps small batches on
        big GPUs, at the cost of a merge in the wrapper. 0 (the default): per call, the fewest splits that
        bring the grid to `target_programs` programs, each split keeping at least `min_split_blocks` key
        blocks: split-K where the batch is small and the cache long. A fixed 1 leaves a batch-1 decode of
        Qwen2.5-7B with 4 programs (one per KV head) for the whole cache, a few percent of an H100/H200.
      target_programs: the grid size `kv_splits=0` aims for (about 1-2 programs per SM).
      min_split_blocks: with `kv_splits=0`, the fewest key blocks per split (a split's fixed cost, its
        partial result and the merge, amortised over at least this many blocks).
      num_warps: Triton warps per program; None = 4 for head dim <= 64, else 8.
      num_stages: Triton software-pipelining stages.
    """

    block_q: int = 64
    block_k: int = 64
    kv_splits: int = 0
    target_programs: int = 256
    min_split_blocks: int = 4
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_q", "block_k"):
            val = getattr(self, name)
            if not (_is_pow2(val) and val >= 16):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {val}")
        if self.kv_splits < 0 or self.target_programs < 1 or self.min_split_blocks < 1:
            raise ValueError(
                f"BlockSizes: kv_splits must be >= 0, target_programs and min_split_blocks >= 1, got {self}"
            )

    def splits_for(self, programs: int, key_blocks: int) -> int:
        """KV splits for a grid of `programs` (rows x KV heads x query blocks) over `key_blocks` blocks."""
        if self.kv_splits:
            return self.kv_splits
        return max(1, min(-(-self.target_programs // programs), key_blocks // self.min_split_blocks))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> BlockSizes:
        """From `to_dict()`'s output; unknown keys are errors (a typo must not fall back silently)."""
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"BlockSizes: unknown fields {sorted(unknown)}")
        return cls(**fields)


# Tuned block sizes (the tuning hook): `experiments/bench/bench_tree_attention.py --tune --tuned-out FILE`
# writes {"by_dtype": {"bfloat16": {...BlockSizes fields...}}, ...} for the device it ran on; pointing this
# variable at FILE (or holding that JSON inline) makes every caller that passes no `block_sizes` use them for
# that dtype (other dtypes keep `BlockSizes()`). gpu/suite.py sets it for the phases after tuning.
BLOCK_SIZES_ENV = "TLT_TREE_ATTENTION_BLOCK_SIZES"


@functools.cache
def default_block_sizes(dtype: str) -> BlockSizes:
    """The kernel's block sizes when a caller gives none: `BlockSizes()`, or the tuned entry for `dtype` (a
    dtype name, e.g. "bfloat16") in `$TLT_TREE_ATTENTION_BLOCK_SIZES`. Read once per process and dtype
    (traced programs are cached by jit anyway); a malformed file raises rather than silently untuned."""
    spec = os.environ.get(BLOCK_SIZES_ENV, "").strip()
    if not spec:
        return BlockSizes()
    try:
        tuned = json.loads(spec if spec.startswith("{") else pathlib.Path(spec).read_text())
        entry = tuned.get("by_dtype", {}).get(dtype)
        return BlockSizes() if entry is None else BlockSizes.from_dict(entry)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"${BLOCK_SIZES_ENV}={spec[:200]!r}: not a tuned block-size file ({e})") from e
