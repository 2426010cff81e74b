"""Which target states a warm-up data folder holds, and the check that a run reuses only data it can train on.

EAGLE-1 trains on the target's final hidden state ([T, H] per sequence); EAGLE-3 on the states entering its
capture points plus the final one ([T, (K + 1) H]: `models.eagle3.states_width`). Each cached chunk's meta
records `states_ident` (the arch, the capture points, the target model), and `check_recorded_states` reads
every chunk's meta (and its feature width, for chunks written before the meta said) before the warm-up builds
its engine or writes anything: data recorded for another arch, other capture points or another model is an
error naming what was recorded, what this run needs and the fix, never a failure mid-training or a folder
mixing both. Runs of the same arch on the same target share a folder (drafter_arch.py's EAGLE and HASS arms).
"""

from __future__ import annotations

import json
import pathlib
import zipfile
from typing import Any

import numpy as np

from tlt_jax.drafter.warmup_config import WarmupConfig
from tlt_jax.models.llama import Transformer

# the `config.model` keys that say which target this is (dtype and kernels only change rounding)
_MODEL_KEYS = ("path", "random", "arch", "init")


def states_ident(job: WarmupConfig, target: Transformer) -> dict[str, Any]:
    """What a chunk's features are: {"arch", "aux_layers" (the target's capture points; [] for EAGLE-1),
    "model" (the target, as `config.model` names it)} (stored in each chunk's meta)."""
    model = {k: getattr(job.model, k) for k in _MODEL_KEYS}
    model["random"] = dict(model["random"] or {})
    return {
        "arch": job.run.arch,
        "aux_layers": [int(i) for i in target.aux_layers],
        "model": json.dumps(model, sort_keys=True, default=str),
    }


def _describe(arch: str, aux: list[int] | None) -> str:
    if arch == "eagle":
        return "arch=eagle (the target's final state only)"
    pts = "unrecorded capture points" if aux is None else f"capture points {tuple(aux)}"
    return f"arch=eagle3 (the states entering the target's {pts} and the final one)"


def _feature_width(path: pathlib.Path) -> int:
    """The feature width of a chunk (the npy header of its `hidden`, without reading the array)."""
    with zipfile.ZipFile(path) as zf, zf.open("hidden.npy") as f:
        version = np.lib.format.read_magic(f)
        read = (
            np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        )
        shape, _, _ = read(f)
    return int(shape[1])


def recorded_states(path: pathlib.Path, hidden_size: int) -> dict[str, Any]:
    """A chunk's `states_ident`; for a chunk written before its meta said, what its feature width implies
    (H: eagle; (K + 1) H: eagle3 with unrecorded capture points; else another model's) and no model."""
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
    if "states" in meta:
        return dict(meta["states"])
    width = _feature_width(path)
    if width == hidden_size:
        return {"arch": "eagle", "aux_layers": []}
    arch = "eagle3" if width % hidden_size == 0 else "unknown"
    return {"arch": arch, "aux_layers": None, "width": width}


def check_recorded_states(job: WarmupConfig, target: Transformer, data_dir: pathlib.Path) -> None:
    """Raise a ValueError when a cached chunk in `data_dir` holds other states than this run records
    (`states_ident`): another arch, other capture points, another target, or a feature width that is not
    this target's. Reads only the chunks' metas and npy headers; writes nothing."""
    want = states_ident(job, target)
    h = target.cfg.hidden_size
    fix = f"delete {data_dir} (or use a new workdir) to record this run's states"
    for path in sorted(data_dir.glob("*_[0-9][0-9][0-9].npz")):
        got = recorded_states(path, h)
        where = f"the warm-up data in {data_dir} ({path.name})"
        if got["arch"] == "unknown":
            raise ValueError(
                f"{where} holds {got['width']}-wide features; this target's states are {h} wide per layer: "
                f"it was recorded from another model; {fix}"
            )
        if got["arch"] != want["arch"] or got["aux_layers"] != want["aux_layers"]:
            keys = f"config.arch={got['arch']}"
            if got["aux_layers"]:
                keys += f", config.aux_layers={tuple(got['aux_layers'])}"
            reuse = f", or set {keys} to train on it" if got["aux_layers"] is not None else ""
            raise ValueError(
                f"{where} was recorded for {_describe(got['arch'], got['aux_layers'])}, but this run trains "
                f"{_describe(want['arch'], want['aux_layers'])}: {fix}{reuse}"
            )
        if "model" in got and got["model"] != want["model"]:
            raise ValueError(
                f"{where} was recorded from the target config.model {got['model']}, but this run's is "
                f"{want['model']}: {fix}"
            )
