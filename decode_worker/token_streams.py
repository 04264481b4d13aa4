"""A decode worker's StreamTokens streams: one per caller (a coordinator), each carrying the tokens of every Decode
call that names it, a message per engine step for all of them (worker.proto's StreamTokens).

Why: with a stream per request, a coordinator relaying B requests from one worker reads B gRPC messages a step, one
read callback each (its event loop's largest cost after the writes to clients, `docs/benchmarks.md`, "What one
coordinator adds to each token's latency"). Here it reads one. The Decode call of each request stays: it carries
the reservation, the request's own error status, and its cancellation frees the request's blocks.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from pdserve.v1 import worker_pb2

# Messages a stream has in flight beyond what its caller said it took (TokenStreamRequest.taken): tokens made while
# the window is full wait and leave together. The caller says what it took every window / 2 messages: 4 keeps
# that to one message back for two out (2 made it one for one: +46-66% coordinator CPU a token at one request a
# worker step, docs/benchmarks.md), and a reader that falls behind sees at most 4 steps queued before they merge.
TOKEN_STREAM_WINDOW = 4

# Tokens a stream holds unsent before the Decode calls adding to it wait for its next write: the caller reads
# slower than the engine makes tokens, so the engine's own back-pressure (`RequestStream`'s max_unread_tokens,
# which pauses a request whose tokens are not taken) applies instead of this buffer growing.
MAX_PENDING_TOKENS = 16384


class TokenStreamClosed(Exception):
    """The caller's token stream ended (the caller went, or the worker drains): tokens cannot reach it."""


class Draining(LookupError):
    """A Decode call named a stream that is not open while the worker drains (it ended with its last user): the
    caller should go to another worker."""


class TokenOutbox:
    """One StreamTokens stream: the `RequestTokens` the Decode calls naming it add, gathered until its next write.

    Every entry added while a write is not under way goes in the next message, so the tokens one engine step hands
    its requests' Decode calls (all woken together) leave as one message; while TOKEN_STREAM_WINDOW messages wait
    for the caller to take them (`taken`), entries keep gathering (a slow reader gets larger messages, not a
    backlog). `batches` is the stream's writer; `put` is called by the Decode calls. users: Decode calls naming
    the stream now (a draining worker ends a stream nobody uses).
    """

    def __init__(self, stream_id: str, on_sent: Callable[[int], None] = lambda parts: None):
        self.stream_id, self._on_sent = stream_id, on_sent
        self.users = 0
        self._pending: dict[str, worker_pb2.RequestTokens] = {}  # each request's entry, in the order they came
        self._pending_tokens = 0
        self._wake = asyncio.Event()
        self._written: asyncio.Future = asyncio.get_running_loop().create_future()  # the gathering message's
        self._closed = False
        self._draining = False
        self._sent = self._taken = 0  # messages written (after the opening one), and taken by the caller

    async def put(self, entry: worker_pb2.RequestTokens, wait: bool = False) -> None:
        """Queue one request's tokens (and finishes) for the stream's next message (merged with what the request
        already has queued there).

        Args:
            wait: return only once that message is written (a request's last entry: its Decode call ends after it,
                so a caller that sees the call end OK has been sent every token). Also waited for, whatever
                `wait`, while MAX_PENDING_TOKENS or more tokens are pending (back-pressure).

        Raises:
            TokenStreamClosed: the stream ended before the entry could be sent.
        """
        if self._closed:
            raise TokenStreamClosed(f"token stream {self.stream_id} is closed")
        gathered = self._pending.get(entry.request_id)
        if gathered is None:
            self._pending[entry.request_id] = entry
        else:  # the request's steps since the last message: one part (its tokens in order, then its finishes)
            gathered.tokens.tokens.extend(entry.tokens.tokens)
            gathered.tokens.num_cached_tokens = max(gathered.tokens.num_cached_tokens, entry.tokens.num_cached_tokens)
            gathered.finished.extend(entry.finished)
        self._pending_tokens += len(entry.tokens.tokens)
        self._wake.set()
        if wait or self._pending_tokens >= MAX_PENDING_TOKENS:
            await asyncio.shield(self._written)  # shielded: one cancelled waiter must not fail the others' future

    async def batches(self) -> AsyncIterator[worker_pb2.TokenStreamBatch]:
        """The stream's messages: an empty one (the stream is open), then each gathering of entries, until the
        worker drains with no Decode call using the stream. The generator's consumer (gRPC) takes each message
        before the next is made, so resolving a message's `put(wait=True)` after its yield means it was written."""
        yield worker_pb2.TokenStreamBatch(window=TOKEN_STREAM_WINDOW)
        while not (self._draining and self.users == 0 and not self._pending):
            await self._wake.wait()
            self._wake.clear()
            if not self._pending or self._sent - self._taken >= TOKEN_STREAM_WINDOW:
                continue
            pending, written = self._pending, self._written
            self._pending, self._pending_tokens = {}, 0
            self._written = asyncio.get_running_loop().create_future()
            yield worker_pb2.TokenStreamBatch(requests=pending.values(), sent_at=time.time())
            self._sent += 1
            written.set_result(None)
            self._on_sent(len(pending))

    def taken(self, count: int) -> None:
        """The caller has taken `count` messages in all (TokenStreamRequest.taken): the window moves on."""
        if count > self._taken:
            self._taken = count
            self._wake.set()

    def release(self) -> None:
        """A Decode call that named the stream ended."""
        self.users -= 1
        if self._draining and self.users == 0:
            self._wake.set()

    def drain(self) -> None:
        """The worker drains: end the stream once no Decode call uses it (a long-lived stream would otherwise hold
        the server's stop for its whole grace period)."""
        self._draining = True
        self._wake.set()

    def close(self) -> None:
        """The stream ended: entries still waiting to be sent fail their `put`."""
        self._closed = True
        if not self._written.done():
            self._written.set_exception(TokenStreamClosed(f"token stream {self.stream_id} closed"))
            self._written.exception()  # retrieved: a message nobody waits on is normal, not an unretrieved error


