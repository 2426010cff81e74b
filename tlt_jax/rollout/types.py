"""What a rollout returns: sequences, the engine's log-probs and the per-step timeline the paper plots."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class ChunkRecord:
    """One device call of the engine (a chunk of decode steps or speculative rounds)."""

    mode: str  # "plain" or a speculative strategy name like "8_4_48" / "ngram_4_1_4"
    batch_bucket: int
    cache_bucket: int
    steps: int
    running_start: int
    seconds: float
    accepted_tokens: int = 0  # tokens emitted by speculative rounds (accepted drafts + bonus)
    verify_rounds: int = 0  # per-row verify rounds (sum over rows)


@dataclasses.dataclass
class RolloutStats:
    running_per_step: list[int] = dataclasses.field(default_factory=list)  # long-tail curve
    sd_per_step: list[bool] = dataclasses.field(default_factory=list)  # SD on at that step
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

    def summary(self) -> dict[str, float]:
        return {
            "rollout/tokens": float(self.num_tokens),
            "rollout/tok_per_s": self.tokens_per_second,
            "rollout/wall_s": self.wall_seconds,
            "rollout/decode_steps": float(len(self.running_per_step)),
            "rollout/sd_seconds": self.sd_seconds,
            "rollout/accept_len": self.mean_accept_length,
            **{f"rollout/time_{k}": v for k, v in self.phase_seconds.items()},
        }


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

    @property
    def mask(self) -> np.ndarray:
        return np.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]

    def response(self, i: int) -> list[int]:
        return self.tokens[i, : self.lengths[i]].tolist()
