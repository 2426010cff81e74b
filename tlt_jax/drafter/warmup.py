"""Drafter warm-up: a first EAGLE drafter for a target model, trained on the target's own generations.

    python -m tlt_jax.main --config configs/drafter_warmup.py --workdir DIR
    python -m tlt_jax.drafter.warmup --config configs/drafter_warmup.py --workdir DIR   (equivalent)

Phases (each resumable; a rerun with the same workdir skips what is done, and a rerun of a finished workdir
with a larger `train.steps` trains on from its last state, the schedule warm-restarted for the new length):
1. load the target (GGUF / HF dir, or a tiny random model) and its tokenizer;
2. data: the target answers task prompts (chat template; `config.generation`) with the RolloutEngine, which
   records the target's final hidden states as it goes (`EngineConfig.record_hidden`: the prefill's for the
   prompt, each decode step's for the token it fed), so the features cost no second pass; with
   `generation.record_hidden=False` a target forward over prompt + response (packed rows with a block
   mask, fixed shapes; the n responses of a prompt share one copy of it) computes them instead (a third
   of the data time on CPU). Each engine batch is cached as
   `DIR/data/{train,eval}_NNN.npz` (tokens, features in float16, timings), so a rerun reuses it. Held-out
   eval prompts come after the training prompts in the task's order (different problems); by default they
   are sampled like the training data (`eval.temperature=0` gives exact greedy-SD numbers, see
   `evaluate.py`, at the cost of compiling the engine's greedy programs too);
3. acceptance length of the untrained drafter on the held-out data (`DIR/eval_before.json`);
4. training with packing (`train_step.py`), logging to `DIR/metrics.jsonl`; the full train state
   (params + optimizer) is checkpointed in `DIR/train_state` every `train.checkpoint_every` steps;
5. acceptance after training; the drafter's trainable weights go to `DIR/drafter` (DrafterCheckpointer, step =
   train steps) and the numbers to `DIR/drafter_eval.json` (before/after, per-position rates, phase times).

`load_drafter(DIR or DIR/drafter, target_cfg)` restores the trained drafter for the benchmark and RL loop.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from tlt_jax.drafter import train_step as ts
from tlt_jax.drafter.draft_vocab import build_from_warmup, load_draft_vocab
from tlt_jax.drafter.evaluate import AcceptanceEvaluator, AcceptanceResult
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.utils.checkpoint import Checkpointer, DrafterCheckpointer
from tlt_jax.utils.tracking import JsonlTracker, RolloutProgress

DRAFTER_DIR = "drafter"
TRAIN_STATE_DIR = "train_state"
DATA_DIR = "data"
EVAL_BEFORE_FILE = "eval_before.json"
RESULT_FILE = "drafter_eval.json"
PHASE_TIMES_FILE = "phase_times.json"


def _plain(config: Any) -> Any:
    """ConfigDict / Mapping -> plain nested dict (JSON-able)."""
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def _log(msg: str) -> None:
    print(f"[drafter_warmup {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _write_json(path: pathlib.Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=float))
    os.replace(tmp, path)


class PhaseTimes:
    """Wall seconds per phase, accumulated across (re)runs in `DIR/phase_times.json`."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.times: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}

    def add(self, phase: str, seconds: float) -> None:
        self.times[phase] = self.times.get(phase, 0.0) + float(seconds)
        _write_json(self.path, self.times)


# ----------------------------------------------------------------------------------------------------------
# Target


def build_target(config: Any) -> tuple[Transformer, Any]:
    """The target model and tokenizer from `config.model` (path, or a tiny random architecture)."""
    from tlt_jax import config_lib

    return config_lib.build_model_and_tokenizer(config)


def build_engine(config: Any, target: Transformer, tokenizer: Any) -> RolloutEngine:
    """The engine that generates the warm-up data (`config.generation`; it records the target's hidden
    states unless `generation.record_hidden=False`)."""
    gen = config.generation
    return RolloutEngine(
        target,
        EngineConfig(
            max_new_tokens=int(gen.max_new_tokens),
            max_cache_len=int(gen.max_cache_len),
            chunk_steps=int(gen.chunk_steps),
            record_hidden=bool(gen.get("record_hidden", True)),
        ),
        eos_ids=list(tokenizer.eos_token_ids),
        tokenizer=tokenizer,
    )


