"""The data plane: moving a published file from its owner node to a consumer node.

Transports plug in by name (like metadata backends); both halves of a transport live in its
own module. ``INSTRIDE_TRANSPORT`` (default ``tcp``) chooses the one the cluster engine fetches
with and ``instride serve`` serves.

=========  ===========================================  =======
name       client half / server half                    needs
=========  ===========================================  =======
``tcp``    :class:`~.tcp.TcpTransport` /                nothing
           :class:`~.tcp.TcpServer`
``ucx``    :class:`~.ucx.UcxTransport` /                ``libucx-dev`` (UCP, in C)
           :class:`~.ucx.UcxServer`
=========  ===========================================  =======
"""

from __future__ import annotations

from typing import Any

from .. import registry as _registry
from ..config import Settings
from .base import Transport, TransportServer

#: transport name -> (dotted client class path, install hint); the client class names its
#: server half (:meth:`Transport.server_class`).
REGISTRY: _registry.Registry = {
    "tcp": ("instride.transport.tcp:TcpTransport", ""),
    "ucx": ("instride.transport.ucx:UcxTransport", "apt-get install libucx-dev ucx-utils"),
}


def register(name: str, target: str, hint: str = "") -> None:
    """Register a transport class ``"package.module:Class"`` under ``name``."""
    _registry.register(REGISTRY, name, target, hint)


def get_transport(name: str, settings: Settings) -> Transport:
    """Instantiate the client half of the transport registered as ``name``."""
    return _registry.load(REGISTRY, "transport", name, settings)


def get_server(name: str, settings: Settings, **options: Any) -> TransportServer:
    """Instantiate the server half of the transport registered as ``name``.

    Parameters
    ----------
    name
        Registry name (``"tcp"``).
    settings
        The node's settings (directory, address, token).
    **options
        ``max_peers``, ``request_timeout``, ``send_timeout`` (see the server class).
    """
    cls = _registry.resolve(REGISTRY, "transport", name)
    return cls.server_class()(settings, **options)


__all__ = ["REGISTRY", "Transport", "TransportServer", "get_server", "get_transport", "register"]
