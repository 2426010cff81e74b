"""The config sections of the GRPO job and those it shares with the warm-up (model, mesh), each a
frozen dataclass: its fields are the section's keys, their defaults THE defaults, `problems()` its checks
(run when it is built). `tlt_jax.config_schema` registers them with the warm-up's sections and parses
configs into them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import ClassVar

from tlt_jax.models.build import DTYPES
from tlt_jax.models.eagle3 import DRAFTER_ARCHS
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.programs import MATMUL_PRECISIONS
from tlt_jax.rollout.record import HIDDEN_SPANS
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.strategy import SpecConfig
from tlt_jax.utils.config_checks import STR, Section
from tlt_jax.utils.watchdog import DEFAULT_LIMITS as WATCHDOG_LIMITS
from tlt_jax.utils.watchdog import limit_problems

JOBS = ("grpo", "drafter_warmup")
DRAFTER_KINDS = ("none", "ngram", "history", "eagle", "auto")
LR_SCHEDULES = ("constant", "cosine", "linear")  # after the warm-up (tlt_jax.rl.schedules)
# what DAPO's dynamic sampling compares within a group (VeRL's algorithm.filter_groups.metric)
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
LOSS_AGG_SCOPES = ("mini_batch", "micro_batch")  # rl.loss_agg_scope (tlt_jax.rl.batch.micro_weights)


@dataclasses.dataclass(frozen=True)
class RunSection(Section):
    """The GRPO job's top-level keys: what runs, for how long, how often it saves and reports."""

    job: str = "grpo"
    seed: int = 0
    multiprocess: bool = False  # jax.distributed.initialize() before anything touches a device
    num_steps: int = 10
    checkpoint_every: int = 5  # save every k steps (and at the end / on a stop between steps); 0: only then
    keep_checkpoints: int = 2
    # the policy and the drafter as HF directories every k steps and at the last (0: off), kept whatever
    # keep_checkpoints removes: W/exports/step_<k>/{policy, drafter, drafter_vllm} (tlt_jax/rl/exports.py)
    export_every: int = 0
    log_every: int = 1  # console summary line every k steps (metrics.jsonl gets every step)
    progress_bar: bool = True  # tqdm rollout bar (shown only on a TTY)
    log_samples: int = 2  # responses per step written to workdir/samples.jsonl (the first to the console)
    # persistent XLA compilation cache: "auto" = $TLT_JAX_COMPILATION_CACHE, else ~/.cache/tlt_jax/xla (shared
    # by the runs on a machine: a rerun of a config compiles nothing); a folder; or "" (off)
    compilation_cache_dir: str = "auto"
    # a stop request (SIGTERM/SIGINT to any process) ends every process within this many seconds: agreed at
    # the next rollout chunk, update part or phase boundary, or between steps; past it a process exits by
    # itself (status 75). Must cover a chunk, an update part and a checkpoint write's whole asynchronous
    # write (docs/usage.md, "Stopping"; SLURM: --signal=B:TERM@<this + 60>, B: the batch shell, which passes
    # it to the tasks: configs/cluster/slurm_grpo.sh); an evaluation's chunks are agreement points too
    stop_within: float = 150.0
    # seconds without progress before a process exits (status 70) naming its phase, per phase kind (0: off)
    watchdog: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(WATCHDOG_LIMITS))

    def problems(self) -> list[str]:
        out = limit_problems(self.watchdog)
        if self.stop_within <= 0:
            out.append(f"config.stop_within={self.stop_within}: must be > 0 seconds.")
        if self.job not in JOBS:
            out.append(f"config.job={self.job!r}: use one of {JOBS}.")
        if self.num_steps < 1:
            out.append(f"config.num_steps={self.num_steps}: must be >= 1.")
        if self.checkpoint_every < 0:
            out.append(
                f"config.checkpoint_every={self.checkpoint_every}: must be >= 0 (0 = only at the end)."
            )
        if self.keep_checkpoints < 1:
            out.append(f"config.keep_checkpoints={self.keep_checkpoints}: must be >= 1.")
        if self.export_every < 0:
            out.append(f"config.export_every={self.export_every}: must be >= 0 (0 = no periodic export).")
        return out


