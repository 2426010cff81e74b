"""The EAGLE drafter loss, written as SUMS over loss pairs so that several devices' gradients add up exactly.

Per loss pair t (see `packing` for the alignment; EAGLE-1, the paper: 0.5/0.5 online, 1.0/0.1 for the
offline warm-up; both weights are config):

    l_t = w_feat * SmoothL1(h^_t, h_{t+1}) + w_ce * softCE(softmax(head(h_{t+1})), log_softmax(head(h^_t)))

with h^_t the drafter's predicted feature (SmoothL1 averaged over the hidden axis, as EAGLE does). The
embedding and LM head are the TARGET's, passed in as arrays under `stop_gradient`: only the drafter's own
parameters (`fc` and its decoder layer) get gradients. The drafter layer runs through
`tlt_jax.drafter.chain` (its own weights; a brute-force test keeps it equal to the `Drafter` module), which
also gives the training-time test (`LossConfig.ttt_steps`): the same per-pair loss at chain steps
j = 2, 3, ... where the drafter's input is its own previous feature, weighted ttt_weight^(j-1) and added.

Gradient convention. `loss_sums` returns S = sum of l_t over the batch's loss pairs (plus the chain steps'
terms) and, in its metrics, N = `num_tokens`, the number of loss pairs. The training loss is S / N, the
mean per loss pair. Both add over batches: for micro-batches b_1..b_D (several idle devices, or several
micro-steps of one), sum_d grad S_d / sum_d N_d is the gradient of one step on the union of their samples
(up to float summation order; tests/drafter/test_trainer.py). So a device returns grad S_d and N_d
unnormalised (`trainer.drafter_grads`), the caller sums both (`lax.psum`) and divides once
(`trainer.mean_grads`). Metrics are likewise sums and counts (`normalize_metrics` turns summed ones into
means).

Subsampled terms are importance-weighted so that they stay estimates of the full sums: with `ce_tokens`, the
soft CE of each of the n_drawn random loss pairs counts n_valid / n_drawn times; the chain steps, run at
`ttt_positions` random eligible positions per row, count each drawn position n_eligible_row / n_drawn_row
times. Both are unbiased, and exact (weight 1) when nothing is subsampled (`ce_tokens=None`,
`ttt_positions >= seq_len`); only then is the union identity above exact for those terms as well.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import chex
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tlt_jax.drafter.chain import ChainContext, draft_logits, shift_by, shift_left, take_rows
from tlt_jax.drafter.packing import EagleInputs, PackedBatch, eagle_inputs
from tlt_jax.models.eagle3 import AnyDrafter


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Loss weights (paper: online 0.5/0.5, offline warm-up 1.0/0.1) and the SmoothL1 beta.

    max_loss_tokens: compute the LM-head terms only at this many loss positions per batch (gathered with a
    static size) instead of at all rows * seq_len positions. The two [positions, vocab] head products are
    most of a step's cost and prompt/padding positions carry no loss, so this is the main lever on CPU. The
    packer must respect it (`pack_samples(..., max_loss_tokens=)`); positions past it would be dropped
    (counted in the `dropped_tokens` metric). None: every position.
    ce_tokens: compute the soft CE (and top-1) on this many valid pairs drawn at random each step (the
    feature loss still covers all of them), importance-weighted: an unbiased estimate of the CE sum at a
    fraction of the head cost.
    feature_noise: EAGLE's data augmentation: uniform noise of this width (U(-a/2, a/2)) added to the INPUT
    features h_t during training, so the drafter tolerates its own imperfect features at later chain steps.
    ttt_steps: the "training-time test" (EAGLE-3, HASS): also train chain steps 2..ttt_steps + 1, where the
    drafter's input feature is its OWN prediction from the previous step (as in rollout) and the token the
    true next one (teacher forcing: an accepted draft is a target sample); see `chain_step_losses`. Without
    it the drafter only ever sees target features and its acceptance falls off after the first draft. Each
    step runs at `ttt_positions` random loss positions per row and its loss is weighted ttt_weight^(j-1).
    topk / w_topk: HASS's harmonised objective distillation (Zhang et al., 2024): beside the soft CE, the CE
    restricted to the target's `topk` most likely tokens, -sum_{x in top-k(p)} p(x) log q(x), weighted
    w_topk, at step 1 and every chain step (0: off). With `ttt_steps` (HASS's harmonised context alignment:
    later steps on the drafter's own features) it is HASS's loss; either architecture takes it.
    """

    w_feat: float = 0.5
    w_ce: float = 0.5
    smooth_l1_beta: float = 1.0
    max_loss_tokens: int | None = None
    ce_tokens: int | None = None
    feature_noise: float = 0.0
    ttt_steps: int = 0
    ttt_positions: int = 64
    ttt_weight: float = 1.0
    topk: int = 0
    w_topk: float = 1.0


