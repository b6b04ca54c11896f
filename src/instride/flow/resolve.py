"""Find a module's function from its target string (``pkg.mod:func`` or ``file:PATH:func``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from .errors import GraphError

GRAPH_MODULE = "__flowgraph__"

#: the directories of the graph files loaded in this process (in order): their siblings import
#: here (:func:`load_file` puts each on ``sys.path``), so the instances get them on their
#: ``PYTHONPATH`` too (see ``runner.run``)
graph_dirs: list[str] = []


def load_file(path: Path) -> ModuleType:
    """Import a graph file as the module ``__flowgraph__`` (its ``__main__`` block does not run).

    Raises
    ------
    GraphError
        The file does not exist, is a directory or another non-file, or does not compile
        (the error names the file and line).
    """
    path = Path(path).resolve()
    if not path.is_file():
        what = "is a directory, not a graph file" if path.is_dir() else "does not exist" \
            if not path.exists() else "is not a regular file"
        raise GraphError(f"graph file {str(path)!r} {what}")
    loaded = sys.modules.get(GRAPH_MODULE)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    spec = importlib.util.spec_from_file_location(GRAPH_MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[GRAPH_MODULE] = module
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    if str(path.parent) not in graph_dirs:
        graph_dirs.append(str(path.parent))
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(GRAPH_MODULE, None)
        raise GraphError(f"graph file {exc.filename or str(path)!r}, line {exc.lineno}: "
                         f"{exc.msg}") from None
    except BaseException:
        sys.modules.pop(GRAPH_MODULE, None)
        raise
    return module


def resolve(target: str) -> Callable[..., Any]:
    """The function a target string names.

    Raises
    ------
    GraphError
        The module cannot be imported or has no such function.
    """
    if target.startswith("file:"):
        path, _, qual = target[5:].rpartition(":")
        obj: Any = load_file(Path(path))
    else:
        modname, _, qual = target.partition(":")
        if not qual:
            raise GraphError(f"module target {target!r}: expected 'package.module:function'")
        try:
            obj = importlib.import_module(modname)
        except (ImportError, SyntaxError) as exc:
            raise GraphError(f"module target {target!r}: cannot import {modname!r}: {exc}") from exc
    for part in qual.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise GraphError(f"module target {target!r}: no {part!r} there") from None
    if not callable(obj):
        raise GraphError(f"module target {target!r} is not callable")
    return obj
