"""KV offload tiers (`engine.offload`): blocks the pool evicts go to a host-memory or disk tier and come back instead
of being recomputed, with HF's greedy tokens; a disk entry that is truncated or corrupt is caught by its length or
checksum and recomputed; the disk tier outlives its engine (a warm restart) and is bounded in bytes."""
import random

import pytest
import torch
from conftest import hf_greedy

from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.builder import build_engine
from pdserve_server.engine.offline import run_until_idle
from pdserve_server.engine.outputs import KvBlockRemoved, KvBlockStored
from pdserve_server.engine.offload.disk import DiskTier
from pdserve_server.engine.offload.entry import HEADER
from pdserve_server.engine.offload.memory import MemoryTier
from pdserve_server.engine.offload.offloader import PROBE_EVERY, KvOffloader
from pdserve_server.engine.request import Request, SamplingParams, SchedulingParams
from pdserve_server.engine.scheduling.block_pool import hash_block_tokens
from pdserve_server.engine.scheduling.kv_cache_manager import KVCacheManager


def payload(n: int, fill: int) -> torch.Tensor:
    return torch.full((n,), fill, dtype=torch.uint8)


def key(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def test_memory_tier_keeps_the_most_recent_within_its_bytes():
    tier = MemoryTier(capacity_bytes=300)
    for i in range(3):
        tier.put(key(i), payload(100, i))
    assert tier.get(key(0)) is not None  # now the most recently used
    tier.put(key(3), payload(100, 3))
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert tier.counters.evictions == 1 and tier.counters.stored_bytes == 400
    tier.put(key(9), payload(301, 9))  # larger than the tier: not kept, nothing else lost
    assert not tier.contains(key(9)) and tier.contains(key(3))


def test_disk_tier_round_trip_bound_and_warm_restart(tmp_path):
    entry = HEADER.size + 64
    tier = DiskTier(tmp_path, capacity_bytes=3 * entry, namespace="ns", entry_bytes=64)
    for i in range(4):
        tier.put(key(i), payload(64, i))
        assert tier.contains(key(i))  # readable while queued for the writer
    tier.close()
    assert sorted(p.name for p in (tmp_path / "ns").glob("*/*.kv")) == sorted(f"{key(i).hex()}.kv" for i in (1, 2, 3))
    assert tier.counters.evictions == 1 and tier.counters.stored_bytes == 4 * 64

    again = DiskTier(tmp_path, capacity_bytes=3 * entry, namespace="ns", entry_bytes=64)  # a restarted worker
    assert torch.equal(again.get(key(2)), payload(64, 2))
    assert again.get(key(0)) is None
    other = DiskTier(tmp_path, capacity_bytes=3 * entry, namespace="other-model", entry_bytes=64)
    assert not other.contains(key(2)) and other.get(key(2)) is None  # another namespace shares nothing
    again.close()
    other.close()


def test_a_disk_tier_deletes_what_a_dead_writer_left_at_start_and_keeps_a_live_ones(tmp_path):
    import os
    import time

    from pdserve_server.engine.offload.disk import STALE_TMP_S

    DiskTier(tmp_path, capacity_bytes=2**20, namespace="ns", entry_bytes=64).close()
    (tmp_path / "ns" / "ab").mkdir()
    dead = tmp_path / "ns" / "ab" / f"{key(1).hex()}.kv.4242.tmp"
    live = tmp_path / "ns" / "ab" / f"{key(2).hex()}.kv.4343.tmp"
    for path in (dead, live):
        path.write_bytes(b"half an entry")
    old = time.time() - STALE_TMP_S - 60
    os.utime(dead, (old, old))
    DiskTier(tmp_path, capacity_bytes=2**20, namespace="ns", entry_bytes=64).close()  # a restart
    assert not dead.exists() and live.exists()  # a young one may be another worker's write in progress


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "wrong size"])
def test_disk_tier_catches_a_bad_entry_and_deletes_it(tmp_path, damage):
    tier = DiskTier(tmp_path, capacity_bytes=10_000, namespace="ns", entry_bytes=64)
    tier.put(key(1), payload(64, 7))
    tier.close()
    (path,) = (tmp_path / "ns").glob("*/*.kv")
    data = bytearray(path.read_bytes())
    if damage == "flipped byte":
        data[-1] ^= 0xFF
    elif damage == "truncated":
        data = data[:-10]
    path.write_bytes(bytes(data))
    reader = DiskTier(tmp_path, capacity_bytes=10_000, namespace="ns", entry_bytes=64 if damage != "wrong size" else 32)
    assert reader.get(key(1)) is None
    assert reader.counters.corrupt == 1 and not path.exists() and not reader.contains(key(1))
    reader.close()


