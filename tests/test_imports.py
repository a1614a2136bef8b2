"""batchgen's modules import each other without circles, counting imports inside functions and under TYPE_CHECKING.

The graph is read from the source with ``ast`` (nothing is imported). Each module gets an edge to every
batchgen module it names in an ``import`` or ``from ... import`` anywhere in its body: at the top, inside
functions and methods, and under ``if TYPE_CHECKING:`` (a type-only import still says "this module needs that
one"). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``; relative
imports are resolved against the importing module's package.

Packages: importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, but that implicit edge is not
counted, or every package whose ``__init__`` re-exports a child would be a circle with that child. What is
counted is what a file writes: an ``__init__`` that imports its children has edges to them, and a child that
imports its own package (``from batchgen.engine import LLM`` inside ``batchgen.engine.*``) has an edge back,
so that circle is found.
"""
from __future__ import annotations

import ast
from pathlib import Path



ROOT = Path(__file__).resolve().parent.parent / "batchgen"


def module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest batchgen module that ``name`` starts with (``a.b.Thing`` -> ``a.b``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(filter(None, (_resolve(alias.name, known) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(module, path).split(".")
                anchor = ".".join(package[: len(package) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                target = _resolve(f"{base}.{alias.name}", known) if alias.name != "*" else None
                target = target if target == f"{base}.{alias.name}" else _resolve(base, known)
                if target:
                    targets.add(target)
    targets.discard(module)
    return targets


def import_graph() -> dict[str, set[str]]:
    known = module_names()
    return {module: imports_of(module, path, known) for module, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"    {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return f"  circle of {len(component)} modules:\n" + "\n".join(edges)


def test_the_graph_sees_lazy_relative_and_submodule_imports(tmp_path):
    known = {name: tmp_path / f"{name}.py" for name in ("p", "p.a", "p.b", "p.c", "p.d")}
    known["p"] = tmp_path / "__init__.py"
    source = "from . import b\nfrom .c import Thing\ndef f():\n    import p.d.deeper\n"
    (tmp_path / "p.a.py").write_text(source)
    assert imports_of("p.a", known["p.a"], known) == {"p.b", "p.c", "p.d"}
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 100 and "batchgen.engine.llm" in graph
    found = cycles(graph)
    assert not found, "import circles among batchgen modules:\n" + "\n".join(_describe(c, graph) for c in found)
