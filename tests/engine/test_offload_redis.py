"""The shared KV tier on a real Redis server (`engine.offload.redis_tier`, `--kv-offload-redis-url`): entries round
trip under their namespace, a damaged value is caught by its checksum and recomputed, two engines share each
other's prefixes through it with HF's greedy tokens, a server that cannot be reached refuses the worker's start,
and an outage mid-run costs only recomputed blocks."""
import random

import pytest
import torch
from conftest import hf_greedy
from helpers import wait_for

from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.builder import build_engine
from pdserve_server.engine.offline import run_until_idle
from pdserve_server.engine.offload import entry
from pdserve_server.engine.offload.redis_tier import RedisTier, public_url
from pdserve_server.engine.request import Request, SamplingParams
from pdserve_server.engine.scheduling.block_pool import hash_block_tokens


def key(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def test_redis_tier_round_trip_namespaces_and_a_damaged_value(redis_url):
    import redis

    tier = RedisTier(redis_url, "ns", entry_bytes=64)
    tier.put(key(1), torch.full((64,), 7, dtype=torch.uint8))
    assert tier.contains(key(1))  # readable while queued for the writer
    tier.close()  # the writer has stored it
    reader = RedisTier(redis_url, "ns", entry_bytes=64)  # another worker, on this host or another
    assert reader.contains(key(1)) and torch.equal(reader.get(key(1)), torch.full((64,), 7, dtype=torch.uint8))
    assert reader.get(key(2)) is None and not reader.contains(key(2))
    other = RedisTier(redis_url, "other-model", entry_bytes=64)
    assert not other.contains(key(1))  # another namespace shares nothing
    other.close()

    client = redis.Redis.from_url(redis_url)
    name = b"pdserve:kv:ns:" + key(1).hex().encode()
    value = bytearray(client.get(name))
    value[entry.HEADER.size + 5] ^= 0xFF
    client.set(name, bytes(value))
    assert reader.get(key(1)) is None  # caught, deleted, counted: the block is recomputed
    assert reader.counters.corrupt == 1 and client.get(name) is None
    reader.close()
    client.close()


def test_get_many_reads_a_batch_in_one_round_trip_and_catches_a_damaged_value(redis_url):
    import redis

    writer = RedisTier(redis_url, "batch", entry_bytes=64)
    for i in (1, 2, 4):
        writer.put(key(i), torch.full((64,), i, dtype=torch.uint8))
    writer.close()
    client = redis.Redis.from_url(redis_url)
    name = b"pdserve:kv:batch:" + key(4).hex().encode()
    client.set(name, client.get(name)[:-1])  # truncated
    reader = RedisTier(redis_url, "batch", entry_bytes=64)
    got = reader.get_many([key(1), key(2), key(3), key(4)])
    assert [None if g is None else int(g[0]) for g in got] == [1, 2, None, None]
    assert reader.counters.corrupt == 1 and client.get(name) is None  # caught and deleted, as by `get`
    assert reader.get_many([]) == []
    reader.close()
    client.close()


def test_a_returning_conversation_is_read_ahead_from_redis_with_the_same_tokens(tiny_model_dir, redis_url):
    parts = engine(tiny_model_dir, redis_url)
    rng = random.Random(5)
    conversation = [rng.randrange(3, 49152) for _ in range(41)]
    first = run(parts, "turn-1", conversation, 6)
    run(parts, "other", [rng.randrange(3, 49152) for _ in range(60)], 1)  # evicts the conversation into Redis
    prefetcher = parts.scheduler.kv.offload.prefetcher
    assert prefetcher.batch > 1  # Redis first among the slow tiers: several blocks a round trip
    again = Request("turn-2", conversation, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                    eos_token_ids=(2,))
    assert parts.scheduler.add_request(again) is None
    wait_for(lambda: not parts.scheduler.kv.reading_ahead(again), 30, "turn-2's blocks read ahead")
    run_until_idle(parts)
    (tier,) = parts.scheduler.make_stats(0).kv_offload
    assert again.output_token_ids == first.output_token_ids == hf_greedy(tiny_model_dir, conversation, 6)
    assert again.num_cached_tokens == 40 and tier.hits == 5 and tier.prefetched == 5
    parts.scheduler.kv.close()


def engine(model_dir, url, **kw):
    # 8 blocks of 8 tokens; loads always (the counts below are exact, not left to measured costs)
    return build_engine(EngineArgs(dtype="float32", model_dir=str(model_dir), block_size=8, kv_tokens=64,
                                   max_model_len=64, kv_offload_redis_url=url, kv_offload_load="always", **kw))


def run(parts, rid, prompt, n):
    req = Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), eos_token_ids=(2,))
    run_until_idle(parts, [req])
    return req


