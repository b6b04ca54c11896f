"""The TCP transport: both halves.

* :class:`TcpTransport` (``client.py``): signed requests, kept-alive connections per owner
  and thread, bodies received in chunks, hashed on the way, verified against the record;
* :class:`TcpServer` (``server.py``): the server of ``instride serve`` that answers them, in C
  (``libinstride_tcp.so``: connections, the common fetch, ``sendfile``) with every other
  decision in Python.

The wire format (length-prefixed JSON headers, HMAC-SHA256 of the job token) is
:mod:`instride.transport.wire`.
"""

from __future__ import annotations

from .client import TcpTransport
from .server import TcpServer

__all__ = ["TcpServer", "TcpTransport"]
