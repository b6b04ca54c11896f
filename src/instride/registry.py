"""Backends looked up lazily by name, the way fsspec file systems are.

A registry maps a name to ``"package.module:Class"`` and an install hint; the module is
imported only when the backend is first used, and registering an existing name is an error.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import Settings
from .errors import ConfigError

Registry = dict[str, tuple[str, str]]


def register(registry: Registry, name: str, target: str, hint: str = "") -> None:
    """Add ``name -> target`` to ``registry``; raise ``ValueError`` if the name is taken."""
    if name in registry:
        raise ValueError(f"backend {name!r} is already registered")
    registry[name] = (target, hint)


def resolve(registry: Registry, kind: str, name: str) -> Any:
    """Import and return (not instantiate) the ``kind`` class registered as ``name``.

    Raises
    ------
    ConfigError
        Unknown name, its module cannot be imported, or it has no such class (the message
        carries the install hint).
    """
    try:
        target, hint = registry[name]
    except KeyError:
        raise ConfigError(kind, name, f"unknown; known: {sorted(registry)}") from None
    module, _, cls = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(kind, name, f"cannot import ({exc}); {hint}") from exc
    try:
        return getattr(mod, cls)
    except AttributeError:  # (a renamed class, a typo, no ":Class": named, not untyped)
        raise ConfigError(kind, name, f"{module} has no {cls or 'class named'} (registered as"
                                      f" {target!r}); {hint}") from None


def load(registry: Registry, kind: str, name: str, settings: Settings) -> Any:
    """Import and instantiate the ``kind`` backend registered as ``name`` for ``settings``.

    Raises
    ------
    ConfigError
        Unknown name, or its module cannot be imported (the message carries the install hint).
    """
    return resolve(registry, kind, name)(settings)