@dataclasses.dataclass(frozen=True)
class ModelSection(Section):
    """`config.model`: what to load (a checkpoint, a tiny random architecture or a named one), in which dtype,
    with which projection kernels. Checked by `models.build.model_problems` (it knows the sources)."""

    path: str | None = dataclasses.field(default=None, metadata=STR)  # a .gguf file or a HF model directory
    random: Mapping[str, object] = dataclasses.field(default_factory=dict)  # OR ModelConfig fields
    # OR a named architecture (tlt_jax.models.presets): with `path` it checks the checkpoint's shapes; with
    # init="random" it is built with random weights born sharded, and no tokenizer (timing and memory only)
    arch: str = ""
    init: str = "auto"  # "auto" | "checkpoint" (weights from `path`) | "random"
    dtype: str = "float32"  # "bfloat16" on GPUs (this CPU has no bf16 instructions: use float32)
    linear_impl: str = "auto"  # projections: "auto" (CPU small-M kernel on one CPU device, else XLA) | ...


@dataclasses.dataclass(frozen=True)
class MeshSection(Section):
    """`config.mesh`: the (data, model) device mesh; data=-1 takes all remaining devices."""

    data: int = -1
    model: int = 1

    def problems(self) -> list[str]:
        if self.model < 1 or (self.data < 1 and self.data != -1):
            return [
                f"config.mesh data={self.data}, model={self.model}: need model >= 1 and data >= 1 (or -1 for "
                "all remaining devices)."
            ]
        return []


@dataclasses.dataclass(frozen=True)
class RolloutSection(Section):
    """`config.rollout`: the engine (lengths, buckets, chunking, kernels, stop strings, recorded hidden
    states) and the sampling; `engine_config` and `sampling` are the typed objects it becomes."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    max_cache_len: int = 1024
    chunk_steps: int = 16
    min_cache_bucket: int = 64
    prompt_bucket: int = 16
    compact: bool = True
    # continuous batching: at most this many rows decode at once per data shard (a power of two; the rest
    # wait in a queue and are inserted into slots as rows finish); 0: chosen from kv_budget_gib, and with
    # that 0 too, every row of the step runs at once
    max_running_rows: int = 0
    kv_budget_gib: float = 0.0  # per-device KV-cache budget that picks max_running_rows (0: no budget)
    attn_impl: str = "auto"  # Pallas on GPU, Mosaic on TPU, the CPU FFI kernel on one CPU device, else jnp
    # dots in the rollout programs: "auto" = full float32 for float32 models whatever the process default
    # (lossless coupled verification on GPUs, whose default is TF32), the process default for bfloat16
    matmul_precision: str = "auto"
    stop_strings: tuple[str, ...] = ()
    # the target's hidden states of the prompt and `hidden_window` response tokens of every sequence
    # (drafter training data; recorded whenever the spot trainer runs). The spot trainer trains on one
    # spot.window-token window per sequence at a random depth of this span (spot.window <= hidden_window);
    # memory: running rows x min(hidden_window, max_new_tokens) x hidden size x dtype per device (replicated
    # over the model axis; rollout_memory_plan.hidden_line; counted in the kv_budget_gib cap), and on the
    # host one harvest's rows at a time (they stream to the spot trainer, no rollout keeps them).
    # hidden_span: which tokens of a response: "first" (0..W-1), "random" (W at a per-row random depth of the
    # response, from the row's key: long responses are recorded at every depth) or "last" (its last W)
    record_hidden: bool = False
    hidden_window: int = 512
    hidden_span: str = "first"

    def problems(self) -> list[str]:
        out = []
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            out.append(
                f"config.rollout.top_p={self.top_p} / top_k={self.top_k}: need 0 < top_p <= 1, top_k >= 0."
            )
        if self.max_new_tokens < 1 or self.max_cache_len <= self.max_new_tokens:
            out.append(
                f"config.rollout.max_new_tokens={self.max_new_tokens} / max_cache_len={self.max_cache_len}: "
                "need max_new_tokens >= 1 and max_cache_len > max_new_tokens + the longest prompt."
            )
        if self.matmul_precision not in MATMUL_PRECISIONS:
            out.append(
                f"config.rollout.matmul_precision={self.matmul_precision!r}: use one of {MATMUL_PRECISIONS} "
                "(auto: full float32 dots for float32 models, the process default for bfloat16)."
            )
        r = self.max_running_rows
        if r < 0 or (r & (r - 1)) or self.kv_budget_gib < 0:
            out.append(
                f"config.rollout.max_running_rows={r} / kv_budget_gib={self.kv_budget_gib}: need a power of "
                "two (or 0: from the budget) and a budget >= 0 GiB (0: none)."
            )
        for key, need in (("chunk_steps", " (decode steps per device call)"), ("min_cache_bucket", ""),
                          ("prompt_bucket", ""), ("hidden_window", "")):  # fmt: skip
            if getattr(self, key) < 1:
                out.append(f"config.rollout.{key}={getattr(self, key)!r}: must be >= 1{need}.")
        if self.hidden_span not in HIDDEN_SPANS:
            out.append(f"config.rollout.hidden_span={self.hidden_span!r}: use one of {list(HIDDEN_SPANS)}.")
        return out

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def engine_config(self, spec: SpecConfig, record_hidden: bool = False) -> EngineConfig:
        """The engine's settings with `spec`; hidden states recorded when asked here or by the section."""
        return EngineConfig(
            max_new_tokens=self.max_new_tokens,
            max_cache_len=self.max_cache_len,
            chunk_steps=self.chunk_steps,
            min_cache_bucket=self.min_cache_bucket,
            prompt_bucket=self.prompt_bucket,
            compact=self.compact,
            max_running_rows=self.max_running_rows,
            kv_budget_gib=self.kv_budget_gib,
            attn_impl=self.attn_impl,
            matmul_precision=self.matmul_precision,
            stop_strings=tuple(self.stop_strings),
            spec=spec,
            record_hidden=self.record_hidden or record_hidden,
            hidden_window=self.hidden_window,
            hidden_span=self.hidden_span,
            keep_hidden=False,  # a run's states stream to the spot trainer; nothing reads Rollout.hidden
        )


