"""Metadata backends, looked up by name.

==========  =====================================  ===============================
name        class                                  needs
==========  =====================================  ===============================
``files``   :class:`~.files.FileMetadata`          nothing (local mode)
``redis``   :class:`~.redis.RedisMetadata`         ``redis[hiredis]`` and a server
==========  =====================================  ===============================
"""

from __future__ import annotations

import importlib

from ..config import Settings
from ..errors import ConfigError
from .base import MetadataBackend, Record

#: backend name -> (dotted class path, install hint)
REGISTRY: dict[str, tuple[str, str]] = {
    "files": ("instride.metadata.files:FileMetadata", ""),
    "redis": ("instride.metadata.redis:RedisMetadata", "pip install 'redis[hiredis]'"),
}


def register(name: str, target: str, hint: str = "") -> None:
    """Register a metadata backend class ``"package.module:Class"`` under ``name``."""
    if name in REGISTRY:
        raise ValueError(f"metadata backend {name!r} is already registered")
    REGISTRY[name] = (target, hint)


def get_backend(name: str, settings: Settings) -> MetadataBackend:
    """Instantiate the backend registered as ``name`` for ``settings``."""
    try:
        target, hint = REGISTRY[name]
    except KeyError:
        raise ConfigError("metadata backend", name, f"unknown; known: {sorted(REGISTRY)}") from None
    module, _, cls = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError("metadata backend", name, f"cannot import ({exc}); {hint}") from exc
    return getattr(mod, cls)(settings)


__all__ = ["MetadataBackend", "Record", "REGISTRY", "register", "get_backend"]
