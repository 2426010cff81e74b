"""The experiment scripts' shape (issue #45): imports point one way in experiments/, between modules and
between its sub-packages (lib at the bottom; bench, checks and paper above it; models on top), read from
the source with `ast` as tests/test_structure.py reads tlt_jax/ (imports inside functions included: a lazy
import closes a circle too). No JAX: milliseconds."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def script_modules(package: str) -> dict[str, pathlib.Path]:
    """{dotted module name: file} of a top-level script package (its __init__ as the package's name)."""
    return {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (ROOT / package).rglob("*.py")
    }


def script_graph(package: str) -> dict[str, set[str]]:
    """{module: the package's modules it imports}: `import a.b`, `from a import b` (b a module or a name
    of a), and relative imports, at any depth of the file."""
    mods = script_modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                out |= {base} | {f"{base}.{a.name}" for a in node.names}
        graph[name] = {m for m in out if m in mods and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep, stack + [dep])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_find_cycle_finds_a_lazy_pair_and_passes_a_chain() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("package", ["experiments"])
def test_no_import_circles_between_modules(package: str) -> None:
    """E.g. project_sd -> measured_costs -> roofline, memory_plans -> rollout_plan -> layer_fit: a module
    two others share lives below both."""
    graph = script_graph(package)
    assert len(graph) > 10 and any(graph.values()), f"{package}: no modules or imports read"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("package", ["experiments"])
def test_no_import_circles_between_subpackages(package: str) -> None:
    """The sub-packages (experiments.lib, .bench, .checks, .paper, .models) import one another one way."""
    sub = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    graph: dict[str, set[str]] = {}
    for mod, deps in script_graph(package).items():
        graph.setdefault(sub(mod), set()).update(sub(d) for d in deps if sub(d) != sub(mod))
    cycle = find_cycle(graph)
    assert cycle is None, "sub-package import circle: " + " -> ".join(cycle or [])
