"""Token streams (worker.proto's StreamTokens): a decode worker sends every request's tokens of one engine step in one
message to the coordinator that named the stream; the coordinator relays the same tokens as over per-call streams."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_server.decode_worker.token_streams import (MAX_PENDING_TOKENS, TOKEN_STREAM_WINDOW, Draining,
                                                       TokenStreamClosed, TokenStreams)

# A mock colocated worker (the real scheduler, step times of a GPU profile, tokens a chain derived from the prompt):
# streams are deterministic and cheap, so what these tests count is the protocol.
MOCK = ["--mock-engine", "smollm2-135m-h200", "--mock-speedup", "20", "--kv-tokens", "4096", "--max-model-len", "512"]


def entry(rid: str, *tokens: int, finished: bool = False) -> worker_pb2.RequestTokens:
    e = worker_pb2.RequestTokens(request_id=rid, tokens=worker_pb2.DecodeTokens(
        tokens=[worker_pb2.SampledToken(token_id=t) for t in tokens]))
    if finished:
        e.finished.append(worker_pb2.DecodeFinished(finish_reason=1))
    return e


# ---- the outbox, alone --------------------------------------------------------------------------------------------

async def settle() -> None:
    """Let every task that is ready run (a shielded wait takes a few loop turns to wake)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_entries_added_together_leave_in_one_message_and_a_last_entry_waits_for_its_write():
    async def main():
        streams = TokenStreams()
        outbox = streams.open("s")
        batches = outbox.batches()
        assert len((await anext(batches)).requests) == 0  # the opening message
        # Three requests' tokens of one step, the third its last (waits for the write).
        await outbox.put(entry("a", 1))
        await outbox.put(entry("b", 2, 3))
        last = asyncio.ensure_future(outbox.put(entry("c", 4, finished=True), wait=True))
        await settle()
        assert not last.done()
        msg = await anext(batches)
        assert [r.request_id for r in msg.requests] == ["a", "b", "c"] and msg.sent_at > 0
        assert not last.done()  # gRPC has the message, but has not come back for the next one yet
        nxt = asyncio.ensure_future(anext(batches))  # ... which is when the write is done
        await asyncio.wait_for(last, 5)
        await outbox.put(entry("a", 5))
        assert [r.request_id for r in (await nxt).requests] == ["a"]

    asyncio.run(main())


def test_past_the_window_entries_gather_until_the_caller_takes_a_message():
    async def main():
        outbox = TokenStreams().open("s")
        batches = outbox.batches()
        await anext(batches)
        sent = []
        for step in range(TOKEN_STREAM_WINDOW):  # the window's messages leave as their steps' tokens come
            await outbox.put(entry("a", step))
            sent.append(await asyncio.wait_for(anext(batches), 5))
        gathering = asyncio.ensure_future(anext(batches))
        more = range(TOKEN_STREAM_WINDOW, TOKEN_STREAM_WINDOW + 4)
        for step in more:  # four more steps while the caller has taken none
            await outbox.put(entry("a", step))
            await settle()
        assert not gathering.done()
        outbox.taken(1)
        msg = await asyncio.wait_for(gathering, 5)
        assert [[t.token_id for t in r.tokens.tokens] for r in msg.requests] == [list(more)]  # one part, merged

    asyncio.run(main())


def test_a_closed_stream_fails_its_waiting_and_later_entries():
    async def main():
        streams = TokenStreams()
        outbox = streams.open("s")
        waiting = asyncio.ensure_future(outbox.put(entry("a", 1, finished=True), wait=True))
        await settle()
        streams.close(outbox)
        with pytest.raises(TokenStreamClosed):
            await waiting
        with pytest.raises(TokenStreamClosed):
            await outbox.put(entry("b", 2))
        with pytest.raises(LookupError, match="no token stream 's' is open"):
            streams.use("s")

    asyncio.run(main())


