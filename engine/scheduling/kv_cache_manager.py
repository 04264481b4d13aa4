"""Per-request block tables on top of the block pool, with prefix-cache lookup and registration."""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pdserve_server.engine.outputs import KvBlockRemoved
from pdserve_server.engine.scheduling.block_pool import BlockPool, chain_root, hash_block_tokens
from pdserve_server.engine.request import Request

if TYPE_CHECKING:
    from pdserve_server.engine.offload.offloader import KvOffloader

# The longest a queued request is held back while its blocks are read ahead from a slow tier (`reading_ahead`):
# a read that takes longer (a stalled disk or server) must not keep it waiting behind a busy batch.
READ_AHEAD_HOLD_S = 2.0


def sliding_kv_window(layer_windows: tuple[int, ...] | None) -> int:
    """The window W behind which a request's blocks can be given back: the widest layer window when every layer
    slides (`ModelConfig.layer_windows`), else 0 (a layer that attends to every key needs every block)."""
    return max(layer_windows) if layer_windows and min(layer_windows) > 0 else 0


def usable_blocks(num_blocks: int, sliding_window: int) -> int:
    """Blocks requests can hold in a pool of num_blocks: all but the null block when blocks are given back behind
    a window (`KVCacheManager`). What a worker advertises as its capacity."""
    return num_blocks - (1 if sliding_window else 0)


