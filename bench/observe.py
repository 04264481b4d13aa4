"""What an operator runs beside pdserve, in-process for benchmarks and demos: an OTLP/gRPC trace sink (stands in
for a collector: keeps spans) and a Prometheus-style scraper of /metrics endpoints (every interval, in a thread)."""
from __future__ import annotations

import os
import threading
import urllib.request
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class OtlpSink(trace_service_pb2_grpc.TraceServiceServicer):
    """Receives OTLP/gRPC trace exports on 127.0.0.1:<port>; `spans` holds (service.name, span) pairs."""

    def __init__(self):
        self.spans: list = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def env(self, **extra: str) -> dict[str, str]:
        """The environment that points pdserve's processes at this sink."""
        return {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.port}",
                "OTEL_EXPORTER_OTLP_INSECURE": "true", **extra}

    def Export(self, request, context):
        with self._lock:
            for rs in request.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                for ss in rs.scope_spans:
                    self.spans += [(service, span) for span in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def stop(self) -> None:
        self.server.stop(0)


class Scraper:
    """GETs every URL each interval_s from a daemon thread, as Prometheus would; counts scrapes and bytes."""

    def __init__(self, urls: list[str], interval_s: float = 1.0):
        self.urls, self.interval_s = urls, interval_s
        self.scrapes, self.bytes = 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for url in self.urls:
                try:
                    self.bytes += len(urllib.request.urlopen(url, timeout=5).read())
                    self.scrapes += 1
                except OSError:
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