def test_back_pressure_holds_the_adders_once_too_many_tokens_wait():
    async def main():
        outbox = TokenStreams().open("s")
        batches = outbox.batches()
        await anext(batches)
        await outbox.put(entry("a", *range(MAX_PENDING_TOKENS - 1)))  # under the bound: returns at once
        held = asyncio.ensure_future(outbox.put(entry("b", 1)))  # at the bound: waits for the write
        await settle()
        assert not held.done()
        await anext(batches)
        nxt = asyncio.ensure_future(anext(batches))
        await asyncio.wait_for(held, 5)
        nxt.cancel()

    asyncio.run(main())


def test_ids_are_checked_and_a_draining_stream_ends_when_its_last_user_leaves():
    async def main():
        streams = TokenStreams()
        with pytest.raises(ValueError, match="empty"):
            streams.open("")
        outbox = streams.open("s")
        with pytest.raises(ValueError, match="already open"):
            streams.open("s")
        batches = outbox.batches()
        await anext(batches)
        assert streams.use("s") is outbox and outbox.users == 1
        streams.drain()
        await outbox.put(entry("a", 1, finished=True))
        assert [r.request_id for r in (await anext(batches)).requests] == ["a"]  # a user left: still open
        ended = asyncio.ensure_future(anext(batches))
        await settle()
        assert not ended.done()
        outbox.release()
        with pytest.raises(StopAsyncIteration):
            await ended
        streams.close(outbox)
        with pytest.raises(Draining, match="draining"):  # the Decode call answers UNAVAILABLE: go elsewhere
            streams.use("s")

    asyncio.run(main())


# ---- a real worker ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mock_cluster(tiny_model_dir, launch_module):
    """A coordinator over one mock colocated worker at the profile's own speed (a step every few ms: requests
    started together share steps), every request's tokens on its token stream."""
    return launch_module(tiny_model_dir, colocated=True,
                         worker_args=MOCK[:2] + ["--mock-speedup", "1"] + MOCK[4:] + ["--metrics-port", "0"],
                         coordinator_args=["--token-streams-min-requests", "0"])  # every request on the stream


async def open_stream(stub, md, stream_id: str):
    """A token stream named stream_id, open (its empty first message read)."""
    stream = stub.StreamTokens(metadata=md)
    await stream.write(worker_pb2.TokenStreamRequest(stream_id=stream_id))
    assert len((await stream.read()).requests) == 0  # open: Decode calls may name it now
    return stream


def _decode(stub, md, rid: str, prompt: list[int], max_tokens: int, stream_id: str):
    from pdserve.v1 import generate_pb2

    return stub.Decode(worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, kv_source=worker_pb2.KV_SOURCE_LOCAL, token_stream_id=stream_id,
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0)), metadata=md, timeout=60)


def _worker(cluster):
    (address,) = cluster.worker_addresses.values()
    return address, cluster.worker_metadata


def test_a_worker_sends_its_requests_tokens_on_one_stream_a_message_per_step(mock_cluster):
    """Four Decode calls naming one token stream: each call sends only its reservation and ends OK once its last
    tokens are on the stream; the stream carries each request's whole chain, several requests a message."""
    from helpers import assert_idle
    from test_mock_engine import chain

    address, md = _worker(mock_cluster)
    prompts = {f"r{i}": list(range(100 + 7 * i, 130 + 7 * i)) for i in range(4)}

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.DecodeStub(channel)
            stream = await open_stream(stub, md, "coord-1")
            calls = {rid: _decode(stub, md, rid, p, 60, "coord-1") for rid, p in prompts.items()}
            tokens = {rid: [] for rid in prompts}
            finished, shared, messages = set(), 0, 0
            while len(finished) < len(prompts):
                msg = await stream.read()
                messages += 1
                await stream.write(worker_pb2.TokenStreamRequest(taken=messages))
                shared += len({r.request_id for r in msg.requests}) > 1
                for part in msg.requests:
                    tokens[part.request_id] += [t.token_id for t in part.tokens.tokens]
                    finished |= {part.request_id for f in part.finished}
            for rid, call in calls.items():
                responses = [r async for r in call]
                assert [r.WhichOneof("response") for r in responses] == ["reserved"]
                assert await call.code() == grpc.StatusCode.OK
            stream.cancel()
            return tokens, shared, messages

    tokens, shared, messages = asyncio.run(main())
    assert tokens == {rid: chain(p, 60) for rid, p in prompts.items()}
    # 240 tokens from steps that each carried several of the four requests: far fewer messages than tokens
    assert shared >= 1 and messages < 240, (shared, messages)
    assert_idle(mock_cluster)