class TokenStreams:
    """The worker's open StreamTokens streams by id (event loop thread); on_sent(parts) is called as each message
    with `parts` requests' tokens is written (metrics)."""

    def __init__(self, on_sent: Callable[[int], None] = lambda parts: None) -> None:
        self._on_sent = on_sent
        self._open: dict[str, TokenOutbox] = {}
        self._draining = False

    def open(self, stream_id: str) -> TokenOutbox:
        """Raises ValueError: the id is empty or already open (a message for the caller)."""
        if not stream_id:
            raise ValueError("stream_id is empty: name the stream (a random id)")
        if stream_id in self._open:
            raise ValueError(f"token stream {stream_id!r} is already open on this worker")
        outbox = self._open[stream_id] = TokenOutbox(stream_id, self._on_sent)
        if self._draining:
            outbox.drain()
        return outbox

    def close(self, outbox: TokenOutbox) -> None:
        self._open.pop(outbox.stream_id, None)
        outbox.close()

    def use(self, stream_id: str) -> TokenOutbox:
        """The open stream a Decode call names, counted as a user until its `release`.

        Raises:
            Draining: none is open and the worker drains.
            LookupError: no stream of that id is open.
        """
        outbox = self._open.get(stream_id)
        if outbox is None and self._draining:
            raise Draining(f"no token stream {stream_id!r} is open: this worker is draining; use another")
        if outbox is None:
            raise LookupError(f"no token stream {stream_id!r} is open on this worker: open it with StreamTokens "
                              "first (it may have just ended)")
        outbox.users += 1
        return outbox

    def drain(self) -> None:
        """End every stream once its Decode calls have (see `TokenOutbox.drain`); streams opened later too."""
        self._draining = True
        for outbox in self._open.values():
            outbox.drain()
