"""Each process's Prometheus endpoint: prometheus_client's exposition, served from a thread that
sleeps until a scrape comes.

`prometheus_client.start_http_server` serves with socketserver's default poll of twice a
second, and each of those wakes of a cold thread cost about 100 us of CPU on the 2-core VM the
suite runs on, whose cores the model's worker keeps busy: as much as a tenth of what the
engine core spends on a streamed token at 64 streams there (`docs/benchmarks.md`). This thread
wakes for scrapes only; it is a daemon, so it needs no shutdown.

`serve_exposition` and `read_exposition` carry one process's exposition to another on the same
host, over a Unix socket: the engine core's registry to the frontends, which serve it as
`/metrics` on the HTTP API's port. The reader sends the scrape's `Accept` header on one line;
the server answers the content type it chose on one line, then the exposition, and closes.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from functools import partial
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder
from prometheus_client.openmetrics import exposition as openmetrics

MAX_ACCEPT = 4096  # bytes of an Accept header passed on
PEER_SECONDS = 5.0  # a reader that sends nothing for this long is dropped


def encoder(accept: str):
    """prometheus_client's format for a scrape's Accept header, as (encode, content type), except
    that OpenMetrics keeps a sample name's colons: its `underscores` escaping (the default, and
    Prometheus 2's) writes `vllm:prompt_tokens_total` as `vllm_prompt_tokens_total` under a
    `# TYPE vllm:prompt_tokens` (prometheus_client 0.26 escapes sample names with the rules for
    label names). Every name here is a legal classic one, which that escaping should leave as
    it is, and `allow-utf-8` does."""
    encode, content_type = choose_encoder(accept)
    if isinstance(encode, partial) and encode.keywords.get("escaping") == openmetrics.UNDERSCORES:
        encode = partial(encode.func, **{**encode.keywords, "escaping": openmetrics.ALLOWUTF8})
    return encode, content_type


def _app(registry: CollectorRegistry):
    def app(environ, start_response):
        encode, content_type = encoder(environ.get("HTTP_ACCEPT", ""))
        body = encode(registry)
        start_response("200 OK", [("Content-Type", content_type),
                                  ("Content-Length", str(len(body)))])
        return [body]
    return app


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # a scrape is not worth a log line
        pass


def serve_metrics(registry: CollectorRegistry, port: int, addr: str) -> None:
    """Serve `registry` at http://addr:port/metrics (IPv4 or IPv6, as `addr` resolves)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
    server = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    httpd = make_server(sockaddr[0], port, _app(registry), server,
                        handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": None},
                     name="metrics", daemon=True).start()


def serve_exposition(registry: CollectorRegistry, path: str) -> None:
    """Serve `registry`'s exposition on a Unix socket at `path`, one reader at a time, from a
    daemon thread that sleeps until one connects."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen()

    def serve() -> None:
        while True:
            conn, _ = sock.accept()
            with conn:
                conn.settimeout(PEER_SECONDS)
                try:
                    accept = conn.makefile("rb").readline(MAX_ACCEPT).decode("latin-1")
                    encode, content_type = encoder(accept.strip())
                    conn.sendall(content_type.encode() + b"\n" + encode(registry))
                except OSError:  # the reader went away or stalled: its loss
                    pass

    threading.Thread(target=serve, name="exposition", daemon=True).start()


async def read_exposition(path: str, accept: str) -> tuple[str, bytes]:
    """(content type, exposition) from `serve_exposition` at `path`, for a scrape that sent
    `accept`. Raises OSError (or EOFError on a torn reply) when nothing serves it."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(" ".join(accept[:MAX_ACCEPT - 1].splitlines()).encode("latin-1", "replace")
                     + b"\n")
        await writer.drain()
        head = await reader.readline()
        if not head.endswith(b"\n"):
            raise EOFError("the exposition ended before its content type")
        return head.decode().strip(), await reader.read()
    finally:
        writer.close()
