"""`--http` addresses (HOST:PORT, [V6]:PORT, :PORT for loopback, or a bare PORT) and the one
listening socket the engine core binds for them."""

from __future__ import annotations

import socket

from ..ports import bind


def parse_address(address: str) -> tuple[str, int]:
    text = address.strip().removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.removeprefix("[").removesuffix("]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535 or not host:
        raise ValueError(f"--http {address!r}: give HOST:PORT, for example 127.0.0.1:8000")
    return host, number


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def listen(address: str) -> socket.socket:
    """A listening TCP socket for `address`, inheritable: every frontend accepts on it, so a
    port in use fails here, once, with the flag named."""
    sock = bind("--http", address, *parse_address(address))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return url(host, port)
