"""`--http` addresses: HOST:PORT, [V6]:PORT, :PORT (loopback) or a bare PORT."""

from __future__ import annotations


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