def test_offloader_saves_an_evicted_block_and_loads_it_into_another():
    kv = torch.randn(5, 2, 2, 4, 1, 8)  # [blocks + 1, layers, K/V, block_size, kv_heads, head_dim]
    offloader = KvOffloader(kv, [MemoryTier(10_000)])
    manager = KVCacheManager(4, 4, enable_prefix_caching=True, offload=offloader)
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    req = Request("a", prompt, SamplingParams(max_tokens=1))
    assert manager.allocate_slots("a", len(prompt))
    req.num_computed_tokens = len(prompt)
    manager.cache_full_blocks(req)
    table = manager.get_block_table("a")
    saved = kv[table[:3]].clone()
    manager.free("a")

    assert manager.allocate_slots("b", 16)  # takes all 4 blocks: the 3 cached ones are evicted, and saved
    kv[:4] = 0.0  # "b" overwrites them
    assert offloader.stats()[0].stored_bytes == 3 * kv[0].nbytes
    manager.free("b")

    hits = manager.get_computed_blocks(Request("c", prompt, SamplingParams(max_tokens=1)))
    assert len(hits) == 3 and torch.equal(kv[hits], saved)
    assert offloader.stats()[0].hits == 3
    assert manager.pool.integrity_errors() == [] and manager.pool.num_free_blocks == 4
    assert manager.get_computed_blocks(Request("d", prompt, SamplingParams(max_tokens=1))) == hits  # now pool hits
    assert offloader.stats()[0].hits == 3


def test_the_cost_rule_recomputes_a_block_its_tier_loads_slower_than_a_prefill_and_probes_it_again():
    """Under the cost rule a tier whose measured load time per block exceeds the block's measured prefill cost is
    passed over (counted as declined), except every PROBE_EVERY-th block; "always" loads whatever the times."""
    kv = torch.randn(5, 2, 2, 4, 1, 8)
    offloader = KvOffloader(kv, [MemoryTier(10_000)])
    offloader.tiers[0].put(key(1), kv[1].reshape(-1).view(torch.uint8).clone())
    assert offloader.load(2, key(1), recompute_ms=0.001)  # unmeasured tier: loaded, and now measured
    assert offloader.load_ms[0] is not None and torch.equal(kv[2], kv[1])
    offloader.load_ms[0] = 5.0  # as if its loads had measured 5 ms a block
    assert offloader.load(3, key(1), recompute_ms=None)  # prefill cost unmeasured: loaded
    offloader.load_ms[0] = 5.0
    assert offloader.load(3, key(1), recompute_ms=6.0)  # cheaper than prefilling: loaded
    offloader.load_ms[0] = 5.0
    declined = [not offloader.load(3, key(1), recompute_ms=1.0) for _ in range(PROBE_EVERY)]
    assert declined == [True] * (PROBE_EVERY - 1) + [False]  # the last one probes the tier
    assert offloader.stats()[0].declined == PROBE_EVERY - 1 and offloader.stats()[0].hits == 4
    always = KvOffloader(kv, offloader.tiers, load_rule="always")
    always.load_ms[0] = 5.0
    assert always.load(4, key(1), recompute_ms=1.0)


