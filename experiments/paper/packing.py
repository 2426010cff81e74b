"""Sequence packing of drafter samples: training throughput with and without (paper: 13.3 -> 29.6 samples/s).

    python -m experiments.paper.packing --quick     # 48 samples, 2 epochs per arm
    python -m experiments.paper.packing             # 128 samples, 3 epochs per arm

The same samples train the same drafter (SmolLM2's EAGLE drafter, `DrafterTrainer` with the warm-up's loss:
configs/drafter_warmup.py's `train` section, rows 4 x 512 tokens, the full LM head) with the same compiled
step, in two layouts:
  * unpacked: one sample per row, padded to the row (what a trainer without packing does);
  * packed:   `drafter.packing.iterate_packed` (first fit, per-sample segment ids: block-diagonal causal
              attention, every sample the loss it would get alone; tests/drafter/test_packing.py).
A step costs the same in both (static shapes); packing puts several short samples in a row, so an epoch
takes fewer steps. samples/s = samples / the epoch's step seconds (one warm-up step first, not timed; the
arms alternate epoch by epoch and the median epoch counts).

The samples: the chat-template prompts of configs/tlt.py's task (real token counts) with responses whose
lengths follow that task's measured distribution at T 0.9 (experiments/paper/task_lengths.py: p50 60, p90
337 tokens, 8% at the 384-token cap: a lognormal with that median and p90, capped), random token ids and
hidden states (a step's cost does not depend on their values).

Final line: `RESULT unpacked_samples_s=.. packed_samples_s=.. speedup=.. samples_per_row_packed=..
paper_unpacked=13.3 paper_packed=29.6 paper_speedup=2.23`; `packing.png` in --out.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np

from experiments.lib import harness as h

PAPER = {"paper_unpacked": 13.3, "paper_packed": 29.6, "paper_speedup": 29.6 / 13.3}
P50, P90, CAP = 60, 337, 384  # response tokens of configs/tlt.py's task (docs: "The long-tail task")


def make_samples(args: Any, tok: Any, hidden_size: int, vocab: int) -> list[Any]:
    """`args.samples` DrafterSamples: real prompt lengths, lognormal response lengths (see the docstring)."""
    from tlt_jax.drafter.packing import DrafterSample
    from tlt_jax.tasks import make_task

    cfg = h.load_config(h.TLT_CONFIG)
    _, prompts = h.task_prompts(make_task(cfg.task.to_dict()), tok, 0, args.samples)
    rng = np.random.default_rng(args.seed)
    sigma = np.log(P90 / P50) / 1.2816
    resp = np.minimum(np.round(np.exp(np.log(P50) + sigma * rng.standard_normal(args.samples))), CAP)
    out = []
    for p, r in zip(prompts, resp.astype(int), strict=True):
        n = len(p) + max(int(r), 1)
        mask = np.zeros(n, bool)
        mask[len(p) :] = True
        hid = rng.standard_normal((n, hidden_size)).astype(np.float16)
        out.append(DrafterSample(rng.integers(0, vocab, n).astype(np.int32), hid, mask))
    return out


def unpacked_batches(samples: list[Any], seq_len: int, rows: int, max_loss: int | None) -> list[Any]:
    """One sample per row, `rows` rows a batch (empty rows pad the last)."""
    import jax

    from tlt_jax.drafter.packing import pack_samples

    hs = samples[0].hidden_size
    out = []
    for i in range(0, len(samples), rows):
        parts = [pack_samples([s], seq_len, 1, hs, max_loss)[0] for s in samples[i : i + rows]]
        parts += [pack_samples([], seq_len, 1, hs)[0]] * (rows - len(parts))
        out.append(jax.tree.map(lambda *xs: np.concatenate(xs), *parts))
    return out


def epoch_seconds(
    trainer: Any, state: Any, batches: list[Any], weights: tuple[Any, Any]
) -> tuple[Any, float]:
    """(state, seconds) of one pass over `batches` (each step waited for)."""
    import jax

    t0 = time.perf_counter()
    for b in batches:
        state, m = trainer.step(state, b, *weights)
        jax.block_until_ready(m)
    return state, time.perf_counter() - t0


def main() -> None:
    ap = h.parser(__doc__, quick="48 samples, 2 epochs per arm", out=None)
    h.add_model_args(ap)
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--epochs", type=int, default=None, help="timed epochs per arm (alternating)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.samples = args.samples or (48 if args.quick else 128)
    epochs = args.epochs or (2 if args.quick else 3)
    out = h.out_dir(args, "packing")
    print(h.device_line(), f"load average {os.getloadavg()[0]:.2f}", flush=True)

    from flax import nnx

    from tlt_jax.drafter.packing import iterate_packed, loss_token_budget
    from tlt_jax.drafter.trainer import DrafterTrainer, optimizer_from_config
    from tlt_jax.drafter.warmup import loss_config
    from tlt_jax.drafter.warmup_config import WarmupTrainSection
    from tlt_jax.models.drafter import Drafter

    loaded, model = h.load_target(args.gguf, "float32")
    tc = WarmupTrainSection()
    samples = make_samples(args, loaded.tokenizer, model.cfg.hidden_size, model.cfg.vocab_size)
    loss_cfg = loss_config(tc, samples)
    max_loss = loss_token_budget(samples, tc.seq_len, tc.rows, tc.max_loss_tokens)
    packed = list(iterate_packed(samples, tc.seq_len, tc.rows, None, max_loss))
    unpacked = unpacked_batches(samples, tc.seq_len, tc.rows, max_loss)
    print(
        f"{len(samples)} samples, {sum(s.length for s in samples)} tokens: {len(unpacked)} unpacked steps vs "
        f"{len(packed)} packed ({len(samples) / (len(packed) * tc.rows):.2f} samples per row); rows "
        f"{tc.rows} x {tc.seq_len}, loss positions {max_loss}",
        flush=True,
    )
    tx, _ = optimizer_from_config({"lr": 1e-4, "steps": 1000, "warmup": 0})
    trainer = DrafterTrainer(tx, loss_cfg)
    state = trainer.init_state(Drafter(model.cfg, nnx.Rngs(0)))
    weights = (model.embed[...], model.head_weight())
    state, _ = epoch_seconds(trainer, state, packed[:1], weights)  # compile (one program: same shapes)
    secs: dict[str, list[float]] = {"unpacked": [], "packed": []}
    for e in range(epochs):
        for arm, batches in (("unpacked", unpacked), ("packed", packed)):
            state, s = epoch_seconds(trainer, state, batches, weights)
            secs[arm].append(s)
            print(
                f"epoch {e + 1} {arm:>8}: {len(batches)} steps, {s:.2f} s, {len(samples) / s:.2f} samples/s"
            )
    rate = {a: len(samples) / statistics.median(v) for a, v in secs.items()}
    res = {
        "unpacked_samples_s": rate["unpacked"],
        "packed_samples_s": rate["packed"],
        "speedup": rate["packed"] / rate["unpacked"],
        "samples_per_row_packed": len(samples) / (len(packed) * tc.rows),
        "step_s": statistics.median(secs["packed"]) / len(packed),
        **PAPER,
    }
    plt = h.pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar(["ours unpacked", "ours packed"], [rate["unpacked"], rate["packed"]], color="C0")
    ax.bar(["paper unpacked", "paper packed"], [PAPER["paper_unpacked"], PAPER["paper_packed"]], color="C1")
    ax.set_ylabel("drafter training samples/s")
    ax.set_title(f"sequence packing: {res['speedup']:.2f}x (paper {PAPER['paper_speedup']:.2f}x)")
    h.save_plot(fig, out / "packing.png")
    print(f"load average {os.getloadavg()[0]:.2f}; plot {out / 'packing.png'}")
    h.result(res, args, fmt=".2f")


if __name__ == "__main__":
    main()