@dataclasses.dataclass(frozen=True)
class DrafterSection(Section):
    """`config.drafter`, what drafts for speculative rollouts (tlt_jax.rl.speculation): "none" (plain),
    "ngram" (model-free, TLT-Base), "history" (model-free, over each prompt's earlier responses:
    tlt_jax.rollout.history; config.spec.history_*), "eagle" (a warmed drafter: `path`, a warm-up workdir,
    or `init_from`, an EAGLE export), "auto" (eagle when `path` holds one, else ngram). min_accept_len: the
    alarm's floor. arch: the learned drafter's architecture, "eagle" (EAGLE-1) or "eagle3"
    (tlt_jax.models.eagle3: the target's states at `aux_layers`, capture points in [0, L]; empty: EAGLE-3's
    (2, L // 2, L - 3)) for a drafter the spot trainer starts; a warmed one must be of this arch."""

    kind: str = "none"
    path: str = ""
    init_from: str = ""
    min_accept_len: float = 1.05
    arch: str = "eagle"
    aux_layers: tuple[int, ...] = ()

    def problems(self) -> list[str]:
        out = []
        if self.kind not in DRAFTER_KINDS:
            out.append(f"config.drafter.kind={self.kind!r}: use one of {DRAFTER_KINDS}.")
        if self.kind == "eagle" and not self.path and not self.init_from:
            out.append(
                "config.drafter.kind=eagle needs config.drafter.path: a drafter warm-up workdir (create one "
                "with `python -m tlt_jax.main --config configs/drafter_warmup.py:tlt --workdir DIR`)."
            )
        if self.min_accept_len < 0:
            out.append(f"config.drafter.min_accept_len={self.min_accept_len}: must be >= 0 (0 disables it).")
        if self.arch not in DRAFTER_ARCHS:
            out.append(f"config.drafter.arch={self.arch!r}: use one of {DRAFTER_ARCHS}.")
        if self.aux_layers and self.arch != "eagle3":
            out.append("config.drafter.aux_layers: only an EAGLE-3 drafter reads them (drafter.arch=eagle3).")
        return out

    def path_problems(self) -> list[str]:
        """The filesystem's half: the drafter directories exist."""
        out = []
        if self.kind == "eagle" and self.path and not os.path.exists(self.path):
            out.append(
                f"config.drafter.path={self.path!r} does not exist: create it with `python -m tlt_jax.main "
                f"--config configs/drafter_warmup.py:tlt --workdir {self.path}`, or use drafter.kind=ngram."
            )
        return out