def head_logits(hidden: jax.Array, head_w: jax.Array) -> jax.Array:
    """The target's LM head on features: float32 logits [..., V] (head_w is [V, H], as Transformer's)."""
    return jnp.einsum("...h,vh->...v", hidden, head_w, preferred_element_type=jnp.float32)


def per_pair_losses(
    drafter: AnyDrafter,
    batch: PackedBatch,
    embed_w: jax.Array,
    head_w: jax.Array,
    beta: float = 1.0,
    max_loss_tokens: int | None = None,
    ce_tokens: int | None = None,
    rng: jax.Array | None = None,
    feature_noise: float = 0.0,
    ttt_steps: int = 0,
    ttt_positions: int = 64,
    topk: int = 0,
) -> dict[str, jax.Array]:
    """Per-pair losses of a packed batch.

    Returns feat / valid ([R, S], or [max_loss_tokens] when set: the valid pairs gathered first, then padding
    with valid=False), ce / top1 / ce_valid (the same positions, or `ce_tokens` of the valid pairs drawn
    uniformly without replacement with `rng` when set) and ce_weight (a scalar: valid pairs / drawn pairs,
    the CE's importance weight; 1 without subsampling). embed_w [V, H] and head_w [V, H] are the target's
    embedding and LM head; they are stop-gradient here. With `ttt_steps`, also `chain` (a list, one dict
    per chain step 2..ttt_steps + 1, from `chain_step_losses`).

    EAGLE-3 (`drafter.arch == "eagle3"`): the batch's states are [aux ; final] per token; the drafter reads
    the aux part, the target distribution is head_w's over the final part, and head_w must be the target
    head's rows of the drafter's draft vocabulary ([Vd, H]: the target's distribution renormalised over the
    tokens the drafter can propose, as EAGLE-3 trains). No feature regression: `feat` is 0.
    """
    chex.assert_rank([embed_w, head_w], 2)
    if drafter.arch == "eagle3" and head_w.shape[0] != drafter.draft_vocab_size:
        raise ValueError(
            f"EAGLE-3 loss: head_w has {head_w.shape[0]} rows, the drafter's head "
            f"{drafter.draft_vocab_size}: "
            "pass the target head's rows of the draft vocabulary (target.head_weight()[draft_vocab])"
        )
    embed_w = jax.lax.stop_gradient(embed_w)
    head_w = jax.lax.stop_gradient(head_w)
    e = eagle_inputs(batch)
    key = rng if rng is not None else jax.random.key(0)
    key_noise, key_ce, key_ttt = jax.random.split(key, 3)
    h_in = e.hidden_in
    if feature_noise > 0:
        h_in = h_in + feature_noise * (jax.random.uniform(key_noise, h_in.shape, h_in.dtype) - 0.5)
    ctx = ChainContext(drafter, embed_w, e.next_tokens, h_in, e.positions, e.mask)
    h_draft = ctx.h.astype(jnp.float32)
    target, valid = final_state(e.hidden_target, drafter), e.valid
    dropped = jnp.zeros((), jnp.int32)
    if max_loss_tokens is not None:
        flat = valid.reshape(-1)
        n_valid = jnp.sum(flat.astype(jnp.int32))
        idx = jnp.nonzero(flat, size=max_loss_tokens, fill_value=0)[0]
        h_draft = h_draft.reshape(-1, h_draft.shape[-1])[idx]
        target = target.reshape(-1, target.shape[-1])[idx]
        valid = jnp.arange(max_loss_tokens) < n_valid
        dropped = jnp.maximum(n_valid - max_loss_tokens, 0)
    feat = _feature_loss(drafter, h_draft, target, beta)
    h_ce, t_ce, ce_valid, ce_weight = _ce_positions(h_draft, target, valid, ce_tokens, key_ce)
    ce, top1, ce_k = _soft_ce(drafter, h_ce, t_ce, head_w, topk)
    out = {
        "ce_topk": ce_k,
        "feat": feat,
        "valid": valid,
        "ce": ce,
        "top1": top1,
        "ce_valid": ce_valid,
        "ce_weight": ce_weight,
        "dropped": dropped,
    }
    if ttt_steps > 0:
        out["chain"] = chain_step_losses(ctx, e, head_w, ttt_steps, ttt_positions, key_ttt, beta, topk)
    return out


