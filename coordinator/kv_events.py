"""Following a worker's KV events (`Worker.SubscribeKvEvents`, a worker started with --kv-events) into the
coordinator's prefix index, so routing knows what each worker actually holds: blocks it stored, minus those it
evicted, emptied when its engine restarts. One task per worker handle (`Membership` owns them); a worker that does
not publish events stays indexed from routing (`PrefixIndex.record`).

The stream resumes from its cursor after a broken connection; a new instance of the worker (a restart: the
instance id in its batches and its info) starts again from its first batch; when the batches needed are gone
(OUT_OF_RANGE) the index restarts from the live stream, knowing less until the worker stores blocks again.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.v1 import worker_pb2
from pdserve_server.coordinator.prefix_index import PrefixIndex
from pdserve_server.coordinator.router import WorkerHandle

log = logging.getLogger(__name__)


def apply(index: PrefixIndex, worker: str, batch: worker_pb2.KvEventBatch) -> None:
    """One batch's events, in order, into the worker's entries."""
    for event in batch.events:
        kind = event.WhichOneof("data")
        if kind == "stored":
            index.stored(worker, event.stored.block_hash, event.stored.parent_hash, event.stored.token_ids)
        elif kind == "removed":
            index.removed(worker, event.removed.block_hash)
        elif kind == "cleared":
            index.follow(worker)
    index.events_applied()


async def follow(handle: WorkerHandle, index: PrefixIndex, retry_s: float) -> None:
    """Keep the index of `handle`'s worker equal to its KV events until cancelled; idle while the worker's info
    (read by membership's polls) is unknown or says it publishes none."""
    instance, cursor = "", 1
    while True:
        info = handle.info
        if info is None:  # not polled yet: follow as soon as it is (the first poll comes within a moment)
            await asyncio.sleep(0.05)
            continue
        if not info.kv_events:
            if instance:  # it stopped publishing (restarted without --kv-events): back to routing's record
                index.unfollow(handle.address)
                instance = ""
            await asyncio.sleep(retry_s)
            continue
        if info.instance_id != instance:
            instance, cursor = info.instance_id, 1
            index.follow(handle.address)
            log.info("following the KV events of worker %s (instance %s)", handle.address, instance)
        call = handle.worker.SubscribeKvEvents(worker_pb2.KvEventsRequest(start_sequence_number=cursor))
        try:
            async for batch in call:
                if batch.instance_id != instance:
                    break  # a restarted worker: its info is re-read by the next poll, then we start again
                apply(index, handle.address, batch)
                cursor = batch.sequence_number + 1
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.OUT_OF_RANGE:  # what it stored before is unknown: start from live
                log.warning("KV events of worker %s: %s", handle.address, e.details())
                index.follow(handle.address)
                cursor = 0
        finally:
            call.cancel()  # a stream left by `break` (or by this task's cancellation) would stay open on the worker
        await asyncio.sleep(retry_s)
