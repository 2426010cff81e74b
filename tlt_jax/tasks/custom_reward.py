"""A reward function of the user's, by import path, as VeRL's `custom_reward_function` (path + name,
verl/trainer/ppo/reward.py `get_custom_reward_fn`): `config.task.reward="module:function"` (an importable
module) or `"path/to/file.py:function"`.

It is called as VeRL 0.9.1's reward managers call it, with keywords: `fn(data_source=, solution_str=,
ground_truth=, extra_info=, **reward_kwargs)` (the whole decoded response, the row's reference as stored, its
`extra_info` dict with the keys VeRL's naive manager adds, `config.task.reward_kwargs` as VeRL's
custom_reward_function.reward_kwargs: verl/trainer/ppo/reward.py get_custom_reward_fn), and returns a number
or a dict with a numeric "score" (VeRL's contract): the score is the reward as it is, no scale applied.
VeRL's "acc" (what filter_metric="acc" and mean@k read): a dict's "acc", or a number's score itself
(verl/experimental/reward_loop/reward_manager/naive.py: `reward_extra_info["acc"] = score`), partial credit
included (`custom_acc="score"`); `custom_acc="full_credit"` (tlt_jax's variant) counts a number as correct
only at full credit (score >= 1). A dict's other numeric entries are logged as `reward/<key>` step means
(VeRL's reward_extra_info). The module is imported and the signature checked when the config is validated;
a bad return value is an error naming the value at the first call. An exception the function raises stops
the run, as in VeRL.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import pathlib
from collections.abc import Callable, Mapping

ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
CUSTOM_ACC = ("score", "full_credit")  # VeRL's acc of a number (the score itself) | tlt_jax's (score >= 1)
EXPECTED = "a number or a dict with a numeric 'score' (VeRL's custom_reward_function contract)"


def is_custom(reward: str) -> bool:
    """Whether a `config.task.reward` value names a function ("module:function") rather than a checker."""
    return ":" in reward


@dataclasses.dataclass(frozen=True)
class CustomScore:
    """What one call returned: the score, the verdict, VeRL's acc, a dict result's other numeric entries."""

    score: float
    correct: bool
    extra: Mapping[str, float]
    acc: float = 0.0


def _module(target: str, spec: str) -> object:
    where = f"config.task.reward={spec!r}"
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = pathlib.Path(target).expanduser()
        if not path.is_file():
            raise ValueError(f"{where}: the file {str(path)!r} does not exist (write 'file.py:function')")
        loader_spec = importlib.util.spec_from_file_location(f"tlt_jax_reward_{abs(hash(str(path)))}", path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"{where}: {str(path)!r} cannot be imported as a Python module")
        module = importlib.util.module_from_spec(loader_spec)
        run = functools.partial(loader_spec.loader.exec_module, module)
    else:
        run = functools.partial(importlib.import_module, target)
    try:
        loaded = run()
    except ModuleNotFoundError as e:
        raise ValueError(
            f"{where}: no module {e.name!r} ({e}); put it on PYTHONPATH or give a file: 'file.py:function'"
        ) from e
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything while importing
        raise ValueError(f"{where}: importing {target!r} raised {type(e).__name__}: {e}") from e
    return module if loaded is None else loaded


@functools.lru_cache(maxsize=32)
def load_reward_fn(spec: str) -> Callable[..., object]:
    """The function `spec` names ("module:function" / "file.py:function"), imported once per process, with
    its signature checked against VeRL's call; a ValueError naming what is wrong and the fix."""
    target, _, name = spec.rpartition(":")
    if not target or not name.isidentifier():
        raise ValueError(
            f"config.task.reward={spec!r}: write 'module:function' or 'path/to/file.py:function' for a "
            "reward function of your own"
        )
    module = _module(target, spec)
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"config.task.reward={spec!r}: {target!r} has no {name!r} (its functions: {found})")
    if not callable(fn) or inspect.iscoroutinefunction(fn):
        raise ValueError(f"config.task.reward={spec!r}: {name!r} must be a plain function (got {fn!r})")
    try:
        inspect.signature(fn).bind(**dict.fromkeys(ARGS))
    except TypeError as e:
        raise ValueError(
            f"config.task.reward={spec!r}: {name}{inspect.signature(fn)} cannot take the keywords VeRL "
            f"passes ({e}): define it as def {name}(data_source, solution_str, ground_truth, extra_info=None)"
        ) from e
    except ValueError:  # a builtin without an introspectable signature: checked at the first call
        pass
    return fn


def _number(value: object) -> float | None:
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    return None


def custom_score(spec: str, value: object, acc_mode: str = "score") -> CustomScore:
    """A call's return `value` read as VeRL reads it; a ValueError naming the value and what is expected.
    `acc_mode` (CUSTOM_ACC): a number's acc is the score itself ("score", VeRL's) or full credit
    ("full_credit"); `correct` (full credit, the accuracy tlt_jax logs) is acc >= 1 either way."""
    if acc_mode not in CUSTOM_ACC:
        raise ValueError(f"config.task.custom_acc={acc_mode!r}: use one of {CUSTOM_ACC}")
    score = _number(value.get("score") if isinstance(value, Mapping) else value)
    if score is None:
        raise ValueError(f"config.task.reward={spec!r} returned {value!r}; expected {EXPECTED}, finite")
    if not isinstance(value, Mapping):
        acc = score if acc_mode == "score" else float(score >= 1.0)
        return CustomScore(score, score >= 1.0, {}, acc)
    numbers_ = ((str(k), _number(v)) for k, v in value.items() if k != "score")
    extra = {k: v for k, v in numbers_ if v is not None}
    if "acc" in value:
        acc = _number(float(value["acc"]) if isinstance(value["acc"], bool) else value["acc"])
        acc = float(bool(value["acc"])) if acc is None else acc
    else:  # VeRL's reward_extra_info then has no "acc"; the score stands in for it
        acc = score if acc_mode == "score" else float(score >= 1.0)
    return CustomScore(score, acc >= 1.0, extra, acc)


def verl_extra_info(extra_info: Mapping | None) -> dict:
    """The `extra_info` VeRL's naive reward manager passes: the row's dict (or {}) with `num_turns` (None for
    a single-turn rollout) and `rollout_reward_scores` ({}) added (verl/experimental/reward_loop/
    reward_manager/naive.py run_single)."""
    out = dict(extra_info or {})
    out["num_turns"] = None
    out["rollout_reward_scores"] = {}
    return out


def call_reward_fn(
    spec: str,
    data_source: str | None,
    response: str,
    reference: str,
    extra_info: Mapping | None,
    reward_kwargs: Mapping[str, object] | None = None,
    acc_mode: str = "score",
) -> CustomScore:
    """Score one response with the function `spec` names, called as VeRL calls it."""
    fn = load_reward_fn(spec)
    value = fn(
        data_source=data_source,
        solution_str=response,
        ground_truth=reference,
        extra_info=verl_extra_info(extra_info),
        **dict(reward_kwargs or {}),
    )
    return custom_score(spec, value, acc_mode)
