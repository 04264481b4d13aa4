"""The one place where request errors become gRPC statuses."""
from __future__ import annotations

import grpc


class RequestError(Exception):
    """A request-level error with the gRPC status it maps to. `code` is a grpc.StatusCode."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def from_rpc_error(e: grpc.aio.AioRpcError, worker: str) -> RequestError:
    """A worker's status, passed on with the worker named; connection loss becomes UNAVAILABLE."""
    code = e.code()
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED):
        code = grpc.StatusCode.UNAVAILABLE
    return RequestError(code, f"{worker}: {e.details()}")
