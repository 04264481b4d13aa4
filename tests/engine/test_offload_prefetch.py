"""Read-ahead from the slow KV offload tiers (`engine.offload.prefetch`): a queued request's blocks are read on a
thread of their own, in chain order up to the first no tier holds, staged within a byte bound, and a load takes
them as memory copies; the engine waits only for the block being read at that moment."""
import random
import threading

import torch
from conftest import hf_greedy

from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.builder import build_engine
from pdserve_server.engine.offline import run_until_idle
from pdserve_server.engine.offload.memory import MemoryTier
from pdserve_server.engine.offload.offloader import KvOffloader
from pdserve_server.engine.offload import prefetch
from pdserve_server.engine.offload.prefetch import Prefetcher
from pdserve_server.engine.offload.stats import TierStats
from pdserve_server.engine.request import Request, SamplingParams
from pdserve_server.engine.scheduling.block_pool import hash_block_tokens


def key(i: int) -> bytes:
    return hash_block_tokens(None, [i])


class SlowTier:
    """A slow tier's face (`get`, `contains`, `put`): holds payloads of 8 bytes for some keys; each `get` can be
    held until the test lets it go, and every read is recorded."""

    name, local, slow = "fake", True, True

    def __init__(self, held: dict[bytes, int], gate: bool = False):
        self.held = held
        self.reads: list[bytes] = []
        self.gate = threading.Semaphore(0) if gate else None
        self.reading = threading.Event()
        self.counters = TierStats(self.name)

    def get(self, k: bytes):
        self.reads.append(k)
        self.reading.set()
        if self.gate is not None:
            self.gate.acquire()
        return None if k not in self.held else torch.full((8,), self.held[k], dtype=torch.uint8)

    def contains(self, k: bytes) -> bool:
        return k in self.held

    def put(self, k: bytes, payload) -> bool:
        return True

    def close(self) -> None:
        pass


def drain(p: Prefetcher) -> None:
    """Wait until the thread has nothing left to read (bounded)."""
    for _ in range(2000):
        with p._cond:
            if not p._wanted and not p._reading and p._jobs.empty():
                return
        threading.Event().wait(0.005)
    raise AssertionError("the read-ahead thread did not finish")


def test_blocks_are_read_in_order_up_to_the_first_missing_and_taken_once():
    tier = SlowTier({key(0): 10, key(1): 11, key(3): 13})
    p = Prefetcher([(1, tier)], capacity_bytes=1024)
    assert p.submit([key(0), key(1), key(2), key(3)])
    drain(p)
    assert tier.reads == [key(0), key(1), key(2)]  # block 3 is of no use without block 2: never read
    tier_index, payload = p.take(key(1))
    assert tier_index == 1 and payload[0] == 11
    assert p.take(key(1)) is None  # taken once
    assert p.take(key(3)) is None
    p.close()


class RemoteTier(SlowTier):
    """A slow tier that reads several blocks a round trip (`get_many`, as `RedisTier`); records each batch."""

    def __init__(self, held: dict[bytes, int]):
        super().__init__(held)
        self.batches: list[list[bytes]] = []

    def get_many(self, keys: list[bytes]):
        self.batches.append(list(keys))
        return [None if k not in self.held else torch.full((8,), self.held[k], dtype=torch.uint8) for k in keys]


def test_a_remote_tier_is_read_a_batch_a_round_trip_up_to_the_first_missing_block():
    tier = RemoteTier({key(i): i for i in range(20) if i != 11})
    p = Prefetcher([(0, tier)], capacity_bytes=1024)
    assert p.batch == prefetch.READ_BATCH == 8
    p.submit([key(i) for i in range(20)])
    drain(p)
    assert tier.batches == [[key(i) for i in range(8)], [key(i) for i in range(8, 16)]]  # nothing after block 11
    assert [p.take(key(i)) is not None for i in (0, 7, 10, 11, 12)] == [True, True, True, False, False]
    p.close()


def test_the_stage_keeps_the_newest_blocks_within_its_bytes():
    tier = SlowTier({key(i): i for i in range(5)})
    p = Prefetcher([(0, tier)], capacity_bytes=3 * 8)
    p.submit([key(i) for i in range(5)])
    drain(p)
    assert [p.take(key(i)) is not None for i in range(5)] == [False, False, True, True, True]
    p.close()


