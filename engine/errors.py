"""Why the engine gave up on a request, as a closed set of kinds. The engine never speaks gRPC: the worker edge
maps each kind to a status code in one table (`worker_common.errors`)."""
from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """A request failure's kind."""

    INVALID_REQUEST = "invalid_request"      # can never run here (e.g. longer than max_model_len)
    DUPLICATE_REQUEST = "duplicate_request"  # the request id is already in use on this worker
    CAPACITY = "capacity"                    # can never fit this worker's KV pool
    ABORTED = "aborted"                      # aborted by an operator or the coordinator (Worker.Abort)
    DEADLINE = "deadline"                    # its first token could not be started before its deadline
    KV_TIMEOUT = "kv_timeout"                # the KV did not arrive or finish arriving in time
    TRANSFER_FAILED = "transfer_failed"      # the KV transfer broke (peer died, connection lost, receiver failed)
    TRANSFER_REJECTED = "transfer_rejected"  # the receiver had no reservation for it (aborted or expired)
    INCOMPATIBLE_PEER = "incompatible_peer"  # KV handshake refused: protocol version or KV layout differ
    INTERNAL = "internal"                    # a bug: the engine step raised
    ENGINE_DIED = "engine_died"              # the engine process died (killed, crashed): retry elsewhere


class EngineError(Exception):
    """A request failed for `kind`; `message` says what the caller can do about it."""

    def __init__(self, kind: ErrorKind, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message
