"""The host-memory KV tier: block payloads by prefix hash, least recently used dropped beyond a byte bound."""
from __future__ import annotations

from collections import OrderedDict, deque

import torch

from pdserve_server.engine.offload.stats import DROPPED_KEYS, TierStats


class MemoryTier:
    """Host-memory copies of evicted KV blocks. Engine thread only.

    Args:
        capacity_bytes: most payload bytes held; the least recently stored or loaded entry goes first beyond it.

    Raises:
        ValueError: capacity_bytes < 1.
    """

    name = "cpu"
    local = True  # this worker's own: its blocks count as held in the worker's KV events
    slow = False  # a load is a memory copy: nothing to read ahead (`engine.offload.prefetch`)

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 1:
            raise ValueError(f"a host-memory KV tier needs a positive size in bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.counters = TierStats(self.name)
        self.dropped: deque[bytes] = deque(maxlen=DROPPED_KEYS)  # keys let go of, for `KvOffloader.take_dropped`
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> torch.Tensor | None:
        """The payload stored under key (1-D uint8, CPU; not a copy: the caller only reads it), or None."""
        payload = self._entries.get(key)
        if payload is not None:
            self._entries.move_to_end(key)
        return payload

    def put(self, key: bytes, payload: torch.Tensor) -> bool:
        """Keep payload (1-D uint8 CPU tensor the caller no longer writes) under key; a payload larger than the
        whole tier is not kept. Returns whether the tier holds key now."""
        if key in self._entries:
            return True
        if payload.nbytes > self.capacity_bytes:
            return False
        self._entries[key] = payload
        self._bytes += payload.nbytes
        self.counters.stored_bytes += payload.nbytes
        while self._bytes > self.capacity_bytes:
            old_key, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self.counters.evictions += 1
            self.dropped.append(old_key)
        return True

    def close(self) -> None:
        """Nothing to flush: host memory ends with the process."""
