"""No import cycles among the modules of the upper layers (analytics, parallel, bench, md).

The imports are read from the source with :mod:`ast` (nothing is imported), including imports
inside functions and under ``TYPE_CHECKING``: a lazy import hides a cycle from Python but not
from the reader of the code. Importing ``pkg.sub`` also runs ``pkg/__init__.py``, so it counts as
importing ``pkg`` too, unless the importer lives inside ``pkg`` (Python has already started
``pkg`` then).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = ("instride.analytics", "instride.parallel", "instride.bench", "instride.md")


def module_files(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``packages`` (``__init__`` = the package)."""
    out: dict[str, Path] = {}
    for pkg in packages:
        root = SRC / pkg.replace(".", "/")
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(SRC).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (file ``path``) imports, anywhere in it."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(name, is_package, node)
            targets.add(module)
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one
            targets.update(f"{module}.{alias.name}" for alias in node.names)
    own_packages = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
    if is_package:
        own_packages.add(name)
    edges: set[str] = set()
    for target in targets:
        parts = target.split(".")
        for k in range(1, len(parts) + 1):  # the module and every package above it
            prefix = ".".join(parts[:k])
            if prefix in known and prefix not in own_packages and prefix != name:
                edges.add(prefix)
    return edges


def import_graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    files = module_files(packages)
    known = set(files)
    return {name: imported_modules(name, path, known) for name, path in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_upper_layers_have_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 30  # the four packages were found
    assert find_cycles(graph) == []


def test_analytics_imports_none_of_the_packages_built_on_it() -> None:
    """One analysis stack: parallel, md and bench use analytics; analytics uses none of them."""
    graph = import_graph()
    above = ("instride.parallel", "instride.bench", "instride.md")
    wrong = {(m, t) for m, targets in graph.items() if m.startswith("instride.analytics")
             for t in targets if t.startswith(above)}
    assert wrong == set()
    assert any(t.startswith("instride.analytics") for t in graph["instride.parallel.adapters"])


@pytest.mark.parametrize(
    ("sources", "cyclic"),
    [
        ({"a/__init__.py": "", "a/x.py": "from .y import f", "a/y.py": "def g():\n from . import x"},
         [["a.x", "a.y"]]),
        ({"a/__init__.py": "from .x import f", "a/x.py": "from . import y", "a/y.py": ""}, []),
        ({"a/__init__.py": "from .x import f", "a/x.py": "import b.z",
          "b/__init__.py": "", "b/z.py": "import a.y", "a/y.py": ""},
         [["a", "a.x", "b.z"]]),
    ],
)
def test_detector_finds_cycles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               sources: dict[str, str], cyclic: list[list[str]]) -> None:
    """The detector itself: a lazy sibling cycle, a clean package, a cycle through ``__init__``."""
    for rel, text in sources.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert find_cycles(import_graph(("a", "b"))) == cyclic
