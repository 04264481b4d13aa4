"""Prometheus metrics: one /metrics HTTP endpoint per process (--metrics-port), names mirroring vLLM's with the
`pdserve:` prefix (vllm:time_to_first_token_seconds -> pdserve:time_to_first_token_seconds), so dashboards and
alerts port over with a prefix change. Each process owns its registry (no module-level state)."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from pdserve_server.server_common.addresses import advertise_host
from pdserve_server.server_common.config import ServerArgs

# Latency buckets in seconds that resolve both a GPU's milliseconds and a CPU's seconds (vLLM's span, denser low).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# Gaps between consecutive tokens: GPUs 5-50 ms, CPUs 50 ms-2 s.
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                         0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
BYTE_BUCKETS = tuple(4096 * 4 ** i for i in range(13))  # 4 KiB .. 64 GiB


@dataclass
class MetricsServer:
    """A running /metrics endpoint: its port, and the server to shut down."""

    port: int
    server: WSGIServer

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def metrics_url(args: ServerArgs, server: MetricsServer | None) -> dict[str, str]:
    """{"metrics_url": "http://advertised-host:port/metrics"} for a ready file, or {} when metrics are off."""
    if server is None:
        return {}
    return {"metrics_url": f"http://{advertise_host(args.host, args.advertise_host)}:{server.port}/metrics"}


def start_metrics_server(host: str, port: int, registry: CollectorRegistry) -> MetricsServer:
    """Serve `registry` at http://host:port/metrics from a daemon thread (prometheus-client's WSGI app).

    Always in the Prometheus text format: prometheus-client's OpenMetrics output, which Prometheus asks for,
    rewrites the ':' of `pdserve:` sample names to '_' while keeping it in # TYPE lines (client_python#1177), so
    the names dashboards query would not exist.

    Args:
        port: 0 picks a free port (see MetricsServer.port).

    Raises:
        OSError: the port cannot be bound.
    """
    app = make_wsgi_app(registry)

    def text_format(environ, start_response):
        return app({**environ, "HTTP_ACCEPT": "text/plain; version=0.0.4"}, start_response)

    server = make_server(host, port, text_format, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return MetricsServer(server.server_port, server)


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape."""

    def log_message(self, format: str, *args) -> None:
        pass
