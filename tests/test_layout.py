"""The package layout: lower layers never import higher ones, and no module imports itself back.

Read from the source (every import: at the top, inside functions, under ``TYPE_CHECKING``), so
a lazy import cannot hide an upward dependency or a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parent.parent / "app"

# A package's layer; a module may import its own package and the layers below its own. The
# client side (http) and the workers' side (fleet) stand side by side: neither imports the other.
LAYERS = {
    "settings": 0, "shutdown": 0, "internals": 0,
    "api": 1,
    "observe": 2,
    "http": 3, "fleet": 3,
    "admission": 4,
    "relay": 5,
    "state": 6, "routes": 7, "gateway": 8, "supervisor": 9, "main": 10, "__main__": 11,
}  # fmt: skip
MAX_TOP_LEVEL = 12


def _modules() -> dict[str, Path]:
    found = {}
    for path in APP.rglob("*.py"):
        parts = path.relative_to(APP.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The app modules ``name`` imports, wherever in the file the import stands."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in out if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _layer(module: str) -> tuple[str, int]:
    parts = module.split(".")
    if len(parts) == 1:  # the app package itself
        return "app", -1
    return parts[1], LAYERS[parts[1]]


def test_every_package_has_a_layer() -> None:
    unplaced = {m.split(".")[1] for m in _graph() if "." in m} - set(LAYERS)
    assert not unplaced, f"give these a layer in LAYERS: {sorted(unplaced)}"


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = []
    for module, imported in _graph().items():
        own, rank = _layer(module)
        for other in imported:
            theirs, their_rank = _layer(other)
            if theirs != own and their_rank >= rank and their_rank >= 0:
                upward.append(f"{module} -> {other}")
    assert not upward, "imports of a layer at or above the importer's: " + ", ".join(upward)


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                cycles.append([*path[path.index(other) :], other])
            elif other not in state:
                visit(other, [*path, other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_top_level_stays_small() -> None:
    top = [p.name for p in APP.glob("*.py")]
    assert len(top) <= MAX_TOP_LEVEL, sorted(top)


def test_every_package_says_what_it_owns() -> None:
    for init in APP.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init}: say what the package owns"
        assert "import" in doc.lower(), f"{init}: say what the package may import"


# The size rule: a function longer than this, or a class, is split by what it does.
MAX_FUNCTION_LINES = 100
MAX_CLASS_LINES = 300
# The settings are one flat list of fields, each with its description: exempt.
SIZE_EXEMPT = {("app.settings", "Settings")}


def _oversized(name: str, source: str) -> list[str]:
    """Every function over ``MAX_FUNCTION_LINES`` and class over ``MAX_CLASS_LINES`` in ``source``.

    Measured from the first line of the definition (its decorators excluded) to its last.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            most, kind = MAX_FUNCTION_LINES, "function"
        elif isinstance(node, ast.ClassDef):
            most, kind = MAX_CLASS_LINES, "class"
        else:
            continue
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        if lines > most and (name, node.name) not in SIZE_EXEMPT:
            found.append(f"{name}.{node.name} ({kind}, {lines} lines > {most})")
    return found


def test_no_function_or_class_outgrows_its_size() -> None:
    oversized = [
        entry
        for name, path in sorted(_modules().items())
        for entry in _oversized(name, path.read_text())
    ]
    assert not oversized, "split these by what they do: " + ", ".join(oversized)


def test_the_size_rule_catches_an_oversized_class_and_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    assert _oversized("m", f"class Big:\n{body}\n") == [
        f"m.Big (class, {MAX_CLASS_LINES + 1} lines > {MAX_CLASS_LINES})"
    ]
    steps = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    assert _oversized("m", f"def fits():\n{steps}\n") == []
    assert _oversized("m", f"def long():\n{steps}\n    x = 0\n") == [
        f"m.long (function, {MAX_FUNCTION_LINES + 1} lines > {MAX_FUNCTION_LINES})"
    ]
    assert _oversized("app.settings", f"class Settings:\n{body}\n") == []
