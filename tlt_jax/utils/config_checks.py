"""Config checks whose messages name the key, the value and the fix: unknown keys with the nearest valid ones,
values out of range, and a workdir whose saved `config.json` differs from the command's config.

Plain logic over nested dicts (a ConfigDict's `to_dict()`) and the workdir's JSON: the callers pass the
reference config and say what is fatal (`tlt_jax.rl.config` validates GRPO configs with these; `tlt_jax.main`
checks command-line overrides and the workdir before anything is written).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import ml_collections as mlc
from ml_collections import config_dict

from tlt_jax.utils.plain import plain_dict
from tlt_jax.utils.tracking import CONFIG_FILE

# `python -m tlt_jax.main --allow_config_change`: resume a workdir whose saved config differs
ALLOW_CHANGE_FLAG = "allow_config_change"
# Keys a resumed run may change: how long it runs, how often it saves, logs and evaluates, where it runs and
# reports. Any other difference would continue one run's checkpoints with another run's settings.
RESUMABLE_KEYS = (
    "num_steps",
    "train.steps",
    "checkpoint_every",
    "keep_checkpoints",
    "log_every",
    "progress_bar",
    "log_samples",
    "compilation_cache_dir",
    "multiprocess",
    "mesh",
    "wandb",
    "eval.every",
    # what an evaluation decodes and reports (never what training reads: eval.prompts is the split)
    "eval.sets",
    "eval.samples",
    "eval.temperature",
    "eval.top_p",
    "eval.top_k",
    "eval.before_train",
    "eval.plain_baseline",
    "export_every",
    "stop_within",  # how a stop or a stall ends the run (tlt_jax/rl/stopping.py)
    "watchdog",
)
# (key, predicate on its value, the allowed range in words) for `range_problems`
Range = tuple[str, Callable[[Any], bool], str]


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of a nested dict (an empty dict is a value)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def nearest_keys(key: str, valid: Iterable[str], n: int = 3) -> list[str]:
    """The valid keys closest to a mistyped `key`: close spellings, the initials of its words ("learning_rate"
    -> "lr"), and keys that contain it or that it contains."""
    valid = sorted(set(valid))
    initials = "".join(w[0] for w in key.split("_") if w)
    found = difflib.get_close_matches(key, valid, n=n, cutoff=0.6)
    found += [k for k in valid if "_" in key and k == initials]
    found += [k for k in valid if min(len(k), len(key)) >= 3 and (k in key or key in k)]
    return list(dict.fromkeys(found))[:n]


def _unknown(config: Mapping[str, Any], reference: Mapping[str, Any], path: str, free: Sequence[str]) -> list:
    out = []
    for key, value in config.items():
        dotted = f"{path}.{key}" if path else str(key)
        if dotted in free:
            continue
        if key not in reference:
            out.append((path, str(key), sorted(map(str, reference))))
        elif isinstance(value, Mapping) and isinstance(reference[key], Mapping):
            out += _unknown(value, reference[key], dotted, free)
    return out


def _unknown_message(path: str, key: str, valid: list[str]) -> str:
    section = f"config.{path}" if path else "config"
    near = nearest_keys(key, valid)
    guess = f"did you mean {', '.join(f'{section}.{k}' for k in near)}? " if near else ""
    return (
        f"{section}.{key} is not a config key: {guess}Fix its name in the config file or the --config "
        f"override ({section} has: {', '.join(valid)})."
    )


def unknown_key_problems(
    config: mlc.ConfigDict | Mapping[str, object],
    reference: mlc.ConfigDict | Mapping[str, object],
    free: Sequence[str] = (),
) -> list[str]:
    """One problem per key of `config` that `reference` lacks (a mistyped section once, not its keys), with
    the nearest valid keys; the sections named in `free` ("model.random") take any keys."""
    return [_unknown_message(*u) for u in _unknown(plain_dict(config), plain_dict(reference), "", free)]


def override_hints(
    config: mlc.ConfigDict | Mapping[str, object] | None, overrides: Iterable[str]
) -> list[str]:
    """For command-line overrides ("--config.rl.lerning_rate=1") that name no key of `config`, the first
    missing part with the nearest valid keys there."""
    hints = []
    for arg in overrides:
        parts = arg.removeprefix("--").split("=", 1)[0].split(".")[1:]
        node: Any = plain_dict(config) if config is not None else None
        for i, part in enumerate(parts):
            if not isinstance(node, Mapping):
                break
            if part not in node:
                hints.append(_unknown_message(".".join(parts[:i]), part, sorted(map(str, node))))
                break
            node = node[part]
    return hints


def range_problems(
    section: mlc.ConfigDict | Mapping[str, object], name: str, ranges: Sequence[Range]
) -> list[str]:
    """`config.<name>.<key>=<value>: must be <range>.` for each key of `section` outside its range."""
    return [
        f"config.{name}.{key}={section[key]!r}: must be {need}."
        for key, ok, need in ranges
        if key in section and not ok(section[key])
    ]


def _resumable(key: str, resumable: Sequence[str]) -> bool:
    return any(key == r or key.startswith(r + ".") for r in resumable)


def config_changes(
    saved: Mapping[str, Any],
    current: mlc.ConfigDict | Mapping[str, object],
    resumable: Sequence[str] = RESUMABLE_KEYS,
) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) for each key both configs have whose values differ, except
    the `resumable` ones. A key only one of them has (added or removed by a code change) is not compared."""
    now = _flatten(json.loads(json.dumps(plain_dict(current), sort_keys=True, default=str)))
    before = _flatten(saved)
    return [
        (k, before[k], now[k])
        for k in sorted(set(before) & set(now))
        if before[k] != now[k] and not _resumable(k, resumable)
    ]


