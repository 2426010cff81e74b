"""What every experiment script shares: the common flags, the RESULT line, plots, the model and the engines.

Scripts run as modules from the repository root: `python -m experiments.<name> [--quick] [--out ...]
[--json [FILE]]`. This module imports neither JAX nor tlt_jax at import time (memory_plans.py sets XLA_FLAGS
before JAX starts), only inside the helpers that need them.

Command line
  `parser(doc, quick=..., out=...)`  an ArgumentParser (the script's docstring as its description) with the
      common flags: `--quick` (the script's small configuration; its help says what; left out where a
      script has none), `--out` (where its plots and files go; a script's default, or a fresh temporary
      folder: `out_dir`) and `--json [FILE]` (also write the RESULT dict as JSON: to FILE, or with a bare
      `--json` to <out>/result.json, <stem>_result.json beside an --out that is a .json file)
  `out_dir(args, prefix)`, `json_path(args)`
Output
  `result(values, args, fmt=".3f", formats=None)`  print the final `RESULT key=value ...` line (floats in
      `fmt`, or per key in `formats`; anything else as str) and, with --json, write the dict under
      "results" (merged into the file when it already holds a JSON object: a script's own details)
  `pyplot()`, `save_plot(fig, path, dpi)`  matplotlib on the Agg backend; tight layout, save, close
  `device_line()`  "jax <version> on <platform>, <N> cores", most scripts' first line
Model, drafter, engines, prompts
  `add_model_args(ap)` / `load_target(gguf, dtype)`: --gguf, the GGUF's config, tensors and tokenizer and
      the Transformer built from them
  `add_drafter_args(ap, default)` / `load_drafter_or_exit(args, model)`: --drafter, --random-drafter,
      --draft-vocab; the warmed EAGLE drafter (or an untrained one), exiting with the warm-up command
  `engine_pair(model, ecfg, eos, drafter, vocab)`: a plain engine (no drafter) and a speculative one
  `rl_engine_config(rollout, max_new)`: EngineConfig with the RL config's engine sizes
  `add_arm(engine, name)`: 'plain', 'ngram_<strategy>' or an EAGLE strategy registered as a mode
  `load_config(name, args)`, `task_prompts(task, tokenizer, offset, n)`
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
TLT_CONFIG = CONFIGS / "tlt.py"
WARMUP_CMD = "python -m tlt_jax.main --config configs/drafter_warmup.py --workdir workdirs/drafter_warmup"

# ---- command line ----------------------------------------------------------------------------------------


def parser(
    doc: str | None, *, quick: str | None, out: str | pathlib.Path | None = None, out_help: str = ""
) -> argparse.ArgumentParser:
    """An ArgumentParser with the common flags (module docstring). `quick`: the help of --quick (None: the
    script has no small configuration, so no flag); `out`: --out's default (None: a fresh temporary folder,
    made by `out_dir`)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if quick is not None:
        ap.add_argument("--quick", action="store_true", help=quick)
    default = None if out is None else str(out)
    ap.add_argument(
        "--out", default=default, help=out_help or f"plots and files (default: {default or 'a temp folder'})"
    )
    ap.add_argument(
        "--json",
        nargs="?",
        const=True,  # a bare --json: result.json under --out
        default=None,
        metavar="FILE",
        help="also write the RESULT dict as JSON to FILE (a bare --json: result.json under --out)",
    )
    return ap


def out_dir(args: argparse.Namespace, prefix: str = "experiment") -> pathlib.Path:
    """--out as a folder, created; without one a fresh temporary folder `<prefix>_*` (then args.out too, so a
    bare --json writes there)."""
    if not args.out:
        args.out = tempfile.mkdtemp(prefix=f"{prefix}_")
    path = pathlib.Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    return path


def json_path(args: argparse.Namespace) -> pathlib.Path | None:
    """Where --json writes (None without it): FILE, or for a bare --json result.json under --out
    (<stem>_result.json beside an --out that is a .json file)."""
    value = getattr(args, "json", None)
    if not value:
        return None
    if value is not True:
        return pathlib.Path(value)
    out = pathlib.Path(args.out) if getattr(args, "out", None) else out_dir(args)
    return out.with_name(f"{out.stem}_result.json") if out.suffix == ".json" else out / "result.json"


