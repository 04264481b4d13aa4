import hashlib

import numpy as np
import pytest

from pdserve_server.coordinator.prefix_index import block_hashes
from pdserve_server.engine.scheduling.block_pool import BlockPool, chain_root, hash_block_tokens
from pdserve_server.engine.scheduling.kv_cache_manager import KVCacheManager, window_chunk_cap, window_peak_blocks
from pdserve_server.engine.request import Request, SamplingParams


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


def test_block_keys_are_the_ones_earlier_releases_stored():
    """Disk and Redis tier entries outlive a worker (warm restart, other hosts): a block's key must not change
    between releases. BLAKE2b-128 of the parent's hash and the tokens as little-endian int64, as when numpy made
    the bytes."""
    tokens = [0, 1, 49151, 2**31 + 5]
    first = hashlib.blake2b(np.asarray(tokens, dtype="<i8").tobytes(), digest_size=16).digest()
    assert hash_block_tokens(None, tokens) == first
    assert hash_block_tokens(first, [7]) == hashlib.blake2b(first + np.asarray([7], "<i8").tobytes(),
                                                            digest_size=16).digest()


@pytest.mark.parametrize("salt", ["", "key:0a1b2c3d", "tenant-é"])
def test_the_coordinators_block_hashes_are_the_engines_keys_salted_or_not(salt):
    """The coordinator routes by the keys workers cache under (and report in KV events): same chain, same root."""
    tokens = list(range(100, 150))  # 3 full blocks of 16, and 2 tokens
    parent, root, engine_keys = None, chain_root(salt), []
    for i in range(3):
        parent = hash_block_tokens(parent, tokens[i * 16:(i + 1) * 16], root)
        engine_keys.append(parent)
    assert block_hashes(tokens, 16, salt) == engine_keys
    if salt:
        assert engine_keys[0] != hash_block_tokens(None, tokens[:16])  # the salt changes every key of the chain
        assert block_hashes(tokens, 16, salt + "x")[2] != engine_keys[2]


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


def _windowed(num_blocks=16, prefix_caching=True) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=prefix_caching, sliding_window=6)


def test_blocks_behind_the_window_go_back_and_the_null_block_stands_in():
    """Window 6, blocks of 4: after 12 computed tokens the next token (position 12) sees keys 7..12, so block 0
    (keys 0-3) is behind every later window and block 1 (4-7) is not."""
    kv = _windowed()
    null = kv.null_block
    assert kv.num_usable_blocks == 15 and kv.pool.num_free_blocks == 15
    assert kv.allocate_slots("a", 13)
    table = kv.get_block_table("a")
    assert kv.release_out_of_window("a", 5) == 0  # position 5 sees keys 0..5: nothing behind it yet
    assert kv.release_out_of_window("a", 12) == 1
    assert kv.get_block_table("a") == [null] + table[1:]
    assert table[0] in kv.pool._free and kv.pool.num_free_blocks == 15 - 4 + 1
    assert kv.release_out_of_window("a", 12) == 0  # idempotent
    assert kv.release_out_of_window("a", 17) == 2  # position 17 sees 12..17: blocks 1 and 2 (keys 4-11) go
    assert kv.get_block_table("a")[:3] == [null] * 3 and kv.pool.ref_counts[null] == 1 + 3
    assert kv.pool.integrity_errors() == []
    kv.free("a")
    assert kv.pool.num_free_blocks == kv.num_usable_blocks and kv.pool.ref_counts[null] == 1
    assert kv.pool.integrity_errors() == []


def test_no_window_keeps_every_block_and_every_usable_block():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    assert kv.null_block is None and kv.num_usable_blocks == 4
    assert kv.allocate_slots("a", 16)
    assert kv.release_out_of_window("a", 16) == 0 and len(set(kv.get_block_table("a"))) == 4


def test_released_blocks_stay_prefix_cached_and_the_null_block_never_is():
    """A block given back keeps its hash while free (a request with the same prefix revives it with its real
    content); a table entry that is the null block is never registered, so no hit can return it."""
    kv = _windowed()
    a = _req("a", list(range(20)))
    assert kv.allocate_slots("a", 20)
    first = kv.get_block_table("a")[0]
    a.num_computed_tokens = 20
    kv.cache_full_blocks(a)
    assert kv.release_out_of_window("a", 20) == 3
    assert kv.pool.block_hashes[first] is not None and kv.pool.block_hashes[kv.null_block] is None
    b = _req("b", list(range(20)))
    hits = kv.get_computed_blocks(b)
    assert hits[0] == first and kv.null_block not in hits

    # Hashes registered after the release (a receiver's table) skip the null block but keep the chain going.
    c = _req("c", list(range(100, 120)))
    assert kv.allocate_slots("c", 20)
    assert kv.release_out_of_window("c", 20) == 3
    c.num_computed_tokens = 20
    kv.cache_full_blocks(c)
    assert kv.pool.block_hashes[kv.null_block] is None
    assert kv.get_computed_blocks(_req("d", list(range(100, 120)))) == []  # the chain's first blocks are gone
    assert kv.pool.integrity_errors() == []


