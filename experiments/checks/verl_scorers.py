"""Our ports of VeRL's rule-based scorers against VeRL's own files, on random (response, reference) pairs.

VeRL's `gsm8k.py`, `math_reward.py` and `math_dapo.py` (`verl/utils/reward_score/`) are plain Python; they are
loaded from the `verl` wheel setup.py pins (installed by `make setup` without its dependencies into
.cache/verl) and run beside our reward path (`tlt_jax.tasks.rewards.ReferenceScorer` under
reward="verl", routed by data_source: `gsm8k_reward`, `math_reward`, `dapo_reward`) on pairs built from the
pieces their quirks turn on (boxes, unbalanced braces, `$`, `\\frac` with and without braces, `\\text{ }`,
`####`, `Answer:`, thousands separators, units, trailing spaces, ...). Prints the pairs whose verdicts
differ (up to --show) and the counts.

    python -m experiments.checks.verl_scorers              # 200,000 pairs per scorer
    python -m experiments.checks.verl_scorers --quick      # 5,000
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pathlib
import random
from collections.abc import Callable

from experiments.lib import harness

PIECES = (
    "\\boxed{",
    "\\boxed ",
    "\\fbox{",
    "{",
    "}",
    "$",
    "\\frac",
    "\\frac{1}{2}",
    "\\dfrac",
    "\\text{ ",
    "k = ",
    "#### ",
    "####",
    "Answer:",
    "Answer: ",
    "answer is ",
    "1,000",
    "1000",
    "12",
    "7",
    "0.5",
    " cm",
    "\\!",
    "\\\\",
    "^\\circ",
    "\\%",
    "x=",
    " ",
    "\n",
    "</think>",
    "-",
    "3.0",
    "\\sqrt2",
    "\\left(",
    "\\right)",
    ".",
    "\\in",
)
REFERENCES = ("12", "\\frac{1}{2}", "0.5", "1000", "7", "72 ", " 12", "3.0", "\\sqrt{2}", "1,000", "-7")


def verl_root() -> tuple[pathlib.Path, str]:
    """(the verl package folder `make setup` installs into .cache/verl, its version)."""
    target = harness.ROOT / ".cache" / "verl"
    dists = sorted(target.glob("verl-*.dist-info"))
    if not (target / "verl").is_dir() or len(dists) != 1:
        raise SystemExit(
            f"no verl wheel in {target}: run `make setup` (it installs setup.py's VERL_ORACLE there)"
        )
    return target / "verl", dists[0].name.removeprefix("verl-").removesuffix(".dist-info")


def verl_scorer(name: str) -> Callable[..., object]:
    """`compute_score` of verl/utils/reward_score/<name>.py, loaded from the pinned wheel's file."""
    root, version = verl_root()
    path = root / "utils" / "reward_score" / f"{name}.py"
    module_spec = importlib.util.spec_from_file_location(f"verl_{name}_{version}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.compute_score


def random_pair(rng: random.Random) -> tuple[str, str]:
    """A response of 1-12 random pieces around random words, and a reference from the pieces or REFERENCES."""
    words = ("so", "the", "sum", "is", "we", "get")
    parts = [rng.choice(words) + " " for _ in range(rng.randint(0, 3))]
    parts += [rng.choice(PIECES) for _ in range(rng.randint(1, 12))]
    reference = rng.choice(REFERENCES) if rng.random() < 0.7 else "".join(rng.choices(PIECES, k=2))
    if rng.random() < 0.5:  # the reference itself inside a construct the scorers read
        parts.insert(
            rng.randint(0, len(parts)), rng.choice(("\\boxed{%s}", "#### %s", "Answer: %s\n")) % reference
        )
    return "".join(parts), reference


def verdicts() -> dict[str, tuple[Callable[[str, str], bool], Callable[[str, str], bool]]]:
    """scorer -> (ours, VeRL's) as (response, reference) -> correct. Ours is the whole path a run takes
    (`ReferenceScorer` with reward="verl", routed by the row's data_source, as VeRL's default_compute_score
    routes it to the file whose compute_score is called here)."""
    from tlt_jax.tasks.rewards import ReferenceScorer

    scorer = ReferenceScorer(reward="verl")
    gsm8k, math, dapo = (verl_scorer(n) for n in ("gsm8k", "math_reward", "math_dapo"))
    return {
        "gsm8k": (lambda r, g: scorer(r, g, "openai/gsm8k").correct, lambda r, g: gsm8k(r, g) == 1.0),
        "math": (lambda r, g: scorer(r, g, "lighteval/MATH").correct, lambda r, g: math(r, g) == 1.0),
        "dapo": (lambda r, g: scorer(r, g, "math_dapo").correct, lambda r, g: dapo(r, g)["score"] == 1.0),
    }


def main() -> None:
    ap = harness.parser(__doc__, quick="5,000 pairs per scorer instead of --pairs")
    ap.add_argument("--pairs", type=int, default=200_000, help="random pairs per scorer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=5, help="differing pairs printed per scorer")
    args = ap.parse_args()
    n = 5_000 if args.quick else args.pairs
    root, version = verl_root()
    print(f"verl {version} ({root}), {n:,} random pairs per scorer, seed {args.seed}")
    values: dict[str, object] = {"pairs": n}
    for name, (ours, theirs) in verdicts().items():
        rng = random.Random(f"{args.seed}-{name}")
        differ = correct = 0
        for _ in range(n):
            response, reference = random_pair(rng)
            with contextlib.redirect_stdout(io.StringIO()):  # VeRL's MATH scorer prints what it catches
                b = theirs(response, reference)
            a = ours(response, reference)
            correct += b
            if a != b:
                differ += 1
                if differ <= args.show:
                    print(f"  {name}: ours {a}, VeRL's {b}: response={response!r} reference={reference!r}")
        print(f"{name}: {differ} verdicts differ; VeRL judges {correct:,} of {n:,} correct")
        values[f"{name}_differ"], values[f"{name}_correct"] = differ, correct
    harness.result(values, args)


if __name__ == "__main__":
    main()
