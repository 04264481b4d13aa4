"""What each KV tier did, as counters the tier keeps and a snapshot the engine publishes."""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

DROPPED_KEYS = 65536  # keys a tier remembers letting go of until the engine takes them (the oldest are forgotten)


@dataclass
class TierCounters:
    """A tier's running counts, updated by the tier (a disk tier's writer thread included: plain int updates).

    Attributes:
        hits: blocks loaded from the tier into the pool.
        loaded_bytes / stored_bytes: payload bytes read from / written to the tier.
        load_seconds: time spent loading hits (read, checksum, copy into the KV cache), seconds.
        evictions: entries the tier dropped to stay within its size.
        corrupt: entries found truncated or failing their checksum (dropped, their block recomputed).
        dropped: blocks not stored because the tier's writer was behind.
    """

    hits: int = 0
    loaded_bytes: int = 0
    stored_bytes: int = 0
    load_seconds: float = 0.0
    evictions: int = 0
    corrupt: int = 0
    dropped: int = 0

    def snapshot(self, tier: str) -> TierStats:
        return TierStats(tier, self.hits, self.loaded_bytes, self.stored_bytes, self.load_seconds, self.evictions,
                         self.corrupt, self.dropped)


class TierStats(msgspec.Struct, frozen=True, array_like=True):
    """One tier's counters at one moment (`TierCounters`' fields, cumulative), named by its tier: "cpu" or
    "disk". Crosses the engine process boundary inside `SchedulerStats.kv_offload`."""

    tier: str
    hits: int = 0
    loaded_bytes: int = 0
    stored_bytes: int = 0
    load_seconds: float = 0.0
    evictions: int = 0
    corrupt: int = 0
    dropped: int = 0
