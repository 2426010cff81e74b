"""The package's shape: imports point one way (no cycles between modules, nor between packages) and every
module stays small. Read from the source with `ast`, so it checks what is written, including imports inside
functions."""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "tlt_jax"
MAX_LINES = 520  # "files under ~500 lines"
# the layers, bottom first: a unit may import only from its own layer's modules or the layers below
LAYERS = [
    {"utils", "kernels", "tasks"},
    {"models"},
    {"sharding"},
    {"rollout"},
    {"drafter"},
    {"config_lib"},
    {"rl"},
    {"main", "generate"},
]


def modules() -> dict[str, pathlib.Path]:
    return {
        ".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PKG.rglob("*.py")
    }


def imports(path: pathlib.Path, name: str) -> set[str]:
    """The tlt_jax modules a module imports (absolute and relative, at any depth)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("tlt_jax")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".")[: -node.level] if not path.name == "__init__.py" else name.split(".")
                base = ".".join(pkg + ([base] if base else []))
            if base.startswith("tlt_jax"):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}
    mods = modules()
    return {m for m in out if m in mods and m != name}


def unit(module: str) -> str:
    """The package (tlt_jax.<unit>) or top-level module a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def graph() -> dict[str, set[str]]:
    return {name: imports(path, name) for name, path in modules().items()}


def test_no_module_import_cycles() -> None:
    g = graph()
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])


def test_packages_import_downwards_only() -> None:
    layer = {u: i for i, us in enumerate(LAYERS) for u in us}
    bad = []
    for m, deps in graph().items():
        u = unit(m)
        if u == "tlt_jax":
            continue
        assert u in layer, f"{m}: unit {u!r} has no layer in tests/test_structure.py"
        for d in deps:
            du = unit(d)
            if du != u and layer.get(du, -1) > layer[u]:
                bad.append(f"{m} ({u}, layer {layer[u]}) imports {d} ({du}, layer {layer[du]})")
    assert not bad, "imports that point up:\n" + "\n".join(sorted(bad))


def test_modules_stay_small() -> None:
    big = {
        str(p.relative_to(PKG.parent)): n
        for p in PKG.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not big, f"modules over {MAX_LINES} lines: {big}"
