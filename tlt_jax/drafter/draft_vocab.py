"""The drafter's reduced LM-head vocabulary: the most frequent tokens of the target's own generations.

At SmolLM2's 49,152-token vocabulary the shared LM head is most of a drafter step (a drafter step costs ~0.25
of a target step at batch 1 on CPU, the head ~80% of it). Restricting the drafter's head to the tokens the
target actually produces (FR-Spec; EAGLE-3 uses a 32k draft vocabulary for the same reason) cuts that cost by
V / Vd, and the drafts it can no longer propose are rare tokens the target seldom samples. Verification is
unchanged, so sampling stays exact.

    python -m tlt_jax.drafter.draft_vocab --workdir workdirs/drafter_warmup --size 8192

counts the tokens of the warm-up's generated training data (`DIR/data/train_*.npz`) and writes
`DIR/drafter/draft_vocab.npy`, which `load_draft_vocab` reads (bench_sd passes it to the engine).
"""

from __future__ import annotations

import argparse
import os
import pathlib
from collections.abc import Iterable, Sequence

import numpy as np

FILENAME = "draft_vocab.npy"


def frequent_tokens(
    token_arrays: Iterable[np.ndarray], size: int, vocab_size: int, always: Sequence[int] = ()
) -> np.ndarray:
    """The `size` most frequent token ids (ties: lower id first) plus `always` (e.g. EOS), sorted, int32."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must be in [1, {vocab_size}]")
    counts = np.zeros(vocab_size, np.int64)
    for toks in token_arrays:
        t = np.asarray(toks).reshape(-1)
        if t.size and (t.min() < 0 or t.max() >= vocab_size):
            raise ValueError(f"token ids outside [0, {vocab_size}) in the counted data")
        counts += np.bincount(t, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    chosen = set(order[:size].tolist()) | {int(a) for a in always}
    return np.asarray(sorted(chosen), np.int32)


def _drafter_dir(workdir: str | os.PathLike) -> pathlib.Path:
    p = pathlib.Path(workdir)
    return p if p.name == "drafter" else p / "drafter"


def build_from_warmup(
    workdir: str | os.PathLike, size: int, vocab_size: int, always: Sequence[int] = ()
) -> pathlib.Path:
    """Count the warm-up's generated training tokens in `workdir/data` and save the draft vocabulary."""
    root = pathlib.Path(workdir)
    files = sorted((root / "data").glob("train_*.npz"))
    if not files:
        raise FileNotFoundError(f"no warm-up data in {root / 'data'}: run the drafter warm-up first")
    ids = frequent_tokens((np.load(f)["tokens"] for f in files), size, vocab_size, always)
    out = _drafter_dir(root) / FILENAME
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npy")
    np.save(tmp, ids)
    os.replace(tmp, out)  # atomic: a crash never leaves a truncated vocabulary next to the checkpoint
    return out


def load_draft_vocab(workdir_or_dir: str | os.PathLike) -> np.ndarray | None:
    """The saved draft vocabulary of a warm-up workdir (or its drafter/ folder), or None if there is none."""
    path = _drafter_dir(workdir_or_dir) / FILENAME
    return np.load(path) if path.exists() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="the drafter warm-up workdir")
    ap.add_argument("--size", type=int, default=8192, help="number of most frequent tokens to keep")
    ap.add_argument(
        "--gguf", default=None, help="model file for the vocabulary size and EOS ids (default: SmolLM2)"
    )
    args = ap.parse_args()
    from tlt_jax.models.loading import DEFAULT_GGUF_PATH, load_gguf

    loaded = load_gguf(args.gguf or DEFAULT_GGUF_PATH)
    eos = list(loaded.tokenizer.eos_token_ids)
    out = build_from_warmup(args.workdir, args.size, loaded.config.vocab_size, always=eos)
    ids = np.load(out)
    print(f"{out}: {ids.size} token ids (the {args.size} most frequent + EOS {eos})")


if __name__ == "__main__":
    main()