# a benchmark set's own sampling keys (config.eval.sets.<name>.<key>); its other keys are task keys
SET_SAMPLING_KEYS = ("samples", "temperature", "top_p", "top_k", "max_new_tokens", "max_prompts")
FLOAT = {"placeholder": float}  # a None default the command line can set to a float
INT = {"placeholder": int}


@dataclasses.dataclass(frozen=True)
class EvalConfig(Section):
    """`config.eval` (tlt_jax.rl.evaluation): before training (`before_train`), every `every` steps and
    after the last (0 = off). The held-out split: the training task's last `prompts` problems of its first
    epoch (never trained on, in any epoch; 0 = no split), the same sampling keys every time (a paired
    measure of learning). `sets`: benchmark files, name -> a path, or {path, and any of SET_SAMPLING_KEYS
    and task keys (layout, answer_key, reward, prompt, ...)}, scored as mean@k / pass@k / maj@k / best@k.
    The sampling of every evaluation (VeRL's val_kwargs; a set's own keys override it): `samples` per
    problem, `temperature` (0: greedy), `top_p`, `top_k` (0: off), None = the rollout's. `plain_baseline`:
    decode each evaluation a second time without speculation, same keys, for its measured SD speed-up
    (doubles the eval's cost)."""

    every: int = 0  # VeRL trainer.test_freq
    before_train: bool = True  # VeRL trainer.val_before_train
    prompts: int = 16
    samples: int = 2  # VeRL val_kwargs.n
    temperature: float | None = dataclasses.field(default=None, metadata=FLOAT)
    top_p: float | None = dataclasses.field(default=None, metadata=FLOAT)
    top_k: int | None = dataclasses.field(default=None, metadata=INT)
    plain_baseline: bool = False
    sets: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def problems(self) -> list[str]:
        out = []
        if self.every < 0 or self.prompts < 0 or self.samples < 1:
            out.append(
                f"config.eval every={self.every}, prompts={self.prompts}, samples={self.samples}: need "
                "every >= 0 (0 = off), prompts >= 0 (0 = no held-out split) and samples >= 1."
            )
        try:
            SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=self.top_k or 0,
                top_p=1.0 if self.top_p is None else self.top_p,
            )
        except ValueError as e:
            out.append(
                f"config.eval temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}: {e} "
                "(None: the rollout's)."
            )
        return out

    def due(self, step: int, num_steps: int) -> bool:
        """Whether to evaluate after `step` completed steps (0: before training, when `before_train`)."""
        if step == 0:
            return self.every > 0 and self.before_train
        return self.every > 0 and (step % self.every == 0 or step == num_steps)


