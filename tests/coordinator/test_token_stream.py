"""The coordinator's end of a worker's token stream (`coordinator.token_stream`), over a scripted stream: parts go to
their requests, one opening serves concurrent requests, and a stream that breaks ends every request on it with the
worker's UNAVAILABLE (so they migrate) and is reopened by the next request."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.v1 import worker_pb2
from pdserve_server.coordinator.errors import RequestError
from pdserve_server.coordinator.router import WorkerHandle
from pdserve_server.coordinator.token_stream import CallEnded, TokenStream, watch


class ScriptedCall:
    """A StreamTokens call whose messages the test feeds (`feed`), or breaks (`fail`)."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.written: list[worker_pb2.TokenStreamRequest] = []  # what the coordinator sent: the name, then `taken`

    async def write(self, request) -> None:
        self.written.append(request)

    def feed(self, *parts: tuple[str, list[int]]) -> None:
        self.queue.put_nowait(worker_pb2.TokenStreamBatch(sent_at=1.0, requests=[
            worker_pb2.RequestTokens(request_id=rid, tokens=worker_pb2.DecodeTokens(
                tokens=[worker_pb2.SampledToken(token_id=t) for t in ids])) for rid, ids in parts]))

    def fail(self) -> None:
        self.queue.put_nowait(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                                   grpc.aio.Metadata(), "Socket closed"))

    async def read(self):
        item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedDecodeStub:
    def __init__(self):
        self.calls: list[tuple[str, ScriptedCall]] = []

    def StreamTokens(self):
        call = ScriptedCall()
        call.feed()  # the opening (empty) message
        self.calls.append(call)
        return call


async def take_one(sub):
    """The subscription's next event (these tests queue one at a time)."""
    (item,) = await sub.take(5)
    if isinstance(item, BaseException):
        raise item
    return item


def ids(item) -> list[int]:
    return [t.token_id for t in item[0].tokens.tokens]


def test_the_worker_is_told_what_was_taken_every_half_window():
    async def main():
        w = worker()
        w.decode.StreamTokens = lambda: opening_with_window(w, 4)
        sub = await TokenStream(w).subscribe("a")
        call = w.decode.calls[0]
        for i in range(5):
            call.feed(("a", [i]))
            await sub.take(5)
            for _ in range(5):
                await asyncio.sleep(0)
        assert [r.taken for r in call.written[1:]] == [2, 4]  # every 2 of a window of 4; the 5th not yet

    asyncio.run(main())


def opening_with_window(w, window: int) -> ScriptedCall:
    call = ScriptedCall()
    call.queue.put_nowait(worker_pb2.TokenStreamBatch(window=window))
    w.decode.calls.append(call)
    return call


def worker() -> WorkerHandle:
    stub = ScriptedDecodeStub()
    return WorkerHandle("10.0.0.9:7000", None, None, None, stub,
                        info=worker_pb2.WorkerInfo(role="colocated", token_streams=True))


def test_parts_reach_their_requests_and_one_opening_serves_concurrent_requests():
    async def main():
        w = worker()
        stream = TokenStream(w)
        a, b = await asyncio.gather(stream.subscribe("a"), stream.subscribe("b"))
        assert len(w.decode.calls) == 1 and a.stream_id == b.stream_id == w.decode.calls[0].written[0].stream_id
        call = w.decode.calls[0]
        call.feed(("a", [1, 2]), ("b", [3]), ("gone", [4]))  # a part for a request that left is dropped
        call.feed(("b", [5]))
        part, sent_at = await take_one(a)
        assert [t.token_id for t in part.tokens.tokens] == [1, 2] and sent_at == 1.0
        # b's two parts queued while it was not reading: taken together, in order
        assert [ids(item) for item in await b.take(5)] == [[3], [5]]
        a.close()
        call.feed(("a", [9]))
        call.feed(("b", [6]))
        assert ids(await take_one(b)) == [6]
        with pytest.raises(TimeoutError):
            await a.take(0.05)  # left: nothing more is handed to it
        # the worker was told of every message taken (4 after the opening), the last count being the total
        assert call.written[-1].taken == 4 and [r.taken for r in call.written[1:]] == sorted(
            r.taken for r in call.written[1:])

    asyncio.run(main())


