"""The HTTP API's server inside a frontend process: uvicorn on a thread of its own, reaching the
frontend as a client on an inproc socket.

The listening socket is the engine core's (`address.listen`), inherited: every frontend accepts
on it, so `--frontends N` share one port and whichever is free takes the next connection.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import zmq
import zmq.asyncio

from protocol.async_client import AsyncClient
from protocol.messages import Serve


class HttpServer:
    def __init__(self, sock: socket.socket, api_key: str | None, keepalive: float | None,
                 timeout: float, metrics_socket: str | None = None):
        """keepalive: seconds of silence before an SSE comment (None: none). timeout: seconds
        a connection may idle before a request (`--http-timeout`). metrics_socket: where the
        engine core serves its metrics exposition, answered as /metrics."""
        self.sock = sock
        self.api_key = api_key
        self.keepalive = keepalive
        self.timeout = timeout
        self.metrics_socket = metrics_socket
        self.server = None
        self.api = None
        self.thread: threading.Thread | None = None

    def start(self, ctx: zmq.Context, endpoint: str, serve: Serve) -> None:
        """Serve until `stop`, as a client of the frontend's `endpoint` (inproc, in `ctx`)."""
        import uvicorn

        from .api import Api

        client = AsyncClient(endpoint, timeout=None,
                             context=zmq.asyncio.Context.shadow(ctx.underlying))
        self.api = Api(client, serve, self.api_key, self.keepalive, self.metrics_socket)
        app = self.api.app()
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2, timeout_keep_alive=self.timeout,
                                http=first_request_deadline(self.timeout))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve(client)),
                                       name="http", daemon=True)
        self.thread.start()

    def refusals(self) -> list[str]:
        """The error codes of the requests the API refused since the last call."""
        if self.api is None:
            return []
        return [self.api.refused.popleft() for _ in range(len(self.api.refused))]

    @property
    def stopped(self) -> bool:
        """Started, and its thread has ended (uvicorn exited or crashed)."""
        return self.thread is not None and not self.thread.is_alive()

    async def _serve(self, client: AsyncClient) -> None:
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


def first_request_deadline(seconds: float) -> type:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request's headers
    `seconds` after connecting: uvicorn times out only a kept-alive connection after a response,
    so one that connects and sends nothing (or its headers a byte at a time) was held forever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.loop.call_later(seconds, self._first_request_due)

        def _first_request_due(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

    return Protocol
