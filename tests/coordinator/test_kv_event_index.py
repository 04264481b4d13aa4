"""The coordinator's prefix index from workers' KV events (`coordinator.kv_events`): a followed worker's entries are
exactly the blocks it reported (routing records nothing for it), evictions and a cleared cache take them away, and
the follower resumes a broken stream from its cursor (here against an in-process fake worker)."""
import asyncio

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_server.coordinator.kv_events import apply, follow
from pdserve_server.coordinator.prefix_index import PrefixIndex, block_hashes
from pdserve_server.coordinator.router import WorkerHandle

H = block_hashes(list(range(48)), 16)  # three chained block hashes, as the engine computes them


def stored(*hashes):
    return [worker_pb2.KvEvent(stored=worker_pb2.KvBlockStored(block_hash=h)) for h in hashes]


def removed(*hashes):
    return [worker_pb2.KvEvent(removed=worker_pb2.KvBlockRemoved(block_hash=h)) for h in hashes]


def test_a_followed_workers_entries_are_its_events():
    index = PrefixIndex()
    index.record("w", H, capacity_blocks=100)
    assert index.overlap("w", H) == 3  # inferred from routing
    index.follow("w")
    assert index.overlap("w", H) == 0
    index.record("w", H, capacity_blocks=100)
    assert index.overlap("w", H) == 0  # routing records nothing for a followed worker
    apply(index, "w", worker_pb2.KvEventBatch(events=stored(H[0], H[1])))
    assert index.overlap("w", H) == 2
    apply(index, "w", worker_pb2.KvEventBatch(events=removed(H[0])))
    assert index.overlap("w", H) == 0  # the chain's first block is gone: nothing after it is a hit
    apply(index, "w", worker_pb2.KvEventBatch(events=stored(H[0]) + [
        worker_pb2.KvEvent(cleared=worker_pb2.KvCacheCleared())]))
    assert index.overlap("w", H) == 0
    index.unfollow("w")
    index.record("w", H, capacity_blocks=100)
    assert index.overlap("w", H) == 3


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """Answers SubscribeKvEvents from a script: the first subscription gets batches 1-2 and then the stream
    breaks; later ones get the batches from their cursor on and then stay open."""

    def __init__(self):
        self.starts = []
        self.batches = [worker_pb2.KvEventBatch(sequence_number=1, instance_id="i1", events=stored(H[0])),
                        worker_pb2.KvEventBatch(sequence_number=2, instance_id="i1", events=stored(H[1])),
                        worker_pb2.KvEventBatch(sequence_number=3, instance_id="i1", events=removed(H[1]))]

    async def SubscribeKvEvents(self, request, context):
        self.starts.append(request.start_sequence_number)
        first = len(self.starts) == 1
        for batch in self.batches[request.start_sequence_number - 1:][:2 if first else None]:
            yield batch
        if not first:
            await asyncio.sleep(3600)


def test_the_follower_applies_a_stream_and_resumes_it_from_its_cursor():
    async def main():
        fake = FakeWorker()
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        handle = WorkerHandle.connect("w", channel)
        handle.info = worker_pb2.WorkerInfo(kv_events=True, instance_id="i1")
        index = PrefixIndex()
        task = asyncio.create_task(follow(handle, index, retry_s=0.05))
        try:
            for _ in range(600):  # bounded: until batch 3 (after the break) was applied
                if fake.starts[1:] and index.overlap("w", H) == 1:
                    break
                await asyncio.sleep(0.05)
            assert fake.starts[:2] == [1, 3]  # from the first batch, then from the cursor after the break
            assert index.overlap("w", H) == 1  # H0 stored; H1 stored, then removed
        finally:
            task.cancel()
            await channel.close()
            await server.stop(0)
    asyncio.run(main())
