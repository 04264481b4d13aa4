"""Ref-counted pool of KV cache blocks with a prefix cache keyed by chained block hashes.

Lives off the device: it only hands out block ids; `engine.execution.kv_cache.KVCache` owns the memory. Owned by the
engine thread; not thread-safe.

Free blocks sit in an LRU queue. A free block may still hold prefix-cache content (it has a hash): a later
request with the same prefix revives it (`touch`), and `allocate` evicts the least recently freed first, handing
the evicted block to `on_evict` (the offload tiers, `engine.offload`) while its contents are still intact.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from pdserve_server.engine.outputs import KvBlockRemoved, KvBlockStored


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], root: bytes | None = None) -> bytes:
    """Chained hash of one full block: blake2b(parent hash || token ids as int64). 16 bytes.

    Chaining makes a block's hash identify the whole prefix up to and including it, as in vLLM's prefix cache. A
    prompt's first block (parent_hash None) chains from `root`: a cache salt's (`chain_root`), or nothing.
    (`coordinator.prefix_index.block_hashes` computes the same: the coordinator loads no engine module.) The tokens'
    bytes come from the standard library's `array` (0.65 us a 16-token block here, numpy's 0.96), the bytes every
    earlier release stored (tier entries outlive workers: `test_block_pool`).
    """
    h = hashlib.blake2b(digest_size=16)
    start = parent_hash if parent_hash is not None else root
    if start is not None:
        h.update(start)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def chain_root(cache_salt: str) -> bytes | None:
    """Where a request's chain of block hashes starts: None without a salt; with one, blake2b of a fixed label and
    the salt (16 bytes), which no block's hash equals, so salted chains never meet unsalted or other salts' chains."""
    if not cache_salt:
        return None
    return hashlib.blake2b(b"pdserve cache salt\0" + cache_salt.encode(), digest_size=16).digest()


class BlockPool:
    """Hands out KV block ids with reference counts.

    Invariants (checked by `integrity_errors`): a block is in the free queue iff its ref count is 0; every entry of
    the hash map points at a block carrying that hash; block ids are 0..num_blocks-1.
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._num_cached_free = 0  # free blocks that still carry a hash, kept current for O(1) stats
        self.kv_events: list | None = None  # a list: what entered and left the prefix cache is recorded here
        # Called with (block id, prefix hash) for each cached block allocate() evicts, before it is handed out;
        # returns whether the content was kept elsewhere (an offload tier), which records no KvBlockRemoved.
        self.on_evict: Callable[[int, bytes], bool] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold reusable prefix-cache content."""
        return self._num_cached_free

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (ref count 1), evicting their old prefix-cache entries.

        Raises:
            MemoryError: fewer than n blocks are free (callers check `num_free_blocks` first).
        """
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            old = self.block_hashes[block]
            if old is not None:
                self._num_cached_free -= 1
                if self._cached.get(old) == block:
                    del self._cached[old]
                    kept = self.on_evict is not None and self.on_evict(block, old)
                    if self.kv_events is not None and not kept:  # a block a tier kept is still this worker's
                        self.kv_events.append(KvBlockRemoved(old))
                self.block_hashes[block] = None
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue.

        Freed in reverse so that a request's tail blocks (least likely shared) are evicted before its head.

        Raises:
            ValueError: a block was already free (double free).
        """
        for block in reversed(block_ids):
            if self.ref_counts[block] <= 0:
                raise ValueError(f"double free of KV block {block}")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                self._num_cached_free += self.block_hashes[block] is not None

    def lookup(self, block_hash: bytes) -> int | None:
        """Block id holding this prefix hash, or None."""
        return self._cached.get(block_hash)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on cached blocks (prefix-cache hit), reviving free ones."""
        for block in block_ids:
            if self.ref_counts[block] == 0:
                del self._free[block]
                self._num_cached_free -= self.block_hashes[block] is not None
            self.ref_counts[block] += 1

    def cache_block(self, block_id: int, block_hash: bytes, parent_hash: bytes | None = None,
                    token_ids: Sequence[int] = ()) -> bool:
        """Record that block_id holds the full block identified by block_hash (first writer wins); parent_hash and
        token_ids (the block's tokens) go into its `KvBlockStored` when events are recorded. Returns whether the
        block was registered (False: it carries a hash already, or another block holds this one)."""
        if self.block_hashes[block_id] is not None:
            return False
        if block_hash in self._cached:
            return False  # same content computed twice by concurrent requests; keep the first copy
        self.block_hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        if self.kv_events is not None:
            self.kv_events.append(KvBlockStored(block_hash, parent_hash, list(token_ids)))
        return True

    def take_kv_events(self) -> list:
        """The KV events recorded since the last call (none unless `kv_events` is a list)."""
        if not self.kv_events:
            return []
        out, self.kv_events = self.kv_events, []
        return out

    def integrity_errors(self) -> list[str]:
        """The violated invariants, one message each; an empty list means the pool is consistent."""
        errors = []
        for b in range(self.num_blocks):
            rc = self.ref_counts[b]
            if rc < 0:
                errors.append(f"block {b} has ref count {rc}")
            if (rc == 0) != (b in self._free):
                errors.append(f"block {b}: ref count {rc} but in free queue={b in self._free}")
        for h, b in self._cached.items():
            if self.block_hashes[b] != h:
                errors.append(f"hash map entry for block {b} does not match its hash")
        if len(self._free) > self.num_blocks:
            errors.append("free queue longer than the pool")
        cached_free = sum(1 for b in self._free if self.block_hashes[b] is not None)
        if cached_free != self._num_cached_free:
            errors.append(f"cached free blocks counted {self._num_cached_free}, found {cached_free}")
        return errors