def test_a_declined_load_leaves_the_pool_whole_and_the_block_recomputed():
    kv = torch.randn(5, 2, 2, 4, 1, 8)
    offloader = KvOffloader(kv, [MemoryTier(10_000)])
    manager = KVCacheManager(4, 4, enable_prefix_caching=True, offload=offloader)
    prompt = list(range(100, 113))
    req = Request("a", prompt, SamplingParams(max_tokens=1))
    assert manager.allocate_slots("a", len(prompt))
    req.num_computed_tokens = len(prompt)
    manager.cache_full_blocks(req)
    manager.free("a")
    assert manager.allocate_slots("b", 16)  # evicts the 3 cached blocks into the tier
    manager.free("b")
    offloader.load_ms[0] = 5.0  # 5 ms a block, against 0.1 ms a token x 4 tokens to prefill it
    assert manager.get_computed_blocks(Request("c", prompt, SamplingParams(max_tokens=1)), 0.1) == []
    assert offloader.stats()[0].declined == 1 and offloader.stats()[0].hits == 0
    assert manager.pool.integrity_errors() == [] and manager.pool.num_free_blocks == 4
    assert len(manager.get_computed_blocks(Request("d", prompt, SamplingParams(max_tokens=1)), 10.0)) == 3


def test_the_engine_applies_the_cost_rule_with_its_measured_prefill_cost(tiny_model_dir):
    """The scheduler hands its measured prefill cost (`StepCost`) to the lookup: a tier measured slower than it is
    not loaded from, and the tokens are HF's either way."""
    parts = engine(tiny_model_dir, kv_offload_cpu_bytes=2**20, kv_offload_load="cost")
    rng = random.Random(6)
    conversation = [rng.randrange(3, 49152) for _ in range(41)]
    first = run(parts, "turn-1", conversation, 6).output_token_ids
    run(parts, "other", [rng.randrange(3, 49152) for _ in range(60)], 1)
    assert parts.scheduler.step_cost.ms_per_prefill_token is not None  # measured on the 41- and 60-token prompts
    parts.scheduler.kv.offload.load_ms[0] = 1e6  # a tier far slower than any prefill
    again = run(parts, "turn-2", conversation, 6)
    assert again.output_token_ids == first == hf_greedy(tiny_model_dir, conversation, 6)
    assert again.num_cached_tokens == 0
    (tier,) = parts.scheduler.make_stats(0).kv_offload
    assert tier.declined == 1 and tier.hits == 0
    assert parts.scheduler.kv.pool.integrity_errors() == []


def engine(model_dir, **offload):
    # 8 blocks of 8 tokens: a 40-token conversation and a 60-token other one cannot both stay in the pool. Loads
    # always (not by the measured cost rule, which a busy machine's timings could tip): the counts below are exact.
    offload.setdefault("kv_offload_load", "always")
    return build_engine(EngineArgs(dtype="float32", model_dir=str(model_dir), block_size=8, kv_tokens=64,
                                   max_model_len=64, **offload))


def run(parts, rid, prompt, n):
    req = Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), eos_token_ids=(2,))
    run_until_idle(parts, [req])
    return req


@pytest.mark.parametrize("tiers", ["cpu", "disk", "cpu+disk"])
def test_an_evicted_prefix_comes_back_from_a_tier_with_hfs_tokens(tiny_model_dir, tmp_path, tiers):
    offload = {}
    if "cpu" in tiers:
        offload["kv_offload_cpu_bytes"] = 2**20
    if "disk" in tiers:
        offload["kv_offload_disk_dir"] = str(tmp_path)
    parts = engine(tiny_model_dir, **offload)
    rng = random.Random(1)
    conversation = [rng.randrange(3, 49152) for _ in range(41)]
    other = [rng.randrange(3, 49152) for _ in range(60)]
    first = run(parts, "turn-1", conversation, 6).output_token_ids
    run(parts, "other", other, 1)  # evicts every block of the conversation
    again = run(parts, "turn-2", conversation, 6)
    assert first == again.output_token_ids == hf_greedy(tiny_model_dir, conversation, 6)
    assert again.num_cached_tokens == 40  # all 5 full blocks, none recomputed
    stats = {t.tier: t for t in parts.scheduler.make_stats(0).kv_offload}
    fastest = tiers.split("+")[0]
    assert stats[fastest].hits == 5 and stats[fastest].loaded_bytes == 5 * parts.runner.kv_cache.kv[0].nbytes
    assert sum(t.hits for t in stats.values()) == 5
    assert parts.scheduler.kv.pool.integrity_errors() == []
    parts.scheduler.kv.close()


