"""What a speculative rollout is configured with: strategies, acceptance rules, the SD config, modes.

A *strategy* `draft_depth_topk_tokens_to_verify` (the paper's `8_4_48`) fixes the static shapes of one
speculative round; a *mode* pairs it with a drafter ("eagle": the learned EAGLE drafter, "ngram": the
model-free drafter, "history": the model-free drafter over the prompt's earlier responses) and an acceptance
rule; `SpecConfig` is the engine's speculative section (which mode, when SD switches on). Everything here is
a frozen, hashable dataclass: modes key the compiled programs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from tlt_jax.rollout.acceptance import TreeAcceptance
from tlt_jax.rollout.history import HistoryParams

DRAFTERS = ("eagle", "ngram", "history")
# How a drafted tree/chain is verified at temperature > 0 (greedy rounds always match the argmax):
# "coupled": the token plain decoding would draw at each position with the row's own uniform is computed and
#     the drafted child equal to it accepted, so in float32 the emitted tokens equal plain decoding's token
#     for token (the default: reward curves, resumes and bandit choices cannot move float32 samples; in
#     bfloat16 verify and decode round apart, so samples flip but keep the target's distribution);
# "target_only": TLT/SGLang's target-only tree walk (exact in distribution, same acceptance as coupled);
# "rejection": EAGLE chains only: drafts SAMPLED from the drafter, Leviathan rejection sampling (exact in
#     distribution only; accepts 1 - TV(p, q) per position instead of p(argmax q)).
ACCEPTANCE = ("coupled", "target_only", "rejection")
DRAFTER_WEIGHT_DTYPES = ("auto", "float32", "bfloat16")
AcceptRule = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, int], TreeAcceptance]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A speculative strategy `draft_depth_topk_tokens_to_verify` (e.g. "8_4_48"); topk 1 is a chain.

    tokens_to_verify counts the root (the last committed token), as SGLang's num_draft_tokens does, so a chain
    of depth d verifies d + 1 tokens. A tree cannot be deeper than tokens_to_verify - 1 nodes:
    `max_depth = min(draft_depth, tokens_to_verify - 1)` is the depth actually drafted.
    """

    draft_depth: int
    topk: int
    tokens_to_verify: int

    def __post_init__(self) -> None:
        if self.draft_depth < 1 or self.topk < 1 or self.tokens_to_verify < 2:
            raise ValueError(
                f"strategy {self.name}: need draft_depth >= 1, topk >= 1 and tokens_to_verify >= 2 "
                "(the root + at least one draft)"
            )
        if self.tokens_to_verify - 1 > self.num_candidates:
            raise ValueError(
                f"strategy {self.name}: tokens_to_verify - 1 = {self.tokens_to_verify - 1} exceeds the "
                f"{self.num_candidates} nodes a depth-{self.max_depth} top-{self.topk} draft produces"
            )

    @classmethod
    def parse(cls, text: str | Strategy) -> Strategy:
        """ "8_4_48" -> Strategy(8, 4, 48)."""
        if isinstance(text, Strategy):
            return text
        parts = str(text).strip().split("_")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(
                f"strategy {text!r}: expected 'draft_depth_topk_tokens_to_verify', e.g. '8_4_48'"
            )
        return cls(*(int(p) for p in parts))

    @property
    def name(self) -> str:
        return f"{self.draft_depth}_{self.topk}_{self.tokens_to_verify}"

    def __str__(self) -> str:
        return self.name

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def max_depth(self) -> int:
        return min(self.draft_depth, self.tokens_to_verify - 1)

    @property
    def num_candidates(self) -> int:
        """Nodes an EAGLE-2 draft scores: topk at depth 1, topk^2 at each later depth."""
        return self.topk + (self.max_depth - 1) * self.topk * self.topk

    @property
    def draft_slots(self) -> int:
        """Drafter KV slots one EAGLE draft writes: the root pair + topk per expanded depth."""
        return 1 + (self.max_depth - 1) * self.topk

    @property
    def tokens_per_round(self) -> int:
        """Most tokens a row emits in one round (accepted drafts + bonus)."""
        return self.max_depth + 1

    @property
    def lookahead(self) -> int:
        """Cache slots past the committed length one round writes (target verify, drafter draft/extend)."""
        return max(self.tokens_to_verify, self.draft_slots, self.max_depth + 1)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative rollouts. `threshold`: SD turns on once at most this many rows are running and have been
    for `min_steps_below` decode steps (the reference uses 32 and 10); with threshold >= the batch and
    min_steps_below=0 the whole rollout is speculative. `drafter`: "eagle" (needs `RolloutEngine(drafter=)`)
    or "ngram" (model-free). The n-gram drafter matches up to `ngram_max` tokens (at least `ngram_min`) in the
    prompt, the row's response and up to `ngram_siblings` sibling responses of the same prompt; "history"
    drafts from a suffix automaton over the prompt and its earlier responses (`rollout.history`: earlier
    epochs' and this group's finished siblings'; `history_*` are its `HistoryParams`).
    `acceptance`: see ACCEPTANCE ("coupled", the default, keeps every sample equal to plain decoding's).
    `drafter_weight_dtype`: the dtype the engine keeps the drafter's weight matrices (and its reduced LM head)
    in: "float32", "bfloat16", or "auto" = bfloat16 where the target's matmuls run the CPU kernel (which
    widens bfloat16 exactly and computes in fp32, so a draft step streams half the bytes), else the drafter's
    own dtype. Drafts are proposals (and a sampled chain's q is the distribution actually sampled), so any
    dtype keeps SD exact; it only moves the acceptance rate.
    """

    enabled: bool = False
    drafter: str = "eagle"
    strategy: str = "3_1_4"
    threshold: int = 32
    min_steps_below: int = 10
    ngram_max: int = 4
    ngram_min: int = 1
    ngram_siblings: int = 16
    history_max_match: int = 32
    history_spec_factor: float = 4.0
    history_min_prob: float = 0.0
    history_max_prompt_tokens: int = 65_536
    history_max_tokens: int = 4_194_304
    acceptance: str = "coupled"
    drafter_weight_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"SpecConfig.drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        Strategy.parse(self.strategy)
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("SpecConfig: need 1 <= ngram_min <= ngram_max")
        if self.threshold < 0 or self.min_steps_below < 0 or self.ngram_siblings < 0:
            raise ValueError("SpecConfig: threshold, min_steps_below and ngram_siblings must be >= 0")
        if self.acceptance not in ACCEPTANCE:
            raise ValueError(f"SpecConfig.acceptance must be one of {ACCEPTANCE}, got {self.acceptance!r}")
        self.history_params()  # its own checks
        if self.drafter_weight_dtype not in DRAFTER_WEIGHT_DTYPES:
            raise ValueError(
                f"SpecConfig.drafter_weight_dtype must be one of {DRAFTER_WEIGHT_DTYPES}, "
                f"got {self.drafter_weight_dtype!r}"
            )

    def history_params(self) -> HistoryParams:
        """The history drafter's settings."""
        return HistoryParams(
            max_match=self.history_max_match,
            spec_factor=self.history_spec_factor,
            min_prob=self.history_min_prob,
            max_prompt_tokens=self.history_max_prompt_tokens,
            max_tokens=self.history_max_tokens,
        )


@dataclasses.dataclass(frozen=True)
class SpecMode:
    """A registered speculative mode: drafter kind + strategy + acceptance rule (a compiled chunk program).

    acceptance: one of ACCEPTANCE; "rejection" needs the learned drafter and a chain (topk = 1); a config-wide
    "rejection" resolves to "coupled" for the other modes (`resolve_acceptance`).
    accept_rule: a replacement for `tree_accept` under "target_only" (tests use a biased one to show the
    statistical tests have power); it must keep its signature. Greedy rounds always match the argmax.
    """

    drafter: str
    strategy: Strategy
    acceptance: str = "coupled"
    accept_rule: AcceptRule | None = None
    label: str = ""

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.acceptance not in ACCEPTANCE:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE}, got {self.acceptance!r}")
        if self.rejection and not (self.drafter == "eagle" and self.strategy.is_chain):
            raise ValueError(
                "rejection-sampling verification needs the learned drafter and a chain strategy (topk = 1); "
                f"got drafter={self.drafter!r}, strategy {self.strategy}"
            )
        if self.accept_rule is not None and self.acceptance != "target_only":
            raise ValueError(
                "a custom accept_rule replaces the target-only walk: use acceptance='target_only'"
            )

    @property
    def rejection(self) -> bool:
        return self.acceptance == "rejection"

    @property
    def name(self) -> str:
        base = self.strategy.name if self.drafter == "eagle" else f"{self.drafter}_{self.strategy.name}"
        return f"{base}_{self.label}" if self.label else base

    @property
    def tokens_per_step(self) -> int:
        return self.strategy.tokens_per_round

    @property
    def lookahead(self) -> int:
        return self.strategy.lookahead


def resolve_acceptance(requested: str, drafter: str, strategy: Strategy) -> str:
    """The acceptance a mode gets from a config-wide setting: "rejection" applies to EAGLE chains only
    (trees, n-gram and history drafts have no draft distribution to reject against): they verify coupled."""
    if requested == "rejection" and not (drafter == "eagle" and strategy.is_chain):
        return "coupled"
    return requested
