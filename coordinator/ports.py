"""Binding a TCP port the way the listeners that will take it do (SO_REUSEADDR), failing with
the flag that named it: the one check behind `--listen` (ZeroMQ binds later, in a frontend)
and `--http` (whose socket every frontend inherits)."""

from __future__ import annotations

import socket


def bind(flag: str, given: str, host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port); OSError naming `flag` and what was `given` if the
    port is taken or the host is not this machine's."""
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and
    # without it every HTTP response waits out the client's delayed ACK (40 ms).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"{flag} {given}: cannot listen on {host}:{port}: {e.strerror}") from None
    return sock