def test_a_caller_that_takes_nothing_gets_the_steps_since_in_one_message(mock_cluster):
    """The window: with TOKEN_STREAM_WINDOW messages untaken, the worker sends nothing more; the tokens of the ten
    or more engine steps run meanwhile leave as one message once the caller says it took one."""
    address, md = _worker(mock_cluster)

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub, worker = worker_pb2_grpc.DecodeStub(channel), worker_pb2_grpc.WorkerStub(channel)

            async def steps() -> int:
                return (await worker.GetStats(worker_pb2.WorkerStatsRequest(), metadata=md)).num_steps

            stream = await open_stream(stub, md, "slow")
            call = _decode(stub, md, "s", list(range(300, 340)), 200, "slow")
            window = [await stream.read() for _ in range(TOKEN_STREAM_WINDOW)]
            start, deadline = await steps(), time.monotonic() + 120
            while await steps() < start + 10 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await stream.write(worker_pb2.TokenStreamRequest(taken=1))
            msg = await stream.read()
            call.cancel()
            stream.cancel()
            return window, msg

    window, msg = asyncio.run(main())
    assert all([r.request_id for r in m.requests] == ["s"] for m in window)
    assert [r.request_id for r in msg.requests] == ["s"] and len(msg.requests[0].tokens.tokens) >= 10


def test_token_stream_refusals_and_a_closed_stream_ends_its_calls(mock_cluster):
    """An unknown stream id: FAILED_PRECONDITION before anything is held; a second stream under an open id:
    ALREADY_EXISTS; an empty id: INVALID_ARGUMENT. A stream cancelled by its caller ends the Decode calls still
    sending on it with UNAVAILABLE, and their blocks are freed."""
    from helpers import assert_idle

    address, md = _worker(mock_cluster)

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.DecodeStub(channel)
            call = _decode(stub, md, "x", [5, 6, 7], 4, "nobody")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                _ = [r async for r in call]
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "StreamTokens" in e.value.details()
            first = await open_stream(stub, md, "dup")
            for stream_id, code in (("", grpc.StatusCode.INVALID_ARGUMENT), ("dup", grpc.StatusCode.ALREADY_EXISTS),
                                    (None, grpc.StatusCode.INVALID_ARGUMENT)):  # None: the caller names nothing
                again = stub.StreamTokens(metadata=md)
                if stream_id is None:
                    await again.done_writing()
                else:
                    await again.write(worker_pb2.TokenStreamRequest(stream_id=stream_id))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await again.read()
                assert e.value.code() == code, e.value.details()
            first.cancel()
            stream = await open_stream(stub, md, "short")
            long = _decode(stub, md, "long", list(range(50, 90)), 400, "short")
            assert (await long.read()).WhichOneof("response") == "reserved"
            while not (await stream.read()).requests:  # its tokens are flowing
                pass
            stream.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await long.read()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "token stream" in e.value.details()

    asyncio.run(main())
    assert_idle(mock_cluster)


def test_the_coordinator_relays_the_same_tokens_over_token_streams(mock_cluster):
    """Through the coordinator (token streams on by default): concurrent requests get the derived chains, and their
    tokens went on the worker's token stream (its message counters moved by fewer messages than tokens)."""
    from helpers import greedy, scrape, total
    from test_mock_engine import chain

    from pdserve import Client

    prompts = [list(range(200 + 11 * i, 240 + 11 * i)) for i in range(6)]
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        with Client(mock_cluster.address) as client:
            results[i] = [t for ch in client.generate(prompts[i], greedy(40)) for t in ch.token_ids]

    url = mock_cluster.metrics_urls["colocated-0"]
    before = scrape(url)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {i: chain(p, 40) for i, p in enumerate(prompts)}
    after = scrape(url)
    messages, parts = (total(after, n) - total(before, n) for n in ("pdserve:token_stream_messages_total",
                                                                     "pdserve:token_stream_request_parts_total"))
    assert 0 < messages < 6 * 40 and parts >= 6, (messages, parts)
