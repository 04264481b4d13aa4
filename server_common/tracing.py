"""OpenTelemetry tracing, configured the standard way: OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT),
OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER(_ARG), OTEL_EXPORTER_OTLP_INSECURE/HEADERS, OTEL_BSP_* ... Off when no
endpoint is set (or OTEL_SDK_DISABLED=true): then no provider is installed, no interceptor runs, and the spans the
code opens are the API's non-recording ones.

gRPC spans and W3C `traceparent` propagation on every worker call come from opentelemetry-instrumentation-grpc's
interceptors (health checks and the membership polls are filtered out: they would bury requests in noise). The
KV transfer carries the context in its offer message (`inject_context` / `extract_context`). Engine-thread work
(queueing, prefill compute, decoding) is recorded from the timestamps the engine keeps (`record_span`), never by
opening spans inside the step loop.

The provider is installed as OpenTelemetry's process-wide one (`trace.set_tracer_provider`), once, at start: the
OpenTelemetry API is built around that single global, as logging is.
"""
from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

log = logging.getLogger(__name__)

TRACER_NAME = "pdserve"
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


class TraceContextFilter(logging.Filter):
    """Puts the current span's trace id on every log record (`record.trace_id`: 32 hex digits, "" outside a
    sampled trace), so a log line can be found from its trace and back. A filter on the process's handler: JSON
    logs carry it as a key; `TraceFormatter` appends it to text lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        record.trace_id = format(ctx.trace_id, "032x") if ctx.is_valid else ""
        return True


class TraceFormatter(logging.Formatter):
    """A text formatter that ends a line with " [trace <id>]" when the record has a trace id."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        trace_id = getattr(record, "trace_id", "")
        return f"{line} [trace {trace_id}]" if trace_id else line


def tracer() -> trace.Tracer:
    """pdserve's tracer (a no-op one while tracing is off)."""
    return trace.get_tracer(TRACER_NAME)


@dataclass
class Tracing:
    """This process's tracing: the SDK provider when on (None when off) and the gRPC interceptors that go with it."""

    provider: object | None = None

    @classmethod
    def from_env(cls, default_service_name: str) -> "Tracing":
        """Install an OTLP/gRPC exporter when the standard environment asks for one; else tracing stays off.

        Args:
            default_service_name: service.name unless OTEL_SERVICE_NAME says otherwise.
        """
        if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or not any(os.environ.get(v)
                                                                              for v in ENDPOINT_VARS):
            return cls()
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", default_service_name)})
        provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        log.info("tracing on: OTLP to %s as %s", next(os.environ[v] for v in ENDPOINT_VARS if os.environ.get(v)),
                 resource.attributes[SERVICE_NAME])
        return cls(provider)

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def server_interceptors(self) -> list:
        """Server spans for every RPC but health checks and reflection, continuing the caller's traceparent."""
        if not self.enabled:
            return []
        from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

        interceptor = aio_server_interceptor(self.provider, filter_=filters.negate(filters.any_of(
            filters.health_check(), filters.service_prefix("grpc.reflection"),
            filters.method_name("GetStats"), filters.method_name("GetInfo"))))
        return [_accept_write_style_streams(interceptor)]

    def client_interceptors(self) -> list:
        """Client spans that inject traceparent into every worker call (membership polls excluded)."""
        if not self.enabled:
            return []
        from opentelemetry.instrumentation.grpc import aio_client_interceptors, filters

        return aio_client_interceptors(self.provider, filter_=filters.negate(filters.any_of(
            filters.health_check(), filters.method_name("GetStats"), filters.method_name("GetInfo"))))

    def shutdown(self) -> None:
        """Flush and stop the exporter (spans still queued are sent)."""
        if self.provider is not None:
            self.provider.shutdown()


def inject_context() -> dict[str, str]:
    """The current trace context as W3C headers ({"traceparent": ...}), for a message that crosses a process
    boundary outside gRPC (the KV offer). Empty while tracing is off."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def extract_context(carrier: dict[str, str] | None) -> otel_context.Context:
    """The trace context a message carried (see `inject_context`)."""
    return propagate.extract(carrier or {})


def record_span(name: str, start_s: float, end_s: float, attributes: dict | None = None,
                parent: otel_context.Context | None = None) -> None:
    """A span for work that already happened, from wall-clock timestamps (seconds since the epoch), as a child of
    `parent` (default: the current span). Does nothing while tracing is off."""
    if not trace.get_current_span(parent).get_span_context().is_valid:  # tracing off, or not in a trace
        return
    span = tracer().start_span(name, context=parent, start_time=int(start_s * 1e9), attributes=attributes or {})
    span.end(end_time=int(max(end_s, start_s) * 1e9))


def _accept_write_style_streams(interceptor):
    """Trace every response-streaming method through the instrumentation's unary wrapper (a span around
    `await behavior(...)`), each as a coroutine that writes its stream with `context.write`.

    - Write-style methods (the coordinator's Generate writes with `context.write` on purpose: it bounds each write,
      so a client that stops reading is noticed) failed in the instrumentation's stream wrapper with "'async for'
      requires an object with __aiter__ method, got coroutine" (open-telemetry/opentelemetry-python-contrib issue
      3066, open as of 0.66b2).
    - Async-generator methods (the workers' streams) are adapted to write style (`_written`). In the stream wrapper
      the span's context was attached inside an async generator; a client that cancelled while a message was being
      written left that generator suspended at its yield, and Python closed it later from another task, where the
      detach failed: "Failed to detach context" with a traceback in the log for every such cancel (seen 6 times in
      80 abandoned streams; open-telemetry/opentelemetry-python-contrib issue 2357). Written by a coroutine, the
      generator is closed in the handler's own task, so the span ends where it began.
    """
    unary_wrapper = interceptor._intercept_aio_server_unary

    def intercept_stream(behavior, handler_call_details):
        if inspect.isasyncgenfunction(behavior):
            behavior = _written(behavior)
        return unary_wrapper(behavior, handler_call_details)

    interceptor._intercept_aio_server_stream = intercept_stream
    return interceptor


def _written(behavior):
    """An async-generator streaming method as a coroutine that writes each message, closing the generator in the
    calling task on every exit (a cancel included)."""
    async def write_style(request, context):
        stream = behavior(request, context)
        try:
            async for message in stream:
                await context.write(message)
        finally:
            await stream.aclose()
    return write_style
