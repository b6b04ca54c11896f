"""The map of docs/design.md, enforced: what each core module may import.

Every core module is parsed (``ast``) and its imports of ``instride`` modules are checked:

* no core module imports a higher layer (the CLI, ``bench``, ``md``, ``analytics``,
  ``parallel``, ``emulate``, ``flow``, ``launch``, ``interception``) — the one exception is the
  public face's :func:`instride.intercept`, which imports ``interception`` lazily, inside the
  function, so that importing instride never patches or loads it;
* arrows only point down: a module imports only modules of a lower layer (or of its own
  package), as listed in :data:`LAYERS`;
* there is no import cycle among core modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "instride"

#: Core parts, bottom to top; a part may import parts of lower layers only (and itself).
LAYERS: list[set[str]] = [
    {"errors"},
    {"config", "native", "perthread", "orphans"},
    {"keys", "registry", "frames", "busypoll"},
    {"record"},
    {"store", "archive", "paths"},
    {"metadata", "transport"},
    {"engine"},
    {"client"},
    {"stream", "agent"},
    {"server", "archiver"},
    {"__init__"},
]
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}
HIGHER = {"cli", "bench", "md", "analytics", "parallel", "emulate", "flow", "launch", "interception",
          "__main__"}
#: (module, imported part) pairs allowed inside a function only, with the reason.
LAZY_EXCEPTIONS = {("instride", "interception"): "intercept() loads the open patch on demand"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(module: str) -> str:
    """The core part a module belongs to: ``instride.store.wait`` -> ``store``."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1].removesuffix(".py")


def _core_files() -> list[Path]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        top = rel.parts[0].removesuffix(".py")
        if top in RANK:
            out.append(path)
    return out


def _resolve(path: Path, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The ``instride`` modules an import statement names (submodules where they exist)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "instride"]
    if node.level:
        here = _module_name(path).split(".")
        if path.name != "__init__.py":
            here = here[:-1]  # the package the module is in
        base = here[: len(here) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    if module.split(".")[0] != "instride":
        return []
    targets = []
    for alias in node.names:
        sub = f"{module}.{alias.name}"
        sub_path = SRC.parent / Path(*sub.split("."))
        targets.append(sub if sub_path.with_suffix(".py").exists() or sub_path.is_dir() else module)
    return targets


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(imported module, inside a function)`` for every import outside ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.extend((m, in_function) for m in _resolve(path, node))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return found


CORE = _core_files()


def test_the_core_modules_are_found() -> None:
    parts = {_part(_module_name(p)) for p in CORE}
    assert parts == set(RANK), set(RANK) - parts


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(SRC)))
def test_core_modules_import_only_lower_layers(path: Path) -> None:
    me = _module_name(path)
    mine = _part(me)
    for target, lazy in _imports(path):
        part = _part(target)
        if part in HIGHER:
            assert lazy and (me, part) in LAZY_EXCEPTIONS, f"{me} imports the higher layer {target}"
            continue
        assert part in RANK, f"{me} imports {target}, which is in no layer of the map"
        assert part == mine or RANK[part] < RANK[mine], (
            f"{me} (layer {RANK[mine]}) imports {target} (layer {RANK[part]}): arrows point down only")


def test_no_import_cycles_among_core_modules() -> None:
    graph = {_module_name(p): {t for t, _lazy in _imports(p)} for p in CORE}
    # importing a.b.c also runs a.b's package module: add that edge
    for deps in graph.values():
        for dep in list(deps):
            parts = dep.split(".")
            deps.update(".".join(parts[:i]) for i in range(2, len(parts)))
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep == node or dep not in graph:
                continue
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                # a package importing its own submodules is how packages work, not a cycle
                if not all(m.startswith(cycle[0] + ".") or m == cycle[0] for m in cycle):
                    raise AssertionError("import cycle: " + " -> ".join(cycle))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
