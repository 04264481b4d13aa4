"""The one place where request errors become gRPC statuses."""
from __future__ import annotations

import math

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status


class RequestError(Exception):
    """A request-level error with the gRPC status it maps to.

    Attributes:
        code: the grpc.StatusCode.
        message: what the caller can do about it.
        retry_after_s: when set (finite), the status carries a google.rpc.RetryInfo with this delay.
        worker: the address of the worker whose call failed, when one did (migration avoids it).
    """

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None,
                 worker: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.worker = worker

    def trailing_metadata(self) -> tuple:
        """The rich status (google.rpc.Status with RetryInfo) for `context.abort`, or () without a retry hint."""
        if self.retry_after_s is None or not math.isfinite(self.retry_after_s):
            return ()
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(self.retry_after_s * 1e9))
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        status = status_pb2.Status(code=getattr(code_pb2, self.code.name), message=self.message, details=[detail])
        return tuple(rpc_status.to_status(status).trailing_metadata)


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def from_rpc_error(e: grpc.aio.AioRpcError, role: str, address: str) -> RequestError:
    """A worker's status, passed on with the worker named; connection loss (and a worker's own fault) becomes
    UNAVAILABLE, which the coordinator answers by migrating the request."""
    code = e.code()
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED):
        code = grpc.StatusCode.UNAVAILABLE
    return RequestError(code, f"{role} worker {address}: {e.details()}", worker=address)
