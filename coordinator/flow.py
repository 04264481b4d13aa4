"""One request's path through the workers, as an async stream of events (`Tokens`, then one `WorkerFinish`).

Disaggregated: Decode(remote) reserves blocks -> Prefill computes the first token (streamed at once) and pushes
the KV -> the decode worker streams the rest. Colocated: one Decode(local) call does both phases.
Every exit path (finish, error, client cancel, Abort) cancels the worker calls, and the workers free the
request's blocks when their call ends; `Router.lease` gives back each worker's count.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from pdserve_server.coordinator import token_stream
from pdserve_server.coordinator.errors import RequestError, from_rpc_error, lost_worker
from pdserve_server.coordinator.record import RequestRecord
from pdserve_server.coordinator.router import Router, WorkerHandle
from pdserve_server.coordinator.scheduling import RequestScheduling, check_first_token_deadline, without_deadline
from pdserve_server.coordinator.token_stream import Subscription
from pdserve.v1 import generate_pb2, worker_pb2
from pdserve_server.server_common.tracing import tracer

# A request whose decode ended waits this long at most for its prefill worker's transfer report (sent as the KV
# transfer completes, so before the decode worker could have finished): the Final's Timings.transfer_ms and the
# access record carry it instead of 0. Bounded, so a slow prefill worker cannot hold a finished request.
TRANSFER_REPORT_WAIT_S = 1.0
# A Decode call whose tokens go on a token stream ends after its last tokens were written there: once its end is
# seen, its last tokens are waited for this long at most before the request fails as if the worker were lost.
CALL_END_WAIT_S = 10.0
# A request cut by the coordinator's drain (`Flow.shut_down`): no worker is at fault.
SHUTTING_DOWN = "the server is shutting down; retry the request (its drain timeout passed)"

log = logging.getLogger(__name__)


@dataclass
class Tokens:
    """Sampled tokens from a worker (worker_pb2.SampledToken list), all of one sample (`index`, 0 unless
    sampling.n > 1); num_cached_tokens is the prefix-cache hit, reported with the first tokens; sent_at: when the
    decode worker sent them (time.time() seconds; 0.0 when unknown: a prefill worker's first token)."""

    tokens: list
    num_cached_tokens: int = 0
    index: int = 0
    sent_at: float = 0.0


@dataclass
class WorkerFinish:
    """The worker stopped the request (with sampling.n > 1: its sample `index`; the stream goes on until every
    sample stopped): finish_reason is a generate_pb2.FinishReason (STOP or LENGTH); stop_token_id is the stop token
    when one matched; num_draft_tokens / num_accepted_tokens count the decode worker's speculative decoding."""

    finish_reason: int
    stop_token_id: int | None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    index: int = 0


@dataclass
class FlowTimings:
    """Worker-side timings of one request, ms (see generate.proto's Timings)."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0


@dataclass
class Flow:
    """Handle of an in-flight request: its worker calls (Abort cancels them), the workers it was routed to, and
    its record once it finished (`coordinator.record`)."""

    request_id: str
    caller: str = ""  # API key id or peer, for per-caller limits
    calls: list = field(default_factory=list)  # what `cancel` cuts: WorkerCalls, and waits for a token stream
    aborted: bool = False
    timings: FlowTimings = field(default_factory=FlowTimings)
    prefill_worker: str = ""
    decode_worker: str = ""
    deadline: float = float("inf")  # time.monotonic() by which the request must end (client's or ours)
    shutting_down: bool = False  # cut by the coordinator's drain: end with UNAVAILABLE, no migration
    # Prompt tokens waiting for their first token (the caller's queued-token limit counts them); 0 once it came.
    # Kept on the flow, so a request that ends in any way stops counting when it leaves the cluster's flows.
    queued_tokens: int = 0
    samples: int = 1  # sampling.n once known: the batch slots it takes (--max-in-flight counts slots)
    scheduling: RequestScheduling | None = None  # tenant, weight, priority, TTFT objective; None = defaults
    record: RequestRecord = field(init=False)

    def __post_init__(self) -> None:
        self.record = RequestRecord(self.request_id)

    @property
    def key(self) -> str:
        """The request's id scoped to its caller (`scoped_id`): its key in the cluster's flows and its id on the
        workers."""
        return scoped_id(self.caller, self.request_id)

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()

    def abandon(self, address: str, why: str) -> None:
        """Membership found the worker at `address` gone (it stopped answering health checks): cut this request's
        calls to it, each then failing as a lost worker's call (UNAVAILABLE, naming it), so the request migrates.
        A frozen worker (a stopped process, a hung host) holds its calls open otherwise, with their first token
        or next tokens, until HTTP/2 keepalive or the request's deadline ends them."""
        for call in self.calls:
            if isinstance(call, WorkerCall) and call.worker.address == address:
                call.abandon(why)

    def first_token(self) -> None:
        """The request's first token reached its client: its prompt stops counting as queued."""
        self.queued_tokens = 0

    def shut_down(self) -> None:
        """The coordinator's drain ran out of time: end the request with UNAVAILABLE (retry elsewhere)."""
        self.shutting_down = True
        self.cancel()


def scoped_id(caller: str, request_id: str) -> str:
    """A request id within its caller's scope: two callers may use the same id, and neither can reach (Abort,
    probe, block with ALREADY_EXISTS) the other's request."""
    return f"{caller}/{request_id}"


class WorkerCall:
    """One streaming call to a worker, read message by message through async iteration (so client interceptors,
    tracing's among them, see the stream end), with its errors turned into RequestErrors naming the worker at fault:
    this one, or `peer` (the other end of the call's KV transfer) when this one reports that the transfer broke."""

    def __init__(self, call, worker: WorkerHandle, flow: Flow, peer: str | None = None):
        self.call, self.worker, self.flow, self.peer = call, worker, flow, peer
        self._responses = call.__aiter__()
        self.lost: str | None = None  # why membership cut the call (`abandon`)
        flow.calls.append(self)

    def cancel(self) -> None:
        """Cancel the gRPC call (`Flow.cancel`: an Abort, a client gone, a drain); its reader's `next` raises."""
        self.call.cancel()

    def abandon(self, why: str) -> None:
        """Cut the call because its worker is gone (`Flow.abandon`): its reader gets a lost worker's UNAVAILABLE."""
        self.lost = why
        self.cancel()

    async def next(self):
        """The next message, or None when the worker ended the stream.

        Raises:
            RequestError: the worker's status (connection loss: UNAVAILABLE), naming the worker; UNAVAILABLE
                "shutting down" when the coordinator's drain cut the request (`Flow.shut_down`); UNAVAILABLE naming
                the worker when membership cut the call (`abandon`).
            asyncio.CancelledError: the request was aborted (Abort RPC).
        """
        try:
            return await self._responses.__anext__()
        except StopAsyncIteration:
            return None
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            if self.flow.shutting_down:  # no worker is at fault: nothing to migrate, nobody to mark down
                raise RequestError(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN) from e
            task = asyncio.current_task()
            if self.lost is not None and not self.flow.aborted and not (task is not None and task.cancelling()):
                raise lost_worker(self.worker.info.role, self.worker.address, self.lost) from e
            if isinstance(e, asyncio.CancelledError):  # our own cancel (Abort) or the client's
                raise
            if self.flow.aborted:
                raise asyncio.CancelledError from e
            raise from_rpc_error(e, self.worker.info.role, self.worker.address, self.peer) from e

    async def close(self) -> None:
        """Cancel the call (the worker frees what it holds) and close the response stream."""
        self.cancel()
        aclose = getattr(self._responses, "aclose", None)  # an interceptor's generator: let it finish its span
        if aclose is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await aclose()


def _events(tokens: worker_pb2.DecodeTokens, finished, sent_at: float) -> list[Tokens | WorkerFinish]:
    """One worker message's events: a Tokens per sample its tokens belong to (in the order they first appear),
    then a WorkerFinish per DecodeFinished."""
    by_sample: dict[int, list] = {}
    for t in tokens.tokens:
        by_sample.setdefault(t.index, []).append(t)
    out: list[Tokens | WorkerFinish] = [Tokens(ts, tokens.num_cached_tokens, index, sent_at)
                                        for index, ts in by_sample.items()]
    return out + [_finish(f) for f in finished]


def _finish(f: worker_pb2.DecodeFinished) -> WorkerFinish:
    return WorkerFinish(f.finish_reason, f.stop_token_id if f.HasField("stop_token_id") else None,
                        f.num_draft_tokens, f.num_accepted_tokens, f.index)


async def _decode_stream(call: WorkerCall, num_samples: int = 1,
                         sub: Subscription | None = None) -> AsyncIterator[Tokens | WorkerFinish]:
    """A Decode call's events until every one of its num_samples samples has finished, from the call's own stream
    or, with `sub`, from its worker's token stream (the call then ends after its last tokens were sent there)."""
    if sub is not None:
        async for item in _token_stream_events(call, sub, num_samples):
            yield item
        return
    left = num_samples
    while True:
        msg = await call.next()
        if msg is None:
            raise _ended_early(call.worker)
        kind = msg.WhichOneof("response")
        if kind == "tokens":
            for item in _events(msg.tokens, (), msg.tokens.sent_at):
                yield item
        elif kind == "finished":
            yield _finish(msg.finished)
            left -= 1
            if left == 0:
                return


async def _token_stream_events(call: WorkerCall, sub: Subscription,
                               num_samples: int) -> AsyncIterator[Tokens | WorkerFinish]:
    """`_decode_stream` over a token stream: the request's parts of it, while a task reads the call to its end
    (its error, or an Abort's cancellation, ends this too). Parts that queued while the previous events were
    being sent are merged: one Tokens per sample, stamped with the oldest part's send time."""
    watcher = asyncio.get_running_loop().create_task(token_stream.watch(call.next, sub))
    left, call_ended = num_samples, False
    try:
        while True:
            try:
                # The call ends only after its last tokens were written on the stream, which the same connection
                # delivers: waiting for them past its end is bounded, in case they never come.
                items = await sub.take(CALL_END_WAIT_S if call_ended else None)
            except TimeoutError:
                raise _ended_early(call.worker) from None
            merged = worker_pb2.DecodeTokens()
            finished: list = []
            sent_at, error = 0.0, None
            for item in items:
                if isinstance(item, BaseException):
                    error = item  # raised once the tokens before it are passed on
                    break
                if isinstance(item, token_stream.CallEnded):
                    call_ended = True
                    continue
                part, stamp = item
                merged.tokens.extend(part.tokens.tokens)
                merged.num_cached_tokens = max(merged.num_cached_tokens, part.tokens.num_cached_tokens)
                finished += part.finished
                sent_at = sent_at or stamp  # parts come in order: the first is the oldest
            for event in _events(merged, finished, sent_at):
                yield event
                if isinstance(event, WorkerFinish):
                    left -= 1
                    if left == 0:
                        return
            if error is not None:
                raise error
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


def _ended_early(worker: WorkerHandle) -> RequestError:
    return RequestError(grpc.StatusCode.UNAVAILABLE, f"decode worker {worker.address} ended the stream early",
                        worker=worker.address, public="the decode worker ended the stream early")


async def _subscribe(worker: WorkerHandle, flow: Flow, request_id: str, min_requests: int | None,
                     timeout_s: float) -> Subscription | None:
    """request_id's subscription to the worker's token stream when the worker serves one and this coordinator has
    at least min_requests other requests there (None: never), else None (the tokens come on the Decode call's own
    stream). Waiting for the stream to open is one of the flow's calls (an Abort or the coordinator's drain cuts
    it, as they cut a worker call) and is bounded by timeout_s.

    Raises:
        RequestError: the stream could not be opened (the worker named), or did not open within timeout_s
            (DEADLINE_EXCEEDED); UNAVAILABLE "shutting down" when the coordinator's drain cut it.
        asyncio.CancelledError: an Abort.
    """
    # `in_flight` counts this request too (`Router.lease`)
    if min_requests is None or worker.info is None or not worker.info.token_streams \
            or worker.in_flight - 1 < min_requests:
        return None
    if worker.token_stream is None:
        worker.token_stream = token_stream.TokenStream(worker)
    waiting = asyncio.ensure_future(worker.token_stream.subscribe(request_id))
    flow.calls.append(waiting)
    try:
        return await asyncio.wait_for(waiting, timeout_s)
    except TimeoutError:
        raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{worker.info.role} worker {worker.address}: its "
                           "token stream did not open within the request's deadline", worker=worker.address,
                           public="the worker did not answer within the request's deadline") from None
    except asyncio.CancelledError:
        if flow.shutting_down:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN) from None
        raise
    finally:
        flow.calls.remove(waiting)