def target_weights(target: Transformer) -> tuple[jax.Array, jax.Array]:
    """The target's embedding [V, H] and LM head [V, H] (the same array for tied embeddings)."""
    return target.embed[...], target.head_weight()


HiddenFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def shared_prefix_mask(segment_ids: jax.Array, branch_ids: jax.Array) -> jax.Array:
    """[R, S, S] mask for rows packing prompt groups: a segment holds one prompt (branch 0) followed by
    several of its responses (branches 1, 2, ...); a token attends causally within its segment to the
    prompt and to its own branch only, so every response sees exactly `prompt + itself`."""
    base = ts.segment_causal_mask(segment_ids)
    bi, bj = branch_ids[..., :, None], branch_ids[..., None, :]
    return base & ((bj == 0) | (bj == bi))


def make_hidden_fn(target: Transformer) -> HiddenFn:
    """Jitted target forward over packed rows: (tokens, positions, segment_ids, branch_ids) [R, S] ->
    final normed hidden states [R, S, H] (no LM head)."""
    graphdef, params = nnx.split(target, nnx.Param)

    @jax.jit
    def fwd(params, tokens, positions, seg, branch):  # noqa: ANN001, ANN202
        model = nnx.merge(graphdef, params)
        mask = shared_prefix_mask(seg, branch)
        return model(tokens, positions, None, mask, compute_logits=False).hidden

    return lambda tokens, positions, seg, branch: fwd(params, tokens, positions, seg, branch)


def target_hidden_states(
    hidden_fn: HiddenFn,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[Sequence[int]]],
    rows: int,
    seq_len: int,
) -> list[list[np.ndarray]]:
    """Target features [len(prompt) + len(response), H] of every (prompt, response) pair.

    The n responses of a prompt share one copy of the prompt in the packed rows (a segment = the prompt plus
    as many of its responses as fit in `seq_len`; `shared_prefix_mask` keeps the responses apart), which
    saves (n - 1) prompt forwards per prompt; positions restart per segment and continue from the prompt in
    each response, so every state equals that of a forward over `prompt + response` alone. A pair longer
    than `seq_len` is truncated to it. Returns out[prompt][response].
    """
    units: list[tuple[int, list[int]]] = []  # (prompt index, response indices) = one segment
    for g, (p, rs) in enumerate(zip(prompts, responses, strict=True)):
        if len(p) >= seq_len:
            raise ValueError(f"prompt {g} has {len(p)} tokens: forward.seq_len={seq_len} must exceed it")
        cur: list[int] = []
        for k, r in enumerate(rs):
            r_len = min(len(r), seq_len - len(p))
            used = len(p) + sum(min(len(rs[j]), seq_len - len(p)) for j in cur)
            if cur and used + r_len > seq_len:
                units.append((g, cur))
                cur = []
            cur.append(k)
        if cur:
            units.append((g, cur))

    def r_len(g: int, k: int) -> int:
        return min(len(responses[g][k]), seq_len - len(prompts[g]))

    unit_len = [len(prompts[g]) + sum(r_len(g, k) for k in ks) for g, ks in units]
    out: list[list[np.ndarray | None]] = [[None] * len(rs) for rs in responses]
    for idx in ts.epoch_plan(unit_len, seq_len, rows):
        tokens, pos, seg, branch = (np.zeros((rows, seq_len), np.int32) for _ in range(4))
        place = ts.first_fit([unit_len[i] for i in idx], seq_len, rows)
        spans = []
        for j, r, a in place:
            g, ks = units[idx[j]]
            p = np.asarray(prompts[g], np.int32)
            sid = seg[r].max() + 1
            tokens[r, a : a + len(p)] = p
            pos[r, a : a + len(p)] = np.arange(len(p))
            seg[r, a : a + len(p)] = sid
            c = a + len(p)
            for b, k in enumerate(ks, start=1):
                n = r_len(g, k)
                tokens[r, c : c + n] = np.asarray(responses[g][k][:n], np.int32)
                pos[r, c : c + n] = np.arange(len(p), len(p) + n)
                seg[r, c : c + n] = sid
                branch[r, c : c + n] = b
                spans.append((g, k, r, a, len(p), c, n))
                c += n
        hidden = np.asarray(jax.device_get(hidden_fn(*(jnp.asarray(x) for x in (tokens, pos, seg, branch)))))
        for g, k, r, a, lp, c, n in spans:
            out[g][k] = np.concatenate([hidden[r, a : a + lp], hidden[r, c : c + n]])
    return out  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------------------