def test_a_cache_salt_keeps_a_tenants_prefix_from_another_in_the_pool_and_in_a_tier(tiny_model_dir):
    """Requests with different cache salts (tenants under --isolate-prefix-cache-by-tenant) never share a block,
    neither in the pool nor from a tier; the same salt shares both; tokens are HF's throughout."""
    parts = engine(tiny_model_dir, kv_offload_cpu_bytes=2**20)
    rng = random.Random(7)
    prompt = [rng.randrange(3, 49152) for _ in range(41)]
    expected = hf_greedy(tiny_model_dir, prompt, 6)

    def send(rid: str, salt: str, tokens=prompt, n=6):
        req = Request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                      eos_token_ids=(2,), scheduling=SchedulingParams(tenant=salt, cache_salt=salt))
        run_until_idle(parts, [req])
        return req

    first = send("a-1", "tenant-a")
    assert first.output_token_ids == expected and first.num_cached_tokens == 0
    assert send("b-1", "tenant-b").num_cached_tokens == 0  # in the pool, but tenant a's
    assert send("none", "").num_cached_tokens == 0  # unsalted requests share only among themselves
    assert send("a-2", "tenant-a").num_cached_tokens == 40
    send("other", "", [rng.randrange(3, 49152) for _ in range(60)], n=1)  # evicts everything into the tier
    assert send("b-2", "tenant-b").num_cached_tokens == 40  # b's own blocks, from the tier
    back = send("a-3", "tenant-a")
    assert back.output_token_ids == expected and back.num_cached_tokens == 40
    assert parts.scheduler.kv.pool.integrity_errors() == []
    parts.scheduler.kv.close()


def test_without_tiers_the_evicted_prefix_is_recomputed(tiny_model_dir):
    parts = engine(tiny_model_dir)
    rng = random.Random(1)
    conversation = [rng.randrange(3, 49152) for _ in range(41)]
    run(parts, "turn-1", conversation, 6)
    run(parts, "other", [rng.randrange(3, 49152) for _ in range(60)], 1)
    assert run(parts, "turn-2", conversation, 6).num_cached_tokens == 0
    assert parts.scheduler.make_stats(0).kv_offload == ()


def test_a_restarted_engine_serves_a_prefix_from_disk_and_recomputes_a_corrupt_one(tiny_model_dir, tmp_path):
    rng = random.Random(2)
    conversation = [rng.randrange(3, 49152) for _ in range(41)]
    parts = engine(tiny_model_dir, kv_offload_disk_dir=str(tmp_path))
    first = run(parts, "turn-1", conversation, 6).output_token_ids
    run(parts, "other", [rng.randrange(3, 49152) for _ in range(60)], 1)
    parts.scheduler.kv.close()  # what the engine loop does as it ends
    files = sorted(tmp_path.glob("*/*/*.kv"))
    assert len(files) >= 5

    restarted = engine(tiny_model_dir, kv_offload_disk_dir=str(tmp_path))
    again = run(restarted, "turn-2", conversation, 6)
    assert again.output_token_ids == first and again.num_cached_tokens == 40
    (disk,) = restarted.scheduler.make_stats(0).kv_offload
    assert disk.hits == 5 and disk.corrupt == 0
    restarted.scheduler.kv.close()

    for path in files:  # every entry damaged: each is caught, deleted and its block recomputed
        data = bytearray(path.read_bytes())
        data[HEADER.size + 3] ^= 0x55
        path.write_bytes(bytes(data))
    damaged = engine(tiny_model_dir, kv_offload_disk_dir=str(tmp_path))
    third = run(damaged, "turn-3", conversation, 6)
    assert third.output_token_ids == first and third.num_cached_tokens == 0
    (disk,) = damaged.scheduler.make_stats(0).kv_offload
    # the first block's entry stops the lookup (the read-ahead thread may have found the next one bad too)
    assert disk.hits == 0 and disk.corrupt >= 1
    damaged.scheduler.kv.close()


