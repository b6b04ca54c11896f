"""The data plane: moving a published file from its owner node to a consumer node.

Transports plug in by name (like metadata backends); ``tcp`` is built in.
"""

from __future__ import annotations

import importlib

from ..config import Settings
from ..errors import ConfigError
from .base import Transport

REGISTRY: dict[str, tuple[str, str]] = {
    "tcp": ("instride.transport.tcp:TcpTransport", ""),
}


def get_transport(name: str, settings: Settings) -> Transport:
    """Instantiate the transport registered as ``name``."""
    try:
        target, hint = REGISTRY[name]
    except KeyError:
        raise ConfigError("transport", name, f"unknown; known: {sorted(REGISTRY)}") from None
    module, _, cls = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError("transport", name, f"cannot import ({exc}); {hint}") from exc
    return getattr(mod, cls)(settings)


__all__ = ["Transport", "REGISTRY", "get_transport"]