def _pick_decode(router: Router, num_tokens: int, prompt: list[int] | None = None,
                 cache_salt: str = "") -> WorkerHandle:
    with tracer().start_as_current_span("route decode") as span:
        worker = router.pick_decode(num_tokens, prompt, cache_salt)
        span.set_attribute("pdserve.decode_worker", worker.address)
        return worker


def _pick_prefill(router: Router, prompt: list[int], cache_salt: str = "") -> WorkerHandle:
    with tracer().start_as_current_span("route prefill") as span:
        worker = router.pick_prefill(prompt, cache_salt)
        span.set_attribute("pdserve.prefill_worker", worker.address)
        return worker


@contextlib.asynccontextmanager
async def _renewing_lease(decode: WorkerHandle, request_id: str, lease_ms: int) -> AsyncIterator[None]:
    """Keep the decode worker's reservation alive while the prefill is queued or running (until its first token,
    after which the KV is on its way): renew at a third of the lease, so two lost renewals still leave time.
    A failed renewal ends the renewing, not the request: the Decode stream reports why the reservation went."""
    async def renew() -> None:
        period_s = lease_ms / 3e3
        while True:
            await asyncio.sleep(period_s)
            try:
                await decode.decode.RenewLease(worker_pb2.RenewLeaseRequest(request_id=request_id), timeout=period_s)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    return
                log.debug("renewing %s's lease on %s failed: %s", request_id, decode.address, e.code().name)

    task = asyncio.create_task(renew()) if lease_ms else None
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _check_due(worker: WorkerHandle, num_tokens: int, due: tuple[float, str] | None) -> None:
    """Refuse (DEADLINE_EXCEEDED) before calling `worker` when its predicted first-token wait for a prompt of
    num_tokens passes `due` (`scheduling.first_token_due`'s (monotonic time, what sets it); None: no check)."""
    if due is not None:
        name = f"{worker.info.role} worker {worker.address}" if worker.info is not None else worker.address
        check_first_token_deadline(name, worker.prefill_queue.predicted_wait_s(num_tokens), *due)


