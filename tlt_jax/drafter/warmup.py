"""Drafter warm-up: a first EAGLE drafter for a target model, trained on the target's own generations.

    python -m tlt_jax.main --config configs/drafter_warmup.py --workdir DIR

Phases (each resumable; a rerun with the same workdir skips what is done, and a rerun of a finished workdir
with a larger `train.steps` trains on from its last state, the schedule warm-restarted for the new length):
1. load the target (GGUF / HF dir, or a tiny random model) and its tokenizer;
2. data (`warmup_data.py`): the target answers task prompts with the RolloutEngine, recording the states
   the drafter reads; each engine batch is cached in `DIR/data/{train,eval}_NNN.npz` for a rerun. Held-out
   eval prompts come after the training prompts in the task's order (different problems), sampled like the
   training data (`eval.temperature=0`: exact greedy-SD numbers, compiling the greedy programs too);
3. acceptance length of the untrained drafter on the held-out data (`DIR/eval_before.json`);
4. training with packing (`trainer.DrafterTrainer`, the same trainer the spot trainer uses), logging to
   `DIR/metrics.jsonl`; the full train state (params, optimizer, step, key) is checkpointed in
   `DIR/train_state` every `train.checkpoint_every` steps;
5. acceptance after training; the drafter's trainable weights go to `DIR/drafter` (DrafterCheckpointer, step =
   train steps) and the numbers to `DIR/drafter_eval.json` (before/after, per-position rates, phase times).
`load_drafter(DIR or DIR/drafter, target_cfg)` restores the trained drafter for the benchmark and RL loop."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from tlt_jax.drafter.draft_vocab import build_from_warmup, load_draft_vocab
from tlt_jax.drafter.evaluate import AcceptanceEvaluator, AcceptanceResult
from tlt_jax.drafter.loss import LossConfig, make_eval_loss, normalize_metrics
from tlt_jax.drafter.packing import (
    DrafterSample,
    batch_plan,
    iterate_packed,
    loss_token_budget,
    pack_samples,
    to_device,
)
from tlt_jax.drafter.trainer import TRAIN_STATE_DIR, DrafterTrainer, TrainState, optimizer_from_config
from tlt_jax.drafter.warmup_config import WarmupConfig, WarmupTrainSection
from tlt_jax.drafter.warmup_data import PhaseTimes, build_data, write_json
from tlt_jax.models.build import TextCodec, build_model_and_tokenizer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.eagle3 import AnyDrafter, default_aux_layers, drafter_from_spec, drafter_spec
from tlt_jax.models.llama import Transformer, with_aux_layers
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.utils.checkpoint import Checkpointer, SaveInfo
from tlt_jax.utils.drafter_checkpoint import DrafterCheckpointer
from tlt_jax.utils.tracking import JsonlTracker

DRAFTER_DIR = "drafter"
DATA_DIR = "data"
EVAL_BEFORE_FILE = "eval_before.json"
RESULT_FILE = "drafter_eval.json"
PHASE_TIMES_FILE = "phase_times.json"


def _log(msg: str) -> None:
    print(f"[drafter_warmup {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- target ----------------------------------------------------------------------------------------------


def build_target(job: WarmupConfig) -> tuple[Transformer, TextCodec]:
    """The target model and tokenizer from `config.model` (path, or a tiny random architecture)."""
    return build_model_and_tokenizer(job.raw)


def target_weights(target: Transformer) -> tuple[jax.Array, jax.Array]:
    """The target's embedding [V, H] and LM head [V, H] (the same array for tied embeddings)."""
    return target.embed[...], target.head_weight()


# ---- drafter init / save / load --------------------------------------------------------------------------