def test_fork_shares_null_entries_and_both_tables_free_cleanly():
    kv = _windowed()
    assert kv.allocate_slots("p", 18)
    assert kv.release_out_of_window("p", 18) == 3
    copy = kv.fork("p", "c", 18)  # 4 full blocks shared (3 of them the null block), the partial one copied
    assert copy is not None and kv.get_block_table("c")[:3] == [kv.null_block] * 3
    assert kv.release_out_of_window("c", 18) == 0  # the child knows what the parent gave back
    assert kv.release_out_of_window("c", 22) == 1
    kv.free("p")
    kv.free("c")
    assert kv.pool.num_free_blocks == kv.num_usable_blocks and kv.pool.integrity_errors() == []


def test_a_one_token_window_keeps_the_last_block():
    """Window 1: position 8 sees only itself, but the table's last block (keys 4-7) stays, so a KV transfer of the
    request has a block to send."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False, sliding_window=1)
    assert kv.allocate_slots("a", 8)
    assert kv.release_out_of_window("a", 8) == 1 and kv.get_block_table("a")[1] != kv.null_block


def test_a_window_needs_room_for_the_null_block():
    with pytest.raises(ValueError, match="null block"):
        KVCacheManager(num_blocks=1, block_size=4, enable_prefix_caching=False, sliding_window=8)


def test_a_first_allocation_takes_no_block_behind_the_window():
    """Window 6, blocks of 4. A request whose KV arrives whole (next position 20: keys 15..20) starts with blocks
    0-2 as the null block and takes only blocks 3-4; one with 16 prompt tokens in the prefix cache (next position
    16: keys 11..16) shares hits 2 and 3 and leaves hits 0 and 1 free in the cache."""
    kv = _windowed()
    null = kv.null_block
    assert kv.num_blocks_to_allocate("a", 20, None, 20) == 2
    assert kv.allocate_slots("a", 20, next_position=20)
    table = kv.get_block_table("a")
    assert table[:3] == [null] * 3 and null not in table[3:] and len(table) == 5
    assert kv.num_released("a") == 3 and kv.release_out_of_window("a", 20) == 0
    assert kv.pool.num_free_blocks == kv.num_usable_blocks - 2

    p = _req("p", list(range(100, 120)))
    assert kv.allocate_slots("p", 20)
    p.num_computed_tokens = 20
    kv.cache_full_blocks(p)
    kv.free("p")
    hits = kv.get_computed_blocks(_req("b", list(range(100, 120))))
    assert len(hits) == 4
    free_before = kv.pool.num_free_blocks
    assert kv.num_blocks_to_allocate("b", 20, hits, 16) == 3  # hits 2 and 3 revived, one new block
    assert kv.allocate_slots("b", 20, hits, next_position=16)
    assert kv.get_block_table("b")[:4] == [null, null, hits[2], hits[3]]
    assert kv.pool.num_free_blocks == free_before - 3
    assert kv.pool.ref_counts[hits[0]] == 0 and kv.pool.block_hashes[hits[0]] is not None  # still a cached block
    kv.free("a")
    kv.free("b")
    assert kv.pool.num_free_blocks == kv.num_usable_blocks and kv.pool.integrity_errors() == []


@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_window_peak_blocks_bounds_every_step_of_a_long_request(block_size):
    """A 150-token request in chunks of C, each allocation followed by the per-step release, never holds more than
    `window_peak_blocks` (and reaches it for some window and chunk: the bound is not loose), from a cold start or
    from a prefix hit; and `window_chunk_cap` is the largest chunk whose peak fits the pool."""
    reached = 0
    for window in (1, 3, 6, 8, 13):
        for chunk in (1, 2, 5, 8, 16):
            bound = window_peak_blocks(block_size, window, chunk)
            for start in (0, 2 * block_size, 5 * block_size):
                kv = KVCacheManager(num_blocks=512, block_size=block_size, enable_prefix_caching=False,
                                    sliding_window=window)
                held, pos = 0, start
                while pos < 150:
                    n = min(chunk, 150 - pos)
                    assert kv.allocate_slots("r", pos + n, next_position=pos)
                    held = max(held, sum(b != kv.null_block for b in kv.get_block_table("r")))
                    pos += n
                    kv.release_out_of_window("r", pos)
                assert held <= bound, (window, chunk, start)
                reached += held == bound
    assert reached > 0
    for window in (1, 6, 13):
        for usable in range(2, 12):
            cap = window_chunk_cap(usable, block_size, window)
            if cap is not None:
                assert window_peak_blocks(block_size, window, cap) <= usable
                assert window_peak_blocks(block_size, window, cap + 1) > usable
