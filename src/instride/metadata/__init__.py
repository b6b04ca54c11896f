"""Metadata backends, looked up by name.

==========  =====================================  ===============================
name        class                                  needs
==========  =====================================  ===============================
``files``   :class:`~.files.FileMetadata`          nothing (local mode)
``redis``   :class:`~.redis.RedisMetadata`         ``redis[hiredis]`` and a server
==========  =====================================  ===============================
"""

from __future__ import annotations

from .. import registry as _registry
from ..config import Settings
from .base import MetadataBackend, Record

#: backend name -> (dotted class path, install hint)
REGISTRY: _registry.Registry = {
    "files": ("instride.metadata.files:FileMetadata", ""),
    "redis": ("instride.metadata.redis:RedisMetadata", "pip install 'redis[hiredis]'"),
}


def register(name: str, target: str, hint: str = "") -> None:
    """Register a metadata backend class ``"package.module:Class"`` under ``name``."""
    _registry.register(REGISTRY, name, target, hint)


def get_backend(name: str, settings: Settings) -> MetadataBackend:
    """Instantiate the metadata backend registered as ``name`` for ``settings``."""
    return _registry.load(REGISTRY, "metadata backend", name, settings)


__all__ = ["MetadataBackend", "Record", "REGISTRY", "register", "get_backend"]