def test_a_take_waits_for_the_block_being_read_and_reads_a_queued_one_itself():
    tier = SlowTier({key(0): 10, key(1): 11, key(2): 12}, gate=True)
    p = Prefetcher([(0, tier)], capacity_bytes=1024)
    p.submit([key(0), key(1), key(2)])
    assert tier.reading.wait(10)  # the thread is inside get(key(0))
    got = []
    taker = threading.Thread(target=lambda: got.append(p.take(key(0))))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive()  # waiting for the read in progress, not reading it a second time
    tier.gate.release()
    taker.join(10)
    assert got[0][1][0] == 10 and tier.reads.count(key(0)) == 1
    # block 1 is being read now (or about to be): block 2 is still queued; a take of it returns at once, and
    # the thread then skips it (the engine reads it itself)
    assert p.take(key(2)) is None
    tier.gate.release(5)
    drain(p)
    assert key(2) not in tier.reads and tier.reads[:2] == [key(0), key(1)]
    p.close()


def test_the_offloader_loads_a_staged_block_as_a_copy_and_keeps_it_out_of_the_cost_rule():
    kv = torch.zeros(4, 8, dtype=torch.uint8)  # 4 blocks of 8 bytes
    slow = SlowTier({key(0): 7})
    off = KvOffloader(kv, [MemoryTier(1024), slow], prefetch_bytes=1024)
    off.prefetch([key(0)])
    drain(off.prefetcher)
    assert off.source(key(0), recompute_ms=0.0) == 1  # staged: loaded whatever the cost rule would say
    assert off.load_from(1, 2, key(0))
    assert torch.equal(kv[2], torch.full((8,), 7, dtype=torch.uint8))
    assert slow.counters.hits == 1 and slow.counters.prefetched == 1 and off.load_ms[1] is None
    assert off.tiers[0].contains(key(0))  # handed to the faster tier, as any load
    off.close()


def test_keys_a_fast_tier_holds_are_not_read_ahead():
    kv = torch.zeros(4, 8, dtype=torch.uint8)
    memory, slow = MemoryTier(1024), SlowTier({key(0): 1, key(1): 2})
    memory.put(key(0), torch.zeros(8, dtype=torch.uint8))
    off = KvOffloader(kv, [memory, slow], prefetch_bytes=1024)
    off.prefetch([key(0), key(1)])
    drain(off.prefetcher)
    assert slow.reads == [key(1)]
    off.close()


def test_a_queued_returning_conversation_loads_its_disk_blocks_read_ahead_with_the_same_tokens(tiny_model_dir,
                                                                                                tmp_path):
    # 8 blocks of 8 tokens: the 60-token other prompt evicts the 40-token conversation's blocks to disk
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=64,
                                    max_model_len=64, kv_offload_disk_dir=str(tmp_path), kv_offload_load="always"))
    rng = random.Random(1)
    conversation = [rng.randrange(3, 49152) for _ in range(41)]

    def request(rid, prompt, n):
        return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                       eos_token_ids=(2,))

    first = request("turn-1", conversation, 6)
    run_until_idle(parts, [first, request("other", [rng.randrange(3, 49152) for _ in range(60)], 1)])
    again = request("turn-2", conversation, 6)
    assert parts.scheduler.add_request(again) is None  # queued: its 5 blocks on disk are read ahead now
    drain(parts.scheduler.kv.offload.prefetcher)
    run_until_idle(parts)
    assert again.output_token_ids == first.output_token_ids == hf_greedy(tiny_model_dir, conversation, 6)
    (disk,) = parts.scheduler.make_stats(0).kv_offload
    assert again.num_cached_tokens == 40 and disk.hits == 5 and disk.prefetched == 5
    assert parts.scheduler.kv.pool.integrity_errors() == []
    parts.scheduler.kv.close()


class Gated:
    """A tier whose reads wait for the test's go-ahead (one `release` a block)."""

    def __init__(self, tier):
        self.tier, self.gate = tier, threading.Semaphore(0)

    def get(self, k: bytes):
        self.gate.acquire()
        return self.tier.get(k)


def test_running_requests_step_while_a_queued_ones_blocks_are_read_and_it_runs_once_they_are(tiny_model_dir,
                                                                                              tmp_path):
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=128,
                                    max_model_len=64, kv_offload_disk_dir=str(tmp_path), kv_offload_load="always"))
    sched = parts.scheduler
    rng = random.Random(3)
    conversation = [rng.randrange(3, 49152) for _ in range(41)]

    def request(rid, prompt, n):
        return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                       eos_token_ids=(2,))

    def step() -> list[str]:
        out = sched.schedule()
        sched.update(out, parts.runner.execute(out))
        return [s.request.request_id for s in out.prefills + out.decodes]

    first = request("turn-1", conversation, 6)
    others = [request(f"other-{i}", [rng.randrange(3, 49152) for _ in range(60)], 1) for i in range(2)]
    for req in (first, *others):  # one after the other: the conversation's blocks are on disk only now
        run_until_idle(parts, [req])
    neighbour = request("neighbour", list(range(100, 108)), 40)
    assert sched.add_request(neighbour) is None
    assert step() == ["neighbour"]
    prefetcher = sched.kv.offload.prefetcher
    (index, disk), = prefetcher.tiers
    gated = Gated(disk)
    prefetcher.tiers = [(index, gated)]
    again = request("turn-2", conversation, 6)
    assert sched.add_request(again) is None
    for _ in range(3):  # its 5 blocks are not read yet: the neighbour decodes on without it
        assert step() == ["neighbour"]
    gated.gate.release(5)
    drain(prefetcher)
    assert "turn-2" in step()  # read: scheduled, its blocks copied from memory
    run_until_idle(parts)
    (stats,) = sched.make_stats(0).kv_offload
    assert again.output_token_ids == first.output_token_ids and again.num_cached_tokens == 40
    assert stats.hits == 5 and stats.prefetched == 5
    assert sched.kv.pool.integrity_errors() == [] and not sched.kv._reading
    sched.kv.close()


