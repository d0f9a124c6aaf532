"""Each process's Prometheus endpoint: prometheus_client's WSGI exposition, served from a thread
that sleeps until a scrape comes.

`prometheus_client.start_http_server` serves with socketserver's default poll of twice a
second, and each of those wakes of a cold thread cost about 100 us of CPU on the 2-core VM the
suite runs on, whose cores the model's worker keeps busy: as much as a tenth of what the
engine core spends on a streamed token at 64 streams there (`docs/benchmarks.md`). This thread
wakes for scrapes only; it is a daemon, so it needs no shutdown.
"""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # a scrape is not worth a log line
        pass


def serve_metrics(registry: CollectorRegistry, port: int, addr: str) -> None:
    """Serve `registry` at http://addr:port/metrics (IPv4 or IPv6, as `addr` resolves)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
    server = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    httpd = make_server(sockaddr[0], port, make_wsgi_app(registry), server,
                        handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": None},
                     name="metrics", daemon=True).start()
