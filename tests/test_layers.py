"""The package's layers: every import between packages of specdecode/ points down, and no modules import each
other in a circle. Read from the source (ast), lazy imports and TYPE_CHECKING imports included: a reader follows
those arrows too.

The floors, lowest first (a package may import its own floor's modules and anything below):
common, data < core, kernels < models < policy < proposers < engine < api < server, bench, training < cli.
Packages on one floor may import each other as long as no circle forms between them. The package's face
(specdecode/__init__.py) stands apart: it defines `__version__` and loads its public names on first use (PEP 562),
importing none at run time, so any module may read the version from it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import specdecode

PACKAGE = Path(specdecode.__file__).parent
FLOORS: dict[str, int] = {
    "common": 0, "data": 0,
    "core": 1, "kernels": 1,
    "models": 2,
    "policy": 3,
    "proposers": 4,
    "engine": 5,
    "api": 6,
    "server": 7, "bench": 7, "training": 7,
    "cli": 8,
}
FACE = ""  # layer() of specdecode/__init__.py

Imports = dict[str, list[tuple[str, int]]]  # module -> (module it imports, line)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_imports(root: Path) -> Imports:
    """Each module of the package under `root` -> the package's modules it imports (`from . import x` names
    module x where x is one)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    found: Imports = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = found.setdefault(name, [])
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == root.name]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != root.name:
                    continue
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                edges += [(t, node.lineno) for t in subs] or [(target, node.lineno)]
    return found


def layer(module: str) -> str:
    """specdecode.models.llama -> models; specdecode.api -> api; specdecode -> '' (the face)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward(imports: Imports, floors: dict[str, int]) -> list[str]:
    """Imports from a package to one on a higher floor (or to a package no floor names)."""
    wrong = []
    for module, edges in sorted(imports.items()):
        for target, line in edges:
            here, there = layer(module), layer(target)
            if here == there or FACE in (here, there):
                continue
            if here not in floors or there not in floors:
                wrong.append(f"{module}:{line} -> {target} (a package with no floor: add it to FLOORS)")
            elif floors[there] > floors[here]:
                wrong.append(f"{module}:{line} -> {target} ({here} imports {there}, a floor above)")
    return wrong


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph.get(start, ()))))]
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
                    work.append((child, iter(sorted(graph.get(child, ())))))
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


def module_graph(imports: Imports) -> dict[str, set[str]]:
    """Module -> the modules it imports, a package's face (__init__.py) left out as a target where the module lies
    inside that package (importing a sibling through its package's face is no circle of the reader's)."""
    return {m: {t for t, _ in edges if t != m and not m.startswith(t + ".")} for m, edges in imports.items()}


def package_graph(imports: Imports) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, edges in imports.items():
        graph.setdefault(layer(module), set()).update(layer(t) for t, _ in edges if layer(t) != layer(module))
    return graph


@pytest.fixture(scope="module")
def imports() -> Imports:
    return read_imports(PACKAGE)


def test_every_import_between_packages_points_down(imports: Imports) -> None:
    assert upward(imports, FLOORS) == []


def test_no_modules_import_each_other_in_a_circle(imports: Imports) -> None:
    assert circles(module_graph(imports)) == []


def test_no_packages_import_each_other_in_a_circle(imports: Imports) -> None:
    assert circles(package_graph(imports)) == []


def test_every_package_has_a_floor(imports: Imports) -> None:
    assert {layer(m) for m in imports} - {FACE} <= set(FLOORS)


def test_the_face_imports_nothing_at_run_time() -> None:
    """What lets every floor read `specdecode.__version__`: the face's imports of the package are for type checkers
    only."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module != "specdecode", ast.unparse(node)


def test_the_checks_find_an_upward_import_and_a_circle(tmp_path: Path) -> None:
    """Negative control: a small package with a model importing the policy, and two modules that import each
    other, is refused on both counts."""
    root = tmp_path / "pkg"
    for folder in ("models", "policy", "core"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "models" / "llama.py").write_text("from ..policy.cost import CostModel\n")
    (root / "policy" / "cost.py").write_text("CostModel = 1\n")
    (root / "core" / "tree.py").write_text("from . import verify\n")
    (root / "core" / "verify.py").write_text("def f():\n    from .tree import x\n")
    found = read_imports(root)
    assert upward(found, FLOORS) == ["pkg.models.llama:1 -> pkg.policy.cost (models imports policy, a floor above)"]
    assert circles(module_graph(found)) == [["pkg.core.tree", "pkg.core.verify"]]
    (root / "core" / "verify.py").write_text("from ..models import llama\n")
    (root / "models" / "llama.py").write_text("from ..core.tree import x\n")
    assert circles(package_graph(read_imports(root))) == [["core", "models"]]
