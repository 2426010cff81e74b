"""The GRPO learner: the RL loop that `python -m tlt_jax.main` runs for `config.job = "grpo"`.

One step (DESIGN.md, "One RL step"):
  task batch (prompts via the chat template) -> engine.generate (n samples per prompt) -> rewards (task.score)
  -> group advantages (GRPO / Dr.GRPO, optional DAPO dynamic sampling) -> trainer forward for the reference /
  old log-probs -> PPO-clipped update(s) with optional low_var_kl -> engine.set_params (no recompilation).

Determinism: step s uses the key fold_in(key(seed), s) and the data position stored in the checkpoint, so a
run resumed from step k's checkpoint reproduces an uninterrupted run exactly (samples, metrics, weights).
Checkpoints (policy params, optimizer state, drafter params when present, rng, data position, step) go
out every `config.checkpoint_every` steps, at the end, and when SIGTERM/SIGINT arrives (PreemptionGuard).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from tlt_jax import config_lib
from tlt_jax.drafter.spot_trainer import SpotTrainer
from tlt_jax.drafter.trainer import TRAIN_STATE_DIR
from tlt_jax.models.build import build_model_and_tokenizer
from tlt_jax.models.drafter import Drafter
from tlt_jax.rl import config as rl_config
from tlt_jax.rl import grpo
from tlt_jax.rl.batch import TrainBatch, build_train_batch, length_sorted_micro
from tlt_jax.rl.evaluation import HeldOutEval
from tlt_jax.rl.speculation import RolloutMonitor, resolve_drafter
from tlt_jax.rollout.adaptive import build_policy
from tlt_jax.rollout.hooks import ProgressHook
from tlt_jax.rollout.types import Rollout
from tlt_jax.tasks import Problem, make_task
from tlt_jax.utils import compile_stats
from tlt_jax.utils.checkpoint import Checkpointer, PreemptionGuard
from tlt_jax.utils.tracking import RolloutProgress, make_trackers, truncate_jsonl

CHECKPOINT_DIR = "checkpoints"
BUFFER_DIR = "spot_buffer"  # the spot trainer's data buffer, one folder per checkpointed step
SAMPLES_FILE = "samples.jsonl"


def _percentiles(x: np.ndarray) -> dict[str, float]:
    return {
        "length/mean": float(x.mean()),
        "length/p50": float(np.percentile(x, 50)),
        "length/p90": float(np.percentile(x, 90)),
        "length/max": float(x.max()),
    }


def _take(batch: TrainBatch, rows: slice) -> TrainBatch:
    return jax.tree_util.tree_map(lambda x: x[rows], batch)


class Learner:
    """Builds everything from a config, restores the workdir's latest checkpoint if any, and runs steps."""

    def __init__(self, config: Any, workdir: str):
        rl_config.validate(config)
        self.config, self.workdir = config, workdir
        self.is_main = jax.process_index() == 0
        self._compiles = compile_stats.compile_log().snapshot()
        rl = config.rl
        self.group = int(rl.samples_per_prompt)
        self.rows = int(rl.prompts_per_step) * self.group
        self.mini_rows = self.rows // int(rl.mini_batches)

        t0 = time.perf_counter()
        model, self.tokenizer = build_model_and_tokenizer(config)
        self.mesh = config_lib.build_mesh(config)
        # what drafts for the rollouts (config.drafter): none / n-gram / a warmed EAGLE drafter
        self.rollout_drafter = resolve_drafter(config.drafter, model.cfg)
        if self.rollout_drafter.note and self.is_main:
            logging.warning("%s", self.rollout_drafter.note)
            print(f"note: {self.rollout_drafter.note}", flush=True)
        spot_cfg = rl_config.spot_config_from(config)
        # the drafter the engine holds: the warmed one, or (spot training without one) a fresh EAGLE drafter
        # that the spot trainer trains from scratch while the rollouts draft with the n-gram drafter
        engine_drafter = self.rollout_drafter.drafter
        if engine_drafter is None and spot_cfg.mode != "off":
            engine_drafter = Drafter(model.cfg, nnx.Rngs(params=int(config.seed)))
        self.engine = config_lib.build_engine(
            config,
            model,
            self.tokenizer,
            self.mesh,
            drafter_kind=self.rollout_drafter.kind,
            drafter=engine_drafter,
            draft_vocab=self.rollout_drafter.draft_vocab,
        )
        self.monitor = RolloutMonitor(float(config.drafter.min_accept_len))
        self.spot = SpotTrainer(spot_cfg, engine_drafter, self.engine) if spot_cfg.mode != "off" else None
        if self.spot is not None and self.rollout_drafter.kind == "eagle":
            # the warmed drafter's optimizer moments too (its workdir's train_state/, when there is one)
            warm = pathlib.Path(self.rollout_drafter.path).parent / TRAIN_STATE_DIR
            if self.spot.warm_start(warm) and self.is_main:
                logging.info("spot trainer: AdamW moments carried over from %s", warm)
        self.adaptive = None  # the adaptive engine's mode selector (config.bandit), kept across steps
        if config.bandit.algorithm != "off":
            eagle_arms = [a for a in config.bandit.arms if a != "plain" and not a.startswith("ngram_")]
            if eagle_arms and engine_drafter is None:
                raise ValueError(
                    f"config.bandit.arms {eagle_arms} need an EAGLE drafter: set config.drafter.kind=eagle "
                    "(a warmed drafter) or config.spot.mode (train one online), or keep plain/ngram_* arms."
                )
            self.adaptive = build_policy(config.bandit, self.engine, seed=int(config.seed))
        self.sampling = config_lib.sampling_from(config)
        self.trainer = rl_config.policy_trainer(config, model, self.mesh)
        del model  # the trainer owns (and donates) its buffers now
        self.engine.set_params(self.trainer.compute_params())
        self.task = make_task(config.task)
        self._prompt_cache: dict[str, list[int]] = {}
        eval_cfg = rl_config.eval_config_from(config)
        self.evaluator = None
        if eval_cfg.every:
            self.evaluator = HeldOutEval(
                eval_cfg,
                self.task,
                self._encode,
                self.tokenizer,
                self.engine,
                self.sampling,
                seed=int(config.seed),
                train_positions=int(config.num_steps) * int(rl.prompts_per_step),
            )
        self.base_key = jax.random.key(int(config.seed))
        # the rollout drafter's weights: fixed for a whole rollout (the engine drafts with one snapshot),
        # saved with the checkpoint; the spot trainer (tlt_jax.drafter) updates them between steps
        self.drafter_params = self.engine.drafter_params
        self.step, self.data_position = 0, 0
        self.ckpt = Checkpointer(
            os.path.join(workdir, CHECKPOINT_DIR), max_to_keep=int(config.keep_checkpoints)
        )
        self._restore()
        if self.is_main:
            truncate_jsonl(os.path.join(workdir, SAMPLES_FILE), self.step + 1)
        # a fresh run logs its held-out eval as step 0: a restart before step 1 drops that line too
        resume = self.step + 1 if self.step else 0
        self.trackers = make_trackers(config, workdir, resume_step=resume) if self.is_main else None
        if self.trackers is not None:
            self.trackers.log_config(config)
        logging.info("learner ready in %.1fs (start at step %d)", time.perf_counter() - t0, self.step + 1)

    # ---- checkpoints --------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "params": self.trainer.params,
            "opt_state": self.trainer.opt_state,
            "drafter": self.drafter_params,
            "spot": None if self.spot is None else self.spot.state_dict(),
            "bandit": None if self.adaptive is None else self.adaptive.policy.state_dict(),
            "rng": self.base_key,
        }

    def _restore(self) -> None:
        latest = self.ckpt.latest_step()
        if latest is None:
            return
        state, meta = self.ckpt.restore(latest, self._state())
        self.trainer.params, self.trainer.opt_state = state["params"], state["opt_state"]
        self.drafter_params, self.base_key = state["drafter"], state["rng"]
        if self.adaptive is not None:
            self.adaptive.policy.load_state_dict(state["bandit"])
        if self.spot is not None:
            self.spot.load_state_dict(state["spot"])
            self.spot.buffer.load(self._buffer_dir(latest))
        self.step, self.data_position = int(meta["step"]), int(meta["data_position"])
        self.engine.set_params(self.trainer.compute_params())
        if self.drafter_params is not None:
            self.engine.set_drafter_params(self.drafter_params)
        logging.info("restored step %d from %s", self.step, self.ckpt.directory)

    def _buffer_dir(self, step: int) -> str:
        return os.path.join(self.workdir, BUFFER_DIR, str(step))

    def save(self) -> None:
        """Checkpoint the state after `self.step` completed steps (async; waited for at exit). The spot
        trainer's data buffer is written first (synchronously): every complete checkpoint has its buffer."""
        if self.spot is not None and self.is_main:
            self.spot.buffer.save(self._buffer_dir(self.step))
            keep = sorted(int(d) for d in os.listdir(os.path.join(self.workdir, BUFFER_DIR)) if d.isdigit())
            for old in keep[: -int(self.config.keep_checkpoints) - 1]:
                shutil.rmtree(self._buffer_dir(old), ignore_errors=True)
        meta = {
            "step": self.step,
            "data_position": self.data_position,
            "num_steps": int(self.config.num_steps),
        }
        info = self.ckpt.save(self.step, self._state(), meta)
        logging.info("checkpoint step %d queued (blocked %.0f ms)", self.step, info.blocking_ms)

    def push_drafter(self, params: Any) -> None:
        """New drafter weights for the next rollouts (they must fit the engine's drafter: same shapes)."""
        self.engine.set_drafter_params(params)
        self.drafter_params = self.engine.drafter_params

    # ---- one step -----------------------------------------------------------------------------------------
    def _encode(self, problem: Problem) -> list[int]:
        if problem.uid not in self._prompt_cache:
            self._prompt_cache[problem.uid] = self.tokenizer.encode_chat(self.task.messages(problem))
        return self._prompt_cache[problem.uid]

    def _rollout(self, problems: list[Problem], key: jax.Array) -> Rollout:
        prompts = [self._encode(p) for p in problems]
        show = bool(self.config.progress_bar) and self.is_main
        with RolloutProgress(
            total=self.rows, desc=f"rollout {self.step + 1}", disable=None if show else True
        ) as bar:
            hooks = [self.adaptive, ProgressHook(bar), self.monitor, self.spot]
            with compile_stats.scope("rollout"):
                return self.engine.generate(
                    prompts, n=self.group, key=key, sampling=self.sampling, hooks=hooks
                )

    def train_step(self) -> dict[str, float]:
        """Run step `self.step + 1`; returns its metrics."""
        cfg, rl = self.config, self.config.rl
        step = self.step + 1
        key = jax.random.fold_in(self.base_key, step)
        times: dict[str, float] = {}
        t_step = time.perf_counter()

        t0 = time.perf_counter()
        compile0 = self.engine.programs.compile_seconds
        problems, next_position = self.task.batch(self.data_position, int(rl.prompts_per_step))
        if self.spot is not None:
            self.spot.begin_step(step)
        rollout = self._rollout(problems, jax.random.fold_in(key, 0))
        times["rollout"] = time.perf_counter() - t0
        if self.spot is not None:
            t0 = time.perf_counter()
            with compile_stats.scope("drafter"):
                self.spot.after_rollout()
            times["spot_after_rollout"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        texts = [self.tokenizer.decode(rollout.response(i)) for i in range(self.rows)]
        results = [
            self.task.score(problems[int(g)], t) for g, t in zip(rollout.prompt_index, texts, strict=True)
        ]
        rewards = np.asarray([r.reward for r in results], np.float32)
        chex.assert_shape([rewards, rollout.lengths], [(self.rows,), (self.rows,)])
        adv = np.asarray(
            grpo.group_advantages(
                jnp.asarray(rewards), self.group, method=rl.advantage, eps=float(rl.adv_eps)
            )
        )
        keep = (
            np.asarray(grpo.dynamic_sampling_mask(jnp.asarray(rewards), self.group))
            if rl.dynamic_sampling
            else np.ones((self.rows,), bool)
        )
        batch = build_train_batch(
            rollout.prompt_tokens,
            rollout.tokens,
            rollout.lengths,
            adv,
            keep,
            group_size=self.group,
            seq_bucket=int(cfg.trainer.seq_bucket),
            max_response=int(cfg.rollout.max_new_tokens),
        )
        times["reward"] = time.perf_counter() - t0

        metrics: dict[str, float] = {}
        with compile_stats.scope("update"):  # compilations of the logprob and update programs
            t0 = time.perf_counter()
            batch, train_logp = self._old_logprobs(batch)
            times["logprob"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            update_metrics, skipped, trained_cols = self._update(batch, rollout.lengths, train_logp)
        self.engine.set_params(self.trainer.compute_params())
        if self.spot is not None:  # the drafter trained during this rollout drafts for the next one
            self.push_drafter(self.spot.params)
        times["update"] = time.perf_counter() - t0

        # ---- metrics
        mask = rollout.mask
        n = min(mask.shape[1], train_logp.shape[1])
        gap_mask = mask[:, :n]
        gap = np.abs(rollout.logprobs[:, :n] - train_logp[:, :n])[gap_mask]
        for k in update_metrics[0] if update_metrics else ():
            metrics[k] = float(np.mean([u[k] for u in update_metrics]))
        metrics.update(
            {
                "reward/mean": float(rewards.mean()),
                "reward/std": float(rewards.std()),
                "accuracy": float(np.mean([r.correct for r in results])),
                "format": float(np.mean([r.format_ok for r in results])),
                **_percentiles(rollout.lengths.astype(np.float64)),
                "length/clip_frac": float(np.mean(np.asarray(rollout.finish_reason) == "length")),
                "rl/kept_frac": float(keep.mean()),
                "rl/skipped_updates": float(skipped),
                "rl/adv_abs_mean": float(np.abs(adv).mean()),
                # response columns the update computed (each micro-batch at its own bucket), as a share of
                # padding every row to the step's longest response
                "update/column_share": trained_cols / max(self.rows * batch.num_response, 1),
                "optim/lr": float(rl.lr) * min(1.0, step * int(rl.mini_batches) / (int(rl.warmup_steps) + 1)),
                "data/position": float(next_position),
                "throughput/tok_per_s": float(rollout.lengths.sum() / max(times["rollout"], 1e-9)),
            }
        )
        if gap.size and (update_metrics or not self.trainer.loss.fuse_old_logprobs):
            metrics["logprob/engine_gap"] = float(gap.mean())
            metrics["logprob/engine_gap_max"] = float(gap.max())
        stats = rollout.stats
        metrics.update(self.monitor.metrics(step))
        if self.spot is not None:
            metrics.update(self.spot.metrics())
        if self.adaptive is not None:
            metrics.update(self.adaptive.metrics())
        for k, v in stats.summary().items():
            metrics.setdefault(k, v)
        metrics["programs/count"] = float(self.engine.compile_count)
        metrics["time/compile_rollout"] = self.engine.programs.compile_seconds - compile0
        total = time.perf_counter() - t_step
        for k, v in times.items():
            metrics[f"time/{k}"] = v
        metrics["time/step"] = total
        metrics["rollout/share"] = times["rollout"] / max(total, 1e-9)

        self._log_samples(step, problems, rollout, texts, results)
        self.step, self.data_position = step, next_position
        return metrics

    def _old_logprobs(self, batch: TrainBatch) -> tuple[TrainBatch, np.ndarray]:
        """The reference (KL) and old (unfused) logprobs the loss needs, in `batch`; and the old logprobs
        [rows, response] for the engine-gap metric (zeros when the update fuses them)."""
        rl = self.config.rl
        train_logp = np.zeros((self.rows, batch.num_response), np.float32)
        if rl.kl_coef > 0 or not self.trainer.loss.fuse_old_logprobs:
            micro = self.trainer.put_micro(batch)
            if rl.kl_coef > 0:
                ref = self.trainer.logprobs(micro, params=self.trainer.ref_params).logp
                batch = batch.replace(ref_logp=np.asarray(ref).reshape(batch.ref_logp.shape))
            if not self.trainer.loss.fuse_old_logprobs:
                old = np.asarray(self.trainer.logprobs(micro).logp)
                batch = batch.replace(old_logp=old.reshape(batch.old_logp.shape))
                train_logp = old.reshape(self.rows, -1)
        return batch, train_logp

    def _update(
        self, batch: TrainBatch, lengths: np.ndarray, train_logp: np.ndarray
    ) -> tuple[list[dict[str, float]], int, int]:
        """The policy update over `rl.mini_batches` mini-batches (micro-batches sorted by length, each padded
        to its own bucket: tlt_jax.rl.batch). Fills `train_logp` with the fused old logprobs; returns the
        per-mini-batch metrics, the mini-batches skipped (all groups filtered) and the columns trained."""
        cfg, rl = self.config, self.config.rl
        update_metrics: list[dict[str, float]] = []
        skipped, trained_cols = 0, 0
        mini_groups = self.mini_rows // self.group
        for m in range(int(rl.mini_batches)):
            rows = slice(m * self.mini_rows, (m + 1) * self.mini_rows)
            mini = _take(batch, slice(m * mini_groups, (m + 1) * mini_groups))
            parts = length_sorted_micro(
                mini, lengths[rows], self.trainer.micro_batch_size, int(cfg.trainer.seq_bucket), rl.loss_agg
            )
            if parts.weights.sum() == 0:  # every group filtered out (dynamic sampling): nothing to learn from
                skipped += 1
                continue
            um, logps = self.trainer.update(
                [self.trainer.put_micro(mb) for mb in parts.micro], [w[None] for w in parts.weights]
            )
            update_metrics.append(um)
            trained_cols += sum(mb.response.size for mb in parts.micro)
            if self.trainer.loss.fuse_old_logprobs:
                train_logp[rows] = parts.unsort([np.asarray(x) for x in logps], batch.num_response)
        return update_metrics, skipped, trained_cols

    def _log_samples(
        self, step: int, problems: list[Problem], rollout: Rollout, texts: list[str], results
    ) -> None:  # noqa: ANN001
        """A few responses per step to `workdir/samples.jsonl` (what the policy actually writes)."""
        k = min(int(self.config.log_samples), self.rows)
        if not k or not self.is_main:
            return
        rows = np.linspace(0, self.rows - 1, k).astype(int)
        with open(os.path.join(self.workdir, SAMPLES_FILE), "a", encoding="utf-8") as f:
            for i in rows:
                p = problems[int(rollout.prompt_index[i])]
                r = results[i]
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "question": p.question,
                            "answer": p.answer,
                            "response": texts[i],
                            "reward": r.reward,
                            "correct": r.correct,
                        }
                    )
                    + "\n"
                )
        logging.info(
            "step %d sample (reward %.2f): %r -> %r",
            step,
            results[rows[0]].reward,
            problems[int(rollout.prompt_index[rows[0]])].question[-60:],
            texts[rows[0]][:200],
        )

    # ---- the loop -----------------------------------------------------------------------------------------
    def train(self) -> str:
        """Run until `config.num_steps` (or a SIGTERM/SIGINT). Returns "done" or "preempted"."""
        cfg = self.config
        every = int(cfg.checkpoint_every)
        status = "done"
        try:
            with PreemptionGuard() as guard:
                if self.step == 0 and self.evaluator is not None:
                    with compile_stats.scope("eval"):
                        before = self.evaluator.run()  # the policy before any update
                    if self.trackers is not None:
                        self.trackers.log(0, before)
                while self.step < int(cfg.num_steps):
                    metrics = self.train_step()
                    if self.evaluator is not None and self.evaluator.cfg.due(self.step, int(cfg.num_steps)):
                        with compile_stats.scope("eval"):
                            metrics.update(self.evaluator.run())
                    self._log_compiles(metrics)
                    if self.trackers is not None:
                        self.trackers.log(self.step, metrics)
                    last = self.step == int(cfg.num_steps)
                    if guard.should_stop or last or (every and self.step % every == 0):
                        self.save()
                    if guard.should_stop and not last:
                        status = "preempted"
                        logging.warning("stopping at step %d after %s", self.step, guard.received.name)
                        break
                if self.step >= int(cfg.num_steps) and self.ckpt.latest_step() != self.step:
                    self.save()  # e.g. resumed at the end of a run that crashed before its final save
        finally:
            self.close()
        return status

    def _log_compiles(self, metrics: dict[str, float]) -> None:
        """compile/*: what compiled since the last step, per kind (step 1: since the learner was built)."""
        now = compile_stats.compile_log().snapshot()
        metrics.update(now.delta(self._compiles).metrics())
        self._compiles = now

    def close(self) -> None:
        self.ckpt.close()
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None


def run(config: Any, workdir: str) -> str:
    """Train GRPO as configured, in `workdir` (created; resumed from its latest checkpoint if present)."""
    os.makedirs(workdir, exist_ok=True)
    return Learner(config, workdir).train()
