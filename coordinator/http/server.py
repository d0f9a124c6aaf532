"""The HTTP API's server inside a frontend process: uvicorn on a thread of its own, reaching the
frontend as a client on an inproc socket.

The listening socket is bound with SO_REUSEPORT, so `--frontends N` processes share one port and
the kernel spreads connections over them. Bound in the frontend's main thread, before it says
it listens, so a port in use stops the start with that message.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import zmq
import zmq.asyncio

from protocol.async_client import AsyncClient
from protocol.messages import Serve
from protocol.security import check_http_bind

from .address import parse_address, url

log = logging.getLogger("siding.http")


class HttpServer:
    def __init__(self, address: str, api_key: str | None, insecure: bool):
        host, port = parse_address(address)
        check_http_bind(host, api_key, insecure)
        self.api_key = api_key
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            self.sock.bind((host, port))
            self.sock.listen(1024)
        except OSError as e:
            self.sock.close()
            raise OSError(e.errno, f"--http {address}: cannot listen on {host}:{port}: "
                          f"{e.strerror}") from None
        self.url = url(host, self.sock.getsockname()[1])
        self.server = None
        self.thread: threading.Thread | None = None

    def start(self, ctx: zmq.Context, endpoint: str, serve: Serve) -> None:
        """Serve until `stop`, as a client of the frontend's `endpoint` (inproc, in `ctx`)."""
        ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(
            self._serve(ctx, endpoint, serve, ready)), name="http", daemon=True)
        self.thread.start()
        ready.wait(30)

    async def _serve(self, ctx: zmq.Context, endpoint: str, serve: Serve,
                     ready: threading.Event) -> None:
        import uvicorn

        from .api import Api

        client = AsyncClient(endpoint, timeout=None,
                             context=zmq.asyncio.Context.shadow(ctx.underlying))
        app = Api(client, serve, self.api_key).app()
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        ready.set()
        try:
            await self.server.serve(sockets=[self.sock])
        finally:
            await client.close()

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(5)
        self.sock.close()