def window_peak_blocks(block_size: int, sliding_window: int, max_chunk: int) -> int:
    """Most blocks a request holds at once under a sliding window W when each step computes at most max_chunk of
    its tokens: the window behind the step's first token, the step's tokens, and up to block_size - 1 positions of
    misalignment at each end, so blocks_needed(W + max_chunk + block_size - 2); and, when the window is narrower
    than a block (the last block is always kept), the step's blocks plus that one. Blocks behind the window go
    back after every step (`KVCacheManager.release_out_of_window`) and a first allocation takes none of them.
    n-gram drafts may take a decode a few blocks past this, and only from blocks no other request needs that step
    (`Scheduler._allocate_drafts`)."""
    cover = -(-(sliding_window + max_chunk + block_size - 2) // block_size)
    return max(cover, -(-max_chunk // block_size) + 1)


def window_chunk_cap(num_usable: int, block_size: int, sliding_window: int) -> int | None:
    """The largest step chunk (tokens) with which one request of any length fits a pool of num_usable blocks under
    a sliding window W (`window_peak_blocks` <= num_usable); None when even one token a step does not fit."""
    cap = min(num_usable * block_size - sliding_window - block_size + 2, (num_usable - 1) * block_size)
    return cap if cap >= 1 else None


def max_request_tokens(num_blocks: int, block_size: int, sliding_window: int, max_model_len: int) -> int:
    """Most tokens (prompt + output) one request may hold on a worker: its context, when blocks behind a sliding
    window go back and a window plus a token fits the pool (prefill chunks are capped to fit:
    `Scheduler`); else what the pool holds. What a worker advertises (`WorkerInfo.max_request_tokens`)."""
    usable = usable_blocks(num_blocks, sliding_window)
    if sliding_window and window_chunk_cap(usable, block_size, sliding_window) is not None:
        return max_model_len
    return min(max_model_len, usable * block_size)


def max_request_blocks(num_blocks: int, block_size: int, sliding_window: int, max_chunk: int) -> int:
    """Most blocks one request holds at once on a worker whose steps compute at most max_chunk of a request's
    tokens: the window's peak (`window_peak_blocks`, the chunk capped as the scheduler caps a request longer than
    the pool) when blocks go back behind a sliding window, else 0 (a block per block_size tokens of its context).
    What a worker advertises (`WorkerInfo.max_request_blocks`)."""
    if not sliding_window:
        return 0
    cap = window_chunk_cap(usable_blocks(num_blocks, sliding_window), block_size, sliding_window)
    return window_peak_blocks(block_size, sliding_window, max_chunk if cap is None else min(max_chunk, cap))


class KVCacheManager:
    """Maps request ids to their block tables. Owned by the engine thread.

    Sliding window: when every layer of the model attends over at most `sliding_window` W keys (Mistral, Phi-3,
    Mixtral with a window), a block whose last position is older than the next token's window can never be read
    again. `release_out_of_window` gives such blocks back to the pool and puts the null block in their place in the
    table, as vLLM's sliding-window KV manager does, so a long request holds about W / block_size + 1 blocks
    instead of its whole context. The table keeps its length (slot mapping and block counts stay positional); the
    attention kernels never read positions outside the window (`kernels.reference`), so the null block's contents
    do not matter. In disaggregation the decode worker never takes those blocks (its reservation starts them as the
    null block: `allocate_slots`' next_position) and the prefill worker skips them (`Scheduler.reserve`). The null
    block is taken from the pool at construction and never freed: every table entry that names it holds one reference,
    so `free` and `fork` treat it as any shared block.

    Args:
        num_blocks: pool size.
        block_size: tokens per block.
        enable_prefix_caching: look up and register full blocks by chained hash.
        sliding_window: W >= 1 when every layer slides over at most W keys; 0 keeps every block to the end.
        offload: tiers under the pool (`engine.offload`): blocks the pool evicts go there, and a lookup that runs
            past the pool continues there (`get_computed_blocks`); None = evicted blocks are dropped.

    Raises:
        ValueError: num_blocks < 2 with a sliding window (one block is the null block).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, sliding_window: int = 0,
                 offload: KvOffloader | None = None):
        if sliding_window and num_blocks < 2:
            raise ValueError(f"a sliding-window KV cache needs at least 2 blocks (one is the null block), "
                             f"got {num_blocks}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.null_block = self.pool.allocate(1)[0] if sliding_window else None
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # chained hashes of each request's registered full blocks
        self._released: dict[str, int] = {}  # leading table entries already swapped for the null block
        # queued request -> (the last key of its read-ahead, time.monotonic() it was asked for) (`prefetch`)
        self._reading: dict[str, tuple[bytes, float]] = {}
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.offload = offload
        if offload is not None:
            self.pool.on_evict = offload.save

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: the pool less the null block, if any (`usable_blocks`)."""
        return usable_blocks(self.pool.num_blocks, self.sliding_window)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def max_chunk(self) -> int | None:
        """Most tokens one step may compute for a request longer than the pool so that it fits under the sliding
        window (`window_chunk_cap`); None without a window, or when not even the window and one token fit (such a
        request is refused at admission, and one that fits whole needs no cap)."""
        if not self.sliding_window:
            return None
        return window_chunk_cap(self.num_usable_blocks, self.block_size, self.sliding_window)

    def peak_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """Most blocks a request of num_tokens tokens (prompt + output) holds at once when its steps compute at most
        max_chunk tokens: all of its blocks, or under a sliding window the window's (`window_peak_blocks`)."""
        need = self.blocks_needed(num_tokens)
        if not self.sliding_window:
            return need
        return min(need, window_peak_blocks(self.block_size, self.sliding_window, max_chunk))

    def _behind_window(self, request_id: str, num_total_tokens: int, next_position: int | None) -> int:
        """Leading entries of a first allocation that the token at next_position (and every later one) cannot
        attend to: they start as the null block and never take a block (`release_out_of_window`'s rule)."""
        if not self.sliding_window or next_position is None or request_id in self.block_tables:
            return 0
        return min(max(0, next_position - self.sliding_window + 1) // self.block_size,
                   self.blocks_needed(num_total_tokens) - 1)

    def _plan(self, request_id: str, num_total_tokens: int, computed_blocks: list[int] | None,
              next_position: int | None) -> tuple[int, list[int], int]:
        """What `allocate_slots` appends: (leading null entries, prefix-cache hits shared, new blocks)."""
        lead = self._behind_window(request_id, num_total_tokens, next_position)
        shared = (computed_blocks or [])[lead:]
        need = self.blocks_needed(num_total_tokens) - len(self.block_tables.get(request_id, [])) - lead - len(shared)
        return lead, shared, need

    def num_blocks_to_allocate(self, request_id: str, num_total_tokens: int,
                               computed_blocks: list[int] | None = None, next_position: int | None = None) -> int:
        """Free blocks `allocate_slots` with these arguments would take (new ones and revived cached ones)."""
        _, shared, need = self._plan(request_id, num_total_tokens, computed_blocks, next_position)
        return max(need, 0) + sum(1 for b in shared if self.pool.ref_counts[b] == 0)

    def prefetch(self, request: Request) -> None:
        """Have the offload tiers read ahead the request's full blocks that the pool lacks (`KvOffloader.prefetch`),
        while it is queued; nothing without tiers or prefix caching."""
        if self.offload is None or self.offload.prefetcher is None or not self.enable_prefix_caching:
            return
        keys = [block_hash for _, _, block_hash in self._prefix_blocks(request) if self.pool.lookup(block_hash) is None]
        if (last := self.offload.prefetch(keys)) is not None:
            self._reading[request.request_id] = (last, time.monotonic())

    def reading_ahead(self, request: Request) -> bool:
        """Whether the request's blocks are still being read ahead (`prefetch`), for at most READ_AHEAD_HOLD_S:
        a read that takes longer (a stalled disk or server) no longer holds the request back."""
        entry = self._reading.get(request.request_id)
        if entry is None:
            return False
        last, since = entry
        if self.offload.prefetcher.pending(last) and time.monotonic() - since < READ_AHEAD_HOLD_S:
            return True
        del self._reading[request.request_id]
        return False

    def _prefix_blocks(self, request: Request) -> Iterator[tuple[list[int], bytes | None, bytes]]:
        """(tokens, parent's hash or None, chained hash) of each full block a prefix-cache lookup may match, in
        order: every full block but one that would hold the last token (the step computing it gives the logits)."""
        tokens, size = request.all_token_ids, self.block_size
        parent, root = None, chain_root(request.scheduling.cache_salt)
        for i in range((len(tokens) - 1) // size):
            block_tokens = tokens[i * size:(i + 1) * size]
            block_hash = hash_block_tokens(parent, block_tokens, root)
            yield block_tokens, parent, block_hash
            parent = block_hash

    def get_computed_blocks(self, request: Request, ms_per_prefill_token: float | None = None) -> list[int]:
        """Longest run of cached full blocks matching the request's tokens (at least one token is left to compute,
        so the step still produces logits). Does not take references; see `allocate_slots`.

        With offload tiers the run continues past the pool: each next block a tier holds is loaded into a free
        block and registered in the prefix cache, as if it had never left (`_load_from_tiers`), unless the tiers'
        cost rule finds loading it slower than prefilling it at `ms_per_prefill_token` (ms; None = unmeasured)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        blocks = self._prefix_blocks(request)
        for block_tokens, parent, block_hash in blocks:
            block = self.pool.lookup(block_hash)
            if block is None:
                if self.offload is not None:
                    recompute_ms = None if ms_per_prefill_token is None else ms_per_prefill_token * self.block_size
                    return self._load_from_tiers(itertools.chain([(block_tokens, parent, block_hash)], blocks), hits,
                                                 recompute_ms)
                break
            hits.append(block)
        return hits

    def _load_from_tiers(self, blocks: Iterator[tuple[list[int], bytes | None, bytes]], hits: list[int],
                         recompute_ms: float | None) -> list[int]:
        """Extend `hits` (pool blocks for the request's leading blocks) with the next of `blocks` (`_prefix_blocks`'s,
        from the first the pool missed) found in the pool or loaded from a tier, until one is in neither or no block
        is free. The blocks found are held while later ones are loaded (a load allocates, which may evict a free
        cached block), then released: they stay in the prefix cache, free and most recently used, for
        `allocate_slots` to take."""
        held = list(hits)
        self.pool.touch(held)
        try:
            for block_tokens, parent, block_hash in blocks:
                block = self.pool.lookup(block_hash)
                if block is None:
                    tier = self.offload.source(block_hash, recompute_ms) if self.pool.num_free_blocks else None
                    if tier is None:  # in no tier, or not worth loading: recomputed from here
                        break
                    (block,) = self.pool.allocate(1)
                    held.append(block)
                    if not self.offload.load_from(tier, block, block_hash):  # a bad entry: recomputed from here
                        break
                    self.pool.cache_block(block, block_hash, parent, block_tokens)
                else:
                    self.pool.touch([block])
                    held.append(block)
                hits.append(block)
        finally:
            self.pool.free(held)
        return hits

    def allocate_slots(self, request_id: str, num_total_tokens: int, computed_blocks: list[int] | None = None,
                       next_position: int | None = None) -> bool:
        """Make the request's block table cover its first num_total_tokens tokens.

        computed_blocks (from `get_computed_blocks`, first allocation only) are shared, not allocated.
        next_position (first allocation only): the position of the first token the request computes next (its
        computed prefix hits, or its whole prompt when the KV arrives from a prefill worker); under a sliding window
        the entries wholly behind that token's window are the null block from the start, so a request whose context
        exceeds the pool never holds all of it, not even for a moment.
        Returns False, changing nothing, when the pool lacks free blocks.
        """
        if self.num_blocks_to_allocate(request_id, num_total_tokens, computed_blocks, next_position) \
                > self.pool.num_free_blocks:
            return False
        table = self.block_tables.get(request_id, [])
        lead, shared, need = self._plan(request_id, num_total_tokens, computed_blocks, next_position)
        if lead:
            self.pool.touch([self.null_block] * lead)
            self._released[request_id] = lead
            table = [self.null_block] * lead
        if shared:
            self.pool.touch(shared)  # reviving a cached free block takes it off the free queue too
            table = table + shared
        if need > 0:
            table = table + self.pool.allocate(need)
        self.block_tables[request_id] = table
        return True

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup: num_tokens looked up (a request's tokens at its first scheduling), num_hit_tokens found."""
        self.prefix_query_tokens += num_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def num_released(self, request_id: str) -> int:
        """Leading table entries of the request given back behind the window (the null block in their place)."""
        return self._released.get(request_id, 0)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        tokens = request.all_token_ids
        root = chain_root(request.scheduling.cache_salt)
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            block_tokens = tokens[i * self.block_size:(i + 1) * self.block_size]
            h = hash_block_tokens(parent, block_tokens, root)
            hashes.append(h)
            if table[i] != self.null_block:  # a prefix-cache hit must never return the null block
                if self.pool.cache_block(table[i], h, parent, block_tokens) and self.offload is not None \
                        and self.offload.store_computed:
                    self.offload.save(table[i], h)

    def release_out_of_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Give back the request's leading blocks that no later token can attend to (see the class docstring).

        The next token sits at position num_computed_tokens and sees keys from num_computed_tokens - W + 1 on, and
        every later token sees less of the past, so blocks ending before that key are never read again. The last
        block of the table is always kept (only a 1-token window could leave it behind; a KV transfer then still
        has a block to send). A new table list replaces the old one (a step already built from the old one keeps
        its ids). Returns how many blocks went back to the pool (0 without a sliding window). Registered
        prefix-cache blocks stay cached while free, as any freed block does.
        """
        if not self.sliding_window:  # called for every scheduled request each step: the common case costs nothing
            return 0
        table = self.block_tables.get(request_id)
        if not table:
            return 0
        start = self._released.get(request_id, 0)
        end = min(max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size, len(table) - 1)
        if end <= start:
            return 0
        dropped = table[start:end]
        self.pool.touch([self.null_block] * (end - start))  # before the free: the null block never reaches 0
        self.block_tables[request_id] = table[:start] + [self.null_block] * (end - start) + table[end:]
        self.pool.free(dropped)
        self._released[request_id] = end
        return end - start

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> tuple[int, int] | None:
        """Give child_id a block table for the parent's first num_tokens tokens: the full blocks shared (one more
        reference each), the partial last block (if any) a fresh block to copy the parent's into (copy-on-write:
        the child writes its own next token there). The caller checks that a block is free when one is needed.

        Returns:
            (src, dst) block ids to copy before the child's first step, or None when nothing needs copying.
        """
        table = self.block_tables.get(parent_id, [])
        full = num_tokens // self.block_size
        shared = table[:full]
        self.pool.touch(shared)
        child = list(shared)
        copy = None
        if num_tokens % self.block_size:
            (dst,) = self.pool.allocate(1)
            child.append(dst)
            copy = (table[full], dst)
        self.block_tables[child_id] = child
        self._hashes[child_id] = list(self._hashes.get(parent_id, [])[:full])
        self._released[child_id] = min(self._released.get(parent_id, 0), full)
        return copy

    def free(self, request_id: str) -> None:
        """Release every block of the request (no-op if it holds none)."""
        self._hashes.pop(request_id, None)
        self._reading.pop(request_id, None)
        self._released.pop(request_id, None)
        table = self.block_tables.pop(request_id, None)
        if table:
            self.pool.free(table)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def take_kv_events(self) -> list:
        """What entered and left this worker's KV cache since the last call, pool and tiers together (none unless
        the pool records events): a block the pool evicts into a tier is still held, and is reported removed once
        no tier holds it either (`KvOffloader.take_dropped`)."""
        events = self.pool.take_kv_events()
        if self.offload is not None:
            dropped = self.offload.take_dropped()  # taken either way, so the tiers' lists stay short
            if self.pool.kv_events is not None:
                events += [KvBlockRemoved(key) for key in dropped if self.pool.lookup(key) is None]
        return events

    def close(self) -> None:
        """Finish the offload tiers' pending writes (the engine loop's end)."""
        if self.offload is not None:
            self.offload.close()
