"""notebooks/quickstart.ipynb, the guided tour: its committed outputs are complete (every code cell ran, in
order, without an error or stderr noise) and it still runs from top to bottom on this repository's python.

The execution test takes minutes (SmolLM2 rollouts and a GRPO step, compiled on first use), so it is marked
`experiments` (`make test-experiments`). Its kernel is a kernel spec written into the test's temporary folder
that starts `sys.executable` (the .venv python under `make`): a `python3` spec of another environment, e.g.
in ~/.local/share/jupyter, cannot take its place. Like the notebook itself, it recreates
workdirs/quickstart (the GRPO step's workdir).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
MAX_BYTES = 300_000  # outputs stay small: a few lines per cell and two small PNGs
CELL_TIMEOUT_S = 900
REFRESH = f"refresh them: .venv/bin/jupyter execute --inplace {NOTEBOOK.relative_to(ROOT)}"


def code_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if c.cell_type == "code"]


def output_text(cell: nbformat.NotebookNode) -> str:
    """The cell's stdout and text/plain results, joined."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream" and out.name == "stdout":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def png_outputs(nb: nbformat.NotebookNode) -> int:
    return sum("image/png" in o.get("data", {}) for c in code_cells(nb) for o in c.outputs)


def check_outputs(nb: nbformat.NotebookNode) -> None:
    """Every code cell executed once, in order, with an output, no error and nothing on stderr."""
    cells = code_cells(nb)
    assert cells, "the notebook has no code cell"
    counts = [c.execution_count for c in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"execution counts {counts}, not 1..{len(cells)}: {REFRESH}"
    )
    for i, cell in enumerate(cells):
        head = cell.source.splitlines()[0] if cell.source else ""
        assert cell.outputs, f"code cell {i} ({head!r}) has no output: {REFRESH}"
        kinds = [(o.output_type, o.get("name", "")) for o in cell.outputs]
        assert ("error", "") not in kinds, f"code cell {i} ({head!r}) raised: {REFRESH}"
        assert ("stream", "stderr") not in kinds, (
            f"code cell {i} ({head!r}) wrote to stderr: silence the warning at its source (first cell)"
        )


def test_committed_outputs_are_complete_and_small() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    check_outputs(nb)
    assert NOTEBOOK.stat().st_size < MAX_BYTES, f"{NOTEBOOK.stat().st_size} bytes: trim the outputs"
    assert png_outputs(nb) == 2, "expected two PNGs: the long-tail plot and the run's plot"


def venv_kernel(folder: pathlib.Path) -> str:
    """A kernel spec named tlt_jax under `folder` that runs this interpreter; returns its name."""
    spec = folder / "tlt_jax"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "tlt_jax (.venv)", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    return spec.name


@pytest.mark.experiments
def test_notebook_executes_top_to_bottom(tmp_path: pathlib.Path) -> None:
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    kernels = tmp_path / "kernels"
    name = venv_kernel(kernels)
    km = AsyncKernelManager(
        kernel_name=name, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)])
    )
    # one CPU device, as a user runs it (tests/conftest.py fakes 8); the tests' compilation cache
    # and the kernel's own (inline) matplotlib backend, whatever an earlier test left in MPLBACKEND
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "MPLBACKEND")}
    env["TLT_JAX_COMPILATION_CACHE"] = str(ROOT / ".cache" / "jax_test_cache")
    env["WANDB_MODE"] = "disabled"
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in code_cells(nb):
        cell.outputs, cell.execution_count = [], None
    client = NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute(env=env)  # raises CellExecutionError on the first failing cell (its asserts included)

    check_outputs(nb)
    text = "\n".join(output_text(c) for c in code_cells(nb))
    assert "identical sequences: 8 of 8" in text  # coupled verification (the cell asserts it too)
    assert "done in" in text  # the GRPO step finished (not preempted)
    assert png_outputs(nb) == 2, "expected two PNGs: the long-tail plot and the run's plot"
