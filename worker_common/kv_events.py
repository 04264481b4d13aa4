"""A worker's KV cache events as a numbered stream (vLLM's KV event publisher; the shape of smg's
`SubscribeKvEvents`): what entered the prefix cache (`KvBlockStored`) and what was evicted (`KvBlockRemoved`), so a
router can index what workers actually hold instead of guessing it from where it sent requests.

Each batch the engine emits becomes one `worker_pb2.KvEventBatch` with the next sequence number, converted once and
shared by every subscriber. The last `keep` batches stay for subscribers that resume from a cursor; a subscriber
that falls `max_lag` batches behind is ended (OUT_OF_RANGE) rather than let the worker's memory grow, and resumes
from its cursor. Event loop thread only.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator

from pdserve.v1 import worker_pb2
from pdserve_server.engine.outputs import KvBlockRemoved, KvBlockStored

DEFAULT_KEEP = 4096  # batches kept for resuming subscribers
DEFAULT_MAX_LAG = 4096  # batches a subscriber may fall behind before its stream ends


class LagError(Exception):
    """The subscriber asked for batches no longer kept, or fell too far behind: resubscribe (from 0 = now)."""


class KvEventLog:
    """Numbered batches of a worker's KV events, kept and fanned out.

    Args:
        block_size: tokens per block (stamped on every batch).
        instance_id: returns the worker's current instance id (it changes when the engine restarts).
        keep: how many of the latest batches stay for resuming subscribers.
        max_lag: how many batches a subscriber may have queued before its stream ends.
    """

    def __init__(self, block_size: int, instance_id, keep: int = DEFAULT_KEEP, max_lag: int = DEFAULT_MAX_LAG):
        self.block_size, self._instance_id = block_size, instance_id
        self.max_lag = max_lag
        self.sequence = 0  # the last batch's number (0: none yet)
        self._kept: deque[worker_pb2.KvEventBatch] = deque(maxlen=keep)
        self._subscribers: set[asyncio.Queue] = set()

    def publish(self, events: list) -> None:
        """Number and send one batch of the engine's KV events (`outputs.KvBlockStored` / `KvBlockRemoved`)."""
        out = []
        for ev in events:
            if isinstance(ev, KvBlockStored):
                out.append(worker_pb2.KvEvent(stored=worker_pb2.KvBlockStored(
                    block_hash=ev.block_hash, parent_hash=ev.parent_hash or b"", token_ids=ev.token_ids)))
            elif isinstance(ev, KvBlockRemoved):
                out.append(worker_pb2.KvEvent(removed=worker_pb2.KvBlockRemoved(block_hash=ev.block_hash)))
        if out:
            self._send(out)

    def cleared(self) -> None:
        """The engine's cache was emptied (its process restarted): one `KvCacheCleared` event."""
        self._send([worker_pb2.KvEvent(cleared=worker_pb2.KvCacheCleared())])

    def _send(self, events: list) -> None:
        self.sequence += 1
        batch = worker_pb2.KvEventBatch(sequence_number=self.sequence, timestamp=time.time(), events=events,
                                        block_size=self.block_size, instance_id=self._instance_id())
        self._kept.append(batch)
        for queue in list(self._subscribers):
            if queue.qsize() >= self.max_lag:
                self._subscribers.discard(queue)
                queue.put_nowait(None)  # ends that stream: it fell behind
            else:
                queue.put_nowait(batch)

    async def subscribe(self, start: int) -> AsyncIterator[worker_pb2.KvEventBatch]:
        """The batches from number `start` on (0: from the next one), in order, until the caller stops.

        Raises:
            LagError: batch `start` is no longer kept, or the subscriber fell max_lag batches behind.
        """
        queue: asyncio.Queue = asyncio.Queue()
        if start:
            oldest = self._kept[0].sequence_number if self._kept else self.sequence + 1
            if start < oldest:
                raise LagError(f"KV event batches before {oldest} are no longer kept (asked from {start}); "
                               "subscribe from 0 and treat what this worker held before as unknown")
            for batch in self._kept:
                if batch.sequence_number >= start:
                    queue.put_nowait(batch)
        self._subscribers.add(queue)
        try:
            while (batch := await queue.get()) is not None:
                yield batch
            raise LagError(f"the subscriber fell {self.max_lag} batches behind; resubscribe from its cursor")
        finally:
            self._subscribers.discard(queue)
