"""A worker's KV event stream (`worker_common.kv_events.KvEventLog`, `Worker.SubscribeKvEvents`): numbered batches
in order, resumable from a cursor while kept, a clear event when the engine restarts, and on a real cluster the
blocks a prompt filled, with its tokens, on both workers."""
import asyncio
import threading

import grpc
import pytest

from pdserve import Client, SamplingParams
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_server.engine.outputs import KvBlockRemoved, KvBlockStored
from pdserve_server.worker_common.kv_events import KvEventLog, LagError


def _log(keep=8, max_lag=4):
    return KvEventLog(block_size=16, instance_id=lambda: "inst", keep=keep, max_lag=max_lag)


async def _take(stream, n):
    return [await anext(stream) for _ in range(n)]


def test_batches_are_numbered_kept_and_resumed():
    async def main():
        log = _log()
        live = log.subscribe(0)
        first = asyncio.ensure_future(_take(live, 2))
        await asyncio.sleep(0)  # the subscriber is registered once its generator runs
        log.publish([KvBlockStored(b"h1", None, [1, 2]), KvBlockRemoved(b"h0")])
        log.publish([])  # nothing to say: no batch
        log.cleared()
        got = await first
        assert [b.sequence_number for b in got] == [1, 2] and all(b.instance_id == "inst" for b in got)
        assert got[0].events[0].stored.token_ids == [1, 2] and got[0].events[0].stored.parent_hash == b""
        assert got[0].events[1].removed.block_hash == b"h0" and got[1].events[0].HasField("cleared")
        resumed = await _take(log.subscribe(2), 1)  # a reconnecting subscriber passes its cursor
        assert resumed[0].sequence_number == 2
        for _ in range(10):
            log.publish([KvBlockRemoved(b"x")])
        with pytest.raises(LagError, match="no longer kept"):
            await _take(log.subscribe(1), 1)
    asyncio.run(main())


def test_a_subscriber_that_falls_behind_is_ended_not_buffered_forever():
    async def main():
        log = _log(max_lag=2)
        slow = log.subscribe(0)
        started = asyncio.ensure_future(anext(slow))
        await asyncio.sleep(0)
        for _ in range(4):
            log.publish([KvBlockRemoved(b"x")])
        assert (await started).sequence_number == 1
        with pytest.raises(LagError, match="fell 2 batches behind"):
            await _take(slow, 4)
    asyncio.run(main())


@pytest.mark.e2e
def test_a_clusters_workers_stream_the_blocks_a_prompt_filled(tiny_model_dir, launch):
    cluster = launch(tiny_model_dir, worker_args=["--dtype", "float32", "--kv-tokens", "1024", "--max-model-len",
                                                  "256", "--connector", "tcp", "--kv-events"])
    received: dict[str, list] = {name: [] for name in cluster.worker_addresses}
    calls = []

    def follow(name: str, address: str) -> None:
        with grpc.insecure_channel(address) as ch:
            call = worker_pb2_grpc.WorkerStub(ch).SubscribeKvEvents(
                worker_pb2.KvEventsRequest(start_sequence_number=1), metadata=cluster.worker_metadata, timeout=120)
            calls.append(call)
            try:
                for batch in call:
                    received[name].append(batch)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.CANCELLED, e

    threads = [threading.Thread(target=follow, args=item, daemon=True) for item in cluster.worker_addresses.items()]
    for t in threads:
        t.start()
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks of 16
    with Client(cluster.address) as c:
        out = c.complete(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert out.completion_tokens == 4

    def stored(name):
        return [e.stored for b in received[name] for e in b.events if e.HasField("stored")]

    deadline = 600  # polls of 0.1 s: a bounded wait, counted in events
    while deadline and not all(len(stored(n)) >= 2 for n in received):
        threading.Event().wait(0.1)
        deadline -= 1
    for call in calls:
        call.cancel()
    for name in received:
        blocks = stored(name)
        assert [list(b.token_ids) for b in blocks[:2]] == [prompt[:16], prompt[16:32]], name
        assert blocks[0].parent_hash == b"" and blocks[1].parent_hash == blocks[0].block_hash, name
        seqs = [b.sequence_number for b in received[name]]
        assert seqs == list(range(1, len(seqs) + 1)), name  # from the first batch, none missing
