"""The one table from engine failure kinds to gRPC status codes, applied at the worker's edge."""
from __future__ import annotations

from typing import NoReturn

import grpc
from google.rpc import error_details_pb2

from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve.v1 import worker_pb2
from pdserve_server.server_common.rich_status import rich_status

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


def kind_details(code: grpc.StatusCode, message: str, kind: ErrorKind) -> tuple:
    """Trailing metadata carrying the rich status (google.rpc.Status, AIP-193) of a failure: its code and message
    again, and a google.rpc.ErrorInfo whose reason names the kind (worker.proto's WorkerErrorReason, e.g.
    "WORKER_ERROR_REASON_TRANSFER_FAILED"; domain "pdserve.v1"), so the coordinator can tell a worker's own report
    from a lost connection (`coordinator.errors.from_rpc_error`)."""
    reason = f"WORKER_ERROR_REASON_{kind.name}"
    worker_pb2.WorkerErrorReason.Value(reason)  # ValueError if engine.errors and worker.proto drift apart
    return rich_status(code, message, error_details_pb2.ErrorInfo(reason=reason, domain=worker_pb2.DESCRIPTOR.package))


async def abort_with(context: grpc.aio.ServicerContext, error: EngineError) -> NoReturn:
    """End the RPC with the status for `error.kind`, its message and the kind as an ErrorInfo (`kind_details`);
    raises, as `context.abort` does."""
    code = STATUS_FOR_KIND[error.kind]
    await context.abort(code, error.message, kind_details(code, error.message, error.kind))
    raise AssertionError("unreachable: context.abort raises")
