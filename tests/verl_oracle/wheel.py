"""Where VeRL's own code lives for the tests and checks that use it as an oracle.

`make setup` installs the `verl` wheel pinned in setup.py (VERL_ORACLE) without its dependencies into
`.cache/verl` (`pip install --no-deps --target`), not into the venv's site-packages: the wheel also ships a
top-level `tests` package, which would shadow this repository's `tests` wherever `import tests` runs outside
pytest. Its files are read directly (tests/verl_oracle; experiments/checks/verl_scorers.py finds the same
folder), never imported as an installed package.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/verl_oracle/wheel.py -> the repository
TARGET = ROOT / ".cache" / "verl"


def pinned_version() -> str:
    """The version setup.py's VERL_ORACLE pins (`verl==X`)."""
    m = re.search(r'^VERL_ORACLE = "verl==([^"]+)"', (ROOT / "setup.py").read_text(), re.M)
    if m is None:
        raise RuntimeError('setup.py has no VERL_ORACLE = "verl==<version>" line')
    return m.group(1)


def verl_root() -> pathlib.Path:
    """The `verl` package folder `make setup` installed into .cache/verl; a clear error when it is missing or
    not the pinned version."""
    version = pinned_version()
    dist = TARGET / f"verl-{version}.dist-info"
    if not (TARGET / "verl").is_dir() or not dist.is_dir():
        found = sorted(p.name for p in TARGET.glob("verl-*.dist-info")) if TARGET.is_dir() else []
        raise RuntimeError(
            f"verl {version} is not in {TARGET} (found: {found or 'nothing'}): run `make setup` (it installs "
            f"verl=={version} --no-deps there, the VeRL oracle of the tests and checks)"
        )
    return TARGET / "verl"