def check_workdir_config(
    config: mlc.ConfigDict | Mapping[str, object], workdir: str | os.PathLike, allow_change: bool = False
) -> list[str]:
    """The differences between `workdir/config.json` (written by the run that made the workdir) and `config`,
    as "key: saved -> now" lines; a ValueError listing them and the ways on unless `allow_change`. A workdir
    without config.json is new: nothing to compare."""
    path = os.path.join(os.fspath(workdir), CONFIG_FILE)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        try:
            saved = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path} is not valid JSON ({e}): the workdir's record of its run is damaged; use a new "
                "--workdir, or delete that file to resume with this command's config."
            ) from e
    lines = [f"config.{k}: {a!r} -> {b!r}" for k, a, b in config_changes(saved, config)]
    if lines and not allow_change:
        raise ValueError(
            f"workdir {workdir} holds a run started with another config ({path}); these keys differ "
            "(saved -> this command):\n    " + "\n    ".join(lines) + "\n  Resuming would continue that "
            "run's checkpoints with other settings. Use a new --workdir for this config, rerun with the "
            f"saved values, or pass --{ALLOW_CHANGE_FLAG} to resume with these anyway (free to change on a "
            f"resume: {', '.join(RESUMABLE_KEYS)})."
        )
    return lines


# ----------------------------------------------------------------------------------------------------------
# Typed sections: a config section as a frozen dataclass (tlt_jax.config_schema registers them)
# ----------------------------------------------------------------------------------------------------------

# field metadata for a default of None that the ConfigDict should type: `field(default=None, metadata=STR)`
STR: Mapping[str, type] = {"placeholder": str}


class SectionError(ValueError):
    """A section's problems, each naming `config.<section>.<key>`, the value and the fix."""

    def __init__(self, problems: Sequence[str]):
        super().__init__("\n".join(problems))
        self.problems = list(problems)


class Section:
    """Base of a config section's dataclass: the fields are the section's keys, their defaults THE defaults
    (`section_defaults` makes the base config's section from them) and `problems()` the section's own checks,
    run once when the section is built (an invalid section is never an object)."""

    def problems(self) -> list[str]:
        return []

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, list):  # ConfigDict sequences: the sections hash
                object.__setattr__(self, f.name, tuple(value))
            elif isinstance(value, (mlc.ConfigDict, Mapping)):  # nested sub-sections: plain dicts
                object.__setattr__(self, f.name, plain_dict(value))
        problems = self.problems()
        if problems:
            raise SectionError(problems)


def section_defaults(cls: type, drop: Sequence[str] = ()) -> mlc.ConfigDict:
    """The ConfigDict of a section dataclass's defaults (a None default with `metadata=STR` is a typed
    placeholder, a dict default an open sub-section); `drop`: fields another section decides."""
    out = mlc.ConfigDict()
    for f in dataclasses.fields(cls):
        if f.name in drop:
            continue
        if f.default is not dataclasses.MISSING:
            value = f.default
        else:
            value = f.default_factory()  # type: ignore[misc]
        if value is None and "placeholder" in f.metadata:
            value = config_dict.placeholder(f.metadata["placeholder"])
        elif isinstance(value, dict):
            value = mlc.ConfigDict(value)
        out[f.name] = value
    return out


def build_section(cls: type, section: mlc.ConfigDict | Mapping[str, object], name: str) -> Any:
    """`cls(**section)`; a wrong value is a ValueError naming `config.<name>` (keys the class lacks
    are left out: `unknown_key_problems` names them with the nearest valid ones)."""
    known = {f.name for f in dataclasses.fields(cls)}
    fields = {k: v for k, v in plain_dict(section).items() if k in known}
    try:
        return cls(**fields)
    except SectionError:
        raise
    except (TypeError, ValueError) as e:
        raise SectionError([f"config.{name} is invalid: {e}"]) from e
