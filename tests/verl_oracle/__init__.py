"""VeRL's own code as a test oracle: the `verl` wheel pinned in setup.py (VERL_ORACLE), installed without its
dependencies into .cache/verl by `make setup` (tests/verl_oracle/wheel.py says why not site-packages), its
module files loaded directly.

`import verl` needs ray, tensordict, omegaconf, hydra, ... (its package __init__ imports its protocol and
workers), which the CPU stack does not install. `verl_module("verl.trainer.ppo.core_algos")` loads the
installed file itself: packages on the way are created from their folders without running their __init__
(a name an __init__ re-exports, e.g. `verl.utils.group_mean_std`, is found by reading the __init__'s
`from .sub import name` lines and importing `sub`), and the uninstalled third-party modules VeRL imports at
module level (STAND_INS) are, during the load only, modules whose every name is an opaque class that raises
when called or instantiated. They are used by VeRL only in annotations and isinstance checks on the paths
the tests call; a VeRL function that reached one would raise, never compute with it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import pathlib
import sys
import types

from tests.verl_oracle.wheel import verl_root

# third-party modules VeRL imports at module level that the CPU stack does not install, and VeRL's own
# modules that need them only to define config / data classes (replaced the same way during a load)
STAND_INS = (
    "omegaconf",
    "tensordict",
    "ray",
    "hydra",
    "codetiming",
    "verl.protocol",
    "verl.trainer.config",
    "verl.workers.config",
    "verl.utils.device",
    "verl.utils.fs",
    "verl.utils.model",
)
# packages whose __init__ defines what the tests call (run for real; the others' __init__ is skipped)
RUN_INIT = ("verl.utils.reward_score",)


class _Opaque(type):
    """The metaclass of a stand-in name: any attribute is another opaque class; calling one raises."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _opaque(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args: object, **kwargs: object) -> object:
        raise RuntimeError(f"{cls.__qualname__}: a stand-in of an uninstalled module was called by VeRL code")

    def __getitem__(cls, item: object) -> type:  # annotations such as Foo[int]
        return cls


def _opaque(name: str) -> type:
    return _Opaque(name, (), {"__qualname__": name})


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _opaque(f"{self.__name__}.{name}")


def _reexports(init: pathlib.Path) -> dict[str, str]:
    """name -> submodule for the package __init__'s `from .sub import name` lines."""
    out = {}
    if init.is_file():
        for node in ast.walk(ast.parse(init.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                out.update({a.asname or a.name: node.module for a in node.names})
    return out


class _Package(types.ModuleType):
    """A verl package created from its folder, its __init__ not run; re-exported names resolve lazily."""

    def __getattr__(self, name: str) -> object:
        sub = _reexports(pathlib.Path(self.__path__[0]) / "__init__.py").get(name)
        if sub is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{self.__name__}.{sub}"), name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `verl.*` to the installed files (packages without their __init__), and while `loading`, the
    STAND_INS to stand-in modules."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root, self.loading = root, False

    def find_spec(
        self, name: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        stand_in = any(name == s or name.startswith(s + ".") for s in STAND_INS)
        if stand_in and self.loading:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if name != "verl" and not name.startswith("verl."):
            return None
        rel = pathlib.Path(*name.split(".")[1:])
        folder = self.root / rel
        if folder.is_dir():
            spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
            spec.submodule_search_locations = [str(folder)]
            return spec
        file = folder.with_suffix(".py")
        return importlib.util.spec_from_file_location(name, file) if file.is_file() else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.submodule_search_locations:
            module = _Package(spec.name)
            module.__path__ = list(spec.submodule_search_locations)
            return module
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Runs a RUN_INIT package's __init__; other packages' are skipped, a stand-in is empty."""
        if module.__name__ in RUN_INIT:
            init = pathlib.Path(module.__path__[0]) / "__init__.py"
            module.__file__ = str(init)
            exec(compile(init.read_text(), init, "exec"), module.__dict__)  # noqa: S102 - VeRL's own file


_FINDER: _Finder | None = None


def verl_module(name: str) -> types.ModuleType:
    """The installed VeRL module `name` (e.g. "verl.utils.reward_score.math_dapo"), loaded from its file."""
    global _FINDER
    if _FINDER is None:
        _FINDER = _Finder(verl_root())
        sys.meta_path.insert(0, _FINDER)
    if name in sys.modules and getattr(sys.modules[name], "__file__", None):
        return sys.modules[name]
    before = set(sys.modules)
    _FINDER.loading = True
    try:
        module = importlib.import_module(name)
    finally:
        _FINDER.loading = False
        for added in set(sys.modules) - before:  # stand-ins live only for the load
            if isinstance(sys.modules[added], _StandIn):
                del sys.modules[added]
    return module


def verl_function(module: str, name: str) -> object:
    """`name` from VeRL's `module` (a function or class of the installed wheel)."""
    return getattr(verl_module(module), name)


def verl_line(module: str, text: str) -> str:
    """'path/in/verl.py:LINE' of the first line of `module`'s file holding `text` (tests name what they
    follow; an error if 0.9.1 has no such line)."""
    file = verl_root() / pathlib.Path(*module.split(".")[1:])
    file = file / "__init__.py" if file.is_dir() else file.with_suffix(".py")
    for i, line in enumerate(file.read_text().splitlines(), 1):
        if text in line:
            return f"verl/{file.relative_to(verl_root()).as_posix()}:{i}"
    raise LookupError(f"{text!r} is not in {file}")
