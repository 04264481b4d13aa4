"""Start a grpc.aio server with standard health checking and reflection, and announce it in a ready file."""
from __future__ import annotations

import asyncio
import errno
import inspect
import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve_server.server_common.config import ServerArgs
from pdserve_server.server_common.errors import CommandError
from pdserve_server.server_common.security import BearerTokenInterceptor, server_credentials, warn_if_exposed

MAX_MESSAGE_BYTES = 64 << 20
# HTTP/2 keepalive: a peer that vanished without closing its connection (host down, network partition) is noticed
# within ~30 s and its calls cancelled, so nothing stays held for it. Servers accept the pings clients send.
SERVER_KEEPALIVE = [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
                    ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
                    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000)]
CLIENT_KEEPALIVE = [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
                    ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
# Health service names: "" and each API service say whether to send work here (readiness); this one says whether
# the process is sound (liveness: a Kubernetes livenessProbe restarts the process when it is NOT_SERVING).
LIVENESS_SERVICE = "pdserve.liveness"
DRAIN_NOTICE_S = 2.0  # after NOT_SERVING, keep accepting this long so pollers notice before new calls are refused
CUT_MARGIN_S = 1.0  # a drain's `cut` comes this long before grpc would cancel what is left, to send its status


@dataclass
class RunningServer:
    """A started server: the grpc.aio server, the port it bound, its health servicer and the services it reports."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: list[str]

    async def set_serving(self, serving: bool) -> None:
        """Readiness: SERVING or NOT_SERVING for "" (the whole server) and every API service."""
        for name in ["", *self.service_names]:
            await self.health.set(name, _status(serving))

    async def set_live(self, live: bool) -> None:
        """Liveness (`LIVENESS_SERVICE`): NOT_SERVING asks the platform to restart this process."""
        await self.health.set(LIVENESS_SERVICE, _status(live))

    async def serve_until_cancelled(self, drain_timeout_s: float, in_flight: Callable[[], int],
                                    cut: Callable[[], None] | None = None,
                                    on_drain: Callable[[], None] | None = None) -> None:
        """Serve until the task is cancelled (SIGTERM/SIGINT), then drain: readiness NOT_SERVING, a short notice
        for pollers when requests are in flight, then refuse new calls and give in-flight ones what is left of
        drain_timeout_s to finish. `cut`, if given, is called CUT_MARGIN_S before that time is up while requests
        remain, so they can end with a status of the server's choosing (grpc would cancel them); `on_drain` as new
        calls stop being taken (long-lived streams end once the requests they serve have, instead of holding the
        stop for its whole grace). A second cancel cuts the drain short."""
        try:
            # Shielded: grpcio's wait_for_termination awaits the server's shutdown future itself, so cancelling it
            # cancelled that future, and the stop below then raised at once: every stream was cut when the drain
            # notice ended instead of being given drain_timeout_s.
            await asyncio.shield(self.server.wait_for_termination())
        finally:
            await self.set_serving(False)
            notice = min(DRAIN_NOTICE_S, drain_timeout_s) if in_flight() and drain_timeout_s > 0 else 0.0
            await asyncio.sleep(notice)
            if on_drain is not None:
                on_drain()
            stopping = asyncio.ensure_future(self.server.stop(grace=drain_timeout_s - notice))
            if cut is not None:
                await asyncio.wait({stopping}, timeout=max(0.0, drain_timeout_s - notice - CUT_MARGIN_S))
                if not stopping.done() and in_flight():
                    cut()
            await stopping


def _status(serving: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


class _Malformed:
    """Stands in for a request body that did not parse; the wrapped method answers INVALID_ARGUMENT."""

    def __init__(self, error: DecodeError):
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers an undecodable request body with INVALID_ARGUMENT. grpcio itself reports the decoder's exception as
    UNKNOWN with a Python class name, which tells the caller nothing it can act on. Unary-request methods only
    (every pdserve method is one)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        deserialize, method = handler.request_deserializer, handler_call_details.method

        def safe_deserialize(data: bytes):
            try:
                return deserialize(data)
            except DecodeError as e:
                return _Malformed(e)

        async def refuse(request: _Malformed, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request body is not a valid message for {method}: {request.error}")

        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if inspect.isasyncgenfunction(behavior):  # a servicer that yields its responses
            async def wrapped(request, context):
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                async for response in behavior(request, context):
                    yield response
        else:  # returns its response, or writes its stream with context.write
            async def wrapped(request, context):
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                return await behavior(request, context)
        field = "unary_stream" if handler.response_streaming else "unary_unary"
        return handler._replace(request_deserializer=safe_deserialize, **{field: wrapped})


async def start_grpc_server(args: ServerArgs, add_servicers: Callable[[grpc.aio.Server], None],
                            service_names: list[str], tokens: list[str], what: str = "API key",
                            interceptors: list[grpc.aio.ServerInterceptor] = (),
                            max_receive_bytes: int = MAX_MESSAGE_BYTES, reuse_port: bool = False) -> RunningServer:
    """Start a grpc.aio server with `grpc.health.v1.Health` and reflection.

    Args:
        args: bind address (port 0 picks a free port) and TLS files.
        add_servicers: registers the role's services on the server.
        service_names: full names of those services (e.g. "pdserve.v1.Generation"), for health and reflection.
        tokens: bearer tokens a caller must present (`BearerTokenInterceptor`); empty = no authentication.
        what: how errors and warnings name the tokens ("API key", "cluster secret").
        interceptors: more server interceptors, run after authentication (e.g. `Tracing.server_interceptors()`).
        max_receive_bytes: the largest request message taken, bytes; a larger one is refused with
            RESOURCE_EXHAUSTED by gRPC before it is parsed.

    Health reports SERVING for "", each service name and `LIVENESS_SERVICE` once the server has started. A request
    body that does not parse is answered with INVALID_ARGUMENT (`MalformedRequestInterceptor`).

    The port is bound without SO_REUSEPORT (grpcio sets it by default on Linux) unless `reuse_port`: a second
    server on a busy port would otherwise start silently and take half of the first one's connections. With
    `reuse_port` that is the point: several processes that all ask for it share the port, and the kernel spreads
    incoming connections among them (coordinators scaled out, `pdserve serve --num-coordinators K`).

    Raises:
        CommandError: the address could not be bound ("port N is in use" when another process holds it).
        ValueError / OSError: unusable TLS files.
    """
    chain: list[grpc.aio.ServerInterceptor] = [MalformedRequestInterceptor(), *interceptors]
    if tokens:
        chain.insert(0, BearerTokenInterceptor(tokens, what))
    server = grpc.aio.server(interceptors=chain,
                             options=[("grpc.max_receive_message_length", max_receive_bytes),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", int(reuse_port)), *SERVER_KEEPALIVE])
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)  # None: plaintext
    address = f"{args.host}:{args.port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError as e:  # grpcio says only "Failed to bind"; the cause is in its C log line
        raise CommandError(_bind_failure(args.host, args.port)) from e
    warn_if_exposed(", ".join(service_names), args.host, tls=credentials is not None, auth=bool(tokens))
    await server.start()
    running = RunningServer(server, bound, health_servicer, list(service_names))
    await running.set_live(True)
    await running.set_serving(True)
    return running


def bind_problem(host: str, port: int) -> str | None:
    """Why host:port cannot be bound now, as an operator reads it, or None when it can (probed with a plain socket,
    closed at once: a launcher checks before it spawns anything, and grpcio's exception carries no errno)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.bind((host.strip("[]"), port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return f"port {port} is in use on {host} (another server holds it); pick another with --port"
        return f"cannot bind {host}:{port}: {e.strerror}"
    finally:
        probe.close()
    return None


def _bind_failure(host: str, port: int) -> str:
    """Why grpc could not bind host:port (`bind_problem`, else a pointer to grpc's own reason)."""
    return bind_problem(host, port) or (f"cannot bind {host}:{port} (grpc refused the address; run with "
                                        "GRPC_VERBOSITY=debug for its reason)")


def write_ready_file(path: str | None, address: str, **extra) -> None:
    """Atomically write {"address": address, "pid": ..., **extra} so a launcher polling the file never reads half
    of it. Does nothing when path is None."""
    if not path:
        return
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid(), **extra}))
    tmp.rename(path)


def unimplemented_quietly(what: str) -> Callable[[type], type]:
    """Class decorator for a servicer: every RPC of its generated base class that it does not define answers
    UNIMPLEMENTED with "<Rpc> is not served by <what>", and nothing is logged. The generated defaults raise
    NotImplementedError, which grpc.aio logs as an ERROR with a traceback on every call (smg, for one, calls
    vLLM's SubscribeKvEvents as soon as it connects).
    """
    def decorate(cls: type) -> type:
        base = cls.__mro__[1]
        for name, default in vars(base).items():
            if name.startswith("_") or not callable(default) or name in vars(cls):
                continue

            async def unimplemented(self, request, context: grpc.aio.ServicerContext, name=name) -> None:
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not served by {what}")
            unimplemented.__name__ = unimplemented.__qualname__ = name
            unimplemented.__doc__ = f"UNIMPLEMENTED: {what} does not serve {name}."
            setattr(cls, name, unimplemented)
        return cls
    return decorate
