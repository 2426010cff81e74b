"""The roofline of a decode step and a speculative round (`Roofline`) at a decoder-only model's shapes
(`ModelShape`; Qwen2.5-7B's from its HF config), and bench_sd's tokens-to-verify -> (depth, topk) mapping.

Below `project_sd.py` (the projection) and `measured_costs.py` (the roofline scaled to a GPU call's measured
cells), which both build on it: imports point one way (project_sd -> measured_costs -> roofline).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What a decode step of a decoder-only model reads and computes (bf16 weights: 2 bytes each)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    bytes_per_param: int = 2

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate

    @property
    def step_params(self) -> int:
        """Weights one forward reads: every layer and the LM head (the embedding: a few rows only)."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.bytes_per_param

    def drafter_params(self, draft_vocab: int | None = None) -> int:
        """EAGLE-1: fc (2H -> H) + one decoder layer + the target's LM head (or a draft vocabulary)."""
        return 2 * self.hidden * self.hidden + self.layer_params + (draft_vocab or self.vocab) * self.hidden


QWEN2_5_7B = ModelShape("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064)


def strategy_for(tv: int, max_depth: int = 8) -> tuple[int, int]:
    """(depth, topk) of bench_sd's TV mapping: depth min(8, TV - 1), the smallest topk whose EAGLE-2 tree
    (k + (depth - 1) k^2 candidates) holds TV - 1 drafts."""
    depth = min(max_depth, tv - 1)
    k = 1
    while k + (depth - 1) * k * k < tv - 1:
        k += 1
    return depth, k


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Seconds of a decode step / verify round of `model` on a device with bandwidth `bw` (bytes/s) and
    matmul peak `flops` (FLOP/s): each pass max(bytes / bw, FLOPs / peak)."""

    model: ModelShape
    bw: float
    flops: float
    draft_vocab: int | None = None
    # fixed seconds added to every plain step / round of tokens_to_verify TV (default 0: hidden under the
    # memory time); `with_fixed_costs` takes them from SmolLM2's measured H100 step and round times
    fixed_plain: float = 0.0
    fixed_round: dict[int, float] = dataclasses.field(default_factory=dict)

    def forward(self, batch: int, tokens: int, cache: int, kv: int = 0) -> float:
        """One target pass of `tokens` new tokens per row: the weights and the KV cache read once (every
        row's whole cache bucket; with `kv` > 0 only those KV tokens, as paged attention reads them)."""
        m = self.model
        kv = kv or batch * cache
        nbytes = m.step_params * m.bytes_per_param + kv * m.kv_bytes_per_token
        attn = 4 * tokens * kv * m.heads * m.head_dim * m.layers
        return max(nbytes / self.bw, (2 * m.step_params * batch * tokens + attn) / self.flops)

    def plain(self, batch: int, cache: int, kv: int = 0) -> float:
        return self.forward(batch, 1, cache, kv) + self.fixed_plain

    def draft(self, batch: int, depth: int, topk: int) -> float:
        """`depth` drafter passes (1 token per row at depth 1, topk per row deeper)."""
        p = self.model.drafter_params(self.draft_vocab)
        one = lambda n: max(p * self.model.bytes_per_param / self.bw, 2 * p * batch * n / self.flops)  # noqa: E731
        return one(1) + (depth - 1) * one(topk)

    def round(self, batch: int, tv: int, cache: int, kv: int = 0) -> float:
        depth, topk = strategy_for(tv)
        fixed = 0.0
        if self.fixed_round:
            tvs = sorted(self.fixed_round)
            fixed = float(np.interp(tv, tvs, [self.fixed_round[t] for t in tvs]))
        return self.forward(batch, tv, cache, kv) + self.draft(batch, depth, topk) + fixed

    def __call__(self, mode: str, batch: int, cache: int, kv: int = 0) -> float:
        """The simulator's StepCost: "plain", a strategy "d_k_tv" or "tv:<n>" (bench_sd's mapping)."""
        if mode == "plain":
            return self.plain(batch, cache, kv)
        tv = int(mode.split(":")[1]) if mode.startswith("tv:") else int(mode.split("_")[-1])
        return self.round(batch, tv, cache, kv)
