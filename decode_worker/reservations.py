"""Bookkeeping of reserved blocks waiting for their KV (the receive side's lease state), on the event loop."""
from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from engine.async_engine import AsyncEngine


class ReservationState(enum.Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    DONE = "done"
    FAILED = "failed"


@dataclass
class Reservation:
    block_ids: list[int]
    state: ReservationState = ReservationState.RESERVED
    first_token: int = 0
    error: str | None = None
    orphaned: bool = False  # the Decode call ended while blocks were being written; free after the receive
    settled: asyncio.Event = field(default_factory=asyncio.Event)


class Reservations:
    """The decode worker's `ReceiveSink`: maps request ids to reserved blocks for the KV receiver.

    Blocks are never freed while a receive writes into them: a Decode call that ends mid-receive marks its
    reservation orphaned, and `end_receive` aborts the request in the engine once the writes stopped.
    """

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self._by_id: dict[str, Reservation] = {}

    def add(self, request_id: str, block_ids: list[int]) -> Reservation:
        r = Reservation(block_ids)
        self._by_id[request_id] = r
        return r

    def release(self, request_id: str, finished: bool) -> None:
        """The Decode call is over. Frees the engine request unless it finished or a receive is in flight."""
        r = self._by_id.get(request_id)
        if r is not None and r.state == ReservationState.RECEIVING:
            r.orphaned = True
            return
        self._by_id.pop(request_id, None)
        if not finished:
            self.engine.abort(request_id)

    def begin_receive(self, request_id: str, num_blocks: int, num_tokens: int) -> list[int]:
        r = self._by_id.get(request_id)
        if r is None or r.state != ReservationState.RESERVED:
            raise LookupError(f"no reservation waiting for KV for {request_id!r} (aborted or expired)")
        if num_blocks != len(r.block_ids):
            raise LookupError(f"{num_blocks} blocks offered for {request_id!r}, {len(r.block_ids)} reserved")
        r.state = ReservationState.RECEIVING
        return r.block_ids

    def end_receive(self, request_id: str, first_token: int, error: str | None) -> None:
        r = self._by_id.get(request_id)
        if r is None:
            return
        if r.orphaned:
            del self._by_id[request_id]
            self.engine.abort(request_id)
            return
        r.state = ReservationState.FAILED if error else ReservationState.DONE
        r.first_token, r.error = first_token, error
        r.settled.set()

    def __len__(self) -> int:
        return len(self._by_id)
