"""asyncio facade over an engine: one owner object per request, commands forwarded to the engine's loop.

`AsyncEngine` runs the `EngineCore` on a thread of this process; `engine.core.process_engine.ProcessEngine` runs it in
a process of its own. Both are `Engine`s (the interface the workers use), and both keep their requests' owners in a
`RequestStreams` of their own: composed, not inherited, so neither carries a method the other cannot serve
(`AsyncEngine.call`, a function run on the engine thread, exists in-process only)."""
from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any, Callable, Protocol

from pdserve_server.engine.args import DEFAULT_MAX_UNREAD_TOKENS
from pdserve_server.engine.core.commands import Abort, AddRequest, Call, Command, KvArrived, Pause
from pdserve_server.engine.core.engine_core import EngineCore
from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve_server.engine.outputs import KV_EVENTS, Forgotten, RequestFailed, Reserved, SchedulerStats, TokenOutput
from pdserve_server.engine.request import FinishReason, Request
from pdserve_server.engine.scheduling.scheduler import Scheduler

# Finish reasons after which the engine has already dropped the request (PREFILL_DONE still holds its blocks).
_DROPPED = (FinishReason.STOP, FinishReason.LENGTH)


class RequestStream:
    """The owner of one request's life in the engine, used as `with engine.request(req) as stream:`.

    Leaving the block frees everything the engine holds for the request (queue entry, KV blocks, the HELD blocks of
    a prefill-done request) unless the engine already dropped it, and stops routing its events — on every exit
    path, so no caller pairs add/abort/forget by hand. `hand_over` passes the free to another owner (the KV
    receiver, while it still writes into the request's blocks).

    Back-pressure: when `max_unread_tokens` tokens wait unread (the caller is blocked sending to a slow client), the
    request is paused in the engine (`Scheduler.pause`: out of the batch, KV kept while blocks allow) and resumed
    once the reader has taken them down to half that. Memory per stalled request stays bounded, and its batch slot
    serves others meanwhile.
    """

    def __init__(self, owner: RequestStreams, request: Request):
        self.owner = owner
        self.request_id = request.request_id
        self.dropped = False  # the engine finished or failed the request: nothing left to free
        self._handed_over = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._request = request
        self._unread = 0  # TokenOutputs queued, not yet taken
        self.paused = False
        self._samples_left = request.sampling.n  # parallel sampling: the request ends when every sample has

    def __enter__(self) -> RequestStream:
        self.owner.open(self, self._request)
        return self

    def __exit__(self, *exc) -> None:
        self.owner.close(self.request_id, abort=not (self.dropped or self._handed_over))

    async def next(self) -> Reserved | TokenOutput:
        """The request's next event.

        Raises:
            EngineError: the engine gave up on the request (it holds nothing for it any more).
        """
        return self._check(await self._queue.get())

    async def next_batch(self) -> list[TokenOutput]:
        """Wait for the next token, then take every token already queued behind it (coalesced streaming).

        Raises:
            EngineError: as `next`.
        """
        batch = [await self.next()]
        while not self._queue.empty() and not self.dropped:
            batch.append(self._check(self._queue.get_nowait()))
        return batch  # type: ignore[return-value]

    def kv_arrived(self, first_token: int) -> None:
        """The prompt's KV is in the reserved blocks: the request joins the running batch with its first token."""
        self.owner.submit(KvArrived(self.request_id, first_token))

    def hand_over(self) -> Callable[[], None]:
        """Leave the free to another owner: this stream's exit will not abort; call the returned function instead."""
        self._handed_over = True
        return lambda: self.owner.submit(Abort(self.request_id))

    def _put(self, ev: Any) -> None:
        """An event for this request (event loop thread): queue it; pause the request when too many wait unread."""
        self._queue.put_nowait(ev)
        if isinstance(ev, TokenOutput):
            self._unread += 1
            limit = self.owner.max_unread_tokens
            if limit and not self.paused and self._unread >= limit and ev.finish_reason is None:
                self.paused = True
                self.owner.submit(Pause(self.request_id))

    def _check(self, ev: Any) -> Reserved | TokenOutput:
        if isinstance(ev, TokenOutput):
            self._unread -= 1
            if self.paused and self._unread <= self.owner.max_unread_tokens // 2:
                self.paused = False
                self.owner.submit(Pause(self.request_id, resume=True))
        if isinstance(ev, RequestFailed):
            self.dropped = True
            raise EngineError(ev.kind, ev.message)
        if isinstance(ev, TokenOutput) and ev.finish_reason in _DROPPED:
            self._samples_left -= 1
            self.dropped = self._samples_left == 0
        return ev