# ---- output ------------------------------------------------------------------------------------------------


def format_result(
    values: Mapping[str, Any], fmt: str = ".3f", formats: Mapping[str, str] | None = None
) -> str:
    """`RESULT key=value ...`: floats in `formats[key]` or `fmt`, everything else (ints, strings) as str."""
    formats = formats or {}
    items = []
    for k, v in values.items():
        spec = formats.get(k, fmt)
        is_float = isinstance(v, float) or type(v).__name__ in ("float16", "float32", "float64")
        items.append(f"{k}={format(v, spec)}" if is_float and spec else f"{k}={v}")
    return "RESULT " + " ".join(items)


def _jsonable(v: Any) -> Any:
    """numpy scalars and arrays as Python numbers and lists; anything else as its str."""
    if hasattr(v, "tolist"):
        return v.tolist()
    return str(v)


def result(
    values: Mapping[str, Any],
    args: argparse.Namespace | None = None,
    fmt: str = ".3f",
    formats: Mapping[str, str] | None = None,
) -> str:
    """Print the script's final line `RESULT key=value ...` (`format_result`) and, with --json, write
    `values` as JSON under "results" (merged into the file when it already holds a JSON object, as a
    script's own details). `fmt=""` prints floats as str. Returns the line."""
    line = format_result(values, fmt, formats)
    path = json_path(args) if args is not None else None
    if path is not None:
        data: dict[str, Any] = {}
        if path.exists():
            try:
                old = json.loads(path.read_text())
                data = old if isinstance(old, dict) else {}
            except ValueError:
                data = {}
        data["results"] = dict(values)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=_jsonable))
        print(f"json: {path}")
    print(line, flush=True)
    return line


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig: Any, path: str | pathlib.Path, dpi: int = 120, tight: bool = True) -> pathlib.Path:
    """Lay `fig` out tightly, save it at `path` (folders created) and close it; returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def device_line(kind: bool = False) -> str:
    """'jax <version> on <platform>[ (<device kind>)], <N> cores'."""
    import jax

    dev = jax.devices()[0]
    where = f"{dev.platform} ({dev.device_kind})" if kind else dev.platform
    return f"jax {jax.__version__} on {where}, {os.cpu_count()} cores"


def ints(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (empty items skipped)."""
    return [int(x) for x in text.split(",") if x.strip()]


# ---- model, drafter, engines, prompts ----------------------------------------------------------------------


