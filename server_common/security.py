"""Who may talk to a pdserve process: TLS for any server, bearer tokens checked by one server interceptor (API keys
on the public port, the cluster secret on worker ports), and the client side of both for internal calls.

Tokens travel as gRPC metadata `authorization: Bearer <token>` (also accepted: `x-api-key: <token>`). They are
compared as SHA-256 digests with `hmac.compare_digest`, so neither the check's timing nor a log line reveals a
key; keys are named in logs by `key_id` (a digest prefix). The gRPC health service stays open, so Kubernetes
and compose probes work without credentials.
"""
from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import grpc

from pdserve_server.server_common.addresses import is_loopback

log = logging.getLogger(__name__)

CLUSTER_SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
API_KEYS_ENV = "PDSERVE_API_KEYS"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def digest(token: str | bytes) -> bytes:
    """SHA-256 of a token (what is stored and compared; never the token itself)."""
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def key_id(token: str) -> str:
    """A short, non-secret name for a key in logs and metrics: the first 8 hex digits of its SHA-256."""
    return digest(token).hex()[:8]


def read_secret(path: str | None, env: str = CLUSTER_SECRET_ENV) -> str | None:
    """The cluster secret: the file's content (stripped) when a path is given, else the environment variable,
    else None (no internal authentication).

    Raises:
        ValueError: the file or variable is empty.
        OSError: the file cannot be read.
    """
    value = Path(path).read_text().strip() if path else os.environ.get(env)
    if value is None:
        return None
    if not value.strip():
        raise ValueError(f"the cluster secret ({path or env}) is empty")
    return value.strip()


def read_api_keys(path: str | None, env: str = API_KEYS_ENV) -> list[str]:
    """API keys: one per line in the file (blank lines and '#' comments skipped), plus any comma-separated in the
    environment variable. An empty list means the port needs no key.

    Raises:
        OSError: the file cannot be read.
    """
    keys = []
    if path:
        keys += [line.strip() for line in Path(path).read_text().splitlines()
                 if line.strip() and not line.lstrip().startswith("#")]
    keys += [k.strip() for k in os.environ.get(env, "").split(",") if k.strip()]
    return keys


def presented_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The bearer token in call metadata (`authorization: Bearer x` or `x-api-key: x`), or None."""
    for key, value in metadata or ():
        value = value.decode() if isinstance(value, bytes) else value
        if key == "authorization" and value[:7].lower() == "bearer ":
            return value[7:].strip()
        if key == "x-api-key":
            return value.strip()
    return None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call (but health checks) that does not present one of `tokens`: UNAUTHENTICATED, with a
    message saying what to send.

    Args:
        tokens: accepted tokens (API keys, or the cluster secret); must not be empty.
        what: how the message names them ("API key", "cluster secret").
    """

    def __init__(self, tokens: Iterable[str], what: str):
        self._digests = [digest(t) for t in tokens]
        if not self._digests:
            raise ValueError("BearerTokenInterceptor needs at least one token")
        self.what = what

    def accepts(self, token: str | None) -> bool:
        """Constant-time check of a presented token against every accepted one."""
        if token is None:
            return False
        presented = digest(token)
        return any([hmac.compare_digest(presented, d) for d in self._digests])  # no short-circuit: same time

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        if self.accepts(presented_token(handler_call_details.invocation_metadata)):
            return handler
        token = presented_token(handler_call_details.invocation_metadata)
        message = (f"missing {self.what}: send metadata 'authorization: Bearer <{self.what}>'" if token is None
                   else f"invalid {self.what}")
        # An operator should see who is knocking (the key itself is never logged, only its id).
        log.warning("refused %s: %s%s", handler_call_details.method, message,
                    f" (presented key id {key_id(token)})" if token is not None else "")
        return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, message)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """`handler` with its behavior replaced by an immediate abort (same streaming shape, so the client sees the
    status whatever kind of call it made)."""
    async def abort(request_or_iterator, context):
        await context.abort(code, message)

    async def abort_stream(request_or_iterator, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator; abort raises first

    field = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary",
             (True, True): "stream_stream"}[(handler.request_streaming, handler.response_streaming)]
    original = getattr(handler, field)
    return handler._replace(**{field: abort_stream if inspect.isasyncgenfunction(original) else abort})


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()),
                                                       ("authorization", f"Bearer {token}")))


class _BearerUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds `authorization: Bearer <token>` to a channel's unary calls. (grpc.aio files an interceptor under its
    first matching kind only, so each call kind needs its own class.)"""

    def __init__(self, token: str):
        self.token = token

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self.token), request)


class _BearerUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to a channel's server-streaming calls."""

    def __init__(self, token: str):
        self.token = token

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self.token), request)


class _BearerStreamStream(grpc.aio.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to a channel's bidirectional calls."""

    def __init__(self, token: str):
        self.token = token

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_token(client_call_details, self.token), request_iterator)


def server_credentials(cert: str | None, key: str | None, client_ca: str | None) -> grpc.ServerCredentials | None:
    """TLS credentials for a server from PEM files (None when no cert is given: plaintext). With client_ca, clients
    must present a certificate it signed (mTLS).

    Raises:
        ValueError: a cert without a key (or the reverse), or a client CA without a cert.
        OSError: a file cannot be read.
    """
    if not cert and not key and not client_ca:
        return None
    if not cert or not key:
        raise ValueError("TLS needs both --tls-cert and --tls-key (and --tls-client-ca only with them)")
    root = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())],
                                       root_certificates=root, require_client_auth=root is not None)


def internal_channel(address: str, tls_ca: str | None, token: str | None,
                     options: list[tuple[str, int]] | None = None,
                     interceptors: list | None = None) -> grpc.aio.Channel:
    """A channel to another pdserve process: TLS verified against tls_ca when given (else plaintext), the cluster
    secret as a bearer token on every call when given, then `interceptors` (e.g. tracing's)."""
    interceptors = [*([_BearerUnaryUnary(token), _BearerUnaryStream(token), _BearerStreamStream(token)] if token
                      else []), *(interceptors or [])]
    interceptors = interceptors or None
    if tls_ca:
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def warn_if_exposed(role: str, host: str, tls: bool, auth: bool) -> None:
    """Log a warning when a server binds beyond loopback without TLS or without authentication."""
    if is_loopback(host):
        return
    missing = [name for name, present in (("TLS", tls), ("authentication", auth)) if not present]
    if missing:
        log.warning("%s binds %s without %s: anyone who can reach this port can use it", role, host,
                    " or ".join(missing))
