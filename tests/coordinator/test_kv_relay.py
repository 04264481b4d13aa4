"""The KV event relay (`coordinator.kv_relay`): the live block set across followed workers as one engine's vLLM KV
events: a block stored once however many workers hold it and removed when the last lets it go, a worker that
restarts or leaves releasing its blocks, resumption from a cursor, and a snapshot for a subscriber without one."""
import asyncio

from pdserve_server.coordinator.kv_events import apply
from pdserve_server.coordinator.kv_relay import KvEventRelay, int64_hash
from pdserve_server.coordinator.prefix_index import PrefixIndex, block_hashes
from pdserve.v1 import worker_pb2

TOKENS = list(range(100, 148))  # three blocks of 16
H = block_hashes(TOKENS, 16)


def stored(i: int) -> worker_pb2.KvEvent:
    return worker_pb2.KvEvent(stored=worker_pb2.KvBlockStored(
        block_hash=H[i], parent_hash=H[i - 1] if i else b"", token_ids=TOKENS[i * 16:(i + 1) * 16]))


def removed(i: int) -> worker_pb2.KvEvent:
    return worker_pb2.KvEvent(removed=worker_pb2.KvBlockRemoved(block_hash=H[i]))


def batch(*events) -> worker_pb2.KvEventBatch:
    return worker_pb2.KvEventBatch(events=events, block_size=16)


def kinds(relay_batch) -> list[tuple[str, list[int]]]:
    out = []
    for e in relay_batch.events:
        kind = e.WhichOneof("data")
        if kind == "stored":
            out.append(("stored", [b.block_hash for b in e.stored.blocks]))
        elif kind == "removed":
            out.append(("removed", list(e.removed.block_hashes)))
        else:
            out.append((kind, []))
    return out


def index_with_relay() -> tuple[PrefixIndex, KvEventRelay]:
    index = PrefixIndex()
    index.relay = KvEventRelay()
    for w in ("p0", "d0"):
        index.follow(w)
    return index, index.relay


def test_a_block_is_stored_once_and_removed_when_its_last_holder_lets_it_go():
    index, relay = index_with_relay()
    apply(index, "p0", batch(stored(0), stored(1)))
    apply(index, "d0", batch(stored(0), stored(1), stored(2)))  # the decode worker received the same KV, and more
    apply(index, "p0", batch(removed(0)))  # d0 still holds block 0: nothing to relay
    apply(index, "d0", batch(removed(0)))
    history = list(relay._history)
    assert [b.sequence_number for b in history] == [1, 2, 3]
    assert kinds(history[0]) == [("stored", [int64_hash(H[0])]), ("stored", [int64_hash(H[1])])]
    assert kinds(history[1]) == [("stored", [int64_hash(H[2])])]
    assert kinds(history[2]) == [("removed", [int64_hash(H[0])])]
    first = history[0].events[1].stored
    assert first.parent_block_hash == int64_hash(H[0]) and list(first.blocks[0].token_ids) == TOKENS[16:32]
    assert not history[0].events[0].stored.HasField("parent_block_hash") and first.blocks[0].block_size == 16
    index.forget("d0")  # restarted: its blocks are gone, p0's block 1 stays live
    assert kinds(relay._history[-1]) == [("removed", [int64_hash(H[2])])] and relay.live_blocks == 1
    index.unfollow("p0")
    assert kinds(relay._history[-1]) == [("removed", [int64_hash(H[1])])] and relay.live_blocks == 0
    assert int64_hash(H[0]) == int.from_bytes(H[0][:8], "big", signed=True)


def test_subscribers_resume_from_their_cursor_or_start_from_a_snapshot():
    async def run():
        index, relay = index_with_relay()
        apply(index, "p0", batch(stored(0)))
        apply(index, "p0", batch(stored(1)))
        snap = relay.subscribe(0)
        chunk = await snap.__anext__()
        assert chunk.HasField("snapshot") and (chunk.snapshot.index, chunk.snapshot.count) == (0, 1)
        assert chunk.sequence_number == 2 and chunk.snapshot.blocks == 2
        assert kinds(chunk) == [("cleared", []), ("stored", [int64_hash(H[0])]), ("stored", [int64_hash(H[1])])]
        resumed = relay.subscribe(2)
        assert kinds(await resumed.__anext__()) == [("stored", [int64_hash(H[1])])]
        apply(index, "p0", batch(stored(2)))  # live: both subscribers get it, after what they were given
        for stream in (snap, resumed):
            live = await asyncio.wait_for(stream.__anext__(), 5)
            assert live.sequence_number == 3 and kinds(live) == [("stored", [int64_hash(H[2])])]
        await snap.aclose()
        await resumed.aclose()
        assert not relay._subscribers

    asyncio.run(run())


def test_a_subscriber_too_far_behind_is_ended_and_nothing_blocks():
    async def run():
        index, relay = index_with_relay()
        apply(index, "p0", batch(stored(0)))
        stream = relay.subscribe(0)
        first = await stream.__anext__()  # the snapshot
        assert kinds(first) == [("cleared", []), ("stored", [int64_hash(H[0])])]
        from pdserve_server.coordinator import kv_relay

        for i in range(kv_relay.SUBSCRIBER_QUEUE + 1):  # it reads nothing meanwhile
            apply(index, "p0", batch(removed(0)) if i % 2 == 0 else batch(stored(0)))
        got = [b async for b in stream]  # what was queued, then the end: it resumes from its cursor
        assert len(got) < kv_relay.SUBSCRIBER_QUEUE + 1 and not relay._subscribers

    asyncio.run(run())
