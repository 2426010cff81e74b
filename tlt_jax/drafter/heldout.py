"""A drafter's acceptance on a finished warm-up's held-out data, for weights trained elsewhere.

The warm-up measures its drafter once, after training (`drafter_eval.json`'s "after": greedy chains and
rejection-sampled ones at the data's temperature). This measures other weights of the same architecture the
same way (same held-out sequences, evaluator, depth and draft vocabulary), so the numbers compare: e.g. the
spot trainer's drafter after RL steps against the warm-up's (paper Table 7's "then through the same spot
training", experiments/paper/drafter_arch.py). It reads the workdir and writes nothing to it.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from flax import nnx

from tlt_jax.drafter.draft_vocab import load_draft_vocab
from tlt_jax.drafter.evaluate import AcceptanceResult
from tlt_jax.drafter.warmup import (
    DATA_DIR,
    RESULT_FILE,
    acceptance_evaluator,
    load_target,
    target_weights,
)
from tlt_jax.drafter.warmup_config import WarmupConfig
from tlt_jax.drafter.warmup_data import PhaseTimes, build_data


def heldout_acceptance(
    job: WarmupConfig, workdir: str | os.PathLike, params: Mapping[str, Any]
) -> AcceptanceResult:
    """The acceptance of drafter `params` (a pure dict, `nnx.to_pure_dict` of the drafter's nnx.Param state)
    on the held-out data of the finished warm-up `job` ran in `workdir`. Refuses a workdir whose warm-up has
    not finished (its data may be partial) and params whose tree is not the warm-up drafter's."""
    wd = pathlib.Path(workdir)
    result = wd / RESULT_FILE
    if not (result.is_file() and json.loads(result.read_text()).get("complete")):
        raise ValueError(
            f"{wd} holds no finished warm-up ({RESULT_FILE} missing or incomplete): finish it first "
            "(python -m tlt_jax.main --config configs/drafter_warmup.py --workdir DIR, its config as before)"
        )
    times = PhaseTimes(None)  # the warm-up's phase record is left as it is
    target, tokenizer = load_target(job, times)
    _, (eval_samples, _) = build_data(job, target, tokenizer, wd / DATA_DIR, times, train=False)
    evaluator, state = acceptance_evaluator(job, target, load_draft_vocab(wd))
    want, got = _shapes(nnx.to_pure_dict(state)), _shapes(params)
    if want != got:
        diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        where = ", ".join(f"{'/'.join(map(str, k))} {got.get(k)} (trained {want.get(k)})" for k in diff[:4])
        raise ValueError(f"the drafter params do not fit the warm-up in {wd} ({job.run.arch}): {where}")
    nnx.replace_by_pure_dict(state, params)
    return evaluator(state, eval_samples, *target_weights(target))


def _shapes(tree: Mapping[str, Any]) -> dict[tuple, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in nnx.traversals.flatten_mapping(tree).items()}