def test_two_engines_share_each_others_prefixes_through_redis(tiny_model_dir, redis_url):
    """Two workers (on two hosts, as far as Redis can tell) with `--kv-offload-store computed`: the second serves
    the prefix the first computed, never evicted there, from Redis."""
    rng = random.Random(8)
    conversation = [rng.randrange(3, 49152) for _ in range(41)]
    a = engine(tiny_model_dir, redis_url, kv_offload_store="computed")
    first = run(a, "on-a", conversation, 6)
    a.scheduler.kv.close()  # the writer has stored what it queued
    b = engine(tiny_model_dir, redis_url, kv_offload_store="computed")
    on_b = run(b, "on-b", conversation, 6)
    assert first.output_token_ids == on_b.output_token_ids == hf_greedy(tiny_model_dir, conversation, 6)
    assert first.num_cached_tokens == 0 and on_b.num_cached_tokens == 40
    (tier,) = b.scheduler.make_stats(0).kv_offload
    assert tier.tier == "redis" and tier.hits == 5 and tier.corrupt == 0
    assert b.scheduler.kv.pool.integrity_errors() == []
    b.scheduler.kv.close()


def test_an_unreachable_redis_refuses_the_start_and_an_outage_costs_only_recompute(tiny_model_dir, redis_url):
    import redis

    with pytest.raises(ConnectionError, match="127.0.0.1:1/0 does not answer"):
        engine(tiny_model_dir, "redis://:secret@127.0.0.1:1/0")
    assert public_url("redis://:secret@host:6379/0") == "redis://***@host:6379/0"

    rng = random.Random(9)
    conversation = [rng.randrange(3, 49152) for _ in range(41)]
    parts = engine(tiny_model_dir, redis_url, kv_offload_store="computed")
    expected = run(parts, "before", conversation, 6).output_token_ids
    with redis.Redis.from_url(redis_url) as client:
        client.shutdown(nosave=True)
    run(parts, "other", [rng.randrange(3, 49152) for _ in range(60)], 1)  # evicts the conversation: stores fail
    (tier,) = parts.scheduler.kv.offload.tiers
    # the writer has given up on the conversation's 5 evicted blocks (a block still queued would be served from the
    # queue, correctly, but this checks the outage's path)
    wait_for(lambda: tier.counters.dropped >= 5, 30, "the writer to drop the blocks it cannot store")
    again = run(parts, "during", conversation, 6)  # Redis is gone: every block recomputed, same tokens
    assert again.output_token_ids == expected and again.num_cached_tokens == 0
    assert parts.scheduler.kv.pool.integrity_errors() == []
    parts.scheduler.kv.close()


def test_a_block_evicted_into_redis_alone_is_reported_removed_by_the_kv_events(tiny_model_dir, redis_url):
    """A shared tier is not this worker's cache: a block the pool evicts into Redis only is reported removed (the
    coordinator's index of the worker must not keep every block Redis ever got), one also in host memory is not."""
    from pdserve_server.engine.outputs import KvBlockRemoved, KvBlockStored

    rng = random.Random(10)
    conversation, other = ([rng.randrange(3, 49152) for _ in range(n)] for n in (41, 60))
    for host_tier, reported in ((0, True), (2**20, False)):
        parts = engine(tiny_model_dir, redis_url, kv_events=True, kv_offload_cpu_bytes=host_tier)
        kv = parts.scheduler.kv
        run(parts, "turn-1", conversation, 6)
        held = {e.block_hash for e in kv.take_kv_events() if isinstance(e, KvBlockStored)}
        run(parts, "other", other, 1)  # evicts the conversation's blocks into the tiers
        removed = {e.block_hash for e in kv.take_kv_events() if isinstance(e, KvBlockRemoved)}
        assert len(held) == 5 and (held <= removed) is reported and (not held & removed) is not reported
        kv.close()
