"""One request's path through the workers, as an async stream of events (`Tokens`, then one `WorkerFinish`).

Disaggregated: Decode(remote) reserves blocks -> Prefill computes the first token (streamed at once) and pushes
the KV -> the decode worker streams the rest. Colocated: one Decode(local) call does both phases.
Every exit path (finish, error, client cancel, Abort) cancels the worker calls, and the workers free the
request's blocks when their call ends; `Router.lease` gives back each worker's count.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from coordinator.errors import RequestError, from_rpc_error
from coordinator.router import Router, WorkerHandle
from pdserve.v1 import generate_pb2, worker_pb2


@dataclass
class Tokens:
    """Sampled tokens from a worker (worker_pb2.SampledToken list); num_cached_tokens is the prefix-cache hit,
    reported with the first tokens."""

    tokens: list
    num_cached_tokens: int = 0


@dataclass
class WorkerFinish:
    """The worker stopped the request: finish_reason is a generate_pb2.FinishReason (STOP or LENGTH);
    stop_token_id is the stop token when one matched."""

    finish_reason: int
    stop_token_id: int | None


@dataclass
class FlowTimings:
    """Worker-side timings of one request, ms (see generate.proto's Timings)."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0


@dataclass
class Flow:
    """Handle of an in-flight request, used by Abort to cancel its worker calls."""

    request_id: str
    calls: list = field(default_factory=list)
    aborted: bool = False
    timings: FlowTimings = field(default_factory=FlowTimings)

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()


async def _next(call, worker: WorkerHandle, flow: Flow):
    try:
        return await call.read()
    except grpc.aio.AioRpcError as e:
        if flow.aborted:
            raise asyncio.CancelledError from e
        raise from_rpc_error(e, f"{worker.info.role} worker {worker.address}") from e


async def _decode_stream(call, worker: WorkerHandle, flow: Flow) -> AsyncIterator[Tokens | WorkerFinish]:
    while True:
        msg = await _next(call, worker, flow)
        if msg is grpc.aio.EOF:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"decode worker {worker.address} ended the stream early")
        kind = msg.WhichOneof("response")
        if kind == "tokens":
            yield Tokens(list(msg.tokens.tokens), msg.tokens.num_cached_tokens)
        elif kind == "finished":
            f = msg.finished
            yield WorkerFinish(f.finish_reason, f.stop_token_id if f.HasField("stop_token_id") else None)
            return


async def run_colocated(router: Router, flow: Flow, prompt: list[int], sampling: generate_pb2.SamplingParams,
                        timeout_s: float) -> AsyncIterator[Tokens | WorkerFinish]:
    """One colocated worker computes the prompt and decodes it."""
    with router.lease(router.pick_decode(len(prompt) + sampling.max_tokens)) as worker:
        call = worker.decode.Decode(worker_pb2.DecodeRequest(
            request_id=flow.request_id, prompt_token_ids=prompt, sampling=sampling,
            kv_source=worker_pb2.KV_SOURCE_LOCAL), timeout=timeout_s)
        flow.calls.append(call)
        try:
            async for item in _decode_stream(call, worker, flow):
                yield item
        finally:
            call.cancel()


async def run_disaggregated(router: Router, flow: Flow, prompt: list[int], sampling: generate_pb2.SamplingParams,
                            arrival: float, timeout_s: float) -> AsyncIterator[Tokens | WorkerFinish]:
    """Reserve on a decode worker, prefill on a prefill worker (first token streamed at once, KV pushed to the
    reservation), then stream the decode worker's tokens. A failed transfer surfaces as its own error."""
    with router.lease(router.pick_decode(len(prompt) + sampling.max_tokens)) as decode:
        dcall = decode.decode.Decode(worker_pb2.DecodeRequest(
            request_id=flow.request_id, prompt_token_ids=prompt, sampling=sampling,
            kv_source=worker_pb2.KV_SOURCE_REMOTE), timeout=timeout_s)
        flow.calls.append(dcall)
        pcall = None
        watcher: asyncio.Task | None = None
        try:
            reserved = await _next(dcall, decode, flow)
            if reserved is grpc.aio.EOF or reserved.WhichOneof("response") != "reserved":
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"decode worker {decode.address} did not reserve")
            with router.lease(router.pick_prefill(prompt)) as prefill:  # a queue slot until the first token
                pcall = prefill.prefill.Prefill(worker_pb2.PrefillRequest(
                    request_id=flow.request_id, prompt_token_ids=prompt, sampling=sampling,
                    kv_address=decode.info.kv_address, arrival_time=arrival), timeout=timeout_s)
                flow.calls.append(pcall)
                first = await _next(pcall, prefill, flow)
            if first is grpc.aio.EOF or first.WhichOneof("response") != "first_token":
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"prefill worker {prefill.address} sent no first token")
            ft = first.first_token
            flow.timings.queue_ms, flow.timings.prefill_ms = ft.queue_ms, ft.prefill_ms
            yield Tokens([ft.token], ft.num_cached_tokens)
            if ft.finished:  # stop token or max_tokens == 1: no transfer; the reservation is cancelled below
                yield WorkerFinish(ft.finish_reason, ft.stop_token_id if ft.HasField("stop_token_id") else None)
                return
            transfer_error: list[RequestError] = []

            async def watch_transfer() -> None:
                try:
                    msg = await _next(pcall, prefill, flow)
                    if msg is not grpc.aio.EOF and msg.WhichOneof("response") == "transfer_done":
                        flow.timings.transfer_ms = msg.transfer_done.transfer_ms
                except RequestError as e:
                    transfer_error.append(e)
                    dcall.cancel()

            watcher = asyncio.create_task(watch_transfer())
            try:
                async for item in _decode_stream(dcall, decode, flow):
                    yield item
            except (RequestError, asyncio.CancelledError):
                if transfer_error:
                    raise transfer_error[0] from None
                raise
        finally:
            dcall.cancel()
            if pcall is not None:
                pcall.cancel()
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher


def now_ms() -> float:
    """A monotonic clock in ms, for durations measured at the coordinator."""
    return time.perf_counter() * 1e3
