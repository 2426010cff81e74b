"""The spot trainer: TLT's adaptive drafter, trained during the rollout on what the rollout produces.

During RL the policy changes every step, so a fixed drafter goes stale. TLT trains the EAGLE drafter online
on the target's own hidden states (the engine records them while it decodes: no second target forward),
using compute the long tail leaves idle, and stops when the rollout ends. The drafter trained during step
t's rollout (on data up to step t) drafts for step t + 1: the learner pushes `params` into the engine
between rollouts, and a rollout drafts with one snapshot.

Data (`on_finished`): every finished sequence streams into a `DrafterBuffer` (one-step offset: this step's
finished sequences plus the previous step's) while the rest still decode. The rollout records the target's
hidden states of `rollout.hidden_window` response tokens of each row (device memory: rows x window x hidden
per device, `rollout_memory_plan.hidden_line`), the first ones or, with `rollout.hidden_span` random / last,
a span at a per-row random depth or the end of the response (`rollout/record.py`: the depths the long tail
drafts at, past any fixed window); the buffer keeps one `spot.window`-token window of each at a uniformly
random depth of that span (`buffer.window_sample`), so a recorded span longer than the window spreads
training over the depths of long responses at the same step shape (`window_problems` checks the two).
Before a step's first update the current drafter is scored on the freshest of that data
(`staleness`: loss, top-1/top-3 accuracy of its next-token guess, i.e. before it has trained on it).

Where the updates run (`SpotConfig.mode`):
- "idle_devices": rollout rows are sharded over the mesh's data axis; after each chunk the engine knows which
  data groups (the model-axis devices of one data index) have no live row. When some are idle and some busy,
  `idle_work` hands the engine a per-group function that it fuses into the next chunk: ONE SPMD program in
  `jax.shard_map`, manual over "data" only, in which busy groups run the decode chunk and idle groups run
  `micro_steps` drafter micro-batches; the idle groups' gradient sums are psum'd over "data" (busy groups
  contribute exact zeros) and the update is applied once, replicated. On a model axis > 1 the policy keeps
  its tensor-parallel sharding (the model axis stays automatic inside the program): decoding groups run
  tensor-parallel as in a plain chunk, and a training group holds the drafter replicated over its model axis
  while the target's embedding and head it trains against stay vocabulary-sharded over it (on XLA:CPU
  that needs whole KV heads per device: `rollout/spmd.py`). Preemption:
  when the rollout ends there is no next chunk, so training stops at the end of a tick's micro-steps. The
  host's part (the staleness probe, packing the micro-batches) is not overlapped and goes into
  `spot/added_seconds`.
- "between_chunks": a data axis of 1 has no idle groups; after each chunk that ended with at most `threshold`
  running rows, `steps_per_chunk` optimizer steps run before the next chunk. Their time is the spot
  trainer's cost and is reported (`spot/added_seconds`), never hidden.
- "after_rollout": `after_rollout_steps` steps once the rollout has ended (cost reported likewise).
- "off": the drafter stays as loaded.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from tlt_jax import sharding as shd
from tlt_jax.drafter import trainer as tr
from tlt_jax.drafter.buffer import DrafterBuffer, window_sample
from tlt_jax.drafter.chain import draft_logits, shift_left
from tlt_jax.drafter.loss import LossConfig, loss_sums, normalize_metrics
from tlt_jax.drafter.packing import DrafterSample, PackedBatch, eagle_inputs, pack_samples, to_device
from tlt_jax.models.eagle3 import AnyDrafter
from tlt_jax.rollout.hooks import ChunkView, FinishedSequences, IdleWork, RolloutHooks, RolloutInfo
from tlt_jax.rollout.interface import EngineLike
from tlt_jax.utils import compile_stats
from tlt_jax.utils.checkpoint import Checkpointer

SPOT_MODES = ("off", "idle_devices", "between_chunks", "after_rollout")


@dataclasses.dataclass(frozen=True)
class SpotConfig:
    """The spot trainer's settings (`config.spot`); see the module docstring for the modes.

    rows x (context + window): one packed micro-batch; `micro_steps` of them per idle device per tick.
    The optimizer is AdamW with a constant learning rate (online training has no horizon); the loss uses
    the paper's online weights 0.5 / 0.5 and the training-time test of the warm-up (`ttt_steps`); `topk` >
    0 adds HASS's top-K distillation (weight `w_topk`, `loss.LossConfig`).
    """

    mode: str = "off"
    micro_steps: int = 1
    steps_per_chunk: int = 1
    threshold: int = 2
    after_rollout_steps: int = 8
    max_steps_per_rollout: int = 64
    rows: int = 2
    window: int = 512
    context: int = 128
    buffer_tokens: int = 262_144
    lr: float = 3e-4
    weight_decay: float = 0.0
    clip_norm: float = 0.5
    w_feat: float = 0.5
    w_ce: float = 0.5
    ce_tokens: int = 256
    ttt_steps: int = 2
    ttt_positions: int = 64
    topk: int = 0
    w_topk: float = 1.0
    eval_samples: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in SPOT_MODES:
            raise ValueError(f"config.spot.mode={self.mode!r}: use one of {SPOT_MODES}.")
        for name in ("micro_steps", "steps_per_chunk", "rows", "window", "max_steps_per_rollout"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.spot.{name}={getattr(self, name)}: must be >= 1.")
        if self.ce_tokens > self.rows * self.seq_len:
            raise ValueError(f"config.spot.ce_tokens={self.ce_tokens} exceeds rows x (context + window)")

    @property
    def seq_len(self) -> int:
        return self.window + self.context

    def loss_config(self) -> LossConfig:
        return LossConfig(
            w_feat=self.w_feat,
            w_ce=self.w_ce,
            ce_tokens=self.ce_tokens or None,
            ttt_steps=self.ttt_steps,
            ttt_positions=self.ttt_positions,
            topk=self.topk,
            w_topk=self.w_topk,
        )

    def optimizer(self) -> optax.GradientTransformation:
        sched = optax.constant_schedule(self.lr)
        return tr.make_optimizer(sched, self.weight_decay, self.clip_norm)


def window_problems(cfg: SpotConfig, hidden_window: int) -> list[str]:
    """`spot.window` against `rollout.hidden_window` (the response tokens the rollout records per row): a
    window longer than the recorded span is never filled (a step shape of padding), so with the spot
    trainer on it is refused; a span longer than the window is what covers long responses."""
    if cfg.mode == "off" or cfg.window <= hidden_window:
        return []
    return [
        f"config.spot.window={cfg.window} exceeds config.rollout.hidden_window={hidden_window}, the response "
        "tokens whose hidden states the rollout records per row: no sample can fill it. Raise "
        "rollout.hidden_window (its memory: rows x window x hidden size per device, "
        "tlt_jax.rollout_memory_plan.hidden_line) or lower spot.window."
    ]


def samples_from(seqs: FinishedSequences, window: int, context: int) -> list[DrafterSample]:
    """Finished sequences with recorded hidden states -> drafter samples, token t's state at row t.

    A span that follows the prompt (offset 0): prompt + the recorded response, loss on the response. A later
    span (offset k > 0, `rollout.hidden_span`): response tokens k, k + 1, ... with their states only (the
    tokens between the prompt and k have none); its first min(context, span - window) tokens are the
    context a window drawn from it keeps before itself (no loss), as the prompt's last tokens are for
    offset 0. Positions restart per packed sample either way: the drafter's attention (RoPE) depends on
    distances only, so a window at depth k trains as it is served."""
    if seqs.hidden is None or seqs.prompt_hidden is None:
        raise ValueError(
            "the spot trainer needs the rollout's hidden states: set config.rollout.record_hidden"
        )
    offsets = np.zeros(len(seqs), np.int64) if seqs.hidden_offset is None else seqs.hidden_offset
    out = []
    for prompt, toks, hid, ph, k in zip(
        seqs.prompt_tokens, seqs.tokens, seqs.hidden, seqs.prompt_hidden, offsets, strict=True
    ):
        if k == 0:
            h = np.concatenate([ph, hid]).astype(np.float16)
            tokens = np.asarray(list(prompt) + toks.tolist(), np.int32)[: len(h)]
            mask = np.arange(len(h)) >= len(prompt)
        else:
            h = hid.astype(np.float16)
            tokens = np.asarray(toks[k : k + len(h)], np.int32)
            mask = np.arange(len(h)) >= min(context, max(len(h) - window, 0))
        out.append(DrafterSample(tokens=tokens, hidden=h, loss_mask=mask))
    return out


def topk_hits(
    graphdef: Any,
    params: Any,
    batch: PackedBatch,
    embed_w: jax.Array,
    head_w: jax.Array,
    vocab: jax.Array | None,
) -> dict[str, jax.Array]:
    """Staleness probe: how often the token the target really sampled two positions on is the drafter's
    top-1 / in its top-3 (its first draft's acceptance under coupled verification), over the batch's pairs.

    By rank, not by `lax.top_k`: the target token's rank is the number of logits above its own (one pass over
    the vocabulary; ties count in its favour). XLA:CPU's top_k over [8, 512, 49,152] logits took ~60 s, the
    whole of a tail rollout's time (2026-11-24). With a reduced draft vocabulary a token outside it misses."""
    e = eagle_inputs(batch)
    drafter = nnx.merge(graphdef, params)
    h, _ = drafter(embed_w[e.next_tokens], e.hidden_in, e.positions, None, e.mask)
    logits = draft_logits(drafter, h.astype(jnp.float32), head_w.astype(jnp.float32))  # [R, S, V or Vd]
    nxt = shift_left(e.next_tokens, -1)  # x_{t+2}
    col, known = nxt, jnp.ones(nxt.shape, bool)
    if vocab is not None:  # the token's column in the draft head (-1: not in the draft vocabulary)
        where = jnp.full((embed_w.shape[0],), -1, jnp.int32).at[vocab].set(jnp.arange(vocab.shape[0]))
        col = where[jnp.maximum(nxt, 0)]
        known = col >= 0
    own = jnp.take_along_axis(logits, jnp.maximum(col, 0)[..., None], axis=-1)
    rank = jnp.sum(logits > own, axis=-1)
    ok = e.valid & shift_left(e.valid, False)
    hit1 = (rank == 0) & known & ok
    hit3 = (rank < 3) & known & ok
    return {"top1": jnp.sum(hit1), "top3": jnp.sum(hit3), "count": jnp.sum(ok)}