def init_drafter(
    target: Transformer, seed: int, arch: str = "eagle", draft_vocab: np.ndarray | None = None
) -> AnyDrafter:
    """A new (randomly initialised, as in EAGLE) drafter for `target`. Measured on SmolLM2: copying the
    target's last decoder layer into it instead trains far worse (accept length 1.12 vs 1.55 after 100
    steps), since that layer expects the un-normalised residual stream, not fc(embedding, final feature).
    arch "eagle3": its head over `draft_vocab` (all tokens without it), reading `target.aux_layers`."""
    if arch == "eagle":
        return Drafter(target.cfg, nnx.Rngs(params=seed))
    spec = {"arch": arch, "aux_layers": list(target.aux_layers)}
    spec["draft_vocab_size"] = None if draft_vocab is None else len(draft_vocab)
    return drafter_from_spec(spec, target.cfg, nnx.Rngs(params=seed))


def drafter_params_dict(params: nnx.State) -> dict[str, Any]:
    """The drafter's nnx.Param state as a plain nested dict of arrays (what DrafterCheckpointer stores)."""
    return nnx.to_pure_dict(params)


def _drafter_dir(path: str | os.PathLike) -> pathlib.Path:
    p = pathlib.Path(path)
    return p / DRAFTER_DIR if (p / DRAFTER_DIR).is_dir() else p


def saved_drafter_spec(directory: pathlib.Path, step: int | None = None) -> dict[str, Any]:
    """The architecture a drafter checkpoint was saved with (its meta's "drafter": `drafter_spec`); EAGLE-1
    when the meta does not say (checkpoints from before EAGLE-3)."""
    steps = sorted((c for c in directory.iterdir() if c.name.isdigit()), key=lambda c: int(c.name))
    if step is not None:
        steps = [c for c in steps if int(c.name) == step]
    for meta in (steps[-1] / "meta" / "metadata", steps[-1] / "meta.json") if steps else ():
        if meta.is_file():
            try:
                return dict(json.loads(meta.read_text()).get("drafter") or {"arch": "eagle"})
            except (json.JSONDecodeError, AttributeError):
                break
    return {"arch": "eagle"}


def load_drafter(
    workdir_or_dir: str | os.PathLike, target_cfg: ModelConfig, step: int | None = None
) -> AnyDrafter:
    """Restore a warm-up (or RL) drafter: `workdir_or_dir` is the warm-up workdir or its `drafter/` folder.

    Builds the drafter its meta names (`drafter_spec`: EAGLE-1 or EAGLE-3 with its capture points and head
    size) for `target_cfg` and fills its trainable weights from the latest (or given) checkpoint step; a
    drafter saved for a different target architecture fails with a message naming the mismatched leaves.
    """
    directory = _drafter_dir(workdir_or_dir)
    spec = saved_drafter_spec(directory, step) if directory.is_dir() else {"arch": "eagle"}
    ckpt = DrafterCheckpointer(directory, async_save=False, own_head=spec["arch"] == "eagle3")
    try:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(
                f"no drafter checkpoint in {directory}: run the warm-up first "
                "(python -m tlt_jax.main --config configs/drafter_warmup.py --workdir DIR)."
            )
        drafter = drafter_from_spec(spec, target_cfg, nnx.Rngs(0))
        state = nnx.state(drafter, nnx.Param)
        restored = ckpt.restore(step, template=nnx.to_pure_dict(state))
    finally:
        ckpt.close()
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(drafter, state)
    return drafter


# ---- training --------------------------------------------------------------------------------------------


def loss_config(train_cfg: WarmupTrainSection, samples: Sequence[DrafterSample]) -> LossConfig:
    """The training loss from `config.train`, with its static loss-position budget sized from the data
    (`loss_token_budget`) and the CE subsample capped by that budget."""
    tc = train_cfg
    max_loss = loss_token_budget(samples, int(tc.seq_len), int(tc.rows), int(tc.max_loss_tokens))
    ce_tokens = int(tc.ce_tokens) if int(tc.ce_tokens) > 0 else None
    if ce_tokens is not None:
        ce_tokens = min(ce_tokens, max_loss or int(tc.rows) * int(tc.seq_len))
    return LossConfig(
        w_feat=float(tc.w_feat),
        w_ce=float(tc.w_ce),
        max_loss_tokens=max_loss,
        ce_tokens=ce_tokens,
        feature_noise=float(tc.feature_noise),
        ttt_steps=tc.ttt_steps,
        ttt_positions=tc.ttt_positions,
        ttt_weight=tc.ttt_weight,
        topk=tc.topk,
        w_topk=tc.w_topk,
    )


