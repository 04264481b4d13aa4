"""The one table from engine failure kinds to gRPC status codes, applied at the worker's edge."""
from __future__ import annotations

from typing import NoReturn

import grpc

from engine.errors import EngineError, ErrorKind

STATUS_FOR_KIND: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.DUPLICATE_REQUEST: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.CAPACITY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.ABORTED: grpc.StatusCode.ABORTED,
    ErrorKind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.KV_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.TRANSFER_FAILED: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.TRANSFER_REJECTED: grpc.StatusCode.ABORTED,
    ErrorKind.INCOMPATIBLE_PEER: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.ENGINE_DIED: grpc.StatusCode.UNAVAILABLE,
}


async def abort_with(context: grpc.aio.ServicerContext, error: EngineError) -> NoReturn:
    """End the RPC with the status for `error.kind` and its message (raises, as `context.abort` does)."""
    await context.abort(STATUS_FOR_KIND[error.kind], error.message)
    raise AssertionError("unreachable: context.abort raises")
