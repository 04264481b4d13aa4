"""asyncio facade over EngineCore: one event queue per request, commands forwarded to the engine thread."""
from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any, Callable

from engine.engine_core import Abort, AddRequest, Call, EngineCore, KvArrived
from engine.request import Request
from engine.scheduler import Scheduler


class AsyncEngine:
    """Bridges the engine thread and the asyncio loop it was started on.

    Contract: every `add_request` is paired with a `forget` (in a finally) once the caller stops reading; the
    caller also calls `abort` unless the request finished, so nothing stays in the engine.
    """

    def __init__(self, core_factory: Callable[[Callable[[list], None]], EngineCore]):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self.core = core_factory(self._emit)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.core.start()

    def stop(self) -> None:
        self.core.stop()

    def _emit(self, events: list) -> None:  # engine thread
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, events)

    def _dispatch(self, events: list) -> None:  # event loop thread
        for ev in events:
            q = self._queues.get(ev.request_id)
            if q is not None:
                q.put_nowait(ev)

    def add_request(self, request: Request) -> asyncio.Queue:
        """Submit a request; its events (Reserved, TokenOutput, RequestFailed) arrive on the returned queue."""
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = q
        self.core.submit(AddRequest(request))
        return q

    def abort(self, request_id: str) -> None:
        """Free everything the engine holds for the request (idempotent). Also releases HELD prefill blocks."""
        self.core.submit(Abort(request_id))

    def kv_arrived(self, request_id: str, first_token: int) -> None:
        self.core.submit(KvArrived(request_id, first_token))

    def forget(self, request_id: str) -> None:
        """Stop routing events for this request."""
        self._queues.pop(request_id, None)

    async def call(self, fn: Callable[[Scheduler], Any]) -> Any:
        """Run fn(scheduler) on the engine thread (consistent snapshot) and return its result."""
        fut: Future = Future()
        self.core.submit(Call(fn, fut))
        return await asyncio.wrap_future(fut)
