"""The phase file (tlt_jax/utils/phase.py): one fixed-width line rewritten in place, read back as written."""

from __future__ import annotations

import pytest

from tlt_jax.utils.phase import PHASE_FILE, PhaseFile, read_phase


def test_the_phase_file_holds_the_last_phase_set(tmp_path) -> None:
    assert read_phase(tmp_path) is None  # no learner yet
    phases = PhaseFile(tmp_path / "w")  # the workdir is created
    phases.set(0, "init")
    assert read_phase(tmp_path / "w") == (0, "init")
    phases.set(12, "spot_after_rollout")
    phases.set(12, "update")  # shorter than the line it replaces: no tail of it remains
    assert read_phase(tmp_path / "w") == (12, "update")
    size = (tmp_path / "w" / PHASE_FILE).stat().st_size
    with pytest.raises(ValueError, match="one word"):
        phases.set(1, "two words")
    phases.close()
    phases.close()
    phases.set(13, "rollout")  # closed: nothing written
    assert read_phase(tmp_path / "w") == (12, "update")
    assert (tmp_path / "w" / PHASE_FILE).stat().st_size == size == 64


def test_a_phase_file_without_a_workdir_writes_nothing(tmp_path) -> None:
    PhaseFile(None).set(3, "rollout")  # processes other than process 0
    (tmp_path / PHASE_FILE).write_text("garbage\n")
    assert read_phase(tmp_path) is None
