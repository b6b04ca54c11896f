"""A TCP relay in front of a server (Redis): tests put one between a client and the server to
delay, drop or cut what passes, on real sockets."""

from __future__ import annotations

import abc
import contextlib
import socket
import threading


class Relay(abc.ABC):
    """Accept connections on a free port of 127.0.0.1 and connect each to ``upstream``; a
    subclass moves the bytes (:meth:`serve`, called with each pair of sockets)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.socks += [client, server]
            self.serve(client, server)

    @abc.abstractmethod
    def serve(self, client: socket.socket, server: socket.socket) -> None:
        """Start moving bytes between ``client`` and ``server`` (in threads)."""

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()