def load_config(name: str | pathlib.Path = TLT_CONFIG, config_args: str | None = None) -> Any:
    """A config file (a path, or a file name under configs/) with optional `:args`, as tlt_jax.main
    loads it."""
    from tlt_jax import config_lib

    path = pathlib.Path(name)
    if not path.exists() and not path.is_absolute() and (CONFIGS / path).exists():
        path = CONFIGS / path
    return config_lib.load_config_file(path, config_args)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--gguf: the target model (default: SmolLM2-135M, what `make setup` fetches)."""
    from tlt_jax.models.loading import DEFAULT_GGUF_PATH

    ap.add_argument("--gguf", default=str(DEFAULT_GGUF_PATH), help="the target model's GGUF file")


def load_target(gguf: str | pathlib.Path, dtype: str | None = None) -> tuple[Any, Any]:
    """(the loaded GGUF: .config, .tensors, .tokenizer; the Transformer built from it), in `dtype` if given
    (else the loader's default)."""
    from tlt_jax.models.llama import from_hf_tensors
    from tlt_jax.models.loading import load_gguf

    loaded = load_gguf(str(gguf)) if dtype is None else load_gguf(str(gguf), dtype=dtype)
    return loaded, from_hf_tensors(loaded.config, loaded.tensors)


def add_drafter_args(
    ap: argparse.ArgumentParser, default: str | pathlib.Path, prefix: str = "", draft_vocab_help: str = ""
) -> None:
    """--drafter (a warm-up workdir or its drafter/ folder), --random-drafter, --draft-vocab; `prefix`
    starts each help (e.g. '--breakdown: ')."""
    ap.add_argument(
        "--drafter", default=str(default), help=f"{prefix}the EAGLE warm-up workdir (or its drafter/)"
    )
    ap.add_argument(
        "--random-drafter", action="store_true", help=f"{prefix}an untrained drafter (smoke test only)"
    )
    ap.add_argument(
        "--draft-vocab",
        default="auto",
        help=draft_vocab_help
        or f"{prefix}the drafter head's vocabulary: 'auto' (the warm-up's drafter/draft_vocab.npy if "
        "present, from `python -m tlt_jax.drafter.draft_vocab`), 'none' (the full head) or a .npy of ids",
    )


def load_drafter_or_exit(args: argparse.Namespace, model: Any) -> tuple[Any, str, Any, str]:
    """The EAGLE drafter of `args.drafter` (a warm-up workdir or its drafter/), or an untrained one with
    `args.random_drafter` (seeded by `args.seed`); exits with the warm-up command when there is none. Also
    its draft vocabulary per `args.draft_vocab` ('auto' | 'none' | a .npy file). Returns (drafter, its name,
    vocabulary, a note)."""
    import numpy as np

    from tlt_jax.drafter.draft_vocab import load_draft_vocab
    from tlt_jax.drafter.warmup import DRAFTER_DIR, init_drafter, load_drafter

    drafter_path = pathlib.Path(args.drafter)
    missing = (
        f"error: no drafter checkpoint under {drafter_path} (expected {drafter_path / DRAFTER_DIR}). "
        f"Warm up the drafter first:\n    {WARMUP_CMD}\n"
        "or pass --random-drafter to smoke-test this script (its acceptance is meaningless)."
    )
    if not args.random_drafter and not (drafter_path / DRAFTER_DIR).is_dir() and not drafter_path.is_dir():
        sys.exit(missing)
    if args.random_drafter:
        drafter, dname = init_drafter(model, args.seed), "random (smoke test)"
    else:
        try:
            drafter, dname = load_drafter(drafter_path, model.cfg), str(drafter_path)
        except FileNotFoundError as e:
            sys.exit(f"{missing}\n({e})")
    if args.draft_vocab == "none" or args.random_drafter:
        draft_vocab = None
    elif args.draft_vocab == "auto":
        draft_vocab = load_draft_vocab(drafter_path)
    else:
        draft_vocab = np.load(args.draft_vocab)
    vocab_note = "full head" if draft_vocab is None else f"draft vocabulary {len(draft_vocab)} tokens"
    return drafter, dname, draft_vocab, vocab_note


def engine_pair(model: Any, ecfg: Any, eos_ids: list[int], drafter: Any, draft_vocab: Any) -> tuple[Any, Any]:
    """(plain: an engine without a drafter, so no speculation and no drafter-cache upkeep, a strong baseline;
    sd: the same engine config with the EAGLE drafter)."""
    from tlt_jax.rollout.engine import RolloutEngine

    plain = RolloutEngine(model, ecfg, eos_ids=eos_ids)
    sd = RolloutEngine(model, ecfg, eos_ids=eos_ids, drafter=drafter, draft_vocab=draft_vocab)
    return plain, sd


RL_ENGINE_SIZES = ("max_cache_len", "chunk_steps", "min_cache_bucket", "prompt_bucket")


def rl_engine_config(rollout: Any, max_new: int) -> Any:
    """An EngineConfig with the RL config's engine sizes (its `rollout` section: configs/tlt.py's) and
    `max_new` new tokens."""
    from tlt_jax.rollout.interface import EngineConfig

    return EngineConfig(max_new_tokens=max_new, **{k: rollout[k] for k in RL_ENGINE_SIZES})


def add_arm(engine: Any, name: str) -> str:
    """Register an arm on `engine`: 'plain' (nothing to register), 'ngram_<strategy>' (the n-gram drafter) or
    an EAGLE strategy 'depth_topk_tv'; returns its mode name."""
    if name == "plain":
        return "plain"
    if name.startswith("ngram_"):
        return engine.add_mode("ngram", name.removeprefix("ngram_"))
    return engine.add_mode("eagle", name)


def task_prompts(task: Any, tokenizer: Any, offset: int, n: int) -> tuple[list[Any], list[list[int]]]:
    """(problems, their chat-template prompt tokens): `n` problems of `task` from stream position `offset`."""
    problems, _ = task.batch(offset, n)
    return problems, [tokenizer.encode_chat(task.messages(p)) for p in problems]