def train(
    job: WarmupConfig,
    workdir: pathlib.Path,
    target: Transformer,
    train_samples: Sequence[DrafterSample],
    eval_samples: Sequence[DrafterSample],
    tracker: JsonlTracker,
    draft_vocab: np.ndarray | None = None,
) -> tuple[nnx.GraphDef, TrainState, dict[str, float]]:
    """Train (or resume training) the drafter for `train.steps` steps; returns (graphdef, state, stats).

    With `draft_vocab` (and `train.ce_draft_vocab`), the soft cross-entropy compares the target's and the
    drafter's distributions over those tokens only: the drafter head the engine runs (FR-Spec style), and a
    6x cheaper LM head in every training step.
    """
    tc = job.train
    tx, sched = optimizer_from_config(dataclasses.asdict(tc))
    loss_cfg = loss_config(tc, train_samples)
    trainer = DrafterTrainer(tx, loss_cfg, seed=job.run.seed)
    state = trainer.init_state(init_drafter(target, job.run.seed, job.run.arch, draft_vocab))
    ckpt = Checkpointer(workdir / TRAIN_STATE_DIR, max_to_keep=1)
    start = ckpt.latest_step() or 0
    if start:
        state = trainer.restore(ckpt)
        _log(f"resumed drafter training at step {start}")
    tracker.truncate_from(start + 1)
    stats: dict[str, float] = {"train_tokens": 0.0, "train_seconds": 0.0}
    if start >= int(tc.steps):
        ckpt.close()
        return trainer.graphdef, state, stats
    embed_w, head_w = target_weights(target)
    own_head = job.run.arch == "eagle3"  # EAGLE-3's CE is always over its own head's vocabulary
    if draft_vocab is not None and (tc.ce_draft_vocab or own_head):
        head_w = head_w[jnp.asarray(draft_vocab, jnp.int32)]
    _log(
        f"training: max_loss_tokens={loss_cfg.max_loss_tokens}, ce_tokens={loss_cfg.ce_tokens} per step of "
        f"{tc.rows}x{tc.seq_len}, chain steps trained {1 + loss_cfg.ttt_steps}, CE over "
        f"{head_w.shape[0] if head_w.shape[0] != target.cfg.vocab_size else 'the full'} vocabulary"
    )
    loop = _TrainLoop(job, trainer, sched, loss_cfg, train_samples, tracker, embed_w, head_w)
    state = loop.run(state, ckpt, start, stats)
    stats.update(_heldout_loss(job, trainer.graphdef, loss_cfg, state, eval_samples, embed_w, head_w))
    return trainer.graphdef, state, stats


