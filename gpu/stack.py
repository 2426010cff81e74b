"""The installed JAX stack against the GPU-tested one, and which versions differ.

The GPU-tested stack is requirements/jax-gpu.txt (jax, jaxlib, flax and jax's CUDA plugin at the versions
every GPU run used) plus setup.py's exact pins of the package's other dependencies (optax, orbax-checkpoint,
chex, ...: the same on both stacks). `make setup-gpu` ends with this report and the devices JAX sees; the GPU
suite's env phase records `compare_stack().as_dict()` beside its measurements, so a result says which stack
made it.

    python -m gpu.stack [--requirements requirements/jax-cpu.txt] [--devices] [--require-gpu] [--json]

Exit status 0 (1 with --require-gpu when JAX's backend is not a GPU); differing versions are reported, not
fatal: a cluster's own jax build may differ on purpose.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.metadata as md
import json
import pathlib
import re
import sys
from collections.abc import Callable, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU_REQUIREMENTS = ROOT / "requirements" / "jax-gpu.txt"
CPU_REQUIREMENTS = ROOT / "requirements" / "jax-cpu.txt"
SETUP = ROOT / "setup.py"
# jax's CUDA plugins: one of the two pairs is installed on a GPU machine (jax[cuda12] or jax[cuda13])
PLUGINS = {"12": ("jax-cuda12-plugin", "jax-cuda12-pjrt"), "13": ("jax-cuda13-plugin", "jax-cuda13-pjrt")}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)\s*(?:#.*)?$")


def normalize(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: str | pathlib.Path) -> dict[str, str]:
    """The `name==version` lines of a requirements/constraints file (comments and blank lines skipped); any
    other line is an error naming it (this report compares exact pins only)."""
    pins: dict[str, str] = {}
    for n, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        m = _PIN.match(text)
        if m is None:
            raise ValueError(f"{path}:{n}: {line.strip()!r} is not a `name==version` pin")
        pins[normalize(m.group(1))] = m.group(2)
    return pins


def setup_pins(path: str | pathlib.Path = SETUP) -> dict[str, str]:
    """setup.py's exact pins (`name==version` strings of its CORE list, read with ast: nothing is run)."""
    for node in ast.walk(ast.parse(pathlib.Path(path).read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "CORE" for t in node.targets):
            strings = [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
            return {normalize(m.group(1)): m.group(2) for s in strings if (m := _PIN.match(s))}
    raise ValueError(f"{path} has no CORE list of requirements")


def installed_version(name: str) -> str | None:
    """The installed version of distribution `name`, or None."""
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


@dataclasses.dataclass(frozen=True)
class Pin:
    """One pinned package: the version the stack wants, the installed one, and which file pins it."""

    package: str
    wanted: str
    installed: str | None
    source: str
    optional: bool = False  # a CUDA plugin of the CUDA version not in use: compared only when installed

    @property
    def status(self) -> str:
        if self.installed is None:
            return "not installed (optional)" if self.optional else "MISSING"
        return "same" if self.installed == self.wanted else "DIFFERS"

    @property
    def differs(self) -> bool:
        return self.status in ("MISSING", "DIFFERS")


@dataclasses.dataclass(frozen=True)
class StackReport:
    """Every pin of the stack with what is installed; `differ` lists the mismatches."""

    requirements: str
    rows: tuple[Pin, ...]
    cuda: str | None  # "12" / "13": the CUDA plugin installed; None: none (no GPU support)

    @property
    def differ(self) -> list[str]:
        out = [f"{p.package} {p.installed or 'missing'} (wanted {p.wanted})" for p in self.rows if p.differs]
        if self.cuda is None:
            out.append("no jax CUDA plugin installed (jax[cuda12] or jax[cuda13])")
        return out

    def as_dict(self) -> dict[str, object]:
        """JSON-able: the requirements file, each package's wanted / installed / source, and `differ`."""
        packages = {
            p.package: {"wanted": p.wanted, "installed": p.installed, "source": p.source} for p in self.rows
        }
        return {
            "requirements": self.requirements,
            "cuda": self.cuda,
            "packages": packages,
            "differ": self.differ,
        }

    def table(self) -> str:
        """A fixed-width table, then one line saying whether the stack is the pinned one."""
        w = max(len(p.package) for p in self.rows)
        lines = [f"{'package':<{w}}  {'wanted':<12} {'installed':<12} {'status':<26} pinned by"]
        for p in self.rows:
            lines.append(
                f"{p.package:<{w}}  {p.wanted:<12} {p.installed or '-':<12} {p.status:<26} {p.source}"
            )
        verdict = "; ".join(self.differ) if self.differ else "none"
        return "\n".join(lines + [f"differ from {self.requirements}: {verdict}"])


def compare_stack(
    requirements: str | pathlib.Path = GPU_REQUIREMENTS,
    version: Callable[[str], str | None] = installed_version,
    setup: str | pathlib.Path = SETUP,
) -> StackReport:
    """The installed versions (`version(name)`, default importlib.metadata) against `requirements`'s pins
    and setup.py's exact pins (the requirements file wins where both pin a package). The CUDA plugin pins
    of the CUDA version that is not installed are optional."""
    req = pathlib.Path(requirements)
    label = str(req.relative_to(ROOT)) if req.is_relative_to(ROOT) else str(req)
    pins = {k: (v, label) for k, v in read_pins(req).items()}
    pins |= {k: (v, "setup.py") for k, v in setup_pins(setup).items() if k not in pins}
    have = {name: version(name) for name in pins}
    cuda = next((c for c, names in PLUGINS.items() if any(have.get(n) or version(n) for n in names)), None)
    other = {n for c, names in PLUGINS.items() if c != cuda for n in names}
    rows = tuple(Pin(n, w, have[n], src, optional=n in other) for n, (w, src) in pins.items())
    return StackReport(label, rows, cuda)


def devices_line() -> tuple[str, bool]:
    """(what JAX sees: backend, device count and kinds; whether the backend is a GPU). Imports jax."""
    import jax

    devices, backend = jax.devices(), jax.default_backend()
    kinds = ", ".join(sorted({d.device_kind for d in devices}))
    line = f"jax {jax.__version__}: backend {backend}, {len(devices)} devices ({kinds})"
    return line, backend in ("gpu", "cuda", "rocm")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requirements", default=str(GPU_REQUIREMENTS), help="the pins to compare against")
    ap.add_argument("--devices", action="store_true", help="also print the devices JAX sees")
    ap.add_argument("--require-gpu", action="store_true", help="exit 1 unless JAX's backend is a GPU")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    report = compare_stack(args.requirements)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.table())
    if not (args.devices or args.require_gpu):
        return 0
    line, on_gpu = devices_line()
    print(line)
    if args.require_gpu and not on_gpu:
        print("error: JAX found no GPU: check `nvidia-smi`, the CUDA version of the plugin (CUDA=12 or 13)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
