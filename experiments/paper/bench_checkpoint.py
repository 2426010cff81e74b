"""Drafter checkpoint latency the training loop sees: full sync vs async vs selective async (paper Fig 17).

TLT checkpoints the drafter while the spot trainer runs (it is preempted at optimizer-step granularity), so
what matters is how long a save stalls training. The paper reports 893 ms for a full synchronous save, 280 ms
asynchronous and 97 ms selective asynchronous (9.2x). Here, for SmolLM2-135M's EAGLE drafter (the target
from `.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf` via `configs/default.py`; `--tiny`: a tiny random
target, for the smoke test):

  (a) full_sync: a deployable EAGLE checkpoint = the drafter's trainable weights + the frozen embedding and
      LM head it uses (SmolLM2 ties them: the same [49152, 576] array, stored under both names as a
      standalone drafter needs) + the AdamW state (mu, nu, counts), orbax synchronous;
  (b) async: the same tree, orbax asynchronous (`Checkpointer`): `save` returns once orbax holds a host copy
      of the arrays, the write finishes in a background thread;
  (c) selective_async: only the trainable drafter weights (`DrafterCheckpointer`, asynchronous).

For each: `blocking` = the time until `save` returns control to the training loop (what the paper's numbers
are: the stall a save costs the trainer) and `durable` = until the step is finalised on disk (`save` +
`wait()`: the write and orbax's atomic rename). Every rep saves a new step into the same manager (as a
training run does) after the previous one is durable; the first save of each manager is an untimed warm-up.
The optimizer moments are filled with random values, so no mode writes suspiciously compressible zeros.

    python -m experiments.paper.bench_checkpoint            # SmolLM2 drafter, 7 reps
    python -m experiments.paper.bench_checkpoint --quick    # 3 reps
    python -m experiments.paper.bench_checkpoint --tiny --quick   # tiny random target (tests)

Writes `<out>/bench_checkpoint.png` (bar plot of the medians) and `<out>/bench_checkpoint.json`; the last
line is `RESULT full_sync_ms=<a> async_ms=<b> selective_async_ms=<c>` (blocking medians) followed on the same
line by the durable medians and sizes.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from experiments.lib import harness as h
from tlt_jax.drafter.loss import LossConfig
from tlt_jax.drafter.trainer import DrafterTrainer, optimizer_from_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.utils.checkpoint import Checkpointer
from tlt_jax.utils.drafter_checkpoint import DrafterCheckpointer

MODES = ("full_sync", "async", "selective_async")


def build_target(tiny: bool) -> Any:
    """The target whose drafter is checkpointed: SmolLM2 from the default config, or a tiny random one."""
    if tiny:
        from tlt_jax.models.config import tiny_config
        from tlt_jax.models.llama import Transformer

        return Transformer(tiny_config(vocab_size=512), nnx.Rngs(0))
    from tlt_jax.models.build import build_model_and_tokenizer

    config = h.load_config("default.py")
    model_path = pathlib.Path(config.model.path)
    if not model_path.exists():
        sys.exit(f"missing {model_path}: run `make setup` (it fetches the SmolLM2 GGUF)")
    return build_model_and_tokenizer(config)[0]


def checkpoint_trees(target: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full tree, trainable drafter weights): a train state of the target's drafter, moments randomised."""
    tx, _ = optimizer_from_config({"lr": 1e-4, "steps": 100, "warmup": 0})
    state = DrafterTrainer(tx, LossConfig()).init_state(Drafter(target.cfg, nnx.Rngs(0)))
    leaves, treedef = jax.tree.flatten(state.opt_state)
    rng = np.random.default_rng(0)
    leaves = [
        jax.numpy.asarray(rng.standard_normal(x.shape, np.float32)) if x.dtype == np.float32 and x.ndim else x
        for x in leaves
    ]
    opt_state = jax.tree.unflatten(treedef, leaves)
    weights = nnx.to_pure_dict(state.params)
    full = {
        "drafter": weights,
        "embed": target.embed[...],
        "lm_head": target.head_weight(),
        "opt_state": opt_state,
        "step": state.step,
    }
    return full, weights


def mbytes(tree: Any) -> float:
    return sum(x.nbytes for x in jax.tree.leaves(tree)) / 2**20


