"""Engines: how a client reaches published keys in its mode, looked up by name.

===========  =========================================  ===============================
name         class                                      chosen when
===========  =========================================  ===============================
``local``    :class:`~.local.LocalEngine`               ``INSTRIDE_REDIS_URL`` unset
``cluster``  :class:`~.cluster.ClusterEngine`           ``INSTRIDE_REDIS_URL`` set
===========  =========================================  ===============================

:attr:`Settings.mode <instride.config.Settings.mode>` names the engine; a
:class:`~instride.client.Client` builds it once, at construction.
"""

from __future__ import annotations

from .. import registry as _registry
from ..config import Settings
from .base import Engine, map_file

#: engine name -> (dotted class path, install hint)
REGISTRY: _registry.Registry = {
    "local": ("instride.engine.local:LocalEngine", ""),
    "cluster": ("instride.engine.cluster:ClusterEngine", "pip install 'redis[hiredis]'"),
}


def register(name: str, target: str, hint: str = "") -> None:
    """Register an engine class ``"package.module:Class"`` under ``name``."""
    _registry.register(REGISTRY, name, target, hint)


def get_engine(name: str, settings: Settings) -> Engine:
    """Instantiate the engine registered as ``name`` for ``settings``."""
    return _registry.load(REGISTRY, "engine", name, settings)


__all__ = ["Engine", "REGISTRY", "get_engine", "map_file", "register"]
