"""What every gRPC door does with its call: who the caller is, the path's `Call`, a write that a stalled client
cannot hold forever, and a request run to its status."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from pdserve_server.coordinator.errors import RequestError
from pdserve_server.coordinator.request_path import Call, DoorRequest, RequestPath
from pdserve_server.server_common.security import key_id, presented_token


def caller(context: grpc.aio.ServicerContext, keys_required: bool) -> str:
    """Who a call is for (rate limits, per-caller limits, the scope of its request ids): its API key's id when the
    port requires keys (the interceptor has checked it), else the peer's address without the port. A key presented
    where none is required is not trusted: random keys made every request a new caller."""
    token = presented_token(context.invocation_metadata())
    if keys_required and token is not None:
        return "key:" + key_id(token)
    return "peer:" + context.peer().rsplit(":", 1)[0]


def call_of(context: grpc.aio.ServicerContext, keys_required: bool) -> Call:
    """The path's view of a call: its caller and its deadline (gRPC's time_remaining, read now)."""
    remaining = context.time_remaining()
    return Call(caller(context, keys_required), None if remaining is None else time.monotonic() + remaining)


async def write(context: grpc.aio.ServicerContext, msg: Any, stall_timeout_s: float) -> None:
    """Send one message of a server-streaming call (any door's response type); a client that has not taken it within
    stall_timeout_s (flow control held it) is given up on, so it cannot keep a batch slot and KV blocks on the
    workers. Every door writes through this, so the limit is the same everywhere.

    Raises:
        RequestError: DEADLINE_EXCEEDED for a stalled client.
    """
    try:
        async with asyncio.timeout(stall_timeout_s):  # a timer, not wait_for's task per message
            await context.write(msg)
    except TimeoutError:
        raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"the client read nothing for {stall_timeout_s:g} s; request cancelled and its KV "
                           "freed") from None


async def run(path: RequestPath, context: grpc.aio.ServicerContext, request: DoorRequest) -> None:
    """Run a request for a call that ends with one status: a RequestError ends the call with its code and message
    (and a google.rpc.RetryInfo where waiting helps)."""
    try:
        await path.run(call_of(context, path.keys_required), request)
    except RequestError as e:
        await context.abort(e.code, e.client_message, e.trailing_metadata())
