"""Blocks reserved for a remote-KV request while its KV is on the way: the receive side's lease state, kept on the
event loop and handed to the KV receiver as its `ReceiveSink`."""
from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pdserve_server.engine.core.async_engine import RequestStream
from pdserve_server.server_common.tracing import extract_context, record_span


class ReservationState(enum.Enum):
    RESERVED = "reserved"    # blocks reserved; no KV offered yet
    RECEIVING = "receiving"  # the receiver writes into the blocks
    DONE = "done"            # every block arrived
    FAILED = "failed"        # the transfer broke; the blocks hold garbage


@dataclass
class Reservation:
    """One request's reserved blocks and how its transfer stands. `settled` is set at DONE or FAILED.

    block_ids: the blocks the KV is received into: the request's block table after its first `first_block`
    blocks, which this worker's prefix cache already held.

    The lease: while RESERVED, the blocks are held until `expires_at` (time.monotonic(), seconds), which each
    renewal moves to `lease_s` from then.
    """

    block_ids: list[int]
    first_block: int
    lease_s: float
    expires_at: float = 0.0
    state: ReservationState = ReservationState.RESERVED
    first_token: int = 0
    error: str | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    reserved_at: float = field(default_factory=time.time)  # wall clock, seconds: the trace's timestamps
    receive_started_at: float = 0.0
    trace_context: dict[str, str] = field(default_factory=dict)  # the sender's, for the receive's span
    # Set when the Decode call ended mid-receive: the receiver frees the blocks once its writes stop.
    free_after_receive: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.expires_at = time.monotonic() + self.lease_s


class Reservations:
    """Maps request ids to reserved blocks for the KV receiver (`kv_transfer.receiver.ReceiveSink`).

    Blocks are never freed while a receive writes into them: a Decode call that ends mid-receive hands the free of
    its request to the receiver (`RequestStream.hand_over`), which runs it in `end_receive`.
    """

    def __init__(self) -> None:
        self._by_id: dict[str, Reservation] = {}

    @contextmanager
    def hold(self, request_id: str, block_ids: list[int], num_cached_blocks: int, stream: RequestStream,
             lease_s: float) -> Iterator[Reservation]:
        """Offer `block_ids` (the request's block table) past its first `num_cached_blocks` to the receiver for the
        duration of the block (the Decode call's wait for KV), under a lease of `lease_s` seconds that `renew`
        restarts (the caller enforces it)."""
        r = Reservation(block_ids[num_cached_blocks:], num_cached_blocks, lease_s)
        self._by_id[request_id] = r
        try:
            yield r
        finally:
            if r.state == ReservationState.RECEIVING:
                r.free_after_receive = stream.hand_over()
            else:
                del self._by_id[request_id]

    def renew(self, request_id: str) -> float:
        """Restart the lease of a reservation still waiting for KV; returns the lease, seconds from now.

        Raises:
            LookupError: no reservation under that id waits for KV (never made, expired, or its KV is arriving).
        """
        r = self._by_id.get(request_id)
        if r is None or r.state != ReservationState.RESERVED:
            raise LookupError(f"no reservation waiting for KV for {request_id!r}")
        r.expires_at = time.monotonic() + r.lease_s
        return r.lease_s

    def begin_receive(self, request_id: str, first_block: int, num_blocks: int, num_tokens: int,
                      trace_context: dict[str, str]) -> list[int]:
        r = self._by_id.get(request_id)
        if r is None or r.state != ReservationState.RESERVED:
            raise LookupError(f"no reservation waiting for KV for {request_id!r} (aborted or expired)")
        if (first_block, num_blocks) != (r.first_block, len(r.block_ids)):
            raise LookupError(f"blocks {first_block}..{first_block + num_blocks} offered for {request_id!r}, "
                              f"{r.first_block}..{r.first_block + len(r.block_ids)} awaited")
        r.state = ReservationState.RECEIVING
        r.receive_started_at, r.trace_context = time.time(), trace_context
        return r.block_ids

    def end_receive(self, request_id: str, first_token: int, error: str | None) -> None:
        r = self._by_id.get(request_id)
        if r is None:
            return
        r.state = ReservationState.FAILED if error else ReservationState.DONE
        r.first_token, r.error = first_token, error
        r.settled.set()
        record_span("kv receive", r.receive_started_at, time.time(), parent=extract_context(r.trace_context),
                    attributes={"pdserve.request_id": request_id, "pdserve.kv.blocks": len(r.block_ids),
                                "pdserve.kv.ok": error is None})
        if r.free_after_receive is not None:  # the Decode call is gone: free now that the writes stopped
            del self._by_id[request_id]
            r.free_after_receive()

    def __len__(self) -> int:
        return len(self._by_id)
