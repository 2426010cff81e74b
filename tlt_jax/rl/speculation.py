"""What drafts for the RL rollouts and how its speculation is watched (the `drafter` config section).

    drafter.kind = "none"   plain decoding (the baseline)
                   "ngram"  the model-free n-gram drafter over the prompt and sibling responses (TLT-Base)
                   "history" the model-free drafter over each prompt's earlier responses (earlier epochs'
                            and the group's finished siblings': tlt_jax.rollout.history), kept in the
                            checkpoint
                   "eagle"  a learned EAGLE drafter from `drafter.path` (a warm-up workdir or its drafter/)
                   "auto"   "eagle" when `drafter.path` holds a drafter, else "ngram" (TLT's order: the
                            model-free drafter until a learned one is ready), saying how to warm one up
    drafter.init_from       (kind eagle/auto) an EAGLE-1 drafter directory instead of `path`: our export or a
                            published one (config.json + model.safetensors; tlt_jax.drafter.eagle_format)

`resolve_drafter` turns the section into a drafter model (checked against the policy: hidden size,
vocabulary, layer layout) and its reduced draft vocabulary. `RolloutMonitor` is a rollout hook that turns a
rollout's chunks into the per-step metrics of speculation and raises the acceptance-collapse alarm: a broken
drafter push silently drops acceptance to ~1.0 in other RL stacks; here it is a warning and a metric.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import numpy as np
from absl import logging

from tlt_jax.config_sections import DrafterSection
from tlt_jax.drafter.eagle3_format import is_eagle3_dir, load_eagle3_drafter
from tlt_jax.drafter.eagle_format import WEIGHTS_FILE, load_eagle_drafter
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.rollout.history import HistoryStore
from tlt_jax.rollout.hooks import ChunkView, RolloutHooks, RolloutInfo
from tlt_jax.rollout.types import ChunkRecord
from tlt_jax.utils.tracking import interpreter

# the hint runs in the same venv as this process (`.venv/bin/python` under `make run`)
WARMUP_COMMAND = interpreter() + " -m tlt_jax.main --config configs/drafter_warmup.py:tlt --workdir {path}"
# the policy/drafter fields that must agree for the drafter's weights to fit the policy
COMPAT_FIELDS = (
    "architecture",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
)


@dataclasses.dataclass(frozen=True)
class ResolvedDrafter:
    """The rollout drafter: its kind ("none" | "ngram" | "history" | "eagle"), the EAGLE model and draft
    vocabulary."""

    kind: str
    drafter: Drafter | None = None
    draft_vocab: np.ndarray | None = None
    path: str = ""
    note: str = ""


def drafter_dir(path: str | pathlib.Path) -> pathlib.Path:
    """A warm-up workdir's `drafter/` folder, or `path` itself when it is one."""
    p = pathlib.Path(path)
    return p / "drafter" if (p / "drafter").is_dir() else p


def has_drafter(path: str | pathlib.Path | None) -> bool:
    """Whether `path` (a warm-up workdir or its drafter/ folder) holds a saved drafter checkpoint."""
    if not path:
        return False
    d = drafter_dir(path)
    return d.is_dir() and any(c.name.isdigit() for c in d.iterdir())


def _saved_target(path: pathlib.Path) -> dict[str, Any] | None:
    """The target config a drafter checkpoint was trained for (its checkpoint metadata), if recorded."""
    steps = sorted((c for c in path.iterdir() if c.name.isdigit()), key=lambda c: int(c.name))
    for meta in (steps[-1] / "meta" / "metadata", steps[-1] / "meta.json") if steps else ():
        if meta.is_file():
            try:
                return json.loads(meta.read_text()).get("target")
            except (json.JSONDecodeError, AttributeError):
                return None
    return None


def check_compatible(saved: dict[str, Any] | None, policy: ModelConfig, where: str) -> None:
    """Raise a clear error when a drafter saved for one target does not fit the policy."""
    if not saved:
        return
    diff = {f: (saved.get(f), getattr(policy, f)) for f in COMPAT_FIELDS if f in saved}
    diff = {f: v for f, v in diff.items() if v[0] != v[1]}
    if diff:
        shown = ", ".join(f"{f} {a} vs {b}" for f, (a, b) in diff.items())
        raise ValueError(
            f"the drafter in {where} does not fit the policy (drafter vs policy: {shown}). A drafter is "
            "trained for one target model: warm one up for this policy with "
            f"`{WARMUP_COMMAND.format(path='DIR')}` (same config.model), or set config.drafter.kind=ngram."
        )


