"""gRPC's rich error model (google.rpc.Status, AIP-193) as trailing metadata, for `context.abort`."""
from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, status_pb2
from grpc_status import rpc_status


def rich_status(code: grpc.StatusCode, message: str, *details: Message) -> tuple:
    """Trailing metadata carrying a google.rpc.Status with `code`, `message` and each detail packed as an Any
    (google.rpc.RetryInfo, ErrorInfo, ...): what `grpc_status.rpc_status.from_call` reads back on the client.

    The code and message must be the ones given to `context.abort` too: grpc-status refuses a status whose copy
    disagrees with the call's (ValueError on the reading side)."""
    packed = []
    for detail in details:
        any_detail = any_pb2.Any()
        any_detail.Pack(detail)
        packed.append(any_detail)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=packed)
    return tuple(rpc_status.to_status(status).trailing_metadata)
