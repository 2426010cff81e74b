"""The package's shape: imports point one way (no cycles between modules, nor between packages), every
module and every function stays small, and the main objects are typed at every seam (never `Any`). Read from
the source with `ast`, so it checks what is written, including imports inside functions."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "tlt_jax"
MAX_LINES = 520  # "files under ~500 lines"
# the layers, bottom first: a unit may import only from its own layer's modules or the layers below
LAYERS = [
    {"utils", "kernels", "tasks"},
    {"models"},
    {"sharding"},
    {"rollout"},
    {"config_sections"},
    {"drafter"},
    {"config_schema"},
    {"config_lib"},
    {"rl"},
    {"main", "generate", "export_drafter", "export_policy", "memory_plan", "rollout_memory_plan"},
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


# ----------------------------------------------------------------------------------------------------------
# Functions (issue #25): short enough to read at once, and the project's main objects typed at every seam
# ----------------------------------------------------------------------------------------------------------

MAX_FUNCTION_LINES = 80  # from the `def` line (decorators not counted) to the body's last line
# parameters holding the project's main objects: typed with their class or a Protocol (the engine's clients:
# `tlt_jax.rollout.interface.EngineLike`), never `Any`. The config and its sections: `mlc.ConfigDict`
# (`| Mapping[str, object]` where plain dicts are accepted too); the tokenizer: `models.build.TextCodec`
TYPED_PARAMS = {
    "config",
    "section",
    "tokenizer",
    "tok",
    "engine",
    "learner",
    "trainer",
    "spot",
    "spot_trainer",
    "selector",
    "policy",
    "harvester",
    "evaluator",
    "drafter",
}


def functions(path: pathlib.Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function and method of a module, nested ones included."""
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def is_any(annotation: ast.expr | None) -> bool:
    """`Any` / `typing.Any` / "Any", or a union or Optional with `Any` in it."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return False
    if isinstance(annotation, ast.Name):
        return annotation.id == "Any"
    if isinstance(annotation, ast.Attribute):
        return annotation.attr == "Any"
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return is_any(annotation.left) or is_any(annotation.right)
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value).split(".")[-1] in (
        "Optional",
        "Union",
    ):
        inner = annotation.slice
        return any(is_any(e) for e in (inner.elts if isinstance(inner, ast.Tuple) else [inner]))
    return False


def test_functions_stay_short() -> None:
    """No function over MAX_FUNCTION_LINES lines (`ast`: end_lineno - lineno + 1, docstring included)."""
    long = [
        f"{p.relative_to(PKG.parent)}:{f.lineno} {f.name} ({n} lines)"
        for p in sorted(PKG.rglob("*.py"))
        for f in functions(p)
        if (n := f.end_lineno - f.lineno + 1) > MAX_FUNCTION_LINES
    ]
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them into named helpers):\n" + "\n".join(long)
    )


def test_main_objects_are_not_typed_any() -> None:
    """No parameter named like one of the main objects (TYPED_PARAMS) is annotated `Any`."""
    bad = [
        f"{p.relative_to(PKG.parent)}:{f.lineno} {f.name}({arg.arg}: {ast.unparse(arg.annotation)})"
        for p in sorted(PKG.rglob("*.py"))
        for f in functions(p)
        for arg in (*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs)
        if arg.arg in TYPED_PARAMS and is_any(arg.annotation)
    ]
    assert not bad, "main objects typed Any (use their class or a Protocol):\n" + "\n".join(bad)


ENTRY_POINTS = {"main"}  # a runnable module's command-line entry (`python -m tlt_jax.<module>`)


def public_names(path: pathlib.Path) -> set[str]:
    """Names a module defines at top level (functions, classes, assigned constants), not underscored."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return {n for n in out if not n.startswith("_") and n != "__all__"}


def test_each_public_name_is_defined_once() -> None:
    """One idea, one name, one place: no public name is defined by two modules (entry points aside); a
    module that needs another's name imports it."""
    where: dict[str, list[str]] = {}
    for name, path in modules().items():
        for n in public_names(path) - ENTRY_POINTS:
            where.setdefault(n, []).append(name)
    twice = {n: sorted(m) for n, m in where.items() if len(m) > 1}
    assert not twice, f"public names defined in several modules: {twice}"


# ----------------------------------------------------------------------------------------------------------
# Tests (issue #39): the core suite tests the package; the experiment scripts' and the GPU suite's own tests
# live under tests/experiments/
# ----------------------------------------------------------------------------------------------------------

TESTS = PKG.parent / "tests"
SCRIPT_PACKAGES = ("experiments", "gpu")


def script_imports(path: pathlib.Path) -> set[str]:
    """The modules of the script packages (experiments/, gpu/) a file imports or runs (`"-m", "<module>"`)."""
    text = path.read_text()
    out = set(re.findall(r"[\"']-m[\"'],\s*f?[\"']((?:experiments|gpu)\.[\w.{}]+)[\"']", text))
    for node in ast.walk(ast.parse(text)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        out |= {n for n in names if n.split(".")[0] in SCRIPT_PACKAGES}
    return out


def test_core_tests_import_no_experiment() -> None:
    """No test outside tests/experiments/ imports (or runs) an experiment script or the GPU suite: what the
    core suite needs lives in the package or in tests/."""
    bad = {
        str(p.relative_to(TESTS.parent)): sorted(m)
        for p in sorted(TESTS.rglob("*.py"))
        if "experiments" not in p.relative_to(TESTS).parts[:-1] and (m := script_imports(p))
    }
    assert not bad, f"core tests that import experiments/ or gpu/ (move them to tests/experiments/): {bad}"
