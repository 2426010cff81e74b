"""A warm-up data folder is reused only by runs that train on the states it holds (`warmup_states`): the
tiny target records real data for EAGLE-1 (final state) and EAGLE-3 (three capture points + final); a run of
the same arch reuses it (drafter_arch.py's HASS arm shares the EAGLE arm's folder), a run of the other arch,
other capture points or another target fails at start (before any compile or write) naming what was
recorded and the fix, and the folder is left as it was. Chunks written before the meta said are judged by
their feature width."""

import json
import pathlib

import numpy as np
import pytest

from tlt_jax import config_schema
from tlt_jax.config_lib import load_config_file
from tlt_jax.drafter import warmup, warmup_data

ROOT = pathlib.Path(__file__).resolve().parents[2]


def job(arch="eagle", aux=(), hass=False, **model_random):
    c = load_config_file(ROOT / "configs" / "drafter_warmup.py", "tiny")
    if hass:  # drafter_arch.py's HASS arm: EAGLE-1 with HASS's objective
        c.train.ttt_steps, c.train.topk = 2, 8
    c.generation.num_prompts, c.generation.n, c.generation.max_new_tokens = 2, 1, 6
    c.drafter_eval.num_prompts, c.drafter_eval.n = 1, 1
    c.arch, c.aux_layers = arch, tuple(aux)
    c.model.random.update(model_random)
    return config_schema.parse(c)


def record(j, wd):
    """The warm-up's phases 1-2 (target with its capture points, data) in `wd`; its data folder."""
    data_dir = wd / warmup.DATA_DIR
    data_dir.mkdir(parents=True, exist_ok=True)
    target, tokenizer = warmup.load_target(j, warmup_data.PhaseTimes(wd / "t.json"))
    warmup_data.build_data(j, target, tokenizer, data_dir, warmup_data.PhaseTimes(wd / "t.json"))
    return data_dir


def snapshot(d):
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Real data recorded by an EAGLE-1 run and by an EAGLE-3 run at capture points (0, 1, 2)."""
    root = tmp_path_factory.mktemp("arch")
    return {
        "eagle": record(job(), root / "eagle"),
        "eagle3": record(job("eagle3", (0, 1, 2)), root / "eagle3"),
    }


def refused(j, data_dir, match):
    """run_warmup on a workdir holding `data_dir` fails before it compiles or writes anything there."""
    before = snapshot(data_dir)
    with pytest.raises(ValueError, match=match):
        warmup.run_warmup(j, data_dir.parent)
    assert snapshot(data_dir) == before


def test_the_meta_records_the_states(folders):
    h = job().model.random["hidden_size"]
    for arch, aux, width in (("eagle", [], h), ("eagle3", [0, 1, 2], 4 * h)):
        for path in sorted(folders[arch].glob("*.npz")):
            with np.load(path) as z:
                states = json.loads(str(z["meta"]))["states"]
                assert z["hidden"].shape[1] == width
            assert (states["arch"], states["aux_layers"]) == (arch, aux)


def test_the_same_arch_reuses_the_folder(folders):
    """A HASS arm (same arch, another loss) on the EAGLE arm's folder, and EAGLE-3 at its capture points,
    load the cached chunks without writing."""
    for arch, j in (("eagle", job(hass=True)), ("eagle3", job("eagle3", (0, 1, 2)))):
        d = folders[arch]
        before = snapshot(d)
        target, tokenizer = warmup.load_target(j, warmup_data.PhaseTimes(d.parent / "t.json"))
        (train, _), _ = warmup_data.build_data(
            j, target, tokenizer, d, warmup_data.PhaseTimes(d.parent / "t.json")
        )
        assert train and snapshot(d) == before


def test_another_arch_or_target_is_refused_at_start(folders):
    refused(
        job("eagle3", (1, 2, 0)),
        folders["eagle"],
        r"recorded for arch=eagle \(the target's final state only\), but this run trains arch=eagle3 "
        r"\(the states entering the target's capture points \(1, 2, 0\).*delete .*data.*, or set "
        r"config.arch=eagle to train on it",
    )
    refused(job(), folders["eagle3"], r"capture points \(0, 1, 2\).* or set config.arch=eagle3, config.aux_l")
    refused(job("eagle3", (0, 1, 1)), folders["eagle3"], r"\(0, 1, 2\).*but this run trains.*\(0, 1, 1\)")
    refused(
        job(num_layers=3), folders["eagle"], r"recorded from the target config.model .*num_layers.*: delete"
    )


def test_chunks_from_before_the_meta_said_are_judged_by_their_width(folders, tmp_path):
    for arch in ("eagle", "eagle3"):
        d = tmp_path / arch / warmup.DATA_DIR
        d.mkdir(parents=True)
        for path in folders[arch].glob("*.npz"):
            samples, meta = warmup_data.load_chunk(path)
            meta.pop("states")
            warmup_data.save_chunk(d / path.name, samples, meta)
    refused(job("eagle3", (0, 1, 2)), tmp_path / "eagle" / "data", r"recorded for arch=eagle \(the target's")
    refused(job("eagle3", (0, 1, 2)), tmp_path / "eagle3" / "data", r"unrecorded capture points.*delete")
    refused(job(), tmp_path / "eagle3" / "data", r"unrecorded capture points.*delete [^,]*$")
    refused(job(hidden_size=48), tmp_path / "eagle" / "data", r"features; this target's states are 48 wide")
