"""The import graph of the packages, read from their source (nothing is imported):

- nothing in zoo or kernels imports cartridges (cartridges builds on zoo, never the other way round);
- the module-level imports of zoo, kernels and cartridges form no cycle, and within each package none form one
  even counting the imports deferred into functions.

Importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` first, so an import counts as importing every
package above the module too. Imports under `if TYPE_CHECKING:` never run and are not counted.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("zoo", "kernels", "cartridges")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_runtime(node: ast.AST):
    """ast.walk, less the bodies of `if TYPE_CHECKING:` (their `else` still runs)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if _type_checking_only(child):
            yield from (n for c in child.orelse for n in _walk_runtime(c))
        else:
            yield from _walk_runtime(child)


def imported(path: Path, module: str, top_level_only: bool) -> set[str]:
    """The modules of our packages that `path` imports: the longest existing module name of each import, and the
    packages above it (whose __init__ runs first)."""
    known = modules()
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(_walk_runtime(tree))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in nodes:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            while name and name.split(".")[0] in PACKAGES:
                if name != module:
                    out.add(name)
                name = name.rpartition(".")[0]
    return out


def test_an_import_counts_the_packages_above_it():
    deps = imported(REPO / "zoo" / "config.py", "zoo.config", top_level_only=False)
    assert {"zoo.models.mixers", "zoo.models", "zoo"} <= deps


def test_type_checking_imports_are_not_counted(tmp_path):
    path = tmp_path / "typed.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zoo.config import ModelConfig\n"
                    "else:\n    import zoo.runs\n")
    assert imported(path, "zoo.typed", top_level_only=False) == {"zoo.runs", "zoo"}


@pytest.mark.parametrize("package", ["zoo", "kernels"])
def test_does_not_import_cartridges(package):
    offenders = sorted(
        f"{module} imports {dep}"
        for module, path in modules().items()
        if module.split(".")[0] == package
        for dep in imported(path, module, top_level_only=False)
        if dep.split(".")[0] == "cartridges"
    )
    assert not offenders, offenders


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = {module: imported(path, module, top_level_only=True) for module, path in modules().items()}
    # A package's __init__ runs before its submodules, so a submodule importing its own package is no cycle.
    for module in graph:
        graph[module] = {d for d in graph[module] if not module.startswith(d + ".")}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles_counting_deferred_imports(package):
    """Imports inside functions count too: a deferred import hides a cycle from Python, not from a reader."""
    graph = {
        module: {d for d in imported(path, module, top_level_only=False) if d.split(".")[0] == package}
        for module, path in modules().items()
        if module.split(".")[0] == package
    }
    for module in graph:
        graph[module] = {d for d in graph[module] if not module.startswith(d + ".")}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
