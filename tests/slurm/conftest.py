"""The real Slurm of `make test-slurm`: one cluster per session (tests/slurm/cluster.py), stopped whatever
happens. The tests here are marked `slurm` and run only when the marker expression names it (`pytest -m
slurm`, as `make test-slurm` runs them): `make test`'s `-m "not experiments and not extended"` deselects them,
so the default tiers never need slurmd or munged."""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Iterator

import pytest

from tests.slurm.cluster import Cluster

HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the `slurm` tests unless -m names the marker (this hook sees every item: filter ours)."""
    if "slurm" in (config.option.markexpr or ""):
        return
    ours = [i for i in items if i.get_closest_marker("slurm") is not None]
    if ours:
        config.hook.pytest_deselected(items=ours)
        items[:] = [i for i in items if i.get_closest_marker("slurm") is None]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """munged + slurmctld + slurmd on this machine (their conf, key, state and logs in a temp dir), stopped
    by pid at the end of the session. Missing binaries fail (make test-slurm installs them), never skip."""
    missing = [b for b in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch") if shutil.which(b) is None]
    if missing:
        pytest.fail(f"{missing} not on PATH: run `make test-slurm` (it installs slurm-wlm and munge)")
    # a short root: munged's socket path must fit a sockaddr_un (108 bytes)
    root = pathlib.Path(os.environ.get("TLT_JAX_SLURM_ROOT") or tmp_path_factory.mktemp("slurm"))
    cluster = Cluster(root / "cluster")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