def resolve_drafter(section: DrafterSection, policy: ModelConfig) -> ResolvedDrafter:
    """Build the rollout drafter of the `drafter` config section for a policy with config `policy`."""
    kind, path = section.kind, section.path
    init_from = section.init_from
    if init_from and kind in ("eagle", "auto"):
        load = load_eagle3_drafter if is_eagle3_dir(init_from) else load_eagle_drafter
        drafter, vocab = load(init_from, policy)
        return ResolvedDrafter("eagle", drafter, vocab, path=str(pathlib.Path(init_from) / WEIGHTS_FILE))
    if kind == "auto":
        if has_drafter(path):
            kind = "eagle"
        else:
            note = (
                f"no warmed EAGLE drafter in {path or '(config.drafter.path unset)'}: drafting with the "
                f"model-free n-gram drafter. Warm one up with `{WARMUP_COMMAND.format(path=path or 'DIR')}`."
            )
            return ResolvedDrafter("ngram", path=path, note=note)
    if kind in ("none", "ngram", "history"):
        return ResolvedDrafter(kind)
    if not path:
        raise ValueError(
            "config.drafter.kind=eagle needs config.drafter.path (a drafter warm-up workdir): create one "
            f"with `{WARMUP_COMMAND.format(path='DIR')}`."
        )
    if not has_drafter(path):
        raise FileNotFoundError(
            f"config.drafter.path={path!r} holds no drafter checkpoint: create it with "
            f"`{WARMUP_COMMAND.format(path=path)}`, or use config.drafter.kind=ngram."
        )
    from tlt_jax.drafter.draft_vocab import load_draft_vocab
    from tlt_jax.drafter.warmup import load_drafter

    d = drafter_dir(path)
    check_compatible(_saved_target(d), policy, str(d))
    drafter = load_drafter(d, policy)
    vocab = load_draft_vocab(d)
    if vocab is not None and (vocab.min() < 0 or vocab.max() >= policy.vocab_size):
        raise ValueError(
            f"the draft vocabulary in {d} has token ids up to {int(vocab.max())}, outside the policy's "
            f"vocabulary of {policy.vocab_size}: the drafter was warmed up for another tokenizer."
        )
    return ResolvedDrafter("eagle", drafter=drafter, draft_vocab=vocab, path=str(d))


def announced_drafter(section: DrafterSection, policy: ModelConfig, announce: bool) -> ResolvedDrafter:
    """`resolve_drafter`, its note (e.g. "auto" fell back to the n-gram drafter) logged once as a warning when
    `announce` (process 0): a run that drafts with another drafter than the one asked for says so up front."""
    resolved = resolve_drafter(section, policy)
    if resolved.note and announce:
        logging.warning("%s", resolved.note)
    return resolved


class RolloutMonitor(RolloutHooks):
    """Per-step speculation metrics and the acceptance-collapse alarm (a rollout hook). It keeps the chunks
    of every rollout since its metrics were last read: a step of several generation batches (DAPO's dynamic
    sampling) reports all of them.

    min_accept: the floor of a step's mean accept length (tokens per row per verify round); below it, once
    `min_rounds` row-rounds were verified, `collapsed` is set and a warning names the likely cause.
    """

    def __init__(self, min_accept: float, min_rounds: int = 16):
        self.min_accept, self.min_rounds = float(min_accept), int(min_rounds)
        self.records: list[ChunkRecord] = []
        self.collapsed = False
        self.history: HistoryStore | None = None  # the engine's history store, seen at a rollout's start

    def on_start(self, info: RolloutInfo) -> None:
        self.history = info.history

    def on_chunk(self, view: ChunkView) -> None:
        self.records.append(view.record)

    def metrics(self, step: int) -> dict[str, float]:
        """Metrics of the rollouts since the last call (then forgotten): speculation (accept length, per
        mode; the alarm, logged when acceptance collapsed) and decode speed per batch bucket for plain and SD
        chunks."""
        records, self.records, self.collapsed = self.records, [], False
        sd = [c for c in records if c.mode != "plain"]
        rounds = sum(c.verify_rounds for c in sd)
        out: dict[str, float] = {"spec/verify_rounds": float(rounds)}
        if rounds:
            accept = sum(c.accepted_tokens for c in sd) / rounds
            out["spec/accept_len"] = accept
            self.collapsed = rounds >= self.min_rounds and accept < self.min_accept
            if self.collapsed:
                logging.warning(
                    "step %d: speculative acceptance collapsed to %.3f tokens per round (floor %.2f over %d "
                    "row-rounds): the drafter no longer predicts the policy. Check the last drafter push "
                    "(weights, draft vocabulary, policy/drafter mismatch).",
                    step,
                    accept,
                    self.min_accept,
                    rounds,
                )
        out["spec/accept_collapse"] = float(self.collapsed)
        if self.history is not None:  # its size (the rollout's host memory for it) and its drafting counters
            out.update(self.history.metrics())
            st = self.history.take_stats()
            out["history/draft_seconds"] = st.draft_seconds
            out["history/match_len"] = st.match_tokens / max(st.rounds, 1)
            out["history/matched_frac"] = st.matched / max(st.rounds, 1)
            out["history/evicted"] = float(st.evicted)
        for name in sorted({c.mode for c in sd}):
            sel = [c for c in sd if c.mode == name]
            r = sum(c.verify_rounds for c in sel)
            out[f"spec/mode/{name}/accept_len"] = sum(c.accepted_tokens for c in sel) / max(r, 1)
            out[f"spec/mode/{name}/seconds"] = sum(c.seconds for c in sel)
        # speed per batch bucket, without chunks whose program compiled first (their clock starts after the
        # compilation, but a fresh program's first execution runs ~8% slower than its reruns, up to 56%)
        timed = [c for c in records if not c.compiled]
        out["rollout/compiled_chunk_seconds"] = sum(c.seconds for c in records if c.compiled)
        for bucket in sorted({c.batch_bucket for c in timed}):
            for tag, sel in (
                ("plain", [c for c in timed if c.mode == "plain"]),
                ("sd", [c for c in timed if c.mode != "plain"]),
            ):
                chunks = [c for c in sel if c.batch_bucket == bucket]
                if chunks:
                    secs = sum(c.seconds for c in chunks)
                    out[f"bucket/{bucket}/{tag}_seconds"] = secs
                    out[f"bucket/{bucket}/{tag}_tokens"] = float(sum(c.new_tokens for c in chunks))
        return out
