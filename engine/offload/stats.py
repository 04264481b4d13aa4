"""What each KV tier did: counters the tier keeps, and copies of them the engine publishes."""
from __future__ import annotations

import msgspec

DROPPED_KEYS = 65536  # keys a tier remembers letting go of until the engine takes them (the oldest are forgotten)


class TierStats(msgspec.Struct, array_like=True):
    """One tier's cumulative counters, named by its tier ("cpu" or "disk"). The tier updates its own (a disk tier's
    writer thread too: plain number updates); `KvOffloader.stats` publishes copies, which cross the engine process
    boundary inside `SchedulerStats.kv_offload`.

    Attributes:
        hits: blocks loaded from the tier into the pool.
        loaded_bytes / stored_bytes: payload bytes read from / written to the tier.
        load_seconds: engine-thread time spent loading hits (read, checksum, copy into the KV cache; for a block
            read ahead, the copy and any wait for its read), seconds.
        evictions: entries the tier dropped to stay within its size.
        corrupt: entries found truncated or failing their checksum (dropped, their block recomputed).
        dropped: blocks not stored because the tier's writer was behind.
        declined: blocks the tier held that a lookup recomputed instead: loading them measured slower than
            prefilling them (`KvOffloader.load`'s cost rule).
        prefetched: of the hits, blocks read ahead while their request was queued (`engine.offload.prefetch`): the
            engine only copied them.
    """

    tier: str
    hits: int = 0
    loaded_bytes: int = 0
    stored_bytes: int = 0
    load_seconds: float = 0.0
    evictions: int = 0
    corrupt: int = 0
    dropped: int = 0
    declined: int = 0
    prefetched: int = 0