class RequestStreams:
    """The requests that have an owner (`RequestStream`) in one engine, and the routing of the engine's events to
    them (event loop thread).

    Args:
        submit: queues a command for the engine (`Engine.submit`).
        max_unread_tokens: tokens a request's stream may hold unread before the request is paused (see
            `RequestStream`); 0 = never pause.
        before_open: called as a request enters; raises EngineError when the engine cannot take it (a dead engine
            process). None: always open.
        after_close: called with a request's id once its owner left. None: nothing.
    """

    def __init__(self, submit: Callable[[Any], None], max_unread_tokens: int = DEFAULT_MAX_UNREAD_TOKENS,
                 before_open: Callable[[], None] | None = None, after_close: Callable[[str], None] | None = None):
        self.submit, self.max_unread_tokens = submit, max_unread_tokens
        self._before_open, self._after_close = before_open, after_close
        self.owners: dict[str, RequestStream] = {}
        # Ids whose owner left with an abort the engine has not acknowledged yet: their events are stale.
        self._stale: dict[str, int] = {}
        self._fault_listeners: list[Callable[[str], None]] = []
        self._kv_listeners: list[Callable[[list], None]] = []

    def request(self, request: Request) -> RequestStream:
        return RequestStream(self, request)

    def open(self, stream: RequestStream, request: Request) -> None:
        """Raises EngineError: DUPLICATE_REQUEST for an id with an owner, or what `before_open` raises."""
        if self._before_open is not None:
            self._before_open()
        if request.request_id in self.owners:
            raise EngineError(ErrorKind.DUPLICATE_REQUEST, f"request id {request.request_id!r} is in use")
        self.owners[request.request_id] = stream
        self.submit(AddRequest(request))

    def close(self, request_id: str, abort: bool) -> None:
        self.owners.pop(request_id, None)
        if self._after_close is not None:
            self._after_close(request_id)
        if abort:
            self._stale[request_id] = self._stale.get(request_id, 0) + 1
            self.submit(Abort(request_id, ack=True))

    def is_stale(self, request_id: str) -> bool:
        """The id's former owner left with an abort the engine has not acknowledged: its events are not its own."""
        return request_id in self._stale

    def dispatch(self, events: list) -> None:
        """Route the engine's events to their owners, KV events to the KV event listeners (event loop thread)."""
        kv_events = []
        for ev in events:
            if isinstance(ev, KV_EVENTS):
                kv_events.append(ev)
                continue
            rid = ev.request_id
            if rid in self._stale:  # made before the engine applied the abort of a former owner of this id
                if isinstance(ev, Forgotten):
                    if (left := self._stale.pop(rid) - 1) > 0:
                        self._stale[rid] = left
                continue
            stream = self.owners.get(rid)
            if stream is not None:
                stream._put(ev)
        if kv_events:
            for listener in self._kv_listeners:
                listener(kv_events)

    def fail_all(self, kind: ErrorKind, message: str) -> None:
        """The engine is gone: every owner's stream ends with EngineError(kind); nothing is stale any more."""
        for rid, stream in list(self.owners.items()):
            stream._queue.put_nowait(RequestFailed(rid, kind, message))
        self._stale.clear()

    def clear_stale(self) -> None:
        self._stale.clear()

    def add_fault_listener(self, listener: Callable[[str], None]) -> None:
        self._fault_listeners.append(listener)

    def add_kv_event_listener(self, listener: Callable[[list], None]) -> None:
        """Call listener(events) on the event loop with each batch of KV events (`outputs.KV_EVENTS`) the engine
        emits (only with `EngineArgs.kv_events`), in the order it made them."""
        self._kv_listeners.append(listener)

    def fault(self, message: str) -> None:
        """Tell the fault listeners (event loop thread)."""
        for listener in self._fault_listeners:
            listener(message)


