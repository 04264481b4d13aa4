import pytest

from engine.block_pool import BlockPool, hash_block_tokens
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, SamplingParams


def test_allocate_free_exact_ids_and_lru_order():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([0, 1])  # freed in reverse: tail block 1 first, then 0
    assert pool.num_free_blocks == 3
    assert pool.allocate(3) == [3, 1, 0]
    assert pool.integrity_errors() == []


def test_double_free_and_overallocation_raise():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        pool.free([blocks[0]])


def test_chained_hash_depends_on_parent():
    a = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(a, [3, 4]) == hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])


def _req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_prefix_cache_hit_shares_blocks_and_survives_free():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.allocate_slots("a", 10)
    assert kv.get_block_table("a") == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    kv.free("a")
    assert kv.pool.num_free_blocks == 8 and kv.pool.num_cached_free_blocks == 2

    b = _req("b", list(range(8)) + [99, 98, 97])
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    assert kv.allocate_slots("b", 11, hits)
    assert kv.get_block_table("b") == [0, 1, 3]  # block 2 was freed last-in-order, 3 is the LRU head now
    assert kv.pool.ref_counts[0] == 1 and kv.pool.integrity_errors() == []


def test_full_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(8)))
    kv.allocate_slots("a", 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    kv.free("a")
    assert kv.get_computed_blocks(_req("b", list(range(8)))) == [0]  # last block recomputed for logits


def test_eviction_drops_hash_entry():
    kv = KVCacheManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    a = _req("a", [1, 2, 3])
    kv.allocate_slots("a", 3)
    a.num_computed_tokens = 3
    kv.cache_full_blocks(a)
    kv.free("a")
    kv.allocate_slots("x", 4)  # takes both blocks, evicting the cached one
    assert kv.get_computed_blocks(_req("b", [1, 2, 3])) == []
    assert kv.pool.integrity_errors() == []
