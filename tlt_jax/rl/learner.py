"""The GRPO learner: the RL loop that `python -m tlt_jax.main` runs for `config.job = "grpo"`.

One step (`Learner.train_step`), each phase in a module of tlt_jax.rl named after it:
  rollout     the task's next prompts (chat template) -> engine.generate, n samples each; the strategy
              selector, the speculation monitor and the spot trainer ride along as hooks   (rl/rollout.py)
  reward      every response decoded and scored by the task's verifier                     (rl/reward.py)
  (refill)    DAPO's dynamic sampling: groups that teach nothing out, more generated (rl/dynamic_sampling.py)
  advantages  group advantages (GRPO / Dr.GRPO), the batch                                  (rl/advantages.py)
  update      reference / old log-probs, then PPO-clipped update(s) with optional low_var_kl (rl/update.py)
  (weights)   the learner owns them: each rollout gets the policy's compute weights and the spot-trained
              drafter (`engine.generate(params=, drafter_params=)`); the engine keeps none between steps
  selector    the bandit learns inside the rollout (its hook); the step logs its state     (rl/selector.py)
  metrics     rewards, lengths, update, engine/trainer log-prob gap, phase timings         (rl/metrics.py)

Determinism: step s uses the key fold_in(key(seed), s) and the data position stored in the checkpoint, so a
run resumed from step k's checkpoint reproduces an uninterrupted run exactly (samples, metrics, weights).
Checkpoints (rl/checkpointing.py: policy params, optimizer state, the drafter once, the spot trainer's and
the selector's state, rng; data position and step in the meta) go out every `config.checkpoint_every` steps,
at the end, and on a stop request (SIGTERM/SIGINT to any process) that lands between steps or in an
evaluation (dropped: the step before it is saved); every process agrees where to stop, mid-step abandoning
the step (saving the state it started from when no checkpoint holds it yet), and a watchdog ends a process
that stops making progress (rl/stopping.py). The current phase ("<step> <phase>") is kept in `W/.phase`
(tlt_jax/utils/phase.py) for whoever watches the process: experiments/checks/kill_loop.py SIGKILLs runs at
chosen phases and checks that the relaunched run ends bit-identical.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from tlt_jax import config_lib
from tlt_jax.config_schema import GrpoConfig
from tlt_jax.rl import config as rl_config
from tlt_jax.rl.advantages import Advantages, step_advantages, train_batch
from tlt_jax.rl.batch import TrainBatch, with_advantages
from tlt_jax.rl.checkpointing import (
    CHECKPOINT_DIR,
    checkpoint_state,
    restore_drafter,
    restore_newest,
    restore_state,
)
from tlt_jax.rl.dynamic_sampling import GenBatch, GroupCollector, StepSamples, generation_key
from tlt_jax.rl.evaluation import held_out_eval
from tlt_jax.rl.exports import after_step as export_after_step
from tlt_jax.rl.exports import check_drafter_exportable
from tlt_jax.rl.kl_reward import reward_kl_penalty
from tlt_jax.rl.metrics import (
    LearnerStatus,
    RolloutWatch,
    StepClock,
    engine_gap_metrics,
    finish_metrics,
    learning_metrics,
)
from tlt_jax.rl.outputs import log_samples, open_outputs
from tlt_jax.rl.plan import StepPlan
from tlt_jax.rl.prompt_budget import fit_to_rollout
from tlt_jax.rl.reward import score_rollout
from tlt_jax.rl.rollout import PromptEncoder, generate_rollout
from tlt_jax.rl.selector import build_selector, load_selector_state, selector_metrics
from tlt_jax.rl.speculation import RolloutMonitor, announced_drafter
from tlt_jax.rl.spot import (
    buffer_dir,
    buffer_root,
    build_spot,
    engine_drafter,
    save_buffer,
    spot_metrics,
)
from tlt_jax.rl.stopping import LoopGuards, PhaseTee, StepStart
from tlt_jax.rl.update import old_logprobs, update_policy
from tlt_jax.rollout.types import Rollout
from tlt_jax.tasks import Problem, make_task
from tlt_jax.tasks.rewards import reward_counts
from tlt_jax.utils import compile_stats
from tlt_jax.utils.checkpoint import Checkpointer
from tlt_jax.utils.heartbeat import Heartbeat
from tlt_jax.utils.phase import PhaseFile
from tlt_jax.utils.preemption import StopRequested
from tlt_jax.utils.run_plots import PlotRefresher, append_timeline


class Learner:
    """Builds everything from a config, restores the workdir's latest checkpoint if any, and runs steps."""

    guards: LoopGuards | None = None  # while `train` runs: stop agreement and watchdog
    _saved_step = 0  # the newest step whose checkpoint this process saved or restored

    def __init__(self, config: ml_collections.ConfigDict | GrpoConfig, workdir: str):
        job = config if isinstance(config, GrpoConfig) else rl_config.validate_grpo(config)
        self.job, self.config, self.workdir = job, job.raw, workdir
        self.is_main = jax.process_index() == 0
        self.phases = PhaseFile(workdir if self.is_main else None)  # W/.phase: where the process is
        self.phases.set(0, "init")
        self._compiles = compile_stats.compile_log().snapshot()
        self.plan = StepPlan.from_config(job)
        t0 = time.perf_counter()
        self.mesh = config_lib.build_mesh(job.raw)
        # a HF checkpoint (or random-weight preset) is read straight into the mesh's parameter layout
        model, self.tokenizer = config_lib.build_model(job.raw, self.mesh)
        # what drafts for the rollouts (config.drafter): none / n-gram / a warmed EAGLE drafter
        self.rollout_drafter = announced_drafter(job.drafter, model.cfg, self.is_main)
        drafter = engine_drafter(self.rollout_drafter, job.spot, model.cfg, job.run.seed, job.drafter)
        self.engine = config_lib.engine_for(
            job.engine_config(self.rollout_drafter.kind),
            model,
            self.tokenizer,
            self.mesh,
            drafter=drafter,
            draft_vocab=self.rollout_drafter.draft_vocab,
        )
        check_drafter_exportable(job.run.export_every, self.engine.aux_layers, model.cfg.num_layers)
        self.monitor = RolloutMonitor(job.drafter.min_accept_len)
        self.watch = RolloutWatch()  # live counters (console heartbeat) and chunk timeline (plots)
        self.spot = build_spot(job.spot, drafter, self.engine, self.rollout_drafter, self.is_main)
        self.selector = build_selector(job.bandit, self.engine, drafter is not None, job.run.seed)
        self.sampling = job.rollout.sampling()
        self.trainer = rl_config.policy_trainer(job, model, self.mesh)
        del model  # the trainer owns (and donates) its buffers now
        # one owner per weight: the engine keeps no policy copy (and no drafter the spot trainer trains)
        self.engine.release_weights(drafter=self.spot is not None)
        self.task = fit_to_rollout(make_task(job.task), job.rollout, self.tokenizer)  # over-long prompts
        self.encode = PromptEncoder(self.task, self.tokenizer)
        self.evaluator = held_out_eval(
            job,
            self.task,
            self.encode,
            self.tokenizer,
            self.engine,
            self.weights,
            self.sampling,
            selector=self.selector,  # plays its current choices, learns nothing (rl/eval_decoding.py)
        )
        if self.evaluator is not None:  # training never reads the held-out problems, in any epoch
            self.task = self.evaluator.train_task
        self.base_key = jax.random.key(job.run.seed)
        self.step, self.data_position = 0, 0
        self.reward_kl_coef = self.plan.reward_kl.coef  # KL in the reward: this step's beta
        self.ckpt = Checkpointer(
            os.path.join(workdir, CHECKPOINT_DIR),
            max_to_keep=job.run.keep_checkpoints,
            followers=(buffer_root(workdir),) if self.spot is not None else (),
        )
        self._restore()
        self.trackers = open_outputs(job.raw, workdir, self.step, self.is_main)
        logging.info("learner ready in %.1fs (start at step %d)", time.perf_counter() - t0, self.step + 1)

    @property
    def drafter_weights(self) -> Any:
        """The spot-trained drafter's weights (None: the engine's own drafter, or none)."""
        return None if self.spot is None else self.spot.params

    def weights(self) -> tuple[Any, Any]:
        """The rollouts' (policy, drafter) weights, which the learner owns: the policy in its compute dtype
        and `drafter_weights`."""
        return self.trainer.rollout_params(), self.drafter_weights

    # ---- checkpoints --------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return checkpoint_state(self.trainer, self.engine, self.spot, self.selector, self.base_key)

    def _restore(self) -> None:
        like = self._state()  # the newest step that reads back (a damaged one is moved aside, with a warning)
        found = restore_newest(
            self.ckpt, lambda step: restore_state(self.ckpt, step, like, self.engine, self.trainer)
        )
        if found is None:
            return
        latest, (state, meta) = found
        self.trainer.params, self.trainer.opt_state = state["params"], state["opt_state"]
        self.base_key = state["rng"]
        load_selector_state(self.selector, state["bandit"])
        if self.spot is not None:
            self.spot.load_state_dict(state["spot"])
            self.spot.buffer.load(buffer_dir(self.workdir, latest))
        self.step, self.data_position = int(meta["step"]), int(meta["data_position"])
        self.reward_kl_coef = float(meta.get("reward_kl_coef", self.reward_kl_coef))
        restore_drafter(self.engine, self.spot, state["drafter"])
        logging.info("restored step %d from %s", self.step, self.ckpt.directory)

    def _meta(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "data_position": self.data_position,
            "reward_kl_coef": self.reward_kl_coef,  # the adaptive KL-in-reward controller's state
            "num_steps": self.job.run.num_steps,
        }

    def save(self, start: StepStart | None = None) -> None:
        """Checkpoint the state after `self.step` completed steps, or `start` (the state an abandoned step
        started from) (async; waited for at exit). The spot trainer's data buffer is written first
        (synchronously): every complete checkpoint has its buffer."""
        step = self.step if start is None else start.step
        if self.spot is not None and self.is_main:
            self.phases.set(step, "buffer_save")
            save_buffer(self.spot, self.workdir, step)
        self.phases.set(step, "checkpoint")
        state, meta = (self._state(), self._meta()) if start is None else (start.state, start.meta)
        info = self.ckpt.save(step, state, meta)
        self._saved_step = step
        logging.info("checkpoint step %d queued (blocked %.0f ms)", step, info.blocking_ms)

    # ---- one step -----------------------------------------------------------------------------------------
    def _rollout(self, problems: list[Problem], key: jax.Array, params: Any) -> Rollout:
        """The step's rollout with the policy's weights `params` (a method: experiments/lib/lockstep.py wraps
        it to see every training rollout)."""
        return generate_rollout(
            self.engine,
            [self.encode(p) for p in problems],
            group=self.plan.group,
            key=key,
            sampling=self.sampling,
            selector=self.selector,
            # the watch times a chunk before spot trains; then the stop agreement (tlt_jax.rl.stopping)
            watchers=[self.monitor, self.watch, self.spot, self.guards and self.guards.rollout_hook],
            desc=f"rollout {self.step + 1}",
            progress=self.job.run.progress_bar and self.is_main,
            params=params,
            drafter_params=self.drafter_weights,
        )

    def _generate(self, step: int, key: jax.Array, clock: StepClock) -> tuple[StepSamples, int]:
        """The step's groups and the data position after them: generation batches of the next prompts, each
        rolled out and scored, until the collector has the step's groups (one batch unless DAPO's dynamic
        sampling drops groups: tlt_jax.rl.dynamic_sampling). Every batch runs through the same engine, hooks
        and spot trainer, and its time goes to the step's rollout, spot and reward parts."""
        plan, position, params = self.plan, self.data_position, None
        groups = GroupCollector(
            plan.prompts,
            plan.group,
            plan.filter_metric,
            plan.max_gen_batches,
            plan.dynamic_sampling,
            train_short=plan.train_short,
        )
        while not groups.full:
            index = len(groups.batches)
            with clock.phase("rollout"):
                problems, position = self.task.batch(position, plan.gen_prompts or plan.prompts)
                if params is None:  # the rollout's weights, dropped before the update
                    params = self.trainer.rollout_params()
                    if self.spot is not None:  # the drafter trains against this policy's embedding and head
                        self.spot.begin_step(step, params)
                spot_before = self.spot.stats["spot/added_seconds"] if self.spot is not None else 0.0
                rollout = self._rollout(problems, generation_key(key, index), params)
            if self.spot is not None:  # its training between chunks is its own part of the step's time
                added = self.spot.stats["spot/added_seconds"] - spot_before
                clock.carve("rollout", "spot", added, compiled_kind="drafter")
                with clock.phase("spot_after_rollout", part="spot"), compile_stats.scope("drafter"):
                    self.spot.after_rollout()
            with clock.phase("reward"):
                rows = len(problems) * plan.group
                scores = score_rollout(self.task, self.tokenizer, problems, rollout, rows, plan.overlong)
            groups.add(GenBatch(problems, rollout, scores))
        del params
        with clock.phase("reward"):
            return groups.samples(), position

    def _advantages(
        self, samples: StepSamples, clock: StepClock
    ) -> tuple[Advantages, TrainBatch, np.ndarray, dict[str, float]]:
        """The step's advantages, its batch with the log-probs the loss needs, the trainer's old log-probs
        (engine-gap metric) and the KL-in-reward metrics. With KL in the reward (VeRL's use_kl_in_reward)
        the reference and old log-probs come first, over every row, and lower the rewards the advantages
        see (tlt_jax.rl.kl_reward); the adaptive controller's coefficient goes on to the next step."""
        plan, rollout, rewards = self.plan, samples.batch.rollout, samples.batch.scores.rewards
        if plan.reward_kl.coef <= 0:
            with clock.phase("reward"):
                adv = step_advantages(rewards, plan, keep=samples.keep)
                batch = train_batch(rollout, adv, plan)
            with compile_stats.scope("update"), clock.phase("logprob"):
                batch, train_logp = old_logprobs(self.trainer, batch, plan)
            return adv, batch, train_logp, {}
        with clock.phase("reward"):
            every_row = Advantages(np.zeros(plan.rows, np.float32), np.ones(plan.rows, bool))
            batch = train_batch(rollout, every_row, plan)
        with compile_stats.scope("update"), clock.phase("logprob"):
            batch, train_logp = old_logprobs(self.trainer, batch, plan)
        with clock.phase("reward"):
            rewards, kl_metrics, self.reward_kl_coef = reward_kl_penalty(
                rewards, batch, plan.reward_kl, self.reward_kl_coef
            )
            adv = step_advantages(rewards, plan, keep=samples.keep)
            batch = with_advantages(batch, adv.values, adv.keep)
        return adv, batch, train_logp, kl_metrics

    def train_step(self) -> dict[str, float]:
        """Run step `self.step + 1` (the phases in the module docstring); returns its metrics."""
        step, plan = self.step + 1, self.plan
        key = jax.random.fold_in(self.base_key, step)
        clock = StepClock(self.engine, on_phase=lambda name: self.phases.set(step, name))
        samples, next_position = self._generate(step, key, clock)
        problems, rollout, scores = samples.batch.problems, samples.batch.rollout, samples.batch.scores
        adv, batch, train_logp, kl_metrics = self._advantages(samples, clock)
        with clock.phase("update"):
            with compile_stats.scope("update"):
                update = update_policy(self.trainer, batch, rollout.lengths, train_logp, plan)
        self.phases.set(step, "metrics")
        metrics = learning_metrics(step, plan, rollout, scores, adv, update, next_position, clock)
        metrics.update(samples.metrics)  # dynamic sampling's generation batches and groups
        metrics.update(kl_metrics)  # KL in the reward (VeRL's actor/reward_kl_penalty*)
        metrics.update(engine_gap_metrics(rollout, update, self.trainer.loss.fuse_old_logprobs))
        metrics.update(reward_counts(scores.results))  # checker failures, unclosed think blocks
        metrics.update(self.monitor.metrics(step))
        metrics.update(spot_metrics(self.spot))
        metrics.update(selector_metrics(self.selector))
        finish_metrics(metrics, rollout, clock)
        if self.is_main:
            log_samples(self.workdir, step, problems, rollout, scores, self.job.run.log_samples)
            append_timeline(self.workdir, step, self.watch.timeline())
        self.step, self.data_position = step, next_position
        return metrics

    # ---- the loop -----------------------------------------------------------------------------------------
    def train(self) -> str:
        """Run until `config.num_steps`, or until a stop request (SIGTERM/SIGINT to any process) that every
        process agrees on, under the watchdog (tlt_jax.rl.stopping). Returns "done" or "preempted"."""
        num_steps = self.job.run.num_steps
        plots = PlotRefresher(self.workdir, enabled=self.is_main)  # W/plots/run.png (tlt_jax.utils.run_plots)
        status_now = LearnerStatus(self.workdir, self.watch, num_steps)
        heartbeat = Heartbeat(status_now, enabled=self.is_main)  # a line every 10 s of a long phase
        guards = self.guards = LoopGuards(self.job.run)
        self.phases = PhaseTee(self.phases, guards)
        self.trainer.between_parts = guards.update_part
        self._saved_step = self.step  # restored (or step 0: the seed's initial state)
        try:
            with guards, heartbeat:
                if self.step == 0 and self.evaluator is not None and self.evaluator.cfg.due(0, num_steps):
                    before = self._evaluate(guards)  # the policy before any update
                    if before is None:
                        return "preempted"  # (finally: closed) nothing to save: step 0 is the seed's
                    if self.trackers is not None:
                        self.trackers.log(0, before)
                status = self._steps(guards, plots)
                if self.step >= num_steps and self.ckpt.latest_step() != self.step:
                    self.save()  # e.g. resumed at the end of a run that crashed before its final save
            self.phases.set(self.step, "plots")
            plots.final()
        finally:
            self.trainer.between_parts, self.guards = None, None
            self.close()
            guards.finish()
        return status

    def _steps(self, guards: LoopGuards, plots: PlotRefresher) -> str:
        """The steps until `num_steps` ("done") or an agreed stop ("preempted"). Before each step the
        processes agree whether to stop (then the last step is saved unless it is); inside a step they abandon
        it (`StopRequested`: `_abandon` saves the state it started from if no checkpoint holds it) or agree to
        finish and save it; in an evaluation they drop it and save the step (docs/usage.md, "Stopping")."""
        every, num_steps = self.job.run.checkpoint_every, self.job.run.num_steps
        save = lambda start=None: guards.timed_save(  # noqa: E731
            lambda: self.save(start), self.ckpt.background_seconds
        )
        while self.step < num_steps:
            if guards.between_steps(self.step):
                if self._saved_step != self.step:
                    save()
                logging.warning("stop agreed by every process: stopped after step %d (saved)", self.step)
                return "preempted"
            saved = self._saved_step == self.step
            guards.begin_step(saved=saved)
            start = None if saved else StepStart(self.step, self._state(), self._meta())  # references
            try:
                metrics = self.train_step()
            except StopRequested as e:
                self._abandon(guards, e, start, save)
                return "preempted"
            del start
            finishing = guards.end_step()  # agreed mid-step: save this step, skip its eval
            if not finishing and self.evaluator is not None and self.evaluator.cfg.due(self.step, num_steps):
                evaluated = self._evaluate(guards)
                finishing = evaluated is None  # a stop agreed during the evaluation: save the step, stop
                metrics.update(evaluated or {})
            metrics.update(guards.metrics())
            self._log_compiles(metrics)
            if self.trackers is not None:
                self.trackers.log(self.step, metrics)
            if finishing or self.step == num_steps or (every and self.step % every == 0):
                save()
            export_after_step(self, stopping=finishing)  # W/exports/step_N every config.export_every steps
            plots.after_step()  # after the save: a preempted run saves first
        return "done"

    def _evaluate(self, guards: LoopGuards) -> dict[str, float] | None:
        """The evaluations after step `self.step` (its state final), each rollout chunk an agreement point:
        their metrics, or None when the processes agreed there to stop (the evaluation is dropped; the
        caller saves the step before it stops)."""
        self.phases.set(self.step, "eval")
        try:
            with compile_stats.scope("eval"), guards.evaluating(self.step):
                return self.evaluator.run(watchers=[guards.rollout_hook])
        except StopRequested as e:
            saved = f"step {self.step} is saved before stopping" if self.step else "nothing to save"
            logging.warning(
                "stop agreed by every process at %s of step %d's evaluation: evaluation dropped; %s",
                e.where,
                self.step,
                saved,
            )
            return None

    def _abandon(
        self, guards: LoopGuards, e: StopRequested, start: StepStart | None, save: Callable[..., None]
    ) -> None:
        """Step `e.step` abandoned by every process: save the state it started from when no checkpoint holds
        it and the step has not changed it in place (`StepStart`; the decision agreed by every process: the
        save is a collective), else say why not and which steps are lost."""
        if start is None:  # its start is saved: only the partial step is lost
            guards.abandoned(e, self._saved_step)
            return
        why = [f"the step changed its {part} in place (donated)" for part in start.changed()]
        if self.spot is not None and e.step in self.spot.buffer.steps():
            why.append("the spot trainer's data buffer took the step's samples")
        if guards.all_agree(not why):
            save(start)
            guards.abandoned(e, self._saved_step, f"step {start.step}, the state it started from, saved")
            return
        lost = (
            f"steps {self._saved_step + 1}-{start.step}"
            if start.step > self._saved_step + 1
            else (f"step {start.step}")
        )
        reason = "; ".join(why) or "another process could not save it"
        guards.abandoned(e, self._saved_step, f"the state at its start is not saved ({reason}): {lost} lost")

    def _log_compiles(self, metrics: dict[str, float]) -> None:
        """compile/*: what compiled since the last step, per kind (step 1: since the learner was built)."""
        now = compile_stats.compile_log().snapshot()
        metrics.update(now.delta(self._compiles).metrics())
        self._compiles = now

    def close(self) -> None:
        """Wait for the checkpoint writes in flight, close the outputs."""
        self.phases.set(self.step, "close")
        self.ckpt.close()
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None
        self.phases.set(self.step, "closed")
        self.phases.close()


def run_grpo(config: ml_collections.ConfigDict | GrpoConfig, workdir: str) -> str:
    """Train GRPO as configured, in `workdir` (created; resumed from its latest checkpoint if present)."""
    os.makedirs(workdir, exist_ok=True)
    return Learner(config, workdir).train()