class Engine(Protocol):
    """What a worker uses of an engine, in this process (`AsyncEngine`) or another (`ProcessEngine`)."""

    def submit(self, command: AddRequest | Abort | KvArrived | Pause) -> None:
        """Queue a command for the engine's loop."""

    @property
    def stats(self) -> SchedulerStats:
        """The stats the engine published after its last loop iteration."""

    async def snapshot(self) -> tuple[SchedulerStats, bool]:
        """Stats and the block pool's integrity, taken together between steps (`EngineCore.snapshot`)."""

    async def abortable(self, request_id: str) -> bool:
        """Whether `abort(request_id)` would drop a request (`EngineCore.abortable`)."""

    def add_fault_listener(self, listener: Callable[[str], None]) -> None:
        """Call listener(message) on the event loop when the engine faults (once)."""

    def add_kv_event_listener(self, listener: Callable[[list], None]) -> None:
        """Call listener(events) on the event loop with each batch of KV events (`RequestStreams`')."""

    def request(self, request: Request) -> RequestStream:
        """The owner of `request` in this engine; entering it submits the request (see `RequestStream`)."""

    @property
    def streams(self) -> dict[str, RequestStream]:
        """The requests with an owner right now, by id (read-only use: drain waits while it is non-empty)."""

    def abort(self, request_id: str) -> None:
        """Abort from outside the owner (Worker.Abort): the owner's stream ends with EngineError(ABORTED).
        Idempotent; unknown ids are ignored."""

    def stop(self) -> None:
        """Stop the engine."""


class EngineStreams:
    """What both engines serve alike through their `RequestStreams` (`self.requests`) and their own `submit`:
    requests' owners, aborts from outside, and the fault and KV event listeners."""

    requests: RequestStreams

    def submit(self, command: Command) -> None:  # each engine's own
        raise NotImplementedError

    def request(self, request: Request) -> RequestStream:
        """An owner for a new request (`RequestStream`; entering it submits the request)."""
        return self.requests.request(request)

    @property
    def streams(self) -> dict[str, RequestStream]:
        """Request id -> its owner, for the requests in flight."""
        return self.requests.owners

    def abort(self, request_id: str) -> None:
        """Abort from outside (Worker.Abort): the owner hears RequestFailed(ABORTED)."""
        self.submit(Abort(request_id, notify=True))

    def add_fault_listener(self, listener: Callable[[str], None]) -> None:
        """Call listener(message) on the event loop when an engine step faults, or its process dies (once)."""
        self.requests.add_fault_listener(listener)

    def add_kv_event_listener(self, listener: Callable[[list], None]) -> None:
        """Call listener(events) on the event loop with each batch of KV events (`RequestStreams`')."""
        self.requests.add_kv_event_listener(listener)


class AsyncEngine(EngineStreams):
    """An `Engine` whose core runs on a thread of this process, bridged to the asyncio loop it was started on.
    Requests enter through `request()`.

    Args:
        core_factory: builds the EngineCore from (emit, on_fault) callbacks that this object provides.
        max_unread_tokens: as `RequestStreams`'.
    """

    def __init__(self, core_factory: Callable[[Callable[[list], None], Callable[[str], None]], EngineCore],
                 max_unread_tokens: int = DEFAULT_MAX_UNREAD_TOKENS):
        self._loop: asyncio.AbstractEventLoop | None = None
        self.requests = RequestStreams(self.submit, max_unread_tokens)
        self.core = core_factory(self._emit, self._fault)

    def submit(self, command: Command) -> None:
        """Queue a command for the engine's loop (any thread)."""
        self.core.submit(command)

    @property
    def stats(self) -> SchedulerStats:
        """The stats the engine published after its last loop iteration (or as its current step started)."""
        return self.core.stats

    async def snapshot(self) -> tuple[SchedulerStats, bool]:
        return await self.call(lambda s: self.core.snapshot())

    async def abortable(self, request_id: str) -> bool:
        return await self.call(lambda s: self.core.abortable(request_id))

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.core.start()

    def stop(self) -> None:
        self.core.stop()

    async def call(self, fn: Callable[[Scheduler], Any]) -> Any:
        """Run fn(scheduler) on the engine thread (consistent snapshot) and return its result (tests, and the typed
        queries above)."""
        fut: Future = Future()
        self.submit(Call(fn, fut))
        return await asyncio.wrap_future(fut)

    def _fault(self, message: str) -> None:  # engine thread
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.requests.fault, message)

    def _emit(self, events: list) -> None:  # engine thread
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.requests.dispatch, events)