@dataclasses.dataclass
class _TrainLoop:
    """`train`'s step loop: the fixed pieces of one training run (trainer, schedule, data, target weights)."""

    job: WarmupConfig
    trainer: DrafterTrainer
    sched: Any  # the learning-rate schedule (logged)
    loss_cfg: LossConfig
    samples: Sequence[DrafterSample]
    tracker: JsonlTracker
    embed_w: jax.Array
    head_w: jax.Array

    def run(self, state: TrainState, ckpt: Checkpointer, start: int, stats: dict[str, float]) -> TrainState:
        """Steps `start`..`train.steps`: pack each step's planned batch and update; log the mean metrics every
        `log_every` steps, checkpoint every `checkpoint_every` (and both at the end). Closes `ckpt`; adds the
        loss tokens and the wall seconds to `stats`."""
        tc, samples, max_loss = self.job.train, self.samples, self.loss_cfg.max_loss_tokens
        steps, seq_len, rows = int(tc.steps), int(tc.seq_len), int(tc.rows)
        plan = batch_plan(samples, seq_len, rows, int(self.job.run.seed), max_loss)
        log_every = max(1, int(tc.log_every))
        acc: dict[str, float] = {}
        t_window = t_start = time.perf_counter()
        bar = tqdm(total=steps, initial=start, desc="drafter train", file=sys.stderr, mininterval=5.0)
        try:
            for step in range(start, steps):
                picked = [samples[i] for i in plan(step)]
                batch, _ = pack_samples(picked, seq_len, rows, samples[0].hidden_size, max_loss)
                state, m = self.trainer.step(state, to_device(batch), self.embed_w, self.head_w)
                for k, v in m.items():
                    acc[k] = acc.get(k, 0.0) + float(v)
                bar.update(1)
                done = step + 1
                if done % log_every == 0 or done == steps:
                    n = log_every if done % log_every == 0 else done % log_every
                    stats["train_tokens"] += self._log_window(
                        bar, step, acc, n, time.perf_counter() - t_window
                    )
                    acc, t_window = {}, time.perf_counter()
                if done % max(1, int(tc.checkpoint_every)) == 0 or done == steps:
                    self.trainer.save(ckpt, state)
        finally:
            bar.close()
            ckpt.close()
        stats["train_seconds"] = time.perf_counter() - t_start
        return state

    def _log_window(self, bar: tqdm, step: int, acc: dict[str, float], n: int, dt: float) -> float:
        """Log the mean metrics of the last `n` steps (summed in `acc`, over `dt` seconds) at step + 1, with
        the learning rate and throughput; returns the window's loss tokens."""
        tok = acc.get("num_tokens", 0.0)
        row = {f"train/{k}": v / n for k, v in acc.items() if k != "num_tokens"}
        row.update(
            {
                "train/lr": float(self.sched(step)),
                "train/loss_tokens_per_s": tok / max(dt, 1e-9),
                "train/step_s": dt / n,
            }
        )
        self.tracker.log(step + 1, row)
        bar.set_postfix_str(
            f"loss {row['train/loss']:.3f} ce {row['train/ce']:.3f} top1 {row['train/top1_acc']:.3f}",
            refresh=False,
        )
        return tok


def _heldout_loss(
    job: WarmupConfig,
    graphdef: nnx.GraphDef,
    loss_cfg: LossConfig,
    state: TrainState,
    samples: Sequence[DrafterSample],
    embed_w: jax.Array,
    head_w: jax.Array,
) -> dict[str, float]:
    """Held-out loss / top-1 after training: metric sums over every held-out batch, normalised once."""
    ec = job.drafter_eval
    budget = loss_token_budget(samples, int(ec.seq_len), int(ec.rows), -1)
    eval_cfg = dataclasses.replace(
        loss_cfg, max_loss_tokens=budget, ce_tokens=None, feature_noise=0.0, ttt_positions=512
    )
    eval_loss = make_eval_loss(graphdef, eval_cfg)
    batches = iterate_packed(samples, int(ec.seq_len), int(ec.rows), max_loss_tokens=budget)
    sums = [jax.device_get(eval_loss(state.params, to_device(b), embed_w, head_w)) for b in batches]
    if not sums:
        return {}
    total = normalize_metrics({k: sum(float(s[k]) for s in sums) for k in sums[0]})
    return {f"heldout_{k}": float(v) for k, v in total.items() if k not in ("num_tokens", "dropped_tokens")}


# ---- the job ---------------------------------------------------------------------------------------------


def _evaluate(
    evaluator: AcceptanceEvaluator,
    params: nnx.State,
    samples: Sequence[DrafterSample],
    target: Transformer,
) -> AcceptanceResult:
    embed_w, head_w = target_weights(target)
    return evaluator(params, samples, embed_w, head_w)


def _fmt_eval(r: AcceptanceResult) -> str:
    pos = ", ".join(f"{100 * p:.0f}" for p in r.per_position)
    n = r.num_positions
    out = f"greedy accept length {r.accept_length:.3f} over {n} positions; per-position % [{pos}]"
    if r.sampled_accept_length is not None:
        sp = ", ".join(f"{100 * p:.0f}" for p in r.sampled_per_position or [])
        out += f"; sampled (T={r.sampled_temperature}) {r.sampled_accept_length:.3f} [{sp}]"
    return out


