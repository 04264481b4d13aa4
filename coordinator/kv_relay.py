"""The workers' KV events, relayed to a gateway as vLLM's (`VllmEngine.SubscribeKvEvents`, smg-grpc-proto's
`KvEventBatch`), with `--kv-events-relay`: what smg's event-driven cache-aware routing reads from a vLLM engine, for
the cluster behind this coordinator taken as one engine.

A block is live while any followed worker holds it (`coordinator.kv_events` feeds the prefix index, which tells this
relay): stored when the first worker reports it, removed when the last lets it go (or leaves, or restarts). Each
change of the live set is one batch with the next sequence number; the last HISTORY_BATCHES are kept, so a
subscriber that lost its stream resumes from its cursor. A subscriber without a usable cursor (0, or older than
the history) first gets a snapshot of the live blocks (smg's `KvSnapshotChunk`: an `AllBlocksCleared`, then one
stored event per block, parents first, in chunks ending at the current sequence), then the live batches.

Block hashes are our 16-byte chained hashes (`prefix_index.block_hashes`) cut to vLLM's int64 (their first 8 bytes,
big-endian, signed); each stored event carries its parent's and the block's token ids. No load records: the gateway
keeps polling `GetLoads`. The stream shows every cached prompt's tokens, so the flag is for a port whose callers are
trusted (the gateway in front of it), like vLLM's ZMQ event socket.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence

from smg_grpc_proto.generated import common_pb2

HISTORY_BATCHES = 4096  # batches kept for subscribers that resume from a cursor
SNAPSHOT_CHUNK_BLOCKS = 8192  # stored events per snapshot chunk (~0.6 MB: well under gRPC's 4 MB message limit)
SUBSCRIBER_QUEUE = 1024  # batches a slow subscriber may fall behind before its stream is ended (it resumes)


def int64_hash(block_hash: bytes) -> int:
    """vLLM's int64 block hash for one of ours: the first 8 bytes, big-endian, signed."""
    return int.from_bytes(block_hash[:8], "big", signed=True)


class KvEventRelay:
    """The live block set across followed workers, and the batches that change it. Event loop only."""

    def __init__(self) -> None:
        self.sequence = 0  # the last batch's sequence number
        self._holders: dict[bytes, int] = {}  # live block -> workers holding it (insertion order: parents first)
        self._blocks: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}  # live block -> (parent hash, token ids)
        self._by_worker: dict[str, set[bytes]] = {}
        self._history: deque[common_pb2.KvEventBatch] = deque(maxlen=HISTORY_BATCHES)
        self._subscribers: set[asyncio.Queue] = set()
        self._pending: list[common_pb2.KvCacheEvent] = []
        self._event_id = 0

    # ---- what the prefix index reports (followed workers only) ------------------------------------------------

    def stored(self, worker: str, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int]) -> None:
        held = self._by_worker.setdefault(worker, set())
        if block_hash in held:
            return
        held.add(block_hash)
        count = self._holders.get(block_hash, 0)
        self._holders[block_hash] = count + 1
        if count == 0:
            self._blocks[block_hash] = (parent_hash, tuple(token_ids))
            self._pending.append(self._stored_event(block_hash))

    def removed(self, worker: str, block_hash: bytes) -> None:
        held = self._by_worker.get(worker)
        if held is None or block_hash not in held:
            return
        held.discard(block_hash)
        self._release(block_hash)

    def forget(self, worker: str) -> None:
        """The worker's cache is gone (cleared, restarted, left, or no longer followed)."""
        for block_hash in self._by_worker.pop(worker, set()):
            self._release(block_hash)

    def _release(self, block_hash: bytes) -> None:
        count = self._holders[block_hash] - 1
        if count:
            self._holders[block_hash] = count
            return
        del self._holders[block_hash]
        del self._blocks[block_hash]
        self._event_id += 1
        self._pending.append(common_pb2.KvCacheEvent(
            event_id=self._event_id, removed=common_pb2.KvBlocksRemoved(block_hashes=[int64_hash(block_hash)])))

    def _stored_event(self, block_hash: bytes, event_id: int | None = None) -> common_pb2.KvCacheEvent:
        parent, tokens = self._blocks[block_hash]
        stored = common_pb2.KvBlocksStored(blocks=[common_pb2.KvBlock(block_hash=int64_hash(block_hash),
                                                                      token_ids=tokens, block_size=len(tokens))])
        if parent:
            stored.parent_block_hash = int64_hash(parent)
        if event_id is None:
            self._event_id += 1
            event_id = self._event_id
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)

    def flush(self) -> None:
        """Send what changed since the last flush as one batch (after each worker batch is applied)."""
        if not self._pending:
            return
        self.sequence += 1
        batch = common_pb2.KvEventBatch(sequence_number=self.sequence, timestamp=time.time(), events=self._pending)
        self._pending = []
        self._history.append(batch)
        for queue in list(self._subscribers):
            try:
                queue.put_nowait(batch)
            except asyncio.QueueFull:  # too slow: its stream ends, and it resumes from its cursor
                self._drop(queue)

    def _drop(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(None)

    @property
    def live_blocks(self) -> int:
        return len(self._holders)

    # ---- subscribers ------------------------------------------------------------------------------------------

    def snapshot(self) -> list[common_pb2.KvEventBatch]:
        """The live blocks as snapshot chunks ending at the current sequence (empty before the first batch)."""
        if self.sequence == 0:
            return []
        hashes = list(self._holders)
        count = max(1, -(-len(hashes) // SNAPSHOT_CHUNK_BLOCKS))
        chunks = []
        for i in range(count):
            part = hashes[i * SNAPSHOT_CHUNK_BLOCKS:(i + 1) * SNAPSHOT_CHUNK_BLOCKS]
            events = [common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())] if i == 0 else []
            events += [self._stored_event(h, event_id=0) for h in part]
            chunks.append(common_pb2.KvEventBatch(
                sequence_number=self.sequence - count + 1 + i, timestamp=time.time(), events=events,
                snapshot=common_pb2.KvSnapshotChunk(index=i, count=count, blocks=len(hashes), unknown_before=0)))
        return chunks

    async def subscribe(self, start_sequence_number: int) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Batches from `start_sequence_number` on when the history still holds it, else a snapshot then the live
        batches; ends when the subscriber falls SUBSCRIBER_QUEUE batches behind (it resumes from its cursor)."""
        queue: asyncio.Queue = asyncio.Queue(SUBSCRIBER_QUEUE)
        oldest = self._history[0].sequence_number if self._history else self.sequence + 1
        if start_sequence_number and oldest <= start_sequence_number:
            first = [b for b in self._history if b.sequence_number >= start_sequence_number]
        else:
            first = self.snapshot()
        self._subscribers.add(queue)  # before yielding: no batch between the snapshot and the live stream is lost
        try:
            for batch in first:
                yield batch
            while (batch := await queue.get()) is not None:
                yield batch
        finally:
            self._subscribers.discard(queue)