async def run_colocated(router: Router, flow: Flow, request_id: str, prompt: list[int], generated: list[int],
                        sampling: generate_pb2.SamplingParams, timeout_s: float,
                        scheduling: worker_pb2.SchedulingHints | None = None,
                        due: tuple[float, str] | None = None,
                        token_streams: int | None = None) -> AsyncIterator[Tokens | WorkerFinish]:
    """One worker computes the prompt (and `generated`, the tokens a lost worker had sent) and decodes: a colocated
    worker, or a decode worker prefilling locally (`Router.local_prefill`). scheduling: the engine's hints; due:
    when the first token must come (refused before the call when the worker's predicted wait passes it);
    token_streams: read the tokens from the worker's token stream where it serves one and this coordinator has at
    least this many other requests there (None: never; `_subscribe`)."""
    context = prompt + generated
    salt = scheduling.cache_salt if scheduling is not None else ""
    with router.lease(_pick_decode(router, len(prompt) + sampling.max_tokens, context, salt), len(context)) as worker:
        _check_due(worker, len(context), due)  # before the prompt joins its queue: the wait ahead of it
        with worker.prefill_queue.track(len(context)) as first_token:
            flow.prefill_worker = flow.decode_worker = worker.address
            sub = await _subscribe(worker, flow, request_id, token_streams, timeout_s)
            call = WorkerCall(worker.decode.Decode(worker_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling=sampling, output_token_ids=generated,
                kv_source=worker_pb2.KV_SOURCE_LOCAL, scheduling=scheduling,
                token_stream_id=sub.stream_id if sub is not None else ""), timeout=timeout_s), worker, flow)
            try:
                async for item in _decode_stream(call, sampling.n or 1, sub):
                    first_token()  # the prefill is done: a rate sample (once)
                    yield item
            finally:
                if sub is not None:
                    sub.close()
                await call.close()


