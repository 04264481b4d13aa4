"""The coordinator's end of a decode worker's token stream (worker.proto's StreamTokens): one long-lived stream per
worker, opened on first use, carrying the tokens of every request this coordinator has there, a message per engine
step for all of them, where a Decode call's own stream carries a message per request per step.

One reader task per stream hands each request's part (`RequestTokens`) to that request's `Subscription`; the
request's Decode call still carries its reservation, its error status and its cancellation (which frees its blocks
on the worker). A stream that fails ends every subscription on it with the worker's UNAVAILABLE (so its requests
migrate, as when their own calls fail); the next request opens a new one. The coordinator says how many messages
it has taken every half of the worker's window (`TokenStreamBatch.window`), so a worker whose coordinator falls
behind merges its steps into fewer messages instead of queueing them (decode_worker/token_streams.py). Which
requests use the stream: `flow._subscribe` (`--token-streams-min-requests`).
"""
from __future__ import annotations

import asyncio
import collections
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from pdserve.v1 import worker_pb2
from pdserve_server.coordinator.errors import RequestError, from_rpc_error

if TYPE_CHECKING:
    from pdserve_server.coordinator.router import WorkerHandle


@dataclass
class CallEnded:
    """A subscription's Decode call ended OK: the worker had written the request's last tokens on the stream."""


@dataclass
class _Open:
    """One opened stream: its id (what Decode calls name), the call, its reader and the requests reading it."""

    stream_id: str
    call: grpc.aio.StreamStreamCall
    subscriptions: dict[str, Subscription] = field(default_factory=dict)
    reader: asyncio.Task | None = None
    ack_every: int = 1  # say `taken` this often (half the worker's window, TokenStreamBatch.window)
    taken: int = 0  # messages handed to their subscriptions (after the opening one): what the worker is told
    told: int = 0  # the last `taken` written
    acking: asyncio.Event = field(default_factory=asyncio.Event)  # `taken` is due


class Subscription:
    """One request's events from its worker's token stream: (RequestTokens, sent_at seconds) pairs, then
    `CallEnded` from its Decode call (`watch`), or an error (RequestError, asyncio.CancelledError). Leave with
    `close`."""

    def __init__(self, stream: _Open, request_id: str):
        self.stream_id, self.request_id = stream.stream_id, request_id
        self._stream = stream
        self._items: collections.deque = collections.deque()
        self._ready = asyncio.Event()

    def put(self, item) -> None:
        self._items.append(item)
        self._ready.set()

    async def take(self, timeout_s: float | None = None) -> list:
        """Every event queued now, in order, once there is one: a request whose client reads slower than its worker
        steps gets its waiting tokens in one go (one chunk to its client instead of one per step, as vLLM's output
        collector merges a lagging request's outputs).

        Raises:
            TimeoutError: nothing came within timeout_s.
        """
        if not self._items:
            self._ready.clear()
            await (self._ready.wait() if timeout_s is None else asyncio.wait_for(self._ready.wait(), timeout_s))
        items = list(self._items)
        self._items.clear()
        return items

    def close(self) -> None:
        if self._stream.subscriptions.get(self.request_id) is self:
            del self._stream.subscriptions[self.request_id]


class TokenStream:
    """A decode (or colocated) worker's token stream for this coordinator (`WorkerHandle.token_stream`)."""

    def __init__(self, worker: WorkerHandle):
        self.worker = worker
        self._open: _Open | None = None
        self._opening: asyncio.Task | None = None

    async def subscribe(self, request_id: str) -> Subscription:
        """A subscription for request_id's tokens (before its Decode call starts: tokens may come before the call's
        first message is read), opening the stream first when none is open.

        Raises:
            RequestError: the stream could not be opened (the worker's status, the worker named).
        """
        if self._open is None:
            if self._opening is None:
                self._opening = asyncio.get_running_loop().create_task(self._start())
            opening = self._opening
            try:
                await asyncio.shield(opening)  # one opening serves every request waiting for it
            finally:
                if opening.done() and self._opening is opening:
                    self._opening = None
        assert self._open is not None
        sub = Subscription(self._open, request_id)
        self._open.subscriptions[request_id] = sub
        return sub

    async def _start(self) -> None:
        """Open the stream and start its reader once the worker's first (empty) message says it is open.

        Raises:
            RequestError: the worker's status.
        """
        stream_id = uuid.uuid4().hex
        call = self.worker.decode.StreamTokens()
        try:
            await call.write(worker_pb2.TokenStreamRequest(stream_id=stream_id))
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, self.worker_role, self.worker.address) from None
        opened = self._open = _Open(stream_id, call, ack_every=max(1, first.window // 2))
        opened.reader = asyncio.get_running_loop().create_task(self._read(opened))

    @staticmethod
    async def _ack(opened: _Open) -> None:
        """Tell the worker how many messages were taken, every `ack_every`: one write at a time, so while one is
        under way the next counts every message taken meanwhile."""
        try:
            while True:
                await opened.acking.wait()
                opened.acking.clear()
                opened.told = opened.taken
                await opened.call.write(worker_pb2.TokenStreamRequest(taken=opened.told))
        except grpc.aio.AioRpcError:
            pass  # the stream failed: its reader reports it

    @property
    def worker_role(self) -> str:
        return self.worker.info.role if self.worker.info is not None else "decode"

    async def _read(self, opened: _Open) -> None:
        """Hand each message's RequestTokens to its subscription until the stream ends; then end every
        subscription on it with UNAVAILABLE (their requests migrate) and let the next request reopen."""
        error: RequestError | None = None
        acks = asyncio.get_running_loop().create_task(self._ack(opened))
        try:
            while True:
                batch = await opened.call.read()
                if batch is grpc.aio.EOF:
                    break
                for part in batch.requests:
                    sub = opened.subscriptions.get(part.request_id)
                    if sub is not None:  # else the request already left (cancelled, or ended by a stop string)
                        sub.put((part, batch.sent_at))
                opened.taken += 1
                if opened.taken - opened.told >= opened.ack_every:
                    opened.acking.set()
        except grpc.aio.AioRpcError as e:
            error = from_rpc_error(e, self.worker_role, self.worker.address)
        except asyncio.CancelledError:
            pass
        finally:
            acks.cancel()
            if self._open is opened:
                self._open = None
            if error is None:
                error = RequestError(grpc.StatusCode.UNAVAILABLE, f"{self.worker_role} worker "
                                     f"{self.worker.address}: its token stream ended (the worker drains)",
                                     worker=self.worker.address, public="the worker serving this request went")
            for sub in list(opened.subscriptions.values()):
                sub.put(error)
            opened.subscriptions.clear()
            opened.call.cancel()


async def watch(call_next, sub: Subscription) -> None:
    """Read a Decode call whose tokens go on a token stream to its end (its DecodeReserved, if not yet read, is
    skipped), and hand the subscription `CallEnded` or the call's error (RequestError, CancelledError)."""
    try:
        while (await call_next()) is not None:
            pass
    except RequestError as e:
        sub.put(e)
        return
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # this watch was cancelled (its request ended), not the call
            raise
        sub.put(asyncio.CancelledError())
        return
    sub.put(CallEnded())
