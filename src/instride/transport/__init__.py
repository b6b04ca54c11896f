"""The data plane: moving a published file from its owner node to a consumer node.

Transports plug in by name (like metadata backends); ``tcp`` is built in.
"""

from __future__ import annotations

from .. import registry as _registry
from ..config import Settings
from .base import Transport

#: transport name -> (dotted class path, install hint)
REGISTRY: _registry.Registry = {
    "tcp": ("instride.transport.tcp:TcpTransport", ""),
}


def register(name: str, target: str, hint: str = "") -> None:
    """Register a transport class ``"package.module:Class"`` under ``name``."""
    _registry.register(REGISTRY, name, target, hint)


def get_transport(name: str, settings: Settings) -> Transport:
    """Instantiate the transport registered as ``name`` for ``settings``."""
    return _registry.load(REGISTRY, "transport", name, settings)


register("ucx", "instride.transport.ucx:UcxTransport", "apt-get install libucx-dev ucx-utils")

__all__ = ["Transport", "REGISTRY", "register", "get_transport"]