def test_with_nothing_else_to_run_a_request_does_not_wait_for_its_read_ahead(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "WAIT_S", 0.2)  # the engine's wait for the block held below, before reading it
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=64,
                                    max_model_len=64, kv_offload_disk_dir=str(tmp_path), kv_offload_load="always"))
    rng = random.Random(4)
    conversation = [rng.randrange(3, 49152) for _ in range(41)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = Request("turn-1", conversation, params, eos_token_ids=(2,))
    run_until_idle(parts, [first, Request("other", [rng.randrange(3, 49152) for _ in range(60)], params,
                                          eos_token_ids=(2,))])
    prefetcher = parts.scheduler.kv.offload.prefetcher
    (index, disk), = prefetcher.tiers
    gated = Gated(disk)
    gated.gate.release(1)  # the thread reads one block, then is held: the engine reads the rest itself
    prefetcher.tiers = [(index, gated)]
    again = Request("turn-2", conversation, params, eos_token_ids=(2,))
    run_until_idle(parts, [again], max_steps=20)  # no step is empty waiting on the read-ahead (that raises)
    assert again.output_token_ids == first.output_token_ids and again.num_cached_tokens == 40
    gated.gate.release(10)
    parts.scheduler.kv.close()


def test_a_failing_read_ends_its_chain_and_the_thread_reads_on():
    class Failing(SlowTier):
        def get(self, k):
            if k == key(1):
                raise PermissionError("no access")
            return super().get(k)

    tier = Failing({key(i): i for i in range(4)})
    p = Prefetcher([(0, tier)], capacity_bytes=1024)
    p.submit([key(0), key(1), key(2)])
    drain(p)
    assert [p.take(key(i)) is not None for i in range(3)] == [True, False, False]  # nothing after the failure
    p.submit([key(3)])  # the thread outlived it
    drain(p)
    assert p.take(key(3)) is not None
    p.close()


def test_a_read_that_stalls_holds_its_request_back_no_longer_than_the_bound(tiny_model_dir, tmp_path, monkeypatch):
    from pdserve_server.engine.scheduling import kv_cache_manager

    monkeypatch.setattr(kv_cache_manager, "READ_AHEAD_HOLD_S", 0.0)  # every hold has run out at once
    monkeypatch.setattr(prefetch, "WAIT_S", 0.2)
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=128,
                                    max_model_len=64, kv_offload_disk_dir=str(tmp_path), kv_offload_load="always"))
    sched = parts.scheduler
    rng = random.Random(6)
    conversation = [rng.randrange(3, 49152) for _ in range(41)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = Request("turn-1", conversation, params, eos_token_ids=(2,))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for req in (first, *(Request(f"other-{i}", [rng.randrange(3, 49152) for _ in range(60)], one,
                                 eos_token_ids=(2,)) for i in range(2))):
        run_until_idle(parts, [req])
    assert sched.add_request(Request("neighbour", list(range(100, 108)),
                                     SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                     eos_token_ids=(2,))) is None
    out = sched.schedule()
    sched.update(out, parts.runner.execute(out))
    prefetcher = sched.kv.offload.prefetcher
    (index, disk), = prefetcher.tiers
    gated = Gated(disk)  # the read stalls
    prefetcher.tiers = [(index, gated)]
    again = Request("turn-2", conversation, params, eos_token_ids=(2,))
    assert sched.add_request(again) is None
    out = sched.schedule()  # not held back: the stalled read's bound has passed
    assert "turn-2" in [s.request.request_id for s in out.prefills + out.decodes]
    sched.update(out, parts.runner.execute(out))
    run_until_idle(parts)
    assert again.output_token_ids == first.output_token_ids and again.num_cached_tokens == 40
    gated.gate.release(10)
    sched.kv.close()
