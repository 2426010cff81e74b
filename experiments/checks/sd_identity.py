"""Coupled speculative rollouts vs plain decoding, token for token: what coupling guarantees on this device.

Coupled verification (`SpecConfig.acceptance = "coupled"`, the default) computes at every verified position
the token plain decoding would draw there with the row's own uniform, so a speculative rollout reproduces the
plain rollout with the same keys token for token, up to float rounding between a T-token verify pass and a
1-token decode step. How often that rounding flips a draw depends on the dtype and the device: this script
measures it, as the fraction of sequences identical to plain decoding. The engine's programs run at
`--matmul-precision` (EngineConfig's: "auto" is "highest" for float32 models, so a GPU's TF32 dots do not
apply, and JAX's default for bfloat16, what GPU RL stacks roll out in).

Protocol (as tests/rollout/test_coupled_smollm2.py, from the same building blocks: configs/default.py's
SmolLM2 and chain_sum prompts, the engine, `FixedMode`): `--prompts` x `--samples` sequences of exactly
`--max-new` tokens (EOS ignored) at `--temperature`; one plain rollout, a second plain rollout with the same
keys (the control: any difference there is the device's own nondeterminism, not speculation), then one
speculative rollout per strategy (an EAGLE chain, an EAGLE tree, the n-gram drafter), each speculative for
the whole rollout and with the same keys. The three strategies share one tokens_to_verify by default, so
they share one compiled program. Per strategy: the identical fraction, the first divergence positions, the
accept length, and at each first divergence (up to `--max-gaps` sequences) how far the plain draw's uniform
lies from the CDF boundary between the two tokens, under a full teacher-forced forward: a rounding flip
sits within ~1e-3 of it, an acceptance bug anywhere in [0, 1).

The EAGLE drafter is `--drafter-path` (a warm-up workdir, e.g. the GPU suite's), else an untrained one over
a reduced draft vocabulary (as the test: its drafts are rarely accepted, so the n-gram column carries most
multi-token paths).

    python -m experiments.checks.sd_identity --quick                  # CPU: 4 x 2 sequences x 32 tokens, fp32
    python -m experiments.checks.sd_identity --dtype bfloat16      # 16 x 4 = 64 sequences x 128 tokens, T 0.9
    python -m experiments.checks.sd_identity --drafter-path workdirs/drafter_tlt --json identity.json

Final line: `RESULT dtype=... sequences=... identical_frac_chain=... identical_frac_tree=...
identical_frac_ngram=... identical_frac_min=... identical_frac_plain_rerun=... first_div_median_<s>=...
accept_len_<s>=... max_gap=...`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.lib import harness as h
from tlt_jax.drafter.draft_vocab import load_draft_vocab
from tlt_jax.drafter.warmup import load_drafter
from tlt_jax.models.build import build_model_and_tokenizer
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FixedMode
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.programs import MATMUL_PRECISIONS
from tlt_jax.rollout.sampling import SamplingParams, target_probs
from tlt_jax.rollout.types import Rollout
from tlt_jax.tasks import make_task

ROUNDING_GAP = 1e-3  # a divergence this close to a CDF boundary is a rounding flip (the test's criterion)


def parse_args() -> argparse.Namespace:
    ap = h.parser(__doc__, quick="CPU smoke: 4 prompts x 2 samples x 32 tokens", out=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--top-p", type=float, default=1.0, help="1.0: plain RL sampling (the test uses 0.95)")
    ap.add_argument("--prompts", type=int, default=None, help="distinct prompts (default 16; quick 4)")
    ap.add_argument("--samples", type=int, default=None, help="samples per prompt (default 4; quick 2)")
    ap.add_argument("--max-new", type=int, default=None, help="tokens per sequence (default 128; quick 32)")
    ap.add_argument("--chain", default="3_1_4", help="EAGLE chain depth_topk_tv ('' to skip)")
    ap.add_argument("--tree", default="2_2_4", help="EAGLE tree depth_topk_tv ('' to skip)")
    ap.add_argument("--ngram", default="3_1_4", help="n-gram drafter depth_topk_tv ('' to skip)")
    ap.add_argument("--drafter-path", default="", help="a warmed drafter (warm-up workdir or its drafter/)")
    h.add_model_args(ap)
    ap.add_argument(
        "--matmul-precision",
        default="auto",
        choices=MATMUL_PRECISIONS,
        help="EngineConfig.matmul_precision (auto: highest for float32 models, JAX's default for bfloat16)",
    )
    ap.add_argument("--max-gaps", type=int, default=16, help="divergences checked per strategy (forwards)")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    quick = {"prompts": 4, "samples": 2, "max_new": 32} if args.quick else {}
    for k, v in {"prompts": 16, "samples": 4, "max_new": 128, **quick}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def load_policy(gguf: str, dtype: str, n_prompts: int) -> tuple[Transformer, list[list[int]]]:
    """configs/default.py's SmolLM2 in `dtype` and the token-identity test's chain_sum prompts."""
    cfg = h.load_config("default.py")
    cfg.model.path, cfg.model.dtype = gguf, dtype
    model, tok = build_model_and_tokenizer(cfg)
    task = make_task(dict(kind="reasoning_gym", name="chain_sum", size=max(64, n_prompts), seed=1))
    return model, h.task_prompts(task, tok, 0, n_prompts)[1]


def load_eagle(model: Transformer, path: str) -> tuple[Drafter, np.ndarray | None, str]:
    """The EAGLE drafter for `model`: a warmed one from `path` (its weights cast to the model's dtypes;
    its draft vocabulary if saved), else an untrained one over every 16th token (a cheap draft head)."""
    if not path:
        return Drafter(model.cfg, nnx.Rngs(0)), np.arange(0, model.cfg.vocab_size, 16), "untrained"
    saved = load_drafter(path, model.cfg.replace(dtype="float32"))  # warm-ups save float32 weights
    drafter = Drafter(model.cfg, nnx.Rngs(0))
    fresh = nnx.state(drafter, nnx.Param)
    cast = jax.tree.map(lambda f, s: s.astype(f.dtype), fresh, nnx.state(saved, nnx.Param))
    nnx.update(drafter, cast)
    return drafter, load_draft_vocab(path), path


def divergence_gap(
    model: Transformer, prompt: list[int], key: jax.Array, a: np.ndarray, b: np.ndarray, sp: SamplingParams
) -> tuple[int, float]:
    """(first differing position j, |u * mass - CDF boundary between the two tokens|) from a full forward
    over the shared prefix; u is the plain draw's uniform at j (the engine's per-row key folded with j)."""
    j = int(np.argmax(a != b))
    seq = list(prompt) + a[:j].tolist()
    width = 1 << math.ceil(math.log2(len(prompt) + len(a)))  # one program for every sequence of the run
    toks = np.zeros((1, width), np.int32)
    toks[0, : len(seq)] = seq
    probs = _next_probs(model, jnp.asarray(toks), len(seq) - 1, sp)
    p = np.asarray(probs, np.float64)
    u = float(jax.random.uniform(jax.random.fold_in(key, j), (1,), jnp.float32)[0])
    boundary = np.cumsum(p)[min(int(a[j]), int(b[j]))]
    return j, abs(u * p.sum() - boundary)


@nnx.jit(static_argnums=(3,))
def _next_probs(model: Transformer, toks: jax.Array, at: jax.Array, sp: SamplingParams) -> jax.Array:
    logits = model(toks, jnp.arange(toks.shape[1])[None]).logits[0, at]
    return target_probs(logits[None], sp)[0]


def compare(
    plain: Rollout, out: Rollout, model: Transformer, keys: jax.Array, sp: SamplingParams, max_gaps: int
) -> dict[str, Any]:
    """Identical fraction, first divergence positions and rounding gaps of `out` against `plain`."""
    same = (out.tokens == plain.tokens).all(axis=1) & (out.lengths == plain.lengths)
    bad = np.nonzero(~same)[0]
    first = [int(np.argmax(plain.tokens[i] != out.tokens[i])) for i in bad]
    gaps = [
        divergence_gap(model, out.prompt_tokens[i], keys[i], plain.tokens[i], out.tokens[i], sp)[1]
        for i in bad[:max_gaps]
    ]
    spec = [c for c in out.stats.chunks if c.mode != "plain"]
    rounds = sum(c.verify_rounds for c in spec)
    return {
        "identical_frac": float(same.mean()),
        "diverged": int(bad.size),
        "first_divergence": first,
        "gaps": gaps,
        "rounding_flips": int(sum(g < ROUNDING_GAP for g in gaps)),
        "accept_len": sum(c.accepted_tokens for c in spec) / rounds if rounds else float("nan"),
    }


def build_engine(
    args: argparse.Namespace, model: Transformer, drafter: Drafter, vocab: np.ndarray | None, longest: int
) -> tuple[RolloutEngine, dict[str, str]]:
    """One engine (one cache bucket, EOS ignored) with the three strategies registered; their mode names."""
    cache = 1 << math.ceil(math.log2(longest + args.max_new + 16))
    ecfg = EngineConfig(
        max_new_tokens=args.max_new,
        max_cache_len=cache,
        min_cache_bucket=cache,
        chunk_steps=16,
        matmul_precision=args.matmul_precision,
    )
    engine = RolloutEngine(model, ecfg, eos_ids=[], drafter=drafter, draft_vocab=vocab)
    specs = {"chain": ("eagle", args.chain), "tree": ("eagle", args.tree), "ngram": ("ngram", args.ngram)}
    return engine, {name: engine.add_mode(kind, strat) for name, (kind, strat) in specs.items() if strat}


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    model, prompts = load_policy(args.gguf, args.dtype, args.prompts)
    drafter, draft_vocab, dname = load_eagle(model, args.drafter_path)
    engine, modes = build_engine(args, model, drafter, draft_vocab, max(map(len, prompts)))
    precision = engine.programs.matmul_precision  # what the engine's programs are traced under
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    key = jax.random.key(args.seed)
    seq_keys = jax.random.split(key, len(prompts) * args.samples)  # the engine's per-sequence keys
    dev = jax.devices()[0]
    print(
        f"{h.device_line(kind=True)}; SmolLM2-135M "
        f"{args.dtype}, matmul precision {args.matmul_precision} ({precision or 'JAX default'}); "
        f"{len(prompts)} prompts x {args.samples} samples x {args.max_new} tokens, T {args.temperature}, "
        f"top-p {args.top_p}; drafter {dname}; modes {modes}",
        flush=True,
    )

    def rollout(mode: str) -> tuple[Rollout, float]:
        t = time.perf_counter()
        out = engine.generate(prompts, n=args.samples, key=key, sampling=sp, hooks=FixedMode(mode))
        return out, time.perf_counter() - t

    plain, secs = rollout("plain")
    print(f"plain: {secs:.1f}s", flush=True)
    rerun, _ = rollout("plain")
    results: dict[str, Any] = {"dtype": args.dtype, "sequences": len(plain.tokens), "new": args.max_new}
    results["matmul_precision"] = precision or "default"
    results["identical_frac_plain_rerun"] = float((rerun.tokens == plain.tokens).all(axis=1).mean())
    details: dict[str, Any] = {"meta": {**vars(args), "modes": modes, "device": dev.device_kind}}
    print(f"{'strategy':>8} {'mode':>12} {'identical':>9} {'diverged':>8} {'first div':>10} {'accept':>6} s")
    for name, mode in modes.items():
        out, secs = rollout(mode)
        with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
            d = compare(plain, out, model, seq_keys, sp, args.max_gaps)  # forwards in the engine's numerics
        details[name] = {**d, "mode": mode, "seconds": secs}
        med = float(np.median(d["first_divergence"])) if d["first_divergence"] else float("nan")
        results |= {f"identical_frac_{name}": d["identical_frac"], f"diverged_{name}": d["diverged"]}
        results |= {f"first_div_median_{name}": med, f"accept_len_{name}": d["accept_len"]}
        results[f"rounding_flips_{name}"] = d["rounding_flips"]
        print(
            f"{name:>8} {mode:>12} {d['identical_frac']:>9.3f} {d['diverged']:>8} {med:>10.0f} "
            f"{d['accept_len']:>6.2f} {secs:.0f}  first divergences {d['first_divergence'][:12]}, gaps "
            f"{[f'{g:.1e}' for g in d['gaps'][:6]]}",
            flush=True,
        )
    fracs = [results[f"identical_frac_{n}"] for n in modes]
    results["identical_frac_min"] = min(fracs) if fracs else float("nan")
    gaps = [g for n in modes for g in details[n]["gaps"]]
    results["max_gap"] = max(gaps) if gaps else 0.0
    results["wall_s"] = time.perf_counter() - t0
    path = h.json_path(args)  # the per-strategy details; `result` adds the RESULT dict as "results"
    if path is not None:
        path.write_text(json.dumps({"results": results, **details}, indent=2, default=str))
    h.result(results, args, fmt=".4g")


if __name__ == "__main__":
    main()