def run_warmup(job: WarmupConfig, workdir: str | os.PathLike) -> str:
    """Run (or resume) the drafter warm-up in `workdir`; returns "done". See the module docstring: its phases
    are `train` and the helpers below, in the order this calls them."""
    wd = pathlib.Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    data_dir = wd / DATA_DIR
    data_dir.mkdir(exist_ok=True)
    times = PhaseTimes(wd / PHASE_TIMES_FILE)
    result_path = wd / RESULT_FILE
    if _already_complete(job, result_path):
        return "done"
    tracker = JsonlTracker(wd)
    tracker.log_config(job.raw)
    t_run = time.perf_counter()
    target, tokenizer = load_target(job, times)
    # phase 2: the training and held-out data (generated, or loaded from the cache)
    (train_samples, train_data), (eval_samples, eval_data) = build_data(
        job, target, tokenizer, data_dir, times
    )
    _log(
        f"data: {len(train_samples)} train sequences ({int(train_data['response_tokens'])} response tokens), "
        f"{len(eval_samples)} held-out ({int(eval_data['response_tokens'])})"
    )
    vocab_path, draft_vocab = _draft_vocab(job, wd, target, tokenizer)
    evaluator, params0 = acceptance_evaluator(job, target, draft_vocab)
    before = _eval_before(job, wd, evaluator, params0, eval_samples, target, times, tracker)

    t0 = time.perf_counter()
    _, state, train_stats = train(
        job, wd, target, train_samples, eval_samples, tracker, draft_vocab=draft_vocab
    )
    times.add("train", time.perf_counter() - t0)

    after, info = _eval_after_and_save(job, wd, evaluator, state, eval_samples, target, times, tracker)
    tracker.close()
    summary = {
        "complete": True,
        "before": before.to_dict() if before is not None else None,
        "after": after.to_dict(),
        "train": train_stats,
        "data": {
            "train": train_data,
            "eval": eval_data,
            "train_sequences": len(train_samples),
            "eval_sequences": len(eval_samples),
        },
        "phase_seconds": times.times,
        "this_run_seconds": time.perf_counter() - t_run,
        "drafter_checkpoint": {
            "dir": str(wd / DRAFTER_DIR),
            "step": job.train.steps,
            "blocking_ms": info.blocking_ms,
        },
        "draft_vocab": str(vocab_path) if vocab_path else None,
    }
    write_json(result_path, summary)
    _log(f"wrote {result_path}; phase seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.times.items()))
    return "done"


def _already_complete(job: WarmupConfig, result_path: pathlib.Path) -> bool:
    """Whether a finished warm-up already trained `train.steps` steps. A finished workdir asked for a longer
    schedule is extended instead: training resumes from its last state (the cosine schedule is recomputed for
    the new length: a warm restart), on the cached data plus any new prompts."""
    finished = json.loads(result_path.read_text()) if result_path.exists() else {}
    if finished.get("complete"):
        trained = int(finished.get("drafter_checkpoint", {}).get("step", 0))
        if trained >= job.train.steps:
            _log(f"already complete: {result_path}")
            return True
        _log(f"extending the finished warm-up from {trained} to {job.train.steps} training steps")
    return False


def load_target(job: WarmupConfig, times: PhaseTimes) -> tuple[Transformer, TextCodec]:
    """Phase 1: the target model and its tokenizer (timed as `load_target`)."""
    t0 = time.perf_counter()
    target, tokenizer = build_target(job)
    if job.run.arch == "eagle3":  # the data records the target's [aux layers ; final] states
        n = target.cfg.num_layers
        with_aux_layers(target, tuple(job.run.aux_layers) or default_aux_layers(n))
    times.add("load_target", time.perf_counter() - t0)
    _log(
        f"target: {target.cfg.num_layers} layers, hidden {target.cfg.hidden_size}, "
        f"vocab {target.cfg.vocab_size}"
    )
    return target, tokenizer


def _draft_vocab(
    job: WarmupConfig, wd: pathlib.Path, target: Transformer, tokenizer: TextCodec
) -> tuple[pathlib.Path | None, np.ndarray | None]:
    """The drafter head's reduced vocabulary (tlt_jax.drafter.draft_vocab) when `draft_vocab_size` > 0: the
    target's most frequent generated tokens; used by the training CE (train.ce_draft_vocab), the sampled
    evaluation and rollouts. Returns (its file, its token ids), or (None, None)."""
    vocab_size = job.run.draft_vocab_size
    vocab_path, draft_vocab = None, None
    if vocab_size > 0:
        vocab_path = build_from_warmup(
            wd, min(vocab_size, target.cfg.vocab_size), target.cfg.vocab_size, tokenizer.eos_token_ids
        )
        draft_vocab = load_draft_vocab(wd)
        _log(f"draft vocabulary ({vocab_size} most frequent generated tokens): {vocab_path}")
    return vocab_path, draft_vocab


def acceptance_evaluator(
    job: WarmupConfig, target: Transformer, draft_vocab: np.ndarray | None
) -> tuple[AcceptanceEvaluator, nnx.State]:
    """The acceptance evaluator of `config.drafter_eval` and the untrained drafter's params. Its sampled
    acceptance uses the data's sampling settings (what rejection-sampled chains in rollouts get)."""
    drafter0 = init_drafter(target, job.run.seed, job.run.arch, draft_vocab)
    graphdef, params0 = nnx.split(drafter0, nnx.Param)
    ec = job.drafter_eval
    eval_sp = SamplingParams(temperature=float(ec.temperature), top_p=job.generation.top_p)
    evaluator = AcceptanceEvaluator(
        graphdef, int(ec.depth), int(ec.seq_len), int(ec.rows), sampling=eval_sp, draft_vocab=draft_vocab
    )
    return evaluator, params0


def _eval_before(
    job: WarmupConfig,
    wd: pathlib.Path,
    evaluator: AcceptanceEvaluator,
    params0: nnx.State,
    eval_samples: Sequence[DrafterSample],
    target: Transformer,
    times: PhaseTimes,
    tracker: JsonlTracker,
) -> AcceptanceResult | None:
    """Phase 3: the untrained drafter's acceptance on the held-out data (cached in `eval_before.json`;
    skipped, None, with `eval.before=False`)."""
    before_path = wd / EVAL_BEFORE_FILE
    before: AcceptanceResult | None = None
    if not job.drafter_eval.before:
        _log("before training: skipped (config.drafter_eval.before=False; an untrained drafter accepts ~0)")
    elif before_path.exists():
        before = AcceptanceResult(**json.loads(before_path.read_text()))
    else:
        t0 = time.perf_counter()
        before = _evaluate(evaluator, params0, eval_samples, target)
        times.add("eval_before", time.perf_counter() - t0)
        write_json(before_path, before.to_dict())
        tracker.log(0, before.metrics("eval/"))
    if before is not None:
        _log(f"before training: {_fmt_eval(before)}")
    return before


def _eval_after_and_save(
    job: WarmupConfig,
    wd: pathlib.Path,
    evaluator: AcceptanceEvaluator,
    state: TrainState,
    eval_samples: Sequence[DrafterSample],
    target: Transformer,
    times: PhaseTimes,
    tracker: JsonlTracker,
) -> tuple[AcceptanceResult, SaveInfo]:
    """Phase 5: the trained drafter's acceptance, then its weights saved to `DIR/drafter` (step = train
    steps). Returns the result and the checkpointer's save info."""
    t0 = time.perf_counter()
    after = _evaluate(evaluator, state.params, eval_samples, target)
    times.add("eval_after", time.perf_counter() - t0)
    tracker.log(job.train.steps, after.metrics("eval/"))
    _log(f"after {job.train.steps} steps: {_fmt_eval(after)}")
    spec = drafter_spec(nnx.merge(evaluator.graphdef, state.params))
    saver = DrafterCheckpointer(wd / DRAFTER_DIR, max_to_keep=1, own_head=spec["arch"] == "eagle3")
    info = saver.save(
        job.train.steps,
        drafter_params_dict(state.params),
        meta={
            "target": dataclasses.asdict(target.cfg),
            "drafter": spec,
            "accept_length": after.accept_length,
            "depth": after.depth,
        },
    )
    saver.close()
    return after, info
