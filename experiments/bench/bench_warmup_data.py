"""Drafter warm-up data: features recorded while generating vs generate + a second target forward.

The drafter trains on the target's final hidden states over prompt + response. The warm-up used to generate
the responses, then run a packed target forward over them (`warmup_data.target_hidden_states`) for the
features; now the engine records them as it generates (`EngineConfig.record_hidden`: the prefill's states for
the prompt, each step's or verify round's states for the tokens it fed). This script builds the same engine
batches both ways in one process, alternating (`--reps` rounds; the first round of each also compiles, so
medians of the later rounds are reported when there are any), and checks that both give the same sequences and
features: identical tokens (per-sequence PRNG streams), features equal to float16 storage and the kernels'
summation order.

    python -m experiments.bench.bench_warmup_data --quick    # one batch of 16 prompts x 4 (~4 minutes)
    python -m experiments.bench.bench_warmup_data            # 2 rounds of 2 batches

Final line: `RESULT data_s_recorded=... data_s_forward=... speedup=... generate_s_recorded=...
generate_s_forward=... forward_s=... max_feature_diff=...`.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

from experiments.lib import harness as h
from tlt_jax import config_schema
from tlt_jax.drafter import warmup, warmup_data
from tlt_jax.tasks import make_task


def main() -> None:
    ap = h.parser(__doc__, quick="one engine batch, one round", out=None)
    ap.add_argument("--prompts", type=int, default=None, help="prompts per build (multiple of 16)")
    ap.add_argument("--reps", type=int, default=None, help="alternating rounds (recorded, forward)")
    args = ap.parse_args()
    config = h.load_config("drafter_warmup.py")
    model_path = pathlib.Path(config.model.path)
    if not model_path.exists():
        sys.exit(f"missing {model_path}: run `make setup` (it fetches the SmolLM2 GGUF)")
    n_prompts = args.prompts or (16 if args.quick else 32)
    reps = args.reps or (1 if args.quick else 2)
    target, tokenizer = warmup.build_target(config_schema.parse(config))
    task = make_task(config.task)
    hidden_fn = warmup_data.make_hidden_fn(target)
    gen = config.generation
    print(
        f"SmolLM2-135M fp32; {n_prompts} prompts x {gen.n} samples per build (batches of {gen.batch_prompts} "
        f"prompts), <= {gen.max_new_tokens} new tokens, temperature {gen.temperature}; {reps} round(s)"
    )
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    samples = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(reps):
            for record in (True, False):
                config.generation.record_hidden = record
                job = config_schema.parse(config)
                data_dir = pathlib.Path(tmp) / f"{r}_{record}"
                data_dir.mkdir()
                t0 = time.perf_counter()
                samples[record], tot = warmup_data.build_split(
                    "train",
                    job=job,
                    task=task,
                    tokenizer=tokenizer,
                    engine=warmup_data.warmup_engine(job, target, tokenizer),
                    hidden_fn=hidden_fn,
                    start=0,
                    num_prompts=n_prompts,
                    n=int(gen.n),
                    temperature=float(gen.temperature),
                    data_dir=data_dir,
                    times=warmup_data.PhaseTimes(data_dir / "times.json"),
                )
                row = {
                    "wall": time.perf_counter() - t0,
                    "generate": tot["generate_s"],
                    "forward": tot["forward_s"],
                }
                runs[record].append(row)
                print(
                    f"round {r + 1} {'recorded' if record else 'forward ':>8}: data {row['wall']:6.1f} s "
                    f"(generate {row['generate']:6.1f} s, forward {row['forward']:5.1f} s), "
                    f"{int(tot['sequences'])} sequences, {int(tot['response_tokens'])} response tokens",
                    flush=True,
                )

    def med(record: bool, key: str) -> float:
        rows = runs[record][1:] or runs[record]  # the first round also compiled
        return statistics.median(r[key] for r in rows)

    rec, fwd = samples[True], samples[False]
    same = [np.array_equal(a.tokens, b.tokens[:-1]) for a, b in zip(rec, fwd, strict=True)]
    diffs = [
        float(np.abs(a.hidden.astype(np.float32) - b.hidden[:-1].astype(np.float32)).max())
        for a, b, ok in zip(rec, fwd, same, strict=True)
        if ok
    ]
    scale = float(np.mean([np.abs(b.hidden.astype(np.float32)).mean() for b in fwd]))
    print(
        f"same token sequences: {sum(same)}/{len(same)}; features: max |diff| {max(diffs):.4f}, median "
        f"of the per-sequence max {np.median(diffs):.4f} (mean |h| {scale:.3f})"
    )
    res = {
        "data_s_recorded": med(True, "wall"),
        "data_s_forward": med(False, "wall"),
        "speedup": med(False, "wall") / med(True, "wall"),
        "generate_s_recorded": med(True, "generate"),
        "generate_s_forward": med(False, "generate"),
        "forward_s": med(False, "forward"),
        "same_sequences": sum(same) / len(same),
        "max_feature_diff": max(diffs),
    }
    h.result(res, args)


if __name__ == "__main__":
    main()
