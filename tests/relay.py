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


class ReplyDropper(Relay):
    """A TCP relay in front of Redis that, once armed, forwards the next ``EVALSHA`` (or the
    next write that holds ``marker``) and then closes the connection instead of passing its
    reply on: Redis has run the command, the client never hears so (a network failure at the
    worst moment). ``refuse``: from then on, no connection is accepted either (Redis out of
    reach until :meth:`close`). ``pass_reply``: the reply is passed on before the connection
    is cut (the client heard Redis's answer, and nothing after)."""

    def __init__(self, upstream: tuple[str, int], marker: bytes = b"EVALSHA",
                 refuse: bool = False, pass_reply: bool = False) -> None:
        self.marker = marker
        self.armed = False
        self.refuse = refuse
        self.pass_reply = pass_reply
        self.dropped = 0
        super().__init__(upstream)

    def resume(self) -> None:
        """Accept connections again, on the same port (Redis back within reach)."""
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def serve(self, client: socket.socket, server: socket.socket) -> None:
        doomed = threading.Event()
        threading.Thread(target=self._up, args=(client, server, doomed), daemon=True).start()
        threading.Thread(target=self._down, args=(server, client, doomed), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket, doomed: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if self.armed and self.marker in data:
                    self.armed = False
                    doomed.set()  # (before the request goes: its reply is the one dropped)
                dst.sendall(data)

    def _down(self, src: socket.socket, dst: socket.socket, doomed: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if doomed.is_set():
                    if self.pass_reply:
                        dst.sendall(data)
                    self.dropped += 1
                    if self.refuse:  # (shut down first: a blocked accept() returns)
                        with contextlib.suppress(OSError):
                            self.listener.shutdown(socket.SHUT_RDWR)
                        self.listener.close()
                    for s in (src, dst):
                        s.shutdown(socket.SHUT_RDWR)
                        s.close()
                    return
                dst.sendall(data)