def test_a_broken_stream_fails_its_requests_as_lost_and_the_next_request_reopens():
    async def main():
        w = worker()
        stream = TokenStream(w)
        a = await stream.subscribe("a")
        first = w.decode.calls[0]
        first.fail()
        with pytest.raises(RequestError) as e:
            await take_one(a)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.worker == "10.0.0.9:7000"
        assert first.cancelled
        b = await stream.subscribe("b")
        assert len(w.decode.calls) == 2 and b.stream_id != a.stream_id
        w.decode.calls[1].feed(("b", [7]))
        assert ids(await take_one(b)) == [7]

    asyncio.run(main())


def test_a_stream_that_will_not_open_is_the_workers_error():
    class Refusing(ScriptedDecodeStub):
        def StreamTokens(self):
            call = ScriptedCall()
            call.fail()
            return call

    async def main():
        w = worker()
        w.decode = Refusing()
        with pytest.raises(RequestError) as e:
            await TokenStream(w).subscribe("a")
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.worker == "10.0.0.9:7000"

    asyncio.run(main())


def test_watch_hands_on_the_decode_calls_end():
    async def main():
        w = worker()
        stream = TokenStream(w)
        sub = await stream.subscribe("a")
        messages = iter([worker_pb2.DecodeResponse(reserved=worker_pb2.DecodeReserved()), None])

        async def ok():
            return next(messages)

        await watch(ok, sub)
        assert isinstance(await take_one(sub), CallEnded)

        async def failed():
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room", worker="w")

        await watch(failed, sub)
        with pytest.raises(RequestError, match="no room"):
            await take_one(sub)

        async def aborted():
            raise asyncio.CancelledError  # the call was cancelled (an Abort), not the watch

        await watch(aborted, sub)
        with pytest.raises(asyncio.CancelledError):
            await take_one(sub)

    asyncio.run(main())


def test_parts_that_queued_meanwhile_leave_as_one_event_and_an_error_after_them():
    """A request whose previous chunk was still being sent gets the parts that queued meanwhile as one Tokens
    (one chunk to its client), stamped with the oldest part's send time; an error that queued behind tokens is
    raised only after they are passed on."""
    from pdserve_server.coordinator.flow import Tokens, _token_stream_events

    async def settle():
        for _ in range(5):
            await asyncio.sleep(0)

    class PendingCall:  # the request's Decode call: reserved, then open until the test ends
        def __init__(self, w):
            self.worker = w

        async def next(self):
            await asyncio.Event().wait()

    async def main():
        w = worker()
        sub = await TokenStream(w).subscribe("a")
        stream = w.decode.calls[0]
        events = _token_stream_events(PendingCall(w), sub, 1)
        stream.feed(("a", [1]))
        stream.feed(("a", [2, 3]))
        await settle()
        first = await anext(events)
        assert isinstance(first, Tokens) and [t.token_id for t in first.tokens] == [1, 2, 3]
        assert first.sent_at == 1.0
        stream.feed(("a", [4]))
        stream.fail()
        await settle()
        assert [t.token_id for t in (await anext(events)).tokens] == [4]
        with pytest.raises(RequestError) as e:
            await anext(events)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_a_request_joins_the_token_stream_once_the_worker_has_enough_of_ours():
    """`--token-streams-min-requests`: with fewer other requests of this coordinator on the worker, a request reads
    its own call (a message per request costs less there); from that many on, the worker's token stream."""
    from pdserve_server.coordinator.flow import Flow, _subscribe

    async def main():
        w = worker()
        w.in_flight = 4  # this request and 3 others (`Router.lease` counts it)
        assert await _subscribe(w, Flow("r"), "r", 4, 5.0) is None
        assert await _subscribe(w, Flow("r"), "r", None, 5.0) is None  # --no-token-streams
        w.in_flight = 5
        sub = await _subscribe(w, Flow("r"), "r", 4, 5.0)
        assert sub is not None and sub.stream_id == w.decode.calls[0].written[0].stream_id
        w.in_flight = 1
        assert await _subscribe(w, Flow("q"), "q", 0, 5.0) is not None  # 0: every request

    asyncio.run(main())
