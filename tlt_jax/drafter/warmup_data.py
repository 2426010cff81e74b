"""Drafter warm-up data: the target answers task prompts and its final hidden states are kept as features.

The task's prompts are fitted to the engine's prompt room when the data loads, on the GRPO learner's code
path (`fit_task`: over-long ones dropped and counted, truncated or refused, never met inside generation).
The target answers them (chat template; `config.generation`) with the RolloutEngine, which records the
target's final hidden states as it goes (`EngineConfig.record_hidden`: the prefill's for the prompt, each
decode step's for the token it fed, over the whole response: `hidden_window = max_new_tokens`) and streams
them to `RecordedSamples` as rows finish, so the features cost no second pass and the host never holds a
whole engine call's states; with `generation.record_hidden=False` a target forward over prompt + response
(packed rows with a block mask, fixed shapes; the n responses of a prompt share one copy of it:
`target_hidden_states`) computes them instead. Every sample is cut to `forward.seq_len` tokens
(`cut_sample`: a long response keeps one window at a seeded random position, so the data covers every depth
of long responses at a bounded size per sequence). Each engine batch is cached as
`DIR/data/{train,eval}_NNN.npz` (tokens, features in float16, timings; `save_chunk` / `load_chunk`), so a
rerun reuses it; the meta says which states they are (arch, capture points, target: `warmup_states`), so a
run of another arch fails at start. Used by `warmup.py` and `experiments/bench/bench_warmup_data.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.drafter.buffer import window_sample
from tlt_jax.drafter.packing import DrafterSample, epoch_plan, first_fit, segment_causal_mask
from tlt_jax.drafter.warmup_config import WarmupConfig
from tlt_jax.drafter.warmup_states import check_recorded_states, states_ident
from tlt_jax.models.build import TextCodec
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FinishedSequences, ProgressHook, RolloutHooks
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.types import Rollout
from tlt_jax.tasks import Task
from tlt_jax.tasks.prompt_fit import fit_prompts
from tlt_jax.utils.tracking import RolloutProgress


def _log(msg: str) -> None:
    print(f"[drafter_warmup {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json(path: pathlib.Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=float))
    os.replace(tmp, path)


class PhaseTimes:
    """Wall seconds per phase, accumulated across (re)runs in `DIR/phase_times.json` (`path` None: in memory
    only, for a reader of a finished warm-up that must not add to its record)."""

    def __init__(self, path: pathlib.Path | None):
        self.path = path
        self.times: dict[str, float] = json.loads(path.read_text()) if path and path.exists() else {}

    def add(self, phase: str, seconds: float) -> None:
        self.times[phase] = self.times.get(phase, 0.0) + float(seconds)
        if self.path is not None:
            write_json(self.path, self.times)


# ----------------------------------------------------------------------------------------------------------
# The engine and the target forward


def warmup_engine(job: WarmupConfig, target: Transformer, tokenizer: TextCodec) -> RolloutEngine:
    """The engine that generates the warm-up data (`config.generation`; it records the target's hidden
    states of the whole response unless `generation.record_hidden=False`: [running rows, max_new_tokens, H]
    on the device, the rows' KV caches' hidden_size / (2 x layers x KV heads x head_dim) share, counted in
    the `kv_budget_gib` cap; streamed to the hooks, not kept in the `Rollout`)."""
    gen = job.generation
    return RolloutEngine(
        target,
        EngineConfig(
            max_new_tokens=gen.max_new_tokens,
            max_cache_len=gen.max_cache_len,
            chunk_steps=gen.chunk_steps,
            max_running_rows=gen.max_running_rows,
            kv_budget_gib=gen.kv_budget_gib,
            record_hidden=gen.record_hidden,
            hidden_window=gen.max_new_tokens,
            keep_hidden=False,  # the states stream to `RecordedSamples`, cut as each row finishes
        ),
        eos_ids=list(tokenizer.eos_token_ids),
        tokenizer=tokenizer,
    )


HiddenFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def shared_prefix_mask(segment_ids: jax.Array, branch_ids: jax.Array) -> jax.Array:
    """[R, S, S] mask for rows packing prompt groups: a segment holds one prompt (branch 0) followed by
    several of its responses (branches 1, 2, ...); a token attends causally within its segment to the
    prompt and to its own branch only, so every response sees exactly `prompt + itself`."""
    base = segment_causal_mask(segment_ids)
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
        return model(tokens, positions, None, mask, compute_logits=False).drafter_states  # EAGLE-3: 4H

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
    for idx in epoch_plan(unit_len, seq_len, rows):
        tokens, pos, seg, branch = (np.zeros((rows, seq_len), np.int32) for _ in range(4))
        place = first_fit([unit_len[i] for i in idx], seq_len, rows)
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


def save_chunk(path: pathlib.Path, samples: Sequence[DrafterSample], meta: Mapping[str, Any]) -> None:
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


def load_chunk(path: pathlib.Path) -> tuple[list[DrafterSample], dict[str, Any]]:
    with np.load(path) as z:
        lengths, tokens, hidden, mask = z["lengths"], z["tokens"], z["hidden"], z["loss_mask"]
        meta = json.loads(str(z["meta"]))
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    samples = [
        DrafterSample(tokens=tokens[a:b], hidden=hidden[a:b], loss_mask=mask[a:b])
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
    raise ValueError(f"job.forward.hidden_dtype={name!r}: use 'float16' or 'float32'")


def build_split(
    split: str,
    *,
    job: WarmupConfig,
    task: Any,
    tokenizer: TextCodec,
    engine: RolloutEngine,
    hidden_fn: HiddenFn,
    start: int,
    num_prompts: int,
    n: int,
    temperature: float,
    data_dir: pathlib.Path,
    times: PhaseTimes,
    states: Mapping[str, Any] | None = None,
) -> tuple[list[DrafterSample], dict[str, float]]:
    """Generate (or load cached) samples of one split: `num_prompts` task prompts from stream position
    `start`, `n` responses each, in engine batches of `generation.batch_prompts` prompts. `states`: what the
    features are (`warmup_states.states_ident`), kept in each chunk's meta."""
    gen = job.generation
    bp = gen.batch_prompts
    sampling = SamplingParams(temperature=float(temperature), top_p=float(gen.top_p) if temperature else 1.0)
    key = jax.random.fold_in(jax.random.key(job.run.seed), 0 if split == "train" else 1)
    samples: list[DrafterSample] = []
    totals = {"generate_s": 0.0, "forward_s": 0.0, "response_tokens": 0.0, "sequences": 0.0, "hit_cap": 0.0}
    num_chunks = -(-num_prompts // bp)
    for c in range(num_chunks):
        path = _chunk_path(data_dir, split, c)
        count = min(bp, num_prompts - c * bp)
        ident = _chunk_ident(job, start + c * bp, count, n, temperature)
        if states is not None:
            ident["states"] = dict(states)
        if path.exists():
            chunk, meta = _load_cached(path, ident, data_dir)
        else:
            problems, _ = task.batch(start + c * bp, count)
            prompts = [task.encode_prompt(p, tokenizer) for p in problems]
            desc = f"{split} {c + 1}/{num_chunks}"
            seed = (job.run.seed, 0 if split == "train" else 1, c)  # with the sequence: its window's draw
            recorded = RecordedSamples(job.forward, seed) if gen.record_hidden else None
            roll, t_gen = _generate(engine, prompts, n, jax.random.fold_in(key, c), sampling, desc, recorded)
            if recorded is not None:  # cut as the rows finished (inside the generation's seconds)
                chunk, t_fwd = recorded.chunk(len(roll.lengths)), recorded.seconds
                t_gen -= t_fwd
            else:
                chunk, t_fwd = _forward_samples(job, roll, count, n, hidden_fn, seed)
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


def _chunk_ident(job: WarmupConfig, start: int, count: int, n: int, temperature: float) -> dict[str, Any]:
    """What a cached chunk was generated from (task, prompt range, sampling, seed): a cached chunk is reused
    only when all of it matches."""
    return {
        "task": json.dumps(dict(job.task), sort_keys=True),
        "start": start,
        "count": count,
        "n": n,
        "temperature": float(temperature),
        "max_new_tokens": job.generation.max_new_tokens,
        "seed": job.run.seed,
        "cut": [job.forward.seq_len, job.forward.context],
    }


def _load_cached(
    path: pathlib.Path, ident: dict[str, Any], data_dir: pathlib.Path
) -> tuple[list[DrafterSample], dict[str, Any]]:
    """A cached chunk and its meta; a chunk generated from other settings (`ident`) is an error (a key its
    meta lacks, from before the key existed, is not compared)."""
    chunk, meta = load_chunk(path)
    old = {k: meta[k] for k in ident if k in meta}
    if old != {k: ident[k] for k in old}:
        raise ValueError(
            f"{path} was generated with {old} but this config asks for {ident}: use a new workdir "
            f"(or delete {data_dir}) when changing the task, prompts or sampling."
        )
    return chunk, meta


def _generate(
    engine: RolloutEngine,
    prompts: list[list[int]],
    n: int,
    key: jax.Array,
    sampling: SamplingParams,
    desc: str,
    hook: RolloutHooks | None,
) -> tuple[Rollout, float]:
    """The target's `n` answers to each prompt (with a progress bar and `hook`); returns the rollout and its
    seconds."""
    t0 = time.perf_counter()
    with RolloutProgress(
        total=len(prompts) * n, desc=f"generate {desc}", disable=False, mininterval=10.0
    ) as bar:
        roll = engine.generate(prompts, n=n, key=key, sampling=sampling, hooks=[ProgressHook(bar), hook])
    return roll, time.perf_counter() - t0


def cut_sample(sample: DrafterSample, seq_len: int, context: int, rng: np.random.Generator) -> DrafterSample:
    """`sample` cut to at most `seq_len` tokens (`config.forward`): unchanged when it fits; else its whole
    response with as much of the prompt's end as fits, or, for a response longer than seq_len - context, one
    window of seq_len - context response tokens at a uniformly random start (`rng`) with the `context` tokens
    before it (`buffer.window_sample`, the spot trainer's cut): long responses are trained on at every depth,
    not only on their first tokens, at a bounded size per sequence."""
    if sample.length <= seq_len:
        return sample
    if sample.num_response == 0:  # nothing to train on: the prompt's end, for the data's counts
        return DrafterSample(sample.tokens[-seq_len:], sample.hidden[-seq_len:], sample.loss_mask[-seq_len:])
    keep = max(int(context), seq_len - sample.num_response)  # the tokens before the window
    return window_sample(sample, seq_len - keep, keep, rng)


def _sample(
    prompt: Sequence[int], response: Sequence[int], hidden: np.ndarray, fw: Any, rng: np.random.Generator
) -> DrafterSample:
    """One training sample: prompt + response tokens with their features [L, H] (L <= their length: the
    recorded path has no state of the newest token), loss on the response, cut to `forward.seq_len`."""
    seq = np.asarray(list(prompt) + list(response), np.int32)[: len(hidden)]
    sample = cut_sample(DrafterSample(seq, hidden, np.arange(len(hidden)) >= len(prompt)), fw.seq_len,
                        fw.context, rng)  # fmt: skip
    return dataclasses.replace(sample, hidden=_hidden_dtype(fw.hidden_dtype, sample.hidden))


class RecordedSamples(RolloutHooks):
    """The recorded path's samples, made as the rows finish: the engine streams each sequence's states
    (`EngineConfig.keep_hidden=False`) and they are cut to `forward.seq_len` on arrival, so the host holds
    the cut samples and one harvest's states instead of a whole engine call's (at 32K tokens on Qwen2.5-7B:
    224 MiB per sequence, 28 GiB for 128). A window is drawn with a generator of (`seed`, sequence id)."""

    def __init__(self, fw: Any, seed: Sequence[int]):
        self.fw, self.seed = fw, tuple(int(x) for x in seed)
        self.samples: dict[int, DrafterSample] = {}
        self.seconds = 0.0

    def on_finished(self, seqs: FinishedSequences) -> None:
        t0 = time.perf_counter()
        if seqs.hidden is None or seqs.prompt_hidden is None:
            raise ValueError("the warm-up's engine records no hidden states (generation.record_hidden)")
        if seqs.hidden_offset is not None and seqs.hidden_offset.any():
            raise ValueError("the warm-up records whole responses: a span after the prompt is a bug")
        for sid, prompt, toks, hid, ph in zip(
            seqs.seq_ids, seqs.prompt_tokens, seqs.tokens, seqs.hidden, seqs.prompt_hidden, strict=True
        ):
            rng = np.random.default_rng([*self.seed, int(sid)])
            self.samples[int(sid)] = _sample(prompt, toks.tolist(), np.concatenate([ph, hid]), self.fw, rng)
        self.seconds += time.perf_counter() - t0

    def chunk(self, total: int) -> list[DrafterSample]:
        """The samples of sequences 0..total-1 in sequence order (every one must have finished)."""
        return [self.samples[i] for i in range(total)]


def _forward_samples(
    job: WarmupConfig, roll: Rollout, count: int, n: int, hidden_fn: HiddenFn, seed: Sequence[int]
) -> tuple[list[DrafterSample], float]:
    """Without recorded states (`generation.record_hidden=False`): the chunk's samples from a target forward
    over prompt + response (`target_hidden_states`), cut as `RecordedSamples` cuts them; returns them and
    the forward's seconds."""
    groups = [list(roll.prompt_tokens[i * n]) for i in range(count)]
    resp = [[roll.response(i * n + k) for k in range(n)] for i in range(count)]
    t0 = time.perf_counter()
    fw = job.forward
    hidden = target_hidden_states(hidden_fn, groups, resp, fw.rows, fw.seq_len)
    t_fwd = time.perf_counter() - t0
    chunk = []
    for g in range(count):
        for k in range(n):
            rng = np.random.default_rng([*seed, g * n + k])
            chunk.append(_sample(groups[g], resp[g][k], hidden[g][k], fw, rng))
    return chunk, t_fwd


def fit_task(job: WarmupConfig, task: Task, tokenizer: TextCodec) -> tuple[Task, int]:
    """`task` fitted to the prompt room the warm-up's engine leaves beside a whole response
    (generation.max_cache_len - max_new_tokens) on the GRPO learner's code path (`tasks.prompt_fit`, as
    `rl.prompt_budget.fit_to_rollout`): over-long prompts dropped when the data loads (the task's
    `filter_overlong_prompts`, on by default; count and longest logged), truncated (`truncation`) or refused
    naming the rows, never met inside generation. Returns it and how many prompts were dropped."""
    gen = job.generation
    what = "config.task (warm-up: generation.max_cache_len - max_new_tokens)"
    fitted = fit_prompts(task, tokenizer, gen.max_cache_len - gen.max_new_tokens, what)
    if dropped := len(task) - len(fitted):
        _log(f"{dropped} of {len(task)} prompts dropped: longer than the engine's prompt room")
    return fitted, dropped


def build_data(
    job: WarmupConfig,
    target: Transformer,
    tokenizer: TextCodec,
    data_dir: pathlib.Path,
    times: PhaseTimes,
    train: bool = True,
) -> tuple[tuple[list[DrafterSample], dict[str, float]], tuple[list[DrafterSample], dict[str, float]]]:
    """((train samples, totals), (held-out samples, totals)): `build_split` of both splits with one engine
    (`train=False`: the held-out split only, the training one ([], {}) and never read).

    Held-out prompts are the last `eval.num_prompts` of the task's order (never trained on)."""
    from tlt_jax.tasks import make_task

    check_recorded_states(job, target, data_dir)  # before anything is compiled or written
    gen = job.generation
    task, dropped = fit_task(job, make_task(job.task), tokenizer)
    n_train, n_eval = gen.num_prompts, job.drafter_eval.num_prompts
    if n_train + n_eval > len(task):
        raise ValueError(
            f"{n_train} training + {n_eval} held-out prompts exceed the task's {len(task)} problems"
            f"{f' ({dropped} over-long ones dropped)' if dropped else ''}: raise config.task.size (a file "
            "task: use more rows, or fewer generation.num_prompts / drafter_eval.num_prompts; held-out "
            "prompts are the last ones of the task's order)."
        )
    engine = warmup_engine(job, target, tokenizer)
    common = dict(
        job=job,
        task=task,
        tokenizer=tokenizer,
        engine=engine,
        hidden_fn=make_hidden_fn(target),
        data_dir=data_dir,
        times=times,
        states=states_ident(job, target),
    )
    # training data first: the held-out batch (often smaller) then reuses the engine programs compiled for
    # the smaller batch buckets that compaction visits
    train_samples, train_data = [], {}
    if train:
        train_samples, train_data = build_split(
            "train", start=0, num_prompts=n_train, n=gen.n, temperature=float(gen.temperature), **common
        )
        train_data["overlong_prompts"] = float(dropped)  # dropped from the task when it loaded
    eval_samples, eval_data = build_split(
        "eval",
        start=len(task) - n_eval,
        num_prompts=n_eval,
        n=job.drafter_eval.n,
        temperature=job.drafter_eval.temperature,
        **common,
    )
    del engine
    return (train_samples, train_data), (eval_samples, eval_data)
