"""What an evaluation logs: accuracy estimators over k samples per problem, and the decode's speed.

Accuracy, from a [problems, k] table of samples (`sample_metrics`), each estimator averaged over problems:
  mean@k   the share of correct samples.
  pass@j   P(at least one of j samples is correct), for j = 1, 2, 4, ... < k and k.
  maj@j    P(the majority-voted answer of j samples is correct).
  best@j   E[the highest reward among j samples] (with 0/1 rewards: pass@j).
For j < k every estimator is EXACT over the j-subsets of the k samples drawn without replacement (pass@j is
Chen et al.'s unbiased estimator; best@j and maj@j the same expectation), not VeRL's bootstrap
(verl/trainer/ppo/metric_utils.py: `process_validation_metrics` draws 1,000 subsets WITH replacement, seed
42, through `bootstrap_metric`): no sampling noise, and at j = k the estimators are the plain statistic of
all k samples (VeRL's best@k at k resamples k with replacement, so it is below the max of the k samples).

maj@j votes with what `Task.vote` gives each sample: with task.reward="verl" (task.maj_votes "auto"), VeRL's
convention (verl/trainer/ppo/metric_utils.py calc_maj_val over the scorer's `pred`): the extracted answer as
it is, "[INVALID]" a vote like any other; else (maj_votes "normalized", tlt_jax's) the canonical number or the
lower-cased text without delimiters, equivalent strings merged, and a sample without an answer abstains (a
subset of abstainers only is wrong). Ties are broken by the answer that appeared first among the k samples
(VeRL's `calc_maj_val` keeps the first on a tie too: `max` over a dict in insertion order); the voted
answer's value is its first sample's (VeRL: the first value of the voted answer), its acc (1 / 0, or a custom
function's number). mean@k is the mean acc (`RewardResult.acc_value`), pass@j counts full credit (acc >= 1).

Speed (`SpeedTally`), from the evaluation's rollouts: decode seconds, SD's share of them, accept length,
tokens per second; with the paired plain pass (`config.eval.plain_baseline`) the speed-up measured on the
same prompts, keys, weights and engine, and the share of responses identical token for token.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from tlt_jax.rollout.types import Rollout, RolloutStats
from tlt_jax.tasks.base import normalized_vote


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator for one problem with `c` correct of `n` samples: 1 - C(n-c, k) / C(n, k),
    the chance that k of the n samples drawn without replacement hold a correct one (Chen et al., 2021)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def best_at_k(rewards: Sequence[float], k: int) -> float:
    """E[max reward of k of the n samples drawn without replacement]: the i-th smallest (1-based) is the
    maximum of C(i - 1, k - 1) of the C(n, k) subsets."""
    r, n = np.sort(np.asarray(rewards, np.float64)), len(rewards)
    if not 0 < k <= n:
        raise ValueError(f"best@k needs 0 < k <= n, got n={n}, k={k}")
    weights = [math.comb(i - 1, k - 1) for i in range(k, n + 1)]
    return float(sum(w * v for w, v in zip(weights, r[k - 1 :], strict=True)) / math.comb(n, k))


def vote_key(extracted: str | None) -> str | None:
    """The answer a sample votes for: the canonical number ("0.5" for "\\frac{1}{2}"), else the normalised
    text; None (abstains) without an extracted answer (tlt_jax.tasks.base.normalized_vote)."""
    return normalized_vote(extracted)


def _truncated_product(a: list[int], b: list[int], degree: int) -> list[int]:
    out = [0] * min(len(a) + len(b) - 1, degree + 1)
    for i, x in enumerate(a):
        for j, y in enumerate(b[: len(out) - i]):
            out[i + j] += x * y
    return out


def _ways_not_beaten(counts: list[int], a: int, t: int, m: int, abstain: int) -> int:
    """Ways to draw `m` samples from the answers other than `a` (and the abstainers) so that none beats `a`
    holding `t` votes: an answer that appeared before `a` wins a tie, so it may hold at most t - 1 votes, one
    after it at most t. An answer whose count is within its limit takes any number of its samples: those
    together with the abstainers contribute C(free, x) (Vandermonde); the others a truncated binomial each."""
    free, poly = abstain, [1]
    for b, c in enumerate(counts):
        if b == a:
            continue
        limit = t - 1 if b < a else t
        if c <= limit:
            free += c
        else:
            poly = _truncated_product(poly, [math.comb(c, x) for x in range(limit + 1)], m)
    poly = _truncated_product(poly, [math.comb(free, x) for x in range(min(free, m) + 1)], m)
    return poly[m] if m < len(poly) else 0


def maj_at_k(votes: Sequence[str | None], correct: Sequence[float], k: int) -> float:
    """E[the value of the majority answer of k of the n samples, drawn without replacement] (`correct`: each
    sample's value, 1 / 0 or partial credit; an answer's value is its first sample's): exact, by counting the
    subsets each answer wins (the module docstring has the voting rules)."""
    n = len(votes)
    if not 0 < k <= n or len(correct) != n:
        raise ValueError(f"maj@k needs 0 < k <= n and a verdict per vote, got n={n}, k={k}, {len(correct)}")
    answers: dict[str, int] = {}  # answer -> its first sample, in order of first appearance
    for i, v in enumerate(votes):
        if v is not None:
            answers.setdefault(v, i)
    counts = [sum(v == answer for v in votes) for answer in answers]
    abstain = n - sum(counts)
    total = 0.0
    for a, first in enumerate(answers.values()):
        value = float(correct[first])  # the answer's value: its first sample's
        if value:
            ways = sum(
                math.comb(counts[a], t) * _ways_not_beaten(counts, a, t, k - t, abstain)
                for t in range(1, min(counts[a], k) + 1)
            )
            total += value * ways
    return total / math.comb(n, k)


def sub_ks(k: int) -> list[int]:
    """The subset sizes each estimator is logged at: 1, 2, 4, ... below k, and k."""
    return sorted({2**i for i in range(k.bit_length()) if 2**i < k} | {k})


def sample_metrics(
    correct: np.ndarray,
    rewards: np.ndarray,
    votes: Sequence[Sequence[str | None]],
    lengths: np.ndarray,
    truncated: np.ndarray,
) -> dict[str, float]:
    """mean@k, pass@j, maj@j, best@j (j in `sub_ks(k)`), the mean reward, length and truncation rate of
    [problems, k] samples (`votes`: per problem, each sample's `vote_key`)."""
    problems, k = correct.shape
    if rewards.shape != correct.shape or len(votes) != problems:
        raise ValueError(
            f"sample_metrics: correct {correct.shape}, rewards {rewards.shape}, votes {len(votes)}"
        )
    out = {f"mean@{k}": float(correct.mean()), "reward_mean": float(rewards.mean())}
    counts = (np.asarray(correct, np.float64) >= 1.0).sum(axis=1)  # full credit
    for j in sub_ks(k):
        out[f"pass@{j}"] = float(np.mean([pass_at_k(k, int(c), j) for c in counts]))
        out[f"maj@{j}"] = float(np.mean([maj_at_k(v, c, j) for v, c in zip(votes, correct, strict=True)]))
        out[f"best@{j}"] = float(np.mean([best_at_k(r, j) for r in rewards]))
    out["length_mean"] = float(np.mean(lengths))
    out["clip_frac"] = float(np.mean(truncated))
    return out


def _generation_seconds(stats: RolloutStats) -> float:
    """Wall seconds of a rollout less the compilation inside it (a first evaluation compiles)."""
    return stats.wall_seconds - stats.phase_seconds.get("compile", 0.0)


@dataclasses.dataclass
class SpeedTally:
    """The decode of one evaluation's rollouts (`add` each as it comes: the rollouts themselves, with their
    tokens and hidden states, are dropped after scoring) and its metrics.

    `metrics()`: `decode_seconds` (device chunks), `sd_share` (of them in speculative chunks), `accept_len`
    (tokens per row per verify round, when SD ran), `tok_per_s` (response tokens per second of generation,
    compilation excluded), `compile_seconds`. With the paired plain pass (the same prompts and keys decoded
    with `FixedMode("plain")`): `plain_seconds`, `sd_speedup` = plain's generation seconds / SD's,
    `sd_decode_speedup` = the same of decode chunks only, `plain_match` = the share of responses identical
    token for token (1.0 in float32 with coupled acceptance)."""

    sd: list[RolloutStats] = dataclasses.field(default_factory=list)
    plain: list[RolloutStats] = dataclasses.field(default_factory=list)
    tokens: int = 0
    same: list[np.ndarray] = dataclasses.field(default_factory=list)

    def add(self, sd: Rollout, plain: Rollout | None) -> None:
        self.sd.append(sd.stats)
        self.tokens += int(sd.lengths.sum())
        if plain is not None:
            self.plain.append(plain.stats)
            # tokens are [rows, max_new_tokens], zero-padded: equal rows are equal responses
            self.same.append((sd.tokens == plain.tokens).all(axis=1) & (sd.lengths == plain.lengths))

    def metrics(self) -> dict[str, float]:
        chunks = [c for s in self.sd for c in s.chunks]
        decode = sum(c.seconds for c in chunks)
        spec = [c for c in chunks if c.mode != "plain"]
        rounds = sum(c.verify_rounds for c in spec)
        seconds = sum(_generation_seconds(s) for s in self.sd)
        out = {
            "decode_seconds": decode,
            "sd_share": sum(c.seconds for c in spec) / max(decode, 1e-9),
            "tok_per_s": self.tokens / max(seconds, 1e-9),
            "compile_seconds": sum(s.phase_seconds.get("compile", 0.0) for s in self.sd),
        }
        if rounds:
            out["accept_len"] = sum(c.accepted_tokens for c in spec) / rounds
        if self.plain:
            out["plain_seconds"] = sum(_generation_seconds(s) for s in self.plain)
            out["sd_speedup"] = out["plain_seconds"] / max(seconds, 1e-9)
            out["sd_decode_speedup"] = sum(s.decode_seconds for s in self.plain) / max(decode, 1e-9)
            out["plain_match"] = float(np.concatenate(self.same).mean())
        return out
