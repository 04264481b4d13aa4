"""The one place where request errors become gRPC statuses."""
from __future__ import annotations

import math

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pdserve.v1 import worker_pb2
from pdserve_server.server_common.rich_status import rich_status


class RequestError(Exception):
    """A request-level error with the gRPC status it maps to.

    Attributes:
        code: the grpc.StatusCode.
        message: what the caller can do about it.
        retry_after_s: when set (finite), the status carries a google.rpc.RetryInfo with this delay.
        worker: the address of the worker whose call failed, when one did (migration avoids it).
        public: what the client is told when `message` names internals (worker addresses, transport text), which
            the coordinator's log keeps under the request id; None = the message itself (`client_message`).
        prompt_tokens: the prompt's length in tokens when it was known before the refusal (a prompt too long for
            the context), for the access log; None = not known.
    """

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None,
                 worker: str | None = None, public: str | None = None, prompt_tokens: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.worker = worker
        self.public = public
        self.prompt_tokens = prompt_tokens

    @property
    def client_message(self) -> str:
        """The status message a client gets: no internal address or raw transport text."""
        return self.public if self.public is not None else self.message

    def naming(self, request_id: str) -> RequestError:
        """This error as told once the request holds its id in flight: the client's message led by the id."""
        return RequestError(self.code, self.message, self.retry_after_s, self.worker,
                            f"request {request_id}: {self.client_message}", self.prompt_tokens)

    def trailing_metadata(self) -> tuple:
        """The rich status (google.rpc.Status with RetryInfo) for `context.abort`, or () without a retry hint."""
        if self.retry_after_s is None or not math.isfinite(self.retry_after_s):
            return ()
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(self.retry_after_s * 1e9))
        return rich_status(self.code, self.client_message, error_details_pb2.RetryInfo(retry_delay=delay))


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def worker_reason(e: grpc.aio.AioRpcError) -> int:
    """The failure a worker reported in its status: worker.proto's WorkerErrorReason, carried as a
    google.rpc.ErrorInfo's reason (`worker_common.errors.kind_details`); WORKER_ERROR_REASON_UNSPECIFIED when the
    status carries none (a lost connection, a deadline, a status gRPC made up rather than the worker)."""
    unspecified = worker_pb2.WORKER_ERROR_REASON_UNSPECIFIED
    try:
        status = rpc_status.from_call(e)
    except ValueError:  # details that disagree with the status: not the worker's
        return unspecified
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == worker_pb2.DESCRIPTOR.package:
            try:
                return worker_pb2.WorkerErrorReason.Value(info.reason)
            except ValueError:  # a newer worker's reason: treat as none
                return unspecified
    return unspecified


def from_rpc_error(e: grpc.aio.AioRpcError, role: str, address: str, peer: str | None = None) -> RequestError:
    """A worker's status, passed on with the worker at fault named (`RequestError.worker`); connection loss (and a
    worker's own fault) becomes UNAVAILABLE, which the coordinator answers by migrating the request.

    peer: the worker at the other end of this call's KV transfer. A TRANSFER_FAILED status that the worker itself
    reported proves the worker alive and points at its peer (a decode worker killed mid-transfer broke the prefill
    worker's send): the peer is named, so membership takes the lost worker out of routing, not the healthy one."""
    code = e.code()
    reason = worker_reason(e)
    if code in LOST_CODES and reason == worker_pb2.WORKER_ERROR_REASON_UNSPECIFIED:
        return lost_worker(role, address, e.details())
    if code in LOST_CODES:
        code = grpc.StatusCode.UNAVAILABLE
    message = f"{role} worker {address}: {e.details()}"
    public = f"{role} worker: {e.details()}"  # a status the worker wrote is meant for the caller
    if peer is not None and reason == worker_pb2.WORKER_ERROR_REASON_TRANSFER_FAILED:
        return RequestError(code, f"{message} (its KV transfer peer {peer} is suspected)", worker=peer,
                            public=f"{public} (KV transfer failed)")
    return RequestError(code, message, worker=address, public=public)


def lost_worker(role: str, address: str, detail: str) -> RequestError:
    """UNAVAILABLE naming the worker at `address` as lost (the request migrates): a lost connection's status, or a
    call membership cut (`flow.WorkerCall.abandon`). The client is told what happened, not where: `detail` (gRPC's and
    the transport's text, or membership's) goes to the log only."""
    return RequestError(grpc.StatusCode.UNAVAILABLE, f"{role} worker {address}: {detail}", worker=address,
                        public=f"the {role} worker serving this request was lost (UNAVAILABLE)")


# Statuses passed on as UNAVAILABLE (the request migrates); without a reason the worker wrote, the call was lost
# rather than answered.
LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.CANCELLED)
