"""The drafter warm-up job's sections of the config schema (`tlt_jax.config_schema` registers them): the
top-level keys, `generation` (the target's own answers), `forward` (a packed target forward when hidden states
are not recorded), `train` (the drafter's offline training) and `drafter_eval` (held-out acceptance). The
defaults here are the warm-up's defaults; `configs/drafter_warmup.py` overrides them per argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import ml_collections as mlc

from tlt_jax.config_sections import MeshSection, ModelSection
from tlt_jax.models.eagle3 import DRAFTER_ARCHS
from tlt_jax.tasks.datasets import FILE_KINDS, TASK_KINDS, check_task_config
from tlt_jax.utils.config_checks import Section


def _at_least(section: str, obj: object, keys: tuple[str, ...], low: int = 1) -> list[str]:
    return [
        f"config.{section}.{k}={getattr(obj, k)!r}: must be >= {low}." for k in keys if getattr(obj, k) < low
    ]


@dataclasses.dataclass(frozen=True)
class WarmupRunSection(Section):
    """The warm-up job's top-level keys. draft_vocab_size: the drafter head's reduced vocabulary (the most
    frequent generated tokens, `tlt_jax.drafter.draft_vocab`; 0: the full vocabulary). arch: the drafter
    warmed up, "eagle" (EAGLE-1) or "eagle3" (its own head over that vocabulary, reading the target's states
    at `aux_layers`, capture points in [0, L]; empty: EAGLE-3's (2, L // 2, L - 3); an export SGLang and vLLM
    serve needs them in [1, L - 1]: `drafter.eagle3_format`). The data folder records which states it holds
    (`drafter.warmup_states`): a rerun with another arch or aux_layers fails at start."""

    job: str = "drafter_warmup"
    seed: int = 0
    multiprocess: bool = False
    compilation_cache_dir: str = "auto"  # the persistent XLA cache (utils.compile_stats.resolve_cache_dir)
    draft_vocab_size: int = 8192
    arch: str = "eagle"
    aux_layers: tuple[int, ...] = ()

    def problems(self) -> list[str]:
        out = _at_least("", self, ("draft_vocab_size",), 0)
        if self.arch not in DRAFTER_ARCHS:
            out.append(f"config.arch={self.arch!r}: use one of {DRAFTER_ARCHS}.")
        return out


@dataclasses.dataclass(frozen=True)
class GenerationSection(Section):
    """`config.generation`: the target answers `num_prompts` task prompts `n` times each (the data), in engine
    calls of `batch_prompts` prompts, at the RL sampling temperature (the drafter learns the RL distribution),
    up to `max_new_tokens` (the response cap of the RL run it serves). record_hidden: the features are the
    engine's own target states of the whole response, recorded as it generates (then cut to one window per
    sequence, `config.forward`); False: a packed target forward afterwards. kv_budget_gib / max_running_rows:
    continuous batching of an engine call's rows, as `config.rollout`'s (long responses: the KV cache of
    batch_prompts x n rows at 32K tokens does not fit one device; 0 / 0: every row at once)."""

    num_prompts: int = 128
    n: int = 4
    batch_prompts: int = 16
    max_new_tokens: int = 256
    temperature: float = 0.9
    top_p: float = 1.0
    max_cache_len: int = 1024
    chunk_steps: int = 16
    record_hidden: bool = True
    kv_budget_gib: float = 0.0
    max_running_rows: int = 0

    def problems(self) -> list[str]:
        keys = ("num_prompts", "n", "batch_prompts", "max_new_tokens", "chunk_steps")
        out = _at_least("generation", self, keys)
        r = self.max_running_rows
        if r < 0 or (r & (r - 1)) or self.kv_budget_gib < 0:
            out.append(
                f"config.generation.max_running_rows={r} / kv_budget_gib={self.kv_budget_gib}: need a power "
                "of two (or 0: from the budget) and a budget >= 0 GiB (0: every row at once)."
            )
        if self.max_cache_len <= self.max_new_tokens:
            out.append(
                f"config.generation.max_cache_len={self.max_cache_len}: must exceed max_new_tokens="
                f"{self.max_new_tokens} + the longest prompt."
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            out.append(
                f"config.generation temperature={self.temperature}, top_p={self.top_p}: need "
                "temperature >= 0 and 0 < top_p <= 1."
            )
        return out


@dataclasses.dataclass(frozen=True)
class ForwardSection(Section):
    """`config.forward`: the target forward for the hidden states when `generation.record_hidden=False`
    (sequences packed into [rows, seq_len] with a block mask), and the cut of every sample to `seq_len`
    tokens either way: a longer recorded sequence keeps ONE window of its response at a seeded uniformly
    random start (`warmup_data.cut_sample`, the spot trainer buffer's `window_sample`) with the `context`
    tokens before it (attention only, no loss), or its whole response and as much of the prompt as fits. The
    forward path truncates to the first seq_len tokens (it computes no states past them)."""

    rows: int = 4
    seq_len: int = 512
    context: int = 128
    hidden_dtype: str = "float16"  # cache / host storage of the features (packed as float32)

    def problems(self) -> list[str]:
        out = _at_least("forward", self, ("rows", "seq_len")) + _at_least("forward", self, ("context",), 0)
        if self.context >= self.seq_len:
            out.append(
                f"config.forward.context={self.context}: must be below seq_len={self.seq_len} (a window "
                "keeps seq_len - context response tokens)."
            )
        return out


@dataclasses.dataclass(frozen=True)
class WarmupTrainSection(Section):
    """`config.train`: the drafter's offline training (`drafter.trainer.DrafterTrainer`, packed rows).

    max_loss_tokens: the LM head is computed only at this many loss positions per step (-1: sized from the
    data, 0: all); ce_tokens: the soft CE on that many random loss positions (0: all). ttt_*: training-time
    test (EAGLE-3 / HASS), chain steps 2..ttt_steps + 1 on the drafter's own features. ce_draft_vocab: the
    soft CE over the draft vocabulary only (the head the engine drafts with). topk > 0: HASS's top-K
    distillation beside it (weight w_topk; `loss.LossConfig`)."""

    steps: int = 400
    lr: float = 1e-3
    warmup: int = 20
    schedule: str = "cosine"
    end_lr_ratio: float = 0.1
    rows: int = 4
    seq_len: int = 512
    w_feat: float = 1.0  # offline EAGLE warm-up weights (online RL training uses 0.5 / 0.5)
    w_ce: float = 0.1
    weight_decay: float = 0.0
    clip_norm: float = 0.5
    max_loss_tokens: int = -1
    ce_tokens: int = 384
    feature_noise: float = 0.0  # EAGLE's uniform noise on the input features (width; 0 = off)
    ttt_steps: int = 2
    ttt_positions: int = 64
    ttt_weight: float = 1.0
    topk: int = 0
    w_topk: float = 1.0
    ce_draft_vocab: bool = True
    b1: float = 0.9
    b2: float = 0.95
    log_every: int = 10
    checkpoint_every: int = 50

    def problems(self) -> list[str]:
        out = _at_least("train", self, ("steps", "rows", "seq_len", "log_every", "checkpoint_every"))
        out += _at_least("train", self, ("warmup", "ce_tokens", "ttt_steps", "topk"), 0)
        if self.lr <= 0:
            out.append(f"config.train.lr={self.lr}: must be > 0.")
        return out


@dataclasses.dataclass(frozen=True)
class DrafterEvalSection(Section):
    """`config.drafter_eval`: the drafter's acceptance on held-out data sampled like the training data (the
    same engine shapes: no extra compiles); drafts are checked against the target's argmax given the true
    prefix (temperature=0 makes the number exact for greedy SD). before: also the untrained drafter."""

    before: bool = False
    depth: int = 6
    num_prompts: int = 16
    n: int = 4
    temperature: float = 0.9
    rows: int = 4
    seq_len: int = 512

    def problems(self) -> list[str]:
        return _at_least("drafter_eval", self, ("depth", "num_prompts", "n", "rows", "seq_len"))


def warmup_task_problems(task: Mapping[str, object]) -> list[str]:
    """`config.task` for the warm-up: a known kind with its own keys, and a data file for the file kinds
    (the files themselves are read, and a bad row named, when the data phase builds the task)."""
    kind = task.get("kind")
    if kind in FILE_KINDS and not task.get("path"):
        return [
            f"config.task.path is empty: the {kind} task needs its file (--config.task.path=/data/x.{kind}, "
            "a glob or a comma list; or the config arg data=PATH)."
        ]
    try:
        check_task_config(task)
    except ValueError as e:
        return [f"config.task: {e} (kinds: {' | '.join(TASK_KINDS)})."]
    return []


def length_problems(forward: ForwardSection, train: WarmupTrainSection, ev: DrafterEvalSection) -> list[str]:
    """Samples are cut to `forward.seq_len` tokens; a training or held-out row shorter than that would cut
    them again, from the end (losing the window's last tokens silently)."""
    return [
        f"config.{key}={n}: below config.forward.seq_len={forward.seq_len}, the samples' length; set "
        f"{key} >= forward.seq_len (or lower forward.seq_len)."
        for key, n in (("train.seq_len", train.seq_len), ("drafter_eval.seq_len", ev.seq_len))
        if n < forward.seq_len
    ]


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
    """A drafter warm-up job's config, every section typed (`tlt_jax.config_schema.parse`); `raw` as given.
    Built only when the sections agree (`warmup_task_problems`, `length_problems`): one ValueError lists every
    problem otherwise."""

    raw: mlc.ConfigDict
    run: WarmupRunSection
    model: ModelSection
    mesh: MeshSection
    task: Mapping[str, object]
    generation: GenerationSection
    forward: ForwardSection
    train: WarmupTrainSection
    drafter_eval: DrafterEvalSection

    def __post_init__(self) -> None:
        problems = warmup_task_problems(self.task) + length_problems(
            self.forward, self.train, self.drafter_eval
        )
        if problems:
            raise ValueError("invalid config:\n  - " + "\n  - ".join(problems))