@dataclasses.dataclass(frozen=True)
class RLSection(Section):
    """`config.rl`: the GRPO algorithm (group size, advantages, loss aggregation, clipping, KL, overlong
    shaping) and the optimizer (AdamW, warm-up and schedule, clipping). The names of advantages and
    aggregations are checked by the GRPO job (`rl.config`, which owns them)."""

    RANGES: ClassVar[tuple[tuple[str, float, str], ...]] = (  # key, lower bound, the range in words
        ("prompts_per_step", 1, ">= 1"),
        ("warmup_steps", 0, ">= 0 (optimizer updates)"),
        ("weight_decay", 0, ">= 0"),
        ("grad_clip", 0, ">= 0 (0 disables clipping)"),
        ("kl_coef", 0, ">= 0 (0 disables the KL term)"),
        ("adv_eps", 0, ">= 0"),
        ("decay_steps", 0, ">= 0 (0 = the run's optimizer updates)"),
        ("overlong_buffer", 0, ">= 0 (0 = no overlong shaping)"),
        ("overlong_penalty", 0, ">= 0"),
        ("max_num_gen_batches", 0, ">= 0 (0 = no limit)"),
        ("gen_prompts_per_batch", 0, ">= 0 (0 = prompts_per_step)"),
        ("entropy_coeff", 0, ">= 0 (0 = no entropy term; a bonus for entropy, as VeRL's)"),
        ("reward_kl_coef", 0, ">= 0 (0 = no KL in the reward)"),
        ("reward_kl_horizon", 1, ">= 1 (the adaptive controller's horizon, in rows)"),
        ("ppo_epochs", 1, ">= 1"),
    )

    prompts_per_step: int = 8
    samples_per_prompt: int = 8  # GRPO group size
    advantage: str = "grpo"  # grpo | drgrpo (tlt_jax.rl.grpo.ADVANTAGE_METHODS)
    adv_eps: float = 1e-6
    # token_mean (DAPO) | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm (rl.grpo)
    loss_agg: str = "seq_mean_token_mean"
    # the aggregation's counts: the mini-batch's (every token / sequence of an optimizer step weighs the same,
    # VeRL 0.9.1's workers) | micro_batch (each micro-batch's own aggregate, averaged over micro-batches:
    # VeRL's legacy dp_actor; micro-batches are length-sorted here, so their token counts differ)
    loss_agg_scope: str = "mini_batch"
    clip_low: float = 0.2
    clip_high: float = 0.2  # DAPO clip-higher: 0.28
    # DAPO's dynamic sampling (tlt_jax.rl.dynamic_sampling): groups whose `filter_metric` is the same for
    # every sample are dropped and more prompts generated (batches of `gen_prompts_per_batch`, 0 = the step's
    # prompts) until the step has `prompts_per_step` groups, or `max_num_gen_batches` batches ran (0: no
    # limit; then the step trains on what it has, the rest of its rows masked out)
    dynamic_sampling: bool = False
    filter_metric: str = "acc"  # acc (the verifier's verdict) | score | seq_reward | seq_final_reward
    max_num_gen_batches: int = 10
    # at max_num_gen_batches with too few groups kept: stop with VeRL's error (False), or train on the groups
    # kept, the missing ones masked out of the loss (True; dynamic_sampling/short_groups counts them)
    train_short_steps: bool = False
    gen_prompts_per_batch: int = 0
    kl_coef: float = 0.0  # KL loss (kl_loss_type) to the frozen initial policy; 0 skips the reference forward
    mini_batches: int = 1  # optimizer updates per RL step (PPO mini-batches over the step's samples)
    # the loss options of VeRL's actor (tlt_jax.rl.losses; README "Optimisation options beside VeRL's names")
    kl_loss_type: str = "low_var_kl"  # kl (k1) | abs | mse (k2) | low_var_kl (k3): rl.grpo.KL_ESTIMATORS
    clip_ratio_c: float = 0.0  # dual-clip PPO's bound for negative advantages (> 1, VeRL's 3.0; 0 = off)
    entropy_coeff: float = 0.0  # the loss subtracts entropy_coeff x the aggregated entropy (0 = off)
    adv_std: str = "population"  # the std GRPO divides by: population | unbiased (VeRL's torch.std)
    ppo_epochs: int = 1  # passes over the step's mini-batches (> 1: old log-probs are computed, not fused)
    mini_batch_shuffle: bool = False  # regroup the step's groups into mini-batches at random every epoch
    # truncated importance sampling against the rollout engine's log-probs: none | token | sequence, weights
    # min(pi_old / pi_rollout, rollout_is_threshold) on each token's loss (VeRL's rollout_correction)
    rollout_is: str = "none"
    rollout_is_threshold: float = 2.0
    # KL in the reward (VeRL's use_kl_in_reward): score - reward_kl_coef x sum of the reward_kl_penalty
    # estimate of KL(old || ref) over the response (tlt_jax.rl.kl_reward); controller fixed | adaptive
    reward_kl_coef: float = 0.0
    reward_kl_penalty: str = "kl"
    reward_kl_ctrl: str = "fixed"
    reward_kl_target: float = 0.1  # the adaptive controller's target KL
    reward_kl_horizon: int = 10000
    lr: float = 1e-6
    warmup_steps: int = 0  # linear warm-up in optimizer updates
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    # after the warm-up: constant | cosine | linear decay to lr * min_lr_ratio at update decay_steps
    # (0: the run's updates, num_steps * mini_batches); see tlt_jax.rl.schedules
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    decay_steps: int = 0
    # DAPO's soft overlong punishment over the last `overlong_buffer` tokens before rollout.max_new_tokens,
    # down to -overlong_penalty at the cap (tlt_jax.rl.reward.OverlongShaping); 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def problems(self) -> list[str]:
        out = [
            f"config.rl.{key}={getattr(self, key)!r}: must be {need}."
            for key, low, need in self.RANGES
            if getattr(self, key) < low
        ]
        if self.lr_schedule not in LR_SCHEDULES:
            out.append(f"config.rl.lr_schedule={self.lr_schedule!r}: use one of {LR_SCHEDULES}.")
        if not 0 <= self.min_lr_ratio <= 1:
            out.append(f"config.rl.min_lr_ratio={self.min_lr_ratio!r}: must be in [0, 1].")
        if self.lr <= 0:
            out.append(f"config.rl.lr={self.lr!r}: must be > 0 (the paper uses 1e-6).")
        out += [
            f"config.rl.{k}={getattr(self, k)!r}: must be in [0, 1)."
            for k in ("b1", "b2")
            if not 0 <= getattr(self, k) < 1
        ]
        if self.clip_low < 0 or self.clip_high < 0 or self.clip_low >= 1:
            out.append(
                f"config.rl.clip_low={self.clip_low} / clip_high={self.clip_high}: need 0 <= clip_low < 1, "
                "clip_high >= 0."
            )
        if self.samples_per_prompt < 2:
            out.append(
                f"config.rl.samples_per_prompt={self.samples_per_prompt}: GRPO compares samples within a "
                "group, use >= 2 (the paper uses 8)."
            )
        if self.filter_metric not in FILTER_METRICS:
            out.append(f"config.rl.filter_metric={self.filter_metric!r}: use one of {FILTER_METRICS}.")
        if self.loss_agg_scope not in LOSS_AGG_SCOPES:
            out.append(f"config.rl.loss_agg_scope={self.loss_agg_scope!r}: use one of {LOSS_AGG_SCOPES}.")
        if self.dynamic_sampling and self.filter_metric == "seq_final_reward" and self.reward_kl_coef > 0:
            out.append(
                "config.rl.filter_metric='seq_final_reward' with KL in the reward (reward_kl_coef > 0) would "
                "need the reference pass over every generation batch, dropped groups included: filter on "
                "'acc' or 'score' (the reward before the KL penalty)."
            )
        gen = self.gen_prompts_per_batch
        if gen and (gen < self.prompts_per_step or not self.dynamic_sampling):
            out.append(
                f"config.rl.gen_prompts_per_batch={gen}: generation batches larger than the step's "
                f"prompts_per_step={self.prompts_per_step} need config.rl.dynamic_sampling=True (they "
                "feed its filter); use 0 (= prompts_per_step) or a value >= prompts_per_step."
            )
        return out


