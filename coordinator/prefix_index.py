"""Which prompt prefixes each worker holds in its prefix cache: from its own KV events where it publishes them
(`--kv-events`, followed by `coordinator.kv_events`), else from what this coordinator sent it.

Without events, like SGLang's cache-aware router, the index is the coordinator's own record of the prompts it
routed: each worker's entries are chained hashes of full `block_size`-token blocks (a block's
hash covers everything before it, as the engine's prefix cache keys do), kept in LRU order and bounded by that
worker's KV pool. It can be wrong both ways (the worker evicted a block; another coordinator filled one); it only
steers routing, never correctness. A worker that restarts, or leaves, starts again from nothing (`forget`).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str = "") -> list[bytes]:
    """Chained hashes of the full blocks of a prompt: blake2b(previous hash || block tokens as int64), 16 bytes; the
    first block chains from the cache salt's root where a request has one. The engine's keys, computed the same way
    (`engine.scheduling.block_pool.hash_block_tokens` and `chain_root`).

    Standard-library `array` rather than numpy: the coordinator process must stay free of numerical libraries.
    """
    out: list[bytes] = []
    parent = (hashlib.blake2b(b"pdserve cache salt\0" + cache_salt.encode(), digest_size=16).digest()
              if cache_salt else b"")
    tokens = array("q", token_ids)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.blake2b(parent + tokens[start:start + block_size].tobytes(), digest_size=16).digest()
        out.append(parent)
    return out


class PrefixIndex:
    """Per worker address, an LRU set of the block hashes routed to it, or, for a worker whose KV events this
    coordinator follows (`coordinator.kv_events`), exactly the blocks the worker reported holding.

    Attributes:
        relay: where the followed workers' reported blocks are relayed to a gateway (`kv_relay.KvEventRelay`,
            `--kv-events-relay`); None = not relayed.
    """

    def __init__(self) -> None:
        self._by_worker: dict[str, OrderedDict[bytes, None]] = {}
        self._followed: set[str] = set()  # workers indexed from their own events: routing records nothing
        self.relay = None

    def follow(self, worker: str) -> None:
        """From now on the worker's entries come from its events (`stored`, `removed`), starting from none."""
        self._by_worker.pop(worker, None)
        self._followed.add(worker)
        self._relay_forget(worker)

    def unfollow(self, worker: str) -> None:
        """Back to inferring the worker's entries from routing (its event stream is gone), starting from none."""
        self._by_worker.pop(worker, None)
        self._followed.discard(worker)
        self._relay_forget(worker)

    def _relay_forget(self, worker: str) -> None:
        if self.relay is not None:
            self.relay.forget(worker)
            self.relay.flush()

    def stored(self, worker: str, block_hash: bytes, parent_hash: bytes = b"", token_ids: Sequence[int] = ()) -> None:
        """The worker reported holding this block (child of `parent_hash`, b"" for a prompt's first block)."""
        held = self._by_worker.setdefault(worker, OrderedDict())
        held[block_hash] = None
        held.move_to_end(block_hash)
        if self.relay is not None:
            self.relay.stored(worker, block_hash, parent_hash, token_ids)

    def removed(self, worker: str, block_hash: bytes) -> None:
        """The worker reported evicting this block."""
        held = self._by_worker.get(worker)
        if held is not None:
            held.pop(block_hash, None)
        if self.relay is not None:
            self.relay.removed(worker, block_hash)

    def events_applied(self) -> None:
        """A worker's batch of events is in: the relay sends what it changed as one batch."""
        if self.relay is not None:
            self.relay.flush()

    def overlap(self, worker: str, hashes: list[bytes]) -> int:
        """How many leading blocks of the prompt the worker probably has cached."""
        held = self._by_worker.get(worker)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def record(self, worker: str, hashes: list[bytes], capacity_blocks: int) -> None:
        """The worker was given these blocks (its prefix cache will hold them); the oldest fall out past capacity.
        Nothing for a followed worker: its events say what it holds."""
        if worker in self._followed:
            return
        held = self._by_worker.setdefault(worker, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > max(capacity_blocks, 0):
            held.popitem(last=False)

    def forget(self, worker: str) -> None:
        """The worker's cache is gone (it restarted or left); whether it is followed stays as it was."""
        self._by_worker.pop(worker, None)
        self._relay_forget(worker)