async def run_disaggregated(router: Router, flow: Flow, request_id: str, prompt: list[int], generated: list[int],
                            sampling: generate_pb2.SamplingParams, arrival: float, timeout_s: float,
                            scheduling: worker_pb2.SchedulingHints | None = None,
                            due: tuple[float, str] | None = None,
                            token_streams: int | None = None) -> AsyncIterator[Tokens | WorkerFinish]:
    """Reserve on a decode worker, prefill on a prefill worker (first token streamed at once, KV pushed to the
    reservation), then stream the decode worker's tokens. A failed transfer surfaces as its own error.
    `generated`: tokens a lost worker had sent (a migration); both workers resume after them. scheduling: the
    engines' hints (the decode worker's without the TTFT deadline: the prefill worker gives the first token); due:
    when the first token must come (refused before either call when the prefill worker's predicted wait passes it);
    token_streams: read the decode worker's tokens from its token stream, as in `run_colocated`.
    """
    context = prompt + generated  # what the prefill worker computes (and then holds in its prefix cache)
    salt = scheduling.cache_salt if scheduling is not None else ""
    with router.lease(_pick_decode(router, len(prompt) + sampling.max_tokens)) as decode:
        # The prefill worker is chosen before the reservation's round trip, so the prompt is in its queue
        # (`lease`, `prefill_queue`) from the moment it is routed: a burst of requests sees the queue it builds.
        # Chosen before the Decode call starts, too: a request that cannot meet its deadline calls no worker.
        prefill_choice = _pick_prefill(router, context, salt)
        _check_due(prefill_choice, len(context), due)
        flow.decode_worker = decode.address
        decode_scheduling = without_deadline(scheduling) if scheduling is not None else None
        sub = await _subscribe(decode, flow, request_id, token_streams, timeout_s)
        dcall = WorkerCall(decode.decode.Decode(worker_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling, output_token_ids=generated,
            kv_source=worker_pb2.KV_SOURCE_REMOTE, scheduling=decode_scheduling,
            token_stream_id=sub.stream_id if sub is not None else ""), timeout=timeout_s), decode, flow,
            peer=prefill_choice.address)
        pcall: WorkerCall | None = None
        watcher: asyncio.Task | None = None
        try:
            with (router.lease(prefill_choice, len(context)) as prefill,  # queued until first token
                  prefill.prefill_queue.track(len(context)) as first_token):
                flow.prefill_worker = prefill.address
                reserved = await dcall.next()
                if reserved is None or reserved.WhichOneof("response") != "reserved":
                    raise RequestError(grpc.StatusCode.UNAVAILABLE, f"decode worker {decode.address} did not "
                                                                    "reserve", worker=decode.address,
                                       public="the decode worker did not reserve KV blocks")
                log.debug("request %s: KV blocks reserved on %s, prefill on %s", request_id, decode.address,
                          prefill.address)
                pcall = WorkerCall(prefill.prefill.Prefill(worker_pb2.PrefillRequest(
                    request_id=request_id, prompt_token_ids=prompt, sampling=sampling, output_token_ids=generated,
                    kv_address=decode.info.kv_address, arrival_time=arrival,
                    kv_skip_blocks=reserved.reserved.num_cached_blocks, scheduling=scheduling), timeout=timeout_s),
                    prefill, flow, peer=decode.address)
                async with _renewing_lease(decode, request_id, reserved.reserved.lease_ms):
                    first = await pcall.next()
                if first is not None and first.WhichOneof("response") == "first_token":
                    first_token()
            if first is None or first.WhichOneof("response") != "first_token":
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"prefill worker {prefill.address} sent no first token",
                                   worker=prefill.address, public="the prefill worker sent no first token")
            ft = first.first_token
            flow.timings.queue_ms, flow.timings.prefill_ms = ft.queue_ms, ft.prefill_ms
            yield Tokens([ft.token], ft.num_cached_tokens)
            if ft.finished:  # stop token or max_tokens == 1: no transfer; the reservation is cancelled below
                yield WorkerFinish(ft.finish_reason, ft.stop_token_id if ft.HasField("stop_token_id") else None)
                return
            transfer_error: list[RequestError] = []

            async def watch_transfer() -> None:
                try:
                    while (msg := await pcall.next()) is not None:  # to the end: the prefill call closes there
                        if msg.WhichOneof("response") == "transfer_done":
                            flow.timings.transfer_ms = msg.transfer_done.transfer_ms
                except RequestError as e:
                    transfer_error.append(e)
                    dcall.call.cancel()

            watcher = asyncio.create_task(watch_transfer())
            try:
                recorded = False
                async for item in _decode_stream(dcall, 1, sub):
                    if not recorded:  # the KV arrived and joined the batch: its blocks enter that prefix cache
                        router.record_prefix(decode, context, received=True, cache_salt=salt)
                        recorded = True
                    if isinstance(item, WorkerFinish) and not watcher.done():
                        await asyncio.wait({watcher}, timeout=TRANSFER_REPORT_WAIT_S)
                    yield item
            except (RequestError, asyncio.CancelledError):
                if transfer_error:
                    raise transfer_error[0] from None
                raise
        finally:
            if sub is not None:
                sub.close()
            dcall.call.cancel()
            if pcall is not None:
                pcall.call.cancel()
            if watcher is not None:  # before closing the streams: it may be reading the prefill's
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            await dcall.close()
            if pcall is not None:
                await pcall.close()


def now_ms() -> float:
    """A monotonic clock in ms, for durations measured at the coordinator."""
    return time.perf_counter() * 1e3