@dataclasses.dataclass(frozen=True)
class TrainerSection(Section):
    """`config.trainer`: shapes and batching of the learner's forward and backward, and what it trains."""

    micro_batch_size: int = 8  # rows per forward/backward (gradient accumulation over micro-batches)
    seq_bucket: int = 32  # prompt/response lengths are padded to multiples of this (fewer compiles)
    fuse_old_logprobs: bool = True  # with one mini-batch, take old log-probs from the update's forward
    logits_chunk: int = 0  # response logits in chunks of this many positions, any length (0: at once)
    master_dtype: str = "float32"  # optimizer/master weights (the model computes in model.dtype)
    fsdp: bool = False  # also shard the trainer's params/optimizer state over the data axis (ZeRO-3-like)
    train_layers: int = 0  # 0: train every parameter; K: only the top K decoder layers + final norm
    # causal attention of the trainer's forward (tlt_jax.kernels.flash_attention): auto (cuDNN on GPU, Pallas
    # on TPU, else blockwise) | blockwise (jnp, O(T x block) memory) | reference (masked softmax) | cudnn |
    # pallas_tpu. The rollout's attention is rollout.attn_impl.
    attn_impl: str = "auto"
    # per-layer rematerialisation in the update's backward pass: none | nothing_saveable | dots_saveable |
    # dots_with_no_batch_dims_saveable (jax.checkpoint_policies: what a layer keeps; the rest is recomputed)
    remat: str = "none"
    # the update's layers as one lax.scan, the trainer storing them stacked (one [L, ...] array per weight
    # in masters, AdamW moments and checkpoints: compile time flat in depth; per-layer remat then holds on
    # XLA:CPU too): the paper configs' (config_lib.paper_grpo). Trains every layer (train_layers must be 0).
    # Off by default: the CPU configs train only their top layers (train_layers), which the unrolled stack
    # does without the frozen layers' backward. The rollout's stack is always unrolled.
    scan_layers: bool = False
    # the update's MLP in token chunks of this size (long responses: no [rows, T, 2F] buffers; 0: at once)
    mlp_chunk: int = 0
    # sequence (context) parallelism of the update: each micro-batch's tokens split over the mesh's model axis
    # (its TP devices, as the paper's Ulysses SP 4), the layers' weights gathered whole, K/V all-gathered for
    # attention (tlt_jax.rl.trainer.SEQ_AXIS); off: tensor parallelism over that axis, as before
    seq_parallel: bool = False

    def problems(self) -> list[str]:
        from tlt_jax.models.llama import CAUSAL_IMPLS, REMAT_POLICIES

        out = []
        if self.attn_impl not in CAUSAL_IMPLS:
            out.append(f"config.trainer.attn_impl={self.attn_impl!r}: use one of {CAUSAL_IMPLS}.")
        if self.remat not in REMAT_POLICIES:
            out.append(f"config.trainer.remat={self.remat!r}: use one of {REMAT_POLICIES}.")
        if self.master_dtype not in DTYPES:
            out.append(f"config.trainer.master_dtype={self.master_dtype!r}: use one of {DTYPES}.")
        if self.train_layers < 0:
            out.append(f"config.trainer.train_layers={self.train_layers}: must be >= 0 (0 = all parameters).")
        if self.train_layers and self.scan_layers:
            out.append(
                f"config.trainer.train_layers={self.train_layers} with config.trainer.scan_layers=True: the "
                "scanned trainer stores every layer's weights as one stacked array and trains them all; set "
                "train_layers=0, or scan_layers=False to train only the top layers."
            )
        if self.logits_chunk < 0:
            out.append(f"config.trainer.logits_chunk={self.logits_chunk}: must be >= 0 (0 = no chunking).")
        if self.mlp_chunk < 0:
            out.append(f"config.trainer.mlp_chunk={self.mlp_chunk}: must be >= 0 (0 = no chunking).")
        if self.seq_bucket < 1:
            out.append(f"config.trainer.seq_bucket={self.seq_bucket}: must be >= 1.")
        return out


@dataclasses.dataclass(frozen=True)
class WandbSection(Section):
    """`config.wandb`: mode None = $WANDB_MODE, else offline."""

    mode: str | None = dataclasses.field(default=None, metadata=STR)
    project: str = "tlt_jax"
    name: str | None = dataclasses.field(default=None, metadata=STR)
