"""`cleanba_utils` has no import cycle, the imports inside functions (lazy ones) included: each
module's imports of the package, read from its source with `ast`, form a graph without a circle.
A lazy import hides a circle from Python's import machinery but not from a reader, who must still
know both modules to understand either."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path, package: str, modules: set[str]) -> set[str]:
    """The modules of `package` that the module at `path` imports, anywhere in its source."""
    name = module_name(path, root)
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")
                parent = parent if is_package else parent[:-1]
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join([*parent, *([base] if base else [])])
            found.add(base)
            # `from package import module` imports the module.
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m in modules and m != name and m.startswith(package)}


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    paths = sorted((root / package.replace(".", "/")).rglob("*.py"))
    modules = {module_name(path, root) for path in paths}
    return {module_name(path, root): imports_of(path, root, package, modules) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph (its modules in order, the first repeated at the end), or None."""
    state = {}
    path = []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for successor in sorted(graph[node]):
            if state.get(successor) == "open":
                return [*path[path.index(successor) :], successor]
            if successor not in state:
                cycle = visit(successor)
                if cycle:
                    return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_cleanba_utils_has_no_import_cycle():
    graph = import_graph(REPO, "cleanba_utils")
    assert len(graph) > 30 and graph["cleanba_utils.run"], "the graph was not read"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_lazy_import_that_closes_a_circle_is_found(tmp_path):
    """A package whose `a` imports `b` at the top, `b` imports `c`, and `c` imports `a` inside a
    function (with a relative import): the circle a -> b -> c -> a."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("import pkg.c\n")
    (package / "c.py").write_text("def late():\n    from .a import thing\n    return thing\n")
    (package / "d.py").write_text("from pkg.a import thing\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.d"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (package / "c.py").write_text("def late():\n    return 1\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) is None