def measure(mode: str, directory: pathlib.Path, full: Any, weights: Any, reps: int) -> dict[str, list[float]]:
    """Blocking and durable milliseconds of `reps` saves (after one untimed warm-up save)."""
    if mode == "selective_async":
        ckpt: Any = DrafterCheckpointer(directory, max_to_keep=2, async_save=True)
        tree = weights
    else:
        ckpt = Checkpointer(directory, max_to_keep=2, async_save=mode == "async")
        tree = full
    out: dict[str, list[float]] = {"blocking_ms": [], "durable_ms": []}
    try:
        for step in range(reps + 1):
            jax.block_until_ready(tree)
            t0 = time.perf_counter()
            info = ckpt.save(step, tree)
            t_block = time.perf_counter() - t0
            ckpt.wait()
            t_durable = time.perf_counter() - t0
            assert info.saved and ckpt.latest_step() == step
            if step > 0:
                out["blocking_ms"].append(1e3 * t_block)
                out["durable_ms"].append(1e3 * t_durable)
    finally:
        ckpt.close()
    return out


def plot(medians: dict[str, dict[str, float]], path: pathlib.Path, title: str) -> None:
    x = np.arange(len(MODES))
    fig, ax = h.pyplot().subplots(figsize=(7, 4))
    for i, (kind, label) in enumerate((("blocking_ms", "blocks training"), ("durable_ms", "until durable"))):
        vals = [medians[m][kind] for m in MODES]
        bars = ax.bar(x + (i - 0.5) * 0.38, vals, 0.38, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(x, ["full sync", "async", "selective async"])
    ax.set_ylabel("ms (median)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    h.save_plot(fig, path, dpi=110)


def main() -> None:
    ap = h.parser(
        __doc__,
        quick="3 repetitions",
        out=h.ROOT / "workdirs" / "bench_checkpoint",
        out_help="plot + json folder",
    )
    ap.add_argument("--reps", type=int, default=None, help="timed saves per mode (default 7, --quick 3)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random target instead of SmolLM2")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = ap.parse_args()
    reps = args.reps or (3 if args.quick else 7)

    target = build_target(args.tiny)
    full, weights = checkpoint_trees(target)
    sizes = {"full": mbytes(full), "selective": mbytes(weights)}
    name = "tiny random target" if args.tiny else "SmolLM2-135M"
    print(
        f"{name}: full checkpoint {sizes['full']:.1f} MiB (drafter {mbytes(weights):.1f}, embed + head "
        f"{mbytes([full['embed'], full['lm_head']]):.1f}, optimizer {mbytes(full['opt_state']):.1f}); "
        f"selective {sizes['selective']:.1f} MiB; {reps} reps; {jax.devices()[0].platform}"
    )
    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_ckpt_") as tmp:
        for mode in MODES:
            results[mode] = measure(mode, pathlib.Path(tmp) / mode, full, weights, reps)
            b, d = results[mode]["blocking_ms"], results[mode]["durable_ms"]
            print(
                f"  {mode:16s} blocking ms {' '.join(f'{x:.0f}' for x in b)} | durable ms "
                f"{' '.join(f'{x:.0f}' for x in d)}",
                flush=True,
            )
    medians = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in results.items()}
    out = h.out_dir(args)
    a, b, c = (medians[m]["blocking_ms"] for m in MODES)
    title = (
        f"{name} drafter checkpoint ({sizes['full']:.0f} MiB full, {sizes['selective']:.0f} MiB selective)"
    )
    plot(medians, out / "bench_checkpoint.png", title)
    (out / "bench_checkpoint.json").write_text(
        json.dumps(
            {"target": name, "reps": reps, "mib": sizes, "runs": results, "medians": medians}, indent=2
        )
    )
    print(f"plot: {out / 'bench_checkpoint.png'}; speedup full sync -> selective async: {a / c:.1f}x")
    res = {"full_sync_ms": a, "async_ms": b, "selective_async_ms": c}
    res |= {f"{m}_durable_ms": medians[m]["durable_ms"] for m in MODES}
    res |= {"full_mib": sizes["full"], "selective_mib": sizes["selective"]}
    h.result(res, args, fmt=".1f")


if __name__ == "__main__":
    main()
