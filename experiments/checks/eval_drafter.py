"""Evaluate saved drafters on a warm-up's held-out data: greedy and sampled (rejection) acceptance.

Compares drafters trained by different warm-ups (or settings) on the SAME held-out generations, without
retraining: the held-out split of `--data` (a warm-up workdir) is loaded from its cache, each drafter from
its workdir (or `drafter/` folder). The sampled estimate uses the data's temperature and the warm-up's draft
vocabulary (`--draft-vocab`), as rollouts do.

    python -m experiments.checks.eval_drafter --data workdirs/drafter_warmup \
        workdirs/drafter_warmup workdirs/other
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
from flax import nnx

from experiments.lib import harness as h
from tlt_jax.drafter import warmup, warmup_data
from tlt_jax.drafter.draft_vocab import load_draft_vocab
from tlt_jax.drafter.evaluate import AcceptanceEvaluator
from tlt_jax.rollout.sampling import SamplingParams


def main() -> None:
    ap = h.parser(__doc__, quick=None, out=None)
    ap.add_argument("drafters", nargs="+", help="warm-up workdirs (or drafter/ folders) to evaluate")
    ap.add_argument("--data", required=True, help="warm-up workdir whose held-out split is the test set")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--draft-vocab", default="auto", help="auto (the --data workdir's), none, or a .npy file")
    args = ap.parse_args()

    data = pathlib.Path(args.data)
    config = json.loads((data / "config.json").read_text())
    files = sorted((data / warmup.DATA_DIR).glob("eval_*.npz"))
    if not files:
        raise SystemExit(f"no held-out data in {data / warmup.DATA_DIR}: run the warm-up there first")
    samples = [s for f in files for s in warmup_data.load_chunk(f)[0]]
    _, target = h.load_target(config["model"]["path"])
    embed_w, head_w = warmup.target_weights(target)
    if args.draft_vocab == "auto":
        vocab = load_draft_vocab(data)
    elif args.draft_vocab == "none":
        vocab = None
    else:
        vocab = np.load(args.draft_vocab)
    ec = config["eval"]
    sp = SamplingParams(temperature=float(ec["temperature"]), top_p=float(config["generation"]["top_p"]))
    results = {}
    for i, d in enumerate(args.drafters):
        drafter = warmup.load_drafter(d, target.cfg)
        graphdef, params = nnx.split(drafter, nnx.Param)
        ev = AcceptanceEvaluator(
            graphdef, args.depth, int(ec["seq_len"]), int(ec["rows"]), sampling=sp, draft_vocab=vocab
        )
        r = ev(params, samples, embed_w, head_w)
        print(
            f"{d}: greedy accept length {r.accept_length:.3f} (conditional "
            f"{', '.join(f'{c:.2f}' for c in r.conditional)}); sampled T={sp.temperature} "
            f"{r.sampled_accept_length:.3f} (reach {', '.join(f'{p:.2f}' for p in r.sampled_per_position)}) "
            f"over {r.num_positions} positions",
            flush=True,
        )
        results[f"greedy_accept_{i}"] = r.accept_length
        results[f"sampled_accept_{i}"] = r.sampled_accept_length
        # a chain of depth 3 (strategy 3_1_4): 1 + sum of the first three reach probabilities
        results[f"sampled_accept_d3_{i}"] = 1.0 + float(np.sum(r.sampled_per_position[:3]))
    h.result(results, args, fmt=".4f")


if __name__ == "__main__":
    main()