def test_tiers_refuse_what_they_cannot_serve(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="prefix caching"):
        engine(tiny_model_dir, kv_offload_cpu_bytes=2**20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="cannot hold one KV block"):
        engine(tiny_model_dir, kv_offload_cpu_bytes=100)
    with pytest.raises(ValueError, match="kv-offload-disk-bytes"):
        engine(tiny_model_dir, kv_offload_disk_dir=str(tmp_path), kv_offload_disk_bytes=100)


@pytest.mark.parametrize("store", ["evicted", "computed"])
def test_engines_sharing_a_directory_use_each_others_prefixes_when_blocks_are_stored_as_computed(
        tiny_model_dir, tmp_path, store):
    """Two engines (two workers on one host) on one disk directory: with `--kv-offload-store computed` the second
    loads the prefix the first computed, though the first never evicted it; with `evicted` it recomputes."""
    rng = random.Random(4)
    conversation = [rng.randrange(3, 49152) for _ in range(41)]
    a = engine(tiny_model_dir, kv_offload_disk_dir=str(tmp_path), kv_offload_store=store)
    b = engine(tiny_model_dir, kv_offload_disk_dir=str(tmp_path), kv_offload_store=store)
    first = run(a, "on-a", conversation, 6).output_token_ids
    a.scheduler.kv.close()  # the first engine's writer has landed what it queued
    on_b = run(b, "on-b", conversation, 6)
    assert on_b.output_token_ids == first
    (disk,) = b.scheduler.make_stats(0).kv_offload
    block = b.runner.kv_cache.kv[0].nbytes
    if store == "computed":
        assert on_b.num_cached_tokens == 40 and disk.hits == 5
        assert a.scheduler.make_stats(0).kv_offload[0].stored_bytes == 5 * block  # 46 tokens computed: 5 full blocks
    else:
        assert on_b.num_cached_tokens == 0 and disk.hits == 0
    b.scheduler.kv.close()


def test_kv_events_count_a_block_in_a_tier_as_held_until_the_tier_lets_it_go(tiny_model_dir):
    """With KV events on, a block the pool evicts into a tier is not reported removed (the worker still serves it:
    the coordinator's prefix index keeps routing its conversation there); once the tier drops it, it is."""
    probe = engine(tiny_model_dir)
    block = probe.runner.kv_cache.kv[0].nbytes
    parts = engine(tiny_model_dir, kv_offload_cpu_bytes=6 * block, kv_events=True)
    kv = parts.scheduler.kv
    rng = random.Random(5)
    conversation, other, third = ([rng.randrange(3, 49152) for _ in range(n)] for n in (41, 60, 60))
    run(parts, "turn-1", conversation, 6)
    held = {e.block_hash for e in kv.take_kv_events() if isinstance(e, KvBlockStored)}
    assert len(held) == 5

    run(parts, "other", other, 1)  # evicts the conversation's 5 blocks into the tier
    assert not {e.block_hash for e in kv.take_kv_events() if isinstance(e, KvBlockRemoved)}

    run(parts, "third", third, 1)  # evicts the other's 7 blocks into the 6-block tier: it lets the 6 oldest go
    removed = {e.block_hash for e in kv.take_kv_events() if isinstance(e, KvBlockRemoved)}
    assert held <= removed and len(removed) == 6
    assert kv.pool.integrity_errors() == []


def test_a_tier_namespace_follows_the_weights_content_not_their_copy(tmp_path):
    """Two copies of the same weights (two hosts, or a re-copy: other modification times) share a namespace, so
    they share a Redis tier's entries; other weights of the same shape do not."""
    import os
    import shutil

    from pdserve_server.engine.offload.offloader import tier_namespace

    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    data = random.Random(0).randbytes(3 * 2**20)
    (a / "model.safetensors").write_bytes(data)
    shutil.copy(a / "model.safetensors", b / "model.safetensors")
    os.utime(b / "model.safetensors", (1, 1))
    (c / "model.safetensors").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one byte in the last MiB differs
    ns = {d.name: tier_namespace("compat", EngineArgs(model_dir=str(d))) for d in (a, b, c)}
    assert ns["a"] == ns["b"] != ns["c"]
    assert tier_namespace("other-layout", EngineArgs(model_dir=str(a))) != ns["a"]