# Data: generation + target features, cached per engine batch


def _chunk_path(data_dir: pathlib.Path, split: str, chunk: int) -> pathlib.Path:
    return data_dir / f"{split}_{chunk:03d}.npz"


def save_chunk(path: pathlib.Path, samples: Sequence[ts.DrafterSample], meta: Mapping[str, Any]) -> None:
    """Samples -> one npz (concatenated tokens / features / masks + lengths), written atomically."""
    lengths = np.asarray([s.length for s in samples], np.int64)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(
        tmp,
        lengths=lengths,
        tokens=np.concatenate([s.tokens for s in samples]),
        hidden=np.concatenate([s.hidden for s in samples]),
        loss_mask=np.concatenate([s.loss_mask for s in samples]),
        meta=np.asarray(json.dumps(dict(meta))),
    )
    os.replace(tmp, path)


def load_chunk(path: pathlib.Path) -> tuple[list[ts.DrafterSample], dict[str, Any]]:
    with np.load(path) as z:
        lengths, tokens, hidden, mask = z["lengths"], z["tokens"], z["hidden"], z["loss_mask"]
        meta = json.loads(str(z["meta"]))
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    samples = [
        ts.DrafterSample(tokens=tokens[a:b], hidden=hidden[a:b], loss_mask=mask[a:b])
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return samples, meta


def _hidden_dtype(name: str, hidden: np.ndarray) -> np.ndarray:
    if name == "float16":
        if np.abs(hidden).max() < 6e4:
            return hidden.astype(np.float16)
        return hidden.astype(np.float32)  # would overflow float16: keep full precision
    if name == "float32":
        return hidden.astype(np.float32)
    raise ValueError(f"config.forward.hidden_dtype={name!r}: use 'float16' or 'float32'")


def build_split(
    split: str,
    *,
    config: Any,
    task: Any,
    tokenizer: Any,
    engine: RolloutEngine,
    hidden_fn: HiddenFn,
    start: int,
    num_prompts: int,
    n: int,
    temperature: float,
    data_dir: pathlib.Path,
    times: PhaseTimes,
) -> tuple[list[ts.DrafterSample], dict[str, float]]:
    """Generate (or load cached) samples of one split: `num_prompts` task prompts from stream position
    `start`, `n` responses each, in engine batches of `generation.batch_prompts` prompts."""
    gen = config.generation
    bp = int(gen.batch_prompts)
    sampling = SamplingParams(temperature=float(temperature), top_p=float(gen.top_p) if temperature else 1.0)
    key = jax.random.fold_in(jax.random.key(int(config.seed)), 0 if split == "train" else 1)
    samples: list[ts.DrafterSample] = []
    totals = {"generate_s": 0.0, "forward_s": 0.0, "response_tokens": 0.0, "sequences": 0.0, "hit_cap": 0.0}
    num_chunks = -(-num_prompts // bp)
    for c in range(num_chunks):
        path = _chunk_path(data_dir, split, c)
        count = min(bp, num_prompts - c * bp)
        ident = {
            "task": json.dumps(_plain(config.task), sort_keys=True),
            "start": start + c * bp,
            "count": count,
            "n": n,
            "temperature": float(temperature),
            "max_new_tokens": int(gen.max_new_tokens),
            "seed": int(config.seed),
        }
        if path.exists():
            chunk, meta = load_chunk(path)
            old = {k: meta.get(k) for k in ident}
            if old != ident:
                raise ValueError(
                    f"{path} was generated with {old} but this config asks for {ident}: use a new workdir "
                    f"(or delete {data_dir}) when changing the task, prompts or sampling."
                )
        else:
            problems, _ = task.batch(start + c * bp, count)
            prompts = [tokenizer.encode_chat(task.messages(p)) for p in problems]
            t0 = time.perf_counter()
            desc = f"generate {split} {c + 1}/{num_chunks}"
            with RolloutProgress(total=count * n, desc=desc, disable=False, mininterval=10.0) as bar:
                roll = engine.generate(
                    prompts, n=n, key=jax.random.fold_in(key, c), sampling=sampling, progress=bar
                )
            t_gen = time.perf_counter() - t0
            groups = [list(roll.prompt_tokens[i * n]) for i in range(count)]
            resp = [[roll.response(i * n + k) for k in range(n)] for i in range(count)]
            t0 = time.perf_counter()
            seq_len = int(config.forward.seq_len)
            if roll.hidden is not None:  # recorded while generating: every position but the newest token
                hidden = [[roll.features(g * n + k)[:seq_len] for k in range(n)] for g in range(count)]
            else:
                hidden = target_hidden_states(hidden_fn, groups, resp, int(config.forward.rows), seq_len)
            t_fwd = time.perf_counter() - t0
            chunk = []
            for g in range(count):
                for k in range(n):
                    h = hidden[g][k]
                    seq = np.asarray(groups[g] + resp[g][k], np.int32)[: len(h)]
                    m = np.arange(len(h)) >= len(groups[g])
                    chunk.append(ts.DrafterSample(seq, _hidden_dtype(config.forward.hidden_dtype, h), m))
            meta = {
                **ident,
                "generate_s": t_gen,
                "forward_s": t_fwd,
                "response_tokens": float(roll.lengths.sum()),
                "sequences": float(len(chunk)),
                "hit_cap": float(sum(r == "length" for r in roll.finish_reason)),
            }
            save_chunk(path, chunk, meta)
            times.add(f"generate_{split}", t_gen)
            times.add(f"forward_{split}", t_fwd)
            n_tok = int(roll.lengths.sum())
            _log(
                f"{split} chunk {c + 1}/{num_chunks}: {len(chunk)} sequences, {n_tok} response tokens, "
                f"generate {t_gen:.1f}s ({n_tok / max(t_gen, 1e-9):.0f} tok/s), forward {t_fwd:.1f}s"
            )
        samples.extend(chunk)
        for k in totals:
            totals[k] += float(meta.get(k) or 0.0)
    return samples, totals


# ----------------------------------------------------------------------------------------------------------
# Drafter init / save / load


def init_drafter(target: Transformer, seed: int) -> Drafter:
    """A new (randomly initialised, as in EAGLE) drafter for `target`. Measured on SmolLM2: copying the
    target's last decoder layer into it instead trains far worse (accept length 1.12 vs 1.55 after 100
    steps), since that layer expects the un-normalised residual stream, not fc(embedding, final feature)."""
    return Drafter(target.cfg, nnx.Rngs(params=seed))


def drafter_params_dict(params: nnx.State) -> dict[str, Any]:
    """The drafter's nnx.Param state as a plain nested dict of arrays (what DrafterCheckpointer stores)."""
    return nnx.to_pure_dict(params)


def _drafter_dir(path: str | os.PathLike) -> pathlib.Path:
    p = pathlib.Path(path)
    return p / DRAFTER_DIR if (p / DRAFTER_DIR).is_dir() else p


def load_drafter(
    workdir_or_dir: str | os.PathLike, target_cfg: ModelConfig, step: int | None = None
) -> Drafter:
    """Restore a warm-up (or RL) drafter: `workdir_or_dir` is the warm-up workdir or its `drafter/` folder.

    Builds `Drafter(target_cfg)` and fills its trainable weights from the latest (or given) checkpoint step;
    a drafter saved for a different target architecture fails with a message naming the mismatched leaves.
    """
    directory = _drafter_dir(workdir_or_dir)
    ckpt = DrafterCheckpointer(directory, async_save=False)
    try:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(
                f"no drafter checkpoint in {directory}: run the warm-up first "
                "(python -m tlt_jax.main --config configs/drafter_warmup.py --workdir DIR)."
            )
        drafter = Drafter(target_cfg, nnx.Rngs(0))
        state = nnx.state(drafter, nnx.Param)
        restored = ckpt.restore(step, template=nnx.to_pure_dict(state))
    finally:
        ckpt.close()
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(drafter, state)
    return drafter


# ----------------------------------------------------------------------------------------------------------
# Training


def _state_leaves(state: ts.TrainState) -> dict[str, Any]:
    """The train state as a flat {index: array} dict (restored into a fresh state's tree structure)."""
    return {f"{i:05d}": x for i, x in enumerate(jax.tree.leaves(state))}


def _restore_state(ckpt: Checkpointer, fresh: ts.TrainState) -> ts.TrainState:
    leaves, treedef = jax.tree.flatten(fresh)
    restored, _ = ckpt.restore(abstract_state=_state_leaves(fresh))
    return jax.tree.unflatten(treedef, [restored[f"{i:05d}"] for i in range(len(leaves))])


def loss_token_budget(
    samples: Sequence[ts.DrafterSample], seq_len: int, rows: int, setting: int
) -> int | None:
    """The step's static loss-position budget: setting > 0 is used as is, 0 means every position (None),
    -1 (auto) sizes it from the data: the share of loss pairs in the packed tokens plus 15% slack, rounded
    up to 64 and at least the largest sample's loss pairs, so batches stay full and nothing is dropped."""
    full = rows * seq_len
    if setting > 0:
        return min(setting, full)
    if setting == 0 or not samples:
        return None
    if setting != -1:
        raise ValueError(f"config.train.max_loss_tokens={setting}: use -1 (auto), 0 (all positions) or > 0")
    tokens = sum(min(s.length, seq_len) for s in samples)
    pairs = [ts.loss_pairs(s, seq_len) for s in samples]
    k = max(int(np.ceil(sum(pairs) / tokens * full * 1.15 / 64)) * 64, max(pairs))
    return None if k >= full else k


def _batch_plan(
    samples: Sequence[ts.DrafterSample], seq_len: int, rows: int, seed: int, max_loss: int | None = None
) -> Callable[[int], list[int]]:
    """Step -> sample indices of its packed batch: shuffled epochs, deterministic given (seed, step)."""
    lengths = [s.length for s in samples]
    counts = [ts.loss_pairs(s, seq_len) for s in samples]
    plans: dict[int, list[list[int]]] = {}
    offsets = [0]  # first step of each epoch

    def epoch(e: int) -> list[list[int]]:
        if e not in plans:
            plans.clear()
            rng = np.random.default_rng([seed, e])
            plans[e] = ts.epoch_plan(lengths, seq_len, rows, rng, counts, max_loss)
        return plans[e]

    def at(step: int) -> list[int]:
        e = len(offsets) - 1
        while step < offsets[e]:
            e -= 1
        while step >= offsets[e] + len(epoch(e)):
            if e + 1 == len(offsets):
                offsets.append(offsets[e] + len(epoch(e)))
            e += 1
        return epoch(e)[step - offsets[e]]

    return at


def train(
    config: Any,
    workdir: pathlib.Path,
    target: Transformer,
    train_samples: Sequence[ts.DrafterSample],
    eval_samples: Sequence[ts.DrafterSample],
    tracker: JsonlTracker,
    draft_vocab: np.ndarray | None = None,
) -> tuple[nnx.GraphDef, ts.TrainState, dict[str, float]]:
    """Train (or resume training) the drafter for `train.steps` steps; returns (graphdef, state, stats).

    With `draft_vocab` (and `train.ce_draft_vocab`), the soft cross-entropy compares the target's and the
    drafter's distributions over those tokens only: the drafter head the engine runs (FR-Spec style), and a
    6x cheaper LM head in every training step.
    """
    tc = config.train
    tx, sched = ts.optimizer_from_config(tc)
    drafter = init_drafter(target, int(config.seed))
    graphdef, state = ts.init_train_state(drafter, tx)
    ckpt = Checkpointer(workdir / TRAIN_STATE_DIR, max_to_keep=1)
    start = ckpt.latest_step() or 0
    if start:
        state = _restore_state(ckpt, state)
        _log(f"resumed drafter training at step {start}")
    tracker.truncate_from(start + 1)
    steps = int(tc.steps)
    stats: dict[str, float] = {"train_tokens": 0.0, "train_seconds": 0.0}
    if start >= steps:
        ckpt.close()
        return graphdef, state, stats
    embed_w, head_w = target_weights(target)
    if draft_vocab is not None and bool(tc.get("ce_draft_vocab", False)):
        head_w = head_w[jnp.asarray(draft_vocab, jnp.int32)]
    max_loss = loss_token_budget(train_samples, int(tc.seq_len), int(tc.rows), int(tc.max_loss_tokens))
    ce_tokens = int(tc.ce_tokens) if int(tc.ce_tokens) > 0 else None
    if ce_tokens is not None:
        ce_tokens = min(ce_tokens, max_loss or int(tc.rows) * int(tc.seq_len))
    loss_cfg = ts.LossConfig(
        w_feat=float(tc.w_feat),
        w_ce=float(tc.w_ce),
        max_loss_tokens=max_loss,
        ce_tokens=ce_tokens,
        feature_noise=float(tc.feature_noise),
        ttt_steps=int(tc.get("ttt_steps", 0)),
        ttt_positions=int(tc.get("ttt_positions", 64)),
        ttt_weight=float(tc.get("ttt_weight", 1.0)),
    )
    _log(
        f"training: max_loss_tokens={max_loss}, ce_tokens={ce_tokens} per step of {tc.rows}x{tc.seq_len}, "
        f"chain steps trained {1 + loss_cfg.ttt_steps}, CE over "
        f"{head_w.shape[0] if head_w.shape[0] != target.cfg.vocab_size else 'the full'} vocabulary"
    )
    step_fn = ts.make_train_step(graphdef, tx, loss_cfg)
    plan = _batch_plan(train_samples, int(tc.seq_len), int(tc.rows), int(config.seed), max_loss)
    ec = config.eval
    eval_budget = loss_token_budget(eval_samples, int(ec.seq_len), int(ec.rows), -1)
    eval_loss = ts.make_eval_loss(
        graphdef,
        dataclasses.replace(
            loss_cfg, max_loss_tokens=eval_budget, ce_tokens=None, feature_noise=0.0, ttt_positions=512
        ),
    )
    log_every = max(1, int(tc.log_every))
    acc: dict[str, float] = {}
    t_window = time.perf_counter()
    t_start = time.perf_counter()
    bar = tqdm(total=steps, initial=start, desc="drafter train", file=sys.stderr, mininterval=5.0)
    try:
        for step in range(start, steps):
            batch, _ = ts.pack_samples(
                [train_samples[i] for i in plan(step)],
                int(tc.seq_len),
                int(tc.rows),
                train_samples[0].hidden_size,
                max_loss,
            )
            state, m = step_fn(state, ts.to_device(batch), embed_w, head_w)
            for k, v in m.items():
                acc[k] = acc.get(k, 0.0) + float(v)
            bar.update(1)
            done = step + 1
            if done % log_every == 0 or done == steps:
                n = log_every if done % log_every == 0 else done % log_every
                dt = time.perf_counter() - t_window
                tok = acc.get("num_tokens", 0.0)
                row = {f"train/{k}": v / n for k, v in acc.items() if k != "num_tokens"}
                row.update(
                    {
                        "train/lr": float(sched(step)),
                        "train/loss_tokens_per_s": tok / max(dt, 1e-9),
                        "train/step_s": dt / n,
                    }
                )
                tracker.log(done, row)
                bar.set_postfix_str(
                    f"loss {row['train/loss']:.3f} ce {row['train/ce']:.3f} top1 {row['train/top1_acc']:.3f}",
                    refresh=False,
                )
                stats["train_tokens"] += tok
                acc, t_window = {}, time.perf_counter()
            if done % max(1, int(tc.checkpoint_every)) == 0 or done == steps:
                ckpt.save(done, _state_leaves(state))
    finally:
        bar.close()
        ckpt.close()
    stats["train_seconds"] = time.perf_counter() - t_start
    # held-out loss / top-1 after training
    held = [
        jax.device_get(eval_loss(state.params, ts.to_device(b), embed_w, head_w))
        for b in ts.iterate_packed(eval_samples, int(ec.seq_len), int(ec.rows), max_loss_tokens=eval_budget)
    ]
    if held:
        w = np.asarray([float(h["num_tokens"]) for h in held])
        for k in sorted(set(held[0]) - {"num_tokens", "dropped_tokens"}):
            vals = np.asarray([float(h[k]) for h in held])
            stats[f"heldout_{k}"] = float(np.sum(vals * w) / max(w.sum(), 1.0))
    return graphdef, state, stats


# ----------------------------------------------------------------------------------------------------------
# The job


def _evaluate(
    evaluator: AcceptanceEvaluator,
    params: nnx.State,
    samples: Sequence[ts.DrafterSample],
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


def run(config: Any, workdir: str | os.PathLike) -> str:
    """Run (or resume) the drafter warm-up in `workdir`; returns "done". See the module docstring."""
    from tlt_jax.tasks import make_task

    wd = pathlib.Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    data_dir = wd / DATA_DIR
    data_dir.mkdir(exist_ok=True)
    times = PhaseTimes(wd / PHASE_TIMES_FILE)
    result_path = wd / RESULT_FILE
    finished = json.loads(result_path.read_text()) if result_path.exists() else {}
    if finished.get("complete"):
        trained = int(finished.get("drafter_checkpoint", {}).get("step", 0))
        if trained >= int(config.train.steps):
            _log(f"already complete: {result_path}")
            return "done"
        # a longer schedule for a finished workdir: training resumes from its last state (the cosine
        # schedule is recomputed for the new length: a warm restart), on the cached data plus any new prompts
        _log(f"extending the finished warm-up from {trained} to {int(config.train.steps)} training steps")
    tracker = JsonlTracker(wd)
    tracker.log_config(config)
    t_run = time.perf_counter()

    t0 = time.perf_counter()
    target, tokenizer = build_target(config)
    times.add("load_target", time.perf_counter() - t0)
    _log(
        f"target: {target.cfg.num_layers} layers, hidden {target.cfg.hidden_size}, "
        f"vocab {target.cfg.vocab_size}"
    )

    # ---- data
    gen = config.generation
    task = make_task(config.task)
    engine = build_engine(config, target, tokenizer)
    hidden_fn = make_hidden_fn(target)
    common = dict(
        config=config,
        task=task,
        tokenizer=tokenizer,
        engine=engine,
        hidden_fn=hidden_fn,
        data_dir=data_dir,
        times=times,
    )
    n_train, n_eval = int(gen.num_prompts), int(config.eval.num_prompts)
    if n_train + n_eval > len(task):
        raise ValueError(
            f"{n_train} training + {n_eval} held-out prompts exceed the task's {len(task)} problems: raise "
            "config.task.size (held-out prompts are the last ones of the task's order, never trained on)."
        )
    # training data first: the held-out batch (often smaller) then reuses the engine programs compiled for
    # the smaller batch buckets that compaction visits
    train_samples, train_data = build_split(
        "train", start=0, num_prompts=n_train, n=int(gen.n), temperature=float(gen.temperature), **common
    )
    eval_samples, eval_data = build_split(
        "eval",
        start=len(task) - n_eval,
        num_prompts=n_eval,
        n=int(config.eval.n),
        temperature=float(config.eval.temperature),
        **common,
    )
    del engine
    _log(
        f"data: {len(train_samples)} train sequences ({int(train_data['response_tokens'])} response tokens), "
        f"{len(eval_samples)} held-out ({int(eval_data['response_tokens'])})"
    )

    # ---- the drafter head's reduced vocabulary (tlt_jax.drafter.draft_vocab): the target's most frequent
    # generated tokens; used by the training CE (train.ce_draft_vocab), the sampled evaluation and rollouts
    vocab_size = int(config.get("draft_vocab_size", 0))
    vocab_path, draft_vocab = None, None
    if vocab_size > 0:
        vocab_path = build_from_warmup(
            wd, min(vocab_size, target.cfg.vocab_size), target.cfg.vocab_size, tokenizer.eos_token_ids
        )
        draft_vocab = load_draft_vocab(wd)
        _log(f"draft vocabulary ({vocab_size} most frequent generated tokens): {vocab_path}")

    # ---- eval before
    drafter0 = init_drafter(target, int(config.seed))
    graphdef, params0 = nnx.split(drafter0, nnx.Param)
    ec = config.eval
    # sampled acceptance at the data's sampling settings (what rejection-sampled chains in rollouts get)
    eval_sp = SamplingParams(temperature=float(ec.temperature), top_p=float(gen.top_p))
    evaluator = AcceptanceEvaluator(
        graphdef, int(ec.depth), int(ec.seq_len), int(ec.rows), sampling=eval_sp, draft_vocab=draft_vocab
    )
    before_path = wd / EVAL_BEFORE_FILE
    before: AcceptanceResult | None = None
    if not bool(ec.get("before", True)):
        _log("before training: skipped (config.eval.before=False; an untrained drafter accepts ~nothing)")
    elif before_path.exists():
        before = AcceptanceResult(**json.loads(before_path.read_text()))
    else:
        t0 = time.perf_counter()
        before = _evaluate(evaluator, params0, eval_samples, target)
        times.add("eval_before", time.perf_counter() - t0)
        _write_json(before_path, before.to_dict())
        tracker.log(0, before.metrics("eval/"))
    if before is not None:
        _log(f"before training: {_fmt_eval(before)}")

    # ---- train
    t0 = time.perf_counter()
    graphdef, state, train_stats = train(
        config, wd, target, train_samples, eval_samples, tracker, draft_vocab=draft_vocab
    )
    times.add("train", time.perf_counter() - t0)

    # ---- eval after + save
    t0 = time.perf_counter()
    after = _evaluate(evaluator, state.params, eval_samples, target)
    times.add("eval_after", time.perf_counter() - t0)
    tracker.log(int(config.train.steps), after.metrics("eval/"))
    _log(f"after {int(config.train.steps)} steps: {_fmt_eval(after)}")
    saver = DrafterCheckpointer(wd / DRAFTER_DIR, max_to_keep=1)
    info = saver.save(
        int(config.train.steps),
        drafter_params_dict(state.params),
        meta={
            "target": dataclasses.asdict(target.cfg),
            "accept_length": after.accept_length,
            "depth": after.depth,
        },
    )
    saver.close()
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
            "step": int(config.train.steps),
            "blocking_ms": info.blocking_ms,
        },
        "draft_vocab": str(vocab_path) if vocab_path else None,
    }
    _write_json(result_path, summary)
    _log(f"wrote {result_path}; phase seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.times.items()))
    return "done"


def main(argv: Sequence[str]) -> None:
    from absl import app, flags

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {list(argv[1:])}")
    cfg = flags.FLAGS["config"].value
    if cfg.get("job", "drafter_warmup") != "drafter_warmup":
        raise app.UsageError(f"config.job={cfg.job!r}: this entry point runs only 'drafter_warmup'.")
    run(cfg, flags.FLAGS.workdir)


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "configs/drafter_warmup.py[:tiny]", lock_config=True)
    flags.DEFINE_string("workdir", None, "Output directory (resumable).")
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