def _ce_positions(
    h: jax.Array, target: jax.Array, valid: jax.Array, ce_tokens: int | None, key: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(features, targets, valid, weight) of the CE: every position, or `ce_tokens` of the valid ones drawn
    uniformly without replacement with `key`, weighted by valid / drawn (1 without subsampling)."""
    if ce_tokens is None:
        return h, target, valid, jnp.ones((), jnp.float32)
    h_flat, t_flat, v_flat = (x.reshape(-1, *x.shape[valid.ndim :]) for x in (h, target, valid))
    if ce_tokens > v_flat.shape[0]:
        raise ValueError(f"ce_tokens={ce_tokens} exceeds the {v_flat.shape[0]} loss positions of a batch")
    scores = jnp.where(v_flat, jax.random.uniform(key, v_flat.shape), -1.0)
    pick = jax.lax.top_k(scores, ce_tokens)[1]
    n_drawn = jnp.sum(v_flat[pick].astype(jnp.float32))
    weight = jnp.sum(v_flat.astype(jnp.float32)) / jnp.maximum(n_drawn, 1.0)
    return h_flat[pick], t_flat[pick], v_flat[pick], weight


def final_state(states: jax.Array, drafter: AnyDrafter) -> jax.Array:
    """The target's final normed state, the last H of a token's recorded states (all of them for EAGLE-1)."""
    return states[..., -drafter.cfg.hidden_size :]


def _feature_loss(drafter: AnyDrafter, h_draft: jax.Array, target: jax.Array, beta: float) -> jax.Array:
    """SmoothL1 per position, averaged over the hidden axis (EAGLE); zeros for EAGLE-3 (no regression: its
    output is not in the target's feature space)."""
    if drafter.arch == "eagle3":
        return jnp.zeros(h_draft.shape[:-1], jnp.float32)
    return jnp.mean(optax.huber_loss(h_draft.astype(jnp.float32), target, delta=beta) / beta, axis=-1)


def _soft_ce(
    drafter: AnyDrafter, h_draft: jax.Array, target: jax.Array, head_w: jax.Array, topk: int = 0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Soft cross-entropy of the drafter's distribution against the target's, top-1 agreement and HASS's
    top-K distillation term -sum_{x in top-k(p)} p(x) log q(x) (zeros when topk is 0)."""
    t_logits = jax.lax.stop_gradient(head_logits(target, head_w))
    d_logits = draft_logits(drafter, h_draft.astype(jnp.float32), head_w)
    p = jax.nn.softmax(t_logits, axis=-1)
    logq = jax.nn.log_softmax(d_logits, axis=-1)
    ce = -jnp.sum(p * logq, axis=-1)
    if topk > 0:
        p_k, idx = jax.lax.top_k(p, min(topk, p.shape[-1]))
        ce_k = -jnp.sum(p_k * jnp.take_along_axis(logq, idx, axis=-1), axis=-1)
    else:
        ce_k = jnp.zeros_like(ce)
    return ce, jnp.argmax(d_logits, axis=-1) == jnp.argmax(t_logits, axis=-1), ce_k


def chain_step_losses(
    ctx: ChainContext,
    e: EagleInputs,
    head_w: jax.Array,
    steps: int,
    positions_per_row: int,
    key: jax.Array,
    beta: float = 1.0,
    topk: int = 0,
) -> list[dict[str, jax.Array]]:
    """Losses of chain steps 2..steps + 1 (the training-time test) at random loss positions of each row.

    Base index i (a valid pair) runs the chain of `tlt_jax.drafter.chain` with the true tokens x_{i+2}, ...
    and the drafter's own features; step j predicts the target feature h_{i+j} and the distribution of
    x_{i+j+1}, and carries loss while pair i + j - 1 is a valid pair of the same sample. Positions are drawn
    uniformly per row (without replacement) among the eligible ones (those whose step 2 is valid); gradients
    flow through the chain (the drafter learns to produce features its own next step can use).
    Returns per step: feat, ce, top1, valid, each [R, P], and weight [R, P]: the row's importance weight
    eligible / drawn positions (1 when every eligible position is drawn, e.g. P >= seq_len).
    """
    r, s = e.valid.shape
    p = min(positions_per_row, s)
    ok = e.valid & shift_left(e.valid, False)
    scores = jnp.where(ok, jax.random.uniform(key, ok.shape), -1.0)
    idx = jax.lax.top_k(scores, p)[1].astype(jnp.int32)  # [R, P]
    sel = take_rows(ok, idx)
    n_ok = jnp.sum(ok.astype(jnp.float32), axis=1, keepdims=True)
    weight = jnp.broadcast_to(
        n_ok / jnp.maximum(jnp.sum(sel.astype(jnp.float32), 1, keepdims=True), 1.0), (r, p)
    )
    feats = ctx.teacher_forced(e.next_tokens, idx, steps + 1)[1:]
    out = []
    for j, h in enumerate(feats, start=2):
        target = take_rows(shift_by(final_state(e.hidden_target, ctx.drafter), j - 1, 0.0), idx)
        valid = sel & take_rows(shift_by(e.valid, j - 1, False), idx)
        ce, top1, ce_k = _soft_ce(ctx.drafter, h, target, head_w, topk)
        feat = _feature_loss(ctx.drafter, h, target, beta)
        out.append({"feat": feat, "ce": ce, "ce_topk": ce_k, "top1": top1, "valid": valid, "weight": weight})
    return out


def loss_sums(
    params: nnx.State,
    graphdef: nnx.GraphDef,
    batch: PackedBatch,
    embed_w: jax.Array,
    head_w: jax.Array,
    loss_cfg: LossConfig,
    rng: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(S, metric sums) of a packed batch: S is the SUM loss of the module docstring (differentiable w.r.t.
    `params` only); the metrics are float32 sums and counts that add over batches and devices:
    num_tokens (N), loss_sum (S), feat_sum, ce_sum / top1_sum over ce_count drawn pairs, dropped_tokens and,
    per chain step j, feat_sum_step{j} / ce_sum_step{j} / top1_sum_step{j} over count_step{j} positions."""
    drafter = nnx.merge(graphdef, params)
    t = per_pair_losses(
        drafter,
        batch,
        embed_w,
        head_w,
        loss_cfg.smooth_l1_beta,
        loss_cfg.max_loss_tokens,
        loss_cfg.ce_tokens,
        rng,
        loss_cfg.feature_noise,
        loss_cfg.ttt_steps,
        loss_cfg.ttt_positions,
        loss_cfg.topk,
    )
    valid, ce_valid = t["valid"].astype(jnp.float32), t["ce_valid"].astype(jnp.float32)
    feat_sum, ce_sum = jnp.sum(t["feat"] * valid), jnp.sum(t["ce"] * ce_valid)
    topk_sum = jnp.sum(t["ce_topk"] * ce_valid)
    ce_terms = loss_cfg.w_ce * ce_sum + loss_cfg.w_topk * topk_sum
    total = loss_cfg.w_feat * feat_sum + t["ce_weight"] * ce_terms
    metrics = {
        "num_tokens": jnp.sum(valid),
        "feat_sum": feat_sum,
        "ce_sum": ce_sum,
        "top1_sum": jnp.sum(t["top1"] * ce_valid),
        "ce_count": jnp.sum(ce_valid),
        "dropped_tokens": t["dropped"].astype(jnp.float32),
    }
    for j, c in enumerate(t.get("chain", []), start=2):
        v = c["valid"].astype(jnp.float32)
        per_pos = loss_cfg.w_feat * c["feat"] + loss_cfg.w_ce * c["ce"] + loss_cfg.w_topk * c["ce_topk"]
        total = total + loss_cfg.ttt_weight ** (j - 1) * jnp.sum(c["weight"] * v * per_pos)
        metrics[f"feat_sum_step{j}"] = jnp.sum(c["feat"] * v)
        metrics[f"ce_sum_step{j}"] = jnp.sum(c["ce"] * v)
        metrics[f"top1_sum_step{j}"] = jnp.sum(c["top1"] * v)
        metrics[f"count_step{j}"] = jnp.sum(v)
    if loss_cfg.topk > 0:
        metrics["topk_sum"] = topk_sum
    metrics["loss_sum"] = total
    return total, metrics


def normalize_metrics(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Metric sums (of one batch, or summed over batches / devices) -> means: loss = loss_sum / num_tokens,
    feat_loss, ce and top1_acc (over the drawn CE pairs), and per chain step j feat_loss_step{j}, ce_step{j},
    top1_acc_step{j}; num_tokens and dropped_tokens stay counts."""

    def div(a: str, b: str) -> jax.Array:
        return jnp.asarray(sums[a], jnp.float32) / jnp.maximum(jnp.asarray(sums[b], jnp.float32), 1.0)

    out = {
        "loss": div("loss_sum", "num_tokens"),
        "feat_loss": div("feat_sum", "num_tokens"),
        "ce": div("ce_sum", "ce_count"),
        **({"ce_topk": div("topk_sum", "ce_count")} if "topk_sum" in sums else {}),
        "top1_acc": div("top1_sum", "ce_count"),
        "num_tokens": jnp.asarray(sums["num_tokens"], jnp.float32),
        "dropped_tokens": jnp.asarray(sums["dropped_tokens"], jnp.float32),
    }
    for k in sums:
        if k.startswith("count_step"):
            j = k.removeprefix("count_step")
            out[f"feat_loss_step{j}"] = div(f"feat_sum_step{j}", k)
            out[f"ce_step{j}"] = div(f"ce_sum_step{j}", k)
            out[f"top1_acc_step{j}"] = div(f"top1_sum_step{j}", k)
    return out


def loss_and_metrics(
    params: nnx.State,
    graphdef: nnx.GraphDef,
    batch: PackedBatch,
    embed_w: jax.Array,
    head_w: jax.Array,
    loss_cfg: LossConfig,
    rng: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One batch's mean loss S / N and its normalised metrics (`loss_sums`, `normalize_metrics`)."""
    total, sums = loss_sums(params, graphdef, batch, embed_w, head_w, loss_cfg, rng)
    return total / jnp.maximum(sums["num_tokens"], 1.0), normalize_metrics(sums)


def make_eval_loss(
    graphdef: nnx.GraphDef, loss_cfg: LossConfig
) -> Callable[[nnx.State, PackedBatch, jax.Array, jax.Array], dict[str, jax.Array]]:
    """Jitted metric SUMS without an update (held-out loss): sum them over batches, then
    `normalize_metrics`."""

    def fn(params, batch, embed_w, head_w):  # noqa: ANN001, ANN202
        return loss_sums(params, graphdef, batch, embed_w, head_w, loss_cfg)[1]

    return jax.jit(fn)
