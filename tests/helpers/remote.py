"""Clusters started apart, as on several hosts (`siding coordinator`, then `siding worker`s):
free ports to tell both sides, and the worker processes."""

from __future__ import annotations

import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(port: int, rank: int, keys: str) -> subprocess.Popen:
    """`siding worker` for the coordinator whose --worker-listen is tcp://127.0.0.1:`port`."""
    return subprocess.Popen([sys.executable, "-m", "worker", "--coordinator",
                             f"tcp://127.0.0.1:{port}", "--rank", str(rank), "--threads", "1",
                             "--curve-keys", keys], stderr=subprocess.DEVNULL)