class SpotTrainer(RolloutHooks):
    """Online drafter training inside the RL loop (see the module docstring). A rollout hook."""

    def __init__(self, cfg: SpotConfig, drafter: AnyDrafter, engine: EngineLike):
        if cfg.mode == "idle_devices" and engine.data_size < 2:
            raise ValueError(
                "config.spot.mode=idle_devices needs a data axis of >= 2 devices (groups of the model axis "
                f"go idle by data index); this mesh is data={engine.data_size}, "
                f"model={engine.mesh.shape['model']}. With data=1 use spot.mode=between_chunks (or "
                "after_rollout)."
            )
        if cfg.mode != "off" and not engine.config.record_hidden:
            raise ValueError(
                "the spot trainer trains on the rollout's hidden states: set config.rollout.record_hidden"
            )
        if problems := window_problems(cfg, engine.config.hidden_window):
            raise ValueError(problems[0])
        self.cfg, self.engine = cfg, engine
        self.tx, self.loss_cfg = cfg.optimizer(), cfg.loss_config()
        self.trainer = tr.DrafterTrainer(self.tx, self.loss_cfg, seed=cfg.seed)
        # replicated over the engine's mesh, like the target's embedding and head it trains against; a copy
        # (may_alias=False): the train step donates its state, and the engine may hold the same buffers. With
        # several processes the mesh spans all of them: put_global puts the host copy of this process's fresh
        # state (equal in every process)
        self.state = shd.put_global(self.trainer.init_state(drafter), engine.replicated, may_alias=False)
        self.buffer = DrafterBuffer(cfg.buffer_tokens, cfg.window, cfg.context, seed=cfg.seed)
        self.rl_step = 0
        self._probe = jax.jit(topk_hits, static_argnums=(0,))
        self._eval = jax.jit(lambda p, b, e, h: self._loss_sums(p, b, e, h))
        self._new_stats()

    def warm_start(self, train_state_dir: str | pathlib.Path) -> bool:
        """Carry the warm-up's AdamW moments (and their step count) into the spot trainer's optimizer.

        The drafter's weights come from the warm-up; without its moments the first online steps are Adam's
        cold-start steps of ~lr * sign(g) on 2-row micro-batches, which move a converged drafter off its
        optimum (measured: -6% acceptance over 4 RL steps with fresh moments, docs/benchmarks.md). Needs the
        warm-up's `train_state/` (same optimizer chain: clipping + AdamW); returns False, changing nothing,
        when there is none. Params, step and key stay the spot trainer's own.
        """
        d = pathlib.Path(train_state_dir)
        if not d.is_dir():
            return False
        ckpt = Checkpointer(d, max_to_keep=1)
        try:
            if ckpt.latest_step() is None:
                return False
            try:
                warm = self.trainer.restore(ckpt, like=self.state)
            except (ValueError, KeyError) as e:
                raise ValueError(
                    f"the warm-up optimizer state in {d} does not fit the spot trainer's optimizer "
                    f"(clip_norm / weight decay chain or drafter shapes differ): {e}"
                ) from e
        finally:
            ckpt.close()
        self.state = self.state.replace(opt_state=warm.opt_state)
        return True

    # ---- the learner's side ----
    @property
    def params(self) -> Any:
        """The drafter's current trainable params (push them into the engine for the next rollout)."""
        return self.state.params

    def begin_step(self, rl_step: int, params: Any | None = None) -> None:
        """Called before step `rl_step`'s rollout with the policy's weights (default: the engine's own): the
        target's embedding/head of this policy version, what the drafter trains against."""
        self.rl_step = int(rl_step)
        model = self.engine.model(params)
        head = model.head_weight()
        vocab = self.engine.draft_vocab
        self.embed_w, self.head_w = model.embed[...], head if vocab is None else jnp.take(head, vocab, axis=0)
        self._new_stats()

    def _new_stats(self) -> None:
        self.stats: dict[str, float] = {
            "spot/steps": 0.0,
            "spot/added_seconds": 0.0,
            "spot/idle_device_s": 0.0,
            "spot/used_device_s": 0.0,
            "spot/trained_tokens": 0.0,
        }
        self._updates: list[dict[str, float]] = []  # normalised metrics of each update
        self._fresh: list[DrafterSample] = []
        self._rollout_steps = 0
        self._idle_at_start = 0  # devices (of data groups) with no live row at the start of the next chunk

    def metrics(self) -> dict[str, float]:
        """This step's spot-training metrics (loss / accuracy of its updates, staleness, cost, buffer)."""
        out = dict(self.stats)
        for k in self._updates[0] if self._updates else ():
            if k not in ("num_tokens", "dropped_tokens", "grad_norm"):
                out[f"spot/{k}"] = float(np.mean([u[k] for u in self._updates]))
        out.update(self.buffer.stats())
        out["spot/drafter_step"] = float(self.state.step)
        return out

    # ---- data ----
    def on_finished(self, seqs: FinishedSequences) -> None:
        if self.cfg.mode == "off":
            return
        samples = samples_from(seqs, self.cfg.window, self.cfg.context)
        # the staleness probe's samples, cut as the buffer cuts them (any prompt and response length)
        scorable = [x for x in samples if x.num_response >= 2][
            : max(self.cfg.eval_samples - len(self._fresh), 0)
        ]
        rng = np.random.default_rng([self.cfg.seed, self.rl_step, len(self._fresh)])
        self._fresh.extend(window_sample(x, self.cfg.window, self.cfg.context, rng) for x in scorable)
        self.buffer.add(samples, self.rl_step, response_lens=[len(t) for t in seqs.tokens])

    def _staleness(self) -> None:
        """Score the current drafter on the step's first finished samples before training on them."""
        if "spot/stale_top1" in self.stats or not self._fresh:
            return
        batch, _ = pack_samples(self._fresh, self.cfg.seq_len, self.cfg.eval_samples)  # static shape
        b = to_device(batch)
        hits = shd.to_host_tree(
            self._probe(
                self.trainer.graphdef,
                self.state.params,
                b,
                self.embed_w,
                self.head_w,
                self.engine.draft_vocab,
            )
        )
        sums = shd.to_host_tree(self._eval(self.state.params, b, self.embed_w, self.head_w))
        if float(hits["count"]) == 0:
            return
        n = float(hits["count"])
        self.stats["spot/stale_top1"] = float(hits["top1"]) / n
        self.stats["spot/stale_top3"] = float(hits["top3"]) / n
        self.stats["spot/stale_loss"] = float(normalize_metrics(sums)["loss"])

    def _loss_sums(self, params: Any, batch: PackedBatch, embed_w: jax.Array, head_w: jax.Array) -> Any:
        return loss_sums(params, self.trainer.graphdef, batch, embed_w, head_w, self.loss_cfg)[1]

    def _batch(self, tick: int, device: int, micro: int) -> PackedBatch:
        rng = np.random.default_rng([self.cfg.seed, self.rl_step, tick, device, micro])
        return self.buffer.sample_packed(self.cfg.seq_len, self.cfg.rows, rng)[0]

    def _budget_left(self) -> bool:
        return len(self.buffer) > 0 and self._rollout_steps < self.cfg.max_steps_per_rollout

    def _record(self, metrics: dict[str, Any]) -> None:
        """Keep one update's normalised metrics (loss, feat_loss, ce, top1_acc, ...)."""
        m = {k: float(v) for k, v in shd.to_host_tree(metrics).items()}
        self._updates.append(m)
        self.stats["spot/trained_tokens"] += m["num_tokens"]

    # ---- one device: updates between chunks / after the rollout ----
    def _host_steps(self, k: int) -> None:
        with compile_stats.scope("drafter"):  # compiled inside the rollout, but the drafter's programs
            self._train_steps(k)

    def _train_steps(self, k: int) -> None:
        t0 = time.perf_counter()  # the staleness probe is the spot trainer's cost too
        self._staleness()
        for _ in range(k):
            if not self._budget_left():
                break
            batch = to_device(self._batch(self._rollout_steps, 0, 0))
            self.state, m = self.trainer.step(self.state, batch, self.embed_w, self.head_w)
            self._record(m)
            self._rollout_steps += 1
            self.stats["spot/steps"] += 1
        jax.block_until_ready(self.state)
        self.stats["spot/added_seconds"] += time.perf_counter() - t0

    def on_chunk(self, view: ChunkView) -> None:
        # idle device-seconds on offer: the devices of the data groups that had no live row when this chunk
        # started (counted by `idle_work`, which the scheduler calls before every chunk on a data axis > 1;
        # a group is the model axis' devices of one data index), for the chunk's duration; a group whose rows
        # end inside a chunk is counted from the next one. `used_device_s` counts the same devices when they
        # trained, so used <= idle, and used / idle is the share taken.
        self.stats["spot/idle_device_s"] += self._idle_at_start * view.record.seconds
        self._idle_at_start = 0
        if self.cfg.mode == "between_chunks" and 0 < view.live_rows <= self.cfg.threshold:
            self._host_steps(self.cfg.steps_per_chunk)

    def after_rollout(self) -> None:
        """Called by the learner once the rollout has ended ("after_rollout" mode trains here)."""
        if self.cfg.mode == "after_rollout":
            self._host_steps(self.cfg.after_rollout_steps)

    # ---- a data axis > 1: micro-steps on idle data groups, fused into the next chunk ----
    def idle_work(self, live_per_shard: tuple[int, ...]) -> IdleWork | None:
        """The drafter micro-steps for the data groups with no live row (None: no tick this chunk). Runs per
        data group inside the engine's tick (`spmd.tick_program`); on a model axis > 1 the group's devices
        compute it together (GSPMD over the model axis: the drafter replicated, the target's embedding and
        head vocabulary-sharded) and every collective but the final psum over "data" stays in the group."""
        active = [n == 0 for n in live_per_shard]
        group = self.engine.mesh.shape["model"]  # devices per data group
        self._idle_at_start = group * sum(active) if not all(active) else 0
        if self.cfg.mode != "idle_devices" or not any(active) or all(active) or not self._budget_left():
            return None
        t0 = time.perf_counter()  # host work before the fused chunk (probe, packing) is added to the step
        with compile_stats.scope("drafter"):
            self._staleness()
        d, k = len(live_per_shard), self.cfg.micro_steps
        tick = self._rollout_steps
        batches = [[self._batch(tick, i, j) for j in range(k)] for i in range(d)]
        stacked = jax.tree.map(
            lambda *xs: np.stack(xs), *[jax.tree.map(lambda *ys: np.stack(ys), *row) for row in batches]
        )
        self.stats["spot/added_seconds"] += time.perf_counter() - t0
        graphdef, tx, loss_cfg = self.trainer.graphdef, self.tx, self.loss_cfg

        def per_group(ops: tuple, active_here: jax.Array) -> tuple:
            state, batch, embed_w, head_w = ops
            dev = jax.lax.axis_index("data")
            zero = jax.tree.map(
                jnp.zeros_like,
                jax.eval_shape(
                    lambda: tr.drafter_grads(
                        graphdef,
                        loss_cfg,
                        state.params,
                        jax.tree.map(lambda x: x[0, 0], batch),
                        state.key,
                        embed_w,
                        head_w,
                    )
                ),
            )

            def micro(j: int, acc: tuple) -> tuple:
                b = jax.tree.map(lambda x: x[0, j], batch)
                key = tr.micro_step_key(state.key, state.step, dev, j)
                g, m = tr.drafter_grads_if(
                    active_here, graphdef, loss_cfg, state.params, b, key, embed_w, head_w, axis_name="data"
                )
                return jax.tree.map(jnp.add, acc, (g, m))

            g, m = jax.lax.fori_loop(0, k, micro, zero)
            norm = optax.global_norm(g)  # this group's own gradient (exact zero when busy)
            g, m = jax.lax.psum((g, m), "data")
            return tr.apply_mean_grads(tx, state, g, m["num_tokens"]), m, norm[None]

        def on_done(outputs: tuple, seconds: float) -> None:
            self.state, sums, norms = outputs
            self.last_device_grad_norms = shd.to_host(norms)  # [data], one per data group
            self._record(normalize_metrics(sums))
            self._rollout_steps += 1
            self.stats["spot/steps"] += 1
            self.stats["spot/used_device_s"] += group * sum(active) * seconds

        operands = (self.state, stacked, self.embed_w, self.head_w)
        key = ("spot", k, self.cfg.rows, self.cfg.seq_len, self.embed_w.shape, self.head_w.shape)
        return IdleWork(key, per_group, operands, (P(), P("data"), P(), P()), (P(), P(), P("data")), on_done)

    # ---- checkpoint ----
    def state_dict(self) -> dict[str, Any]:
        """The train state (params, optimizer, step, key) for the learner's checkpoint."""
        return {"state": self.state}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.state = shd.put_global(d["state"], self.engine.replicated, may_alias=False)

    def on_start(self, info: RolloutInfo) -> None:
        del info
        self._rollout_steps = 0
