"""Reading a queued request's KV blocks from the slow tiers (disk, Redis) before it is scheduled, on a thread of
its own, so the engine thread finds them in memory instead of reading them between steps.

A load from a slow tier runs on the engine thread (`KvOffloader.load_from`): a file read and a checksum (~0.4 ms
for a 368 KiB block here), or a network round trip to Redis, per block, while every running request waits for the
next step. SGLang's HiCache prefetches from its storage tier while a request waits in the queue, and vLLM's KV
connectors load asynchronously for the same reason. Here a request's blocks that no faster place holds are handed
to this thread as it is queued (`KVCacheManager.prefetch`); the thread reads them in order and keeps them staged
in memory, bounded in bytes. While they are read the scheduler lets the running requests step without it (vLLM's
requests waiting for remote KV); the engine's load then takes a staged block (a memory copy), waits for the one being
read at that moment (it would read it itself otherwise), and reads any other itself, as before.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

QUEUED_REQUESTS = 256  # requests whose blocks wait to be read at most; more are not prefetched (loaded as before)
READ_BATCH = 8  # blocks a tier with get_many (Redis) reads per round trip: 16 MiB of Llama-3.1-8B blocks
WAIT_S = 5.0  # the most the engine waits for the block being read (a tier's own timeouts are shorter)


class Prefetcher:
    """Blocks read ahead from the slow tiers, staged until a load takes them.

    Args:
        tiers: (index in the offloader's tier list, tier) of the slow tiers, fastest first; each has
            `get(key) -> 1-D uint8 tensor | None` that is safe to call from this thread (`DiskTier`, `RedisTier`),
            and may have `get_many(keys) -> list[tensor | None]`, several blocks a round trip (`RedisTier`).
        capacity_bytes: payload bytes staged at most; the oldest staged blocks (never taken: their request was
            cancelled, or found them in the pool after all) are dropped beyond it.
        pin: stage in pinned host memory (a GPU pool: the engine's copy to the device then runs at DMA speed, as
            `KvOffloader._copy_out`'s copies the other way). Unverified on a GPU.
    """

    def __init__(self, tiers: Sequence[tuple[int, object]], capacity_bytes: int, pin: bool = False):
        self.tiers = list(tiers)
        self.pin = pin
        # blocks read at once: a batch a round trip where the first slow tier is remote, else one at a time (a
        # take waits for the whole batch it is in; a file read gains nothing from company)
        self.batch = READ_BATCH if self.tiers and hasattr(self.tiers[0][1], "get_many") else 1
        self.capacity_bytes = capacity_bytes
        self._staged: OrderedDict[bytes, tuple[int, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self._wanted: set[bytes] = set()  # submitted and not yet read (a take of one of these reads it itself)
        self._reading: set[bytes] = set()  # the keys the thread reads now
        self._cond = threading.Condition()
        self._jobs: queue.Queue = queue.Queue(QUEUED_REQUESTS)
        self._thread = threading.Thread(target=self._loop, name="kv-prefetch", daemon=True)
        self._thread.start()

    def submit(self, keys: list[bytes]) -> bool:
        """Read the blocks with these prefix hashes, in chain order (a request's blocks past what the pool and the
        fast tiers hold), up to the first no slow tier holds. Engine thread; never blocks. Returns False (nothing
        queued) when QUEUED_REQUESTS requests are waiting already."""
        if not keys:
            return True
        with self._cond:
            fresh = [k for k in keys if k not in self._staged and k not in self._reading]
            self._wanted.update(fresh)
        try:
            self._jobs.put_nowait(fresh)
        except queue.Full:
            with self._cond:
                self._wanted.difference_update(fresh)
            return False
        return True

    def pending(self, key: bytes) -> bool:
        """Whether the block under key is still to be read (queued, or being read now). Engine thread."""
        with self._cond:
            return key in self._wanted or key in self._reading

    def take(self, key: bytes) -> tuple[int, torch.Tensor] | None:
        """The staged block under key as (tier index, payload), removed from the stage; waits (at most WAIT_S) when
        the thread is reading that very block; None otherwise (the caller reads it itself, and the thread skips it).
        Engine thread."""
        with self._cond:
            self._cond.wait_for(lambda: key not in self._reading, WAIT_S)
            self._wanted.discard(key)
            found = self._staged.pop(key, None)
            if found is not None:
                self._bytes -= found[1].nbytes
            return found

    def _loop(self) -> None:
        while (keys := self._jobs.get()) is not None:
            start = 0
            while start < len(keys):
                with self._cond:  # blocks the engine took meanwhile (it read them itself) are skipped
                    batch = [k for k in keys[start:start + self.batch] if k in self._wanted]
                    self._reading = set(batch)
                start += self.batch
                found: dict[bytes, tuple[int, torch.Tensor]] = {}
                try:
                    for i, tier in self.tiers:
                        missing = [k for k in batch if k not in found]
                        if not missing:
                            break
                        many = getattr(tier, "get_many", None)
                        payloads = many(missing) if many is not None else [tier.get(k) for k in missing]
                        found.update((k, (i, p.pin_memory() if self.pin else p))
                                     for k, p in zip(missing, payloads) if p is not None)
                except Exception as e:  # noqa: BLE001 - the thread must outlive a failed read (the chain ends there)
                    log.warning("KV read-ahead: reading %d block(s) failed (%s: %s); they are loaded or recomputed "
                                "when their request runs", len(batch), type(e).__name__, e)
                finally:
                    with self._cond:
                        self._reading = set()
                        self._wanted.difference_update(batch)
                        for k in batch:
                            if k not in found:  # the chain ends here: later blocks are of no use without this one
                                self._wanted.difference_update(keys)
                                start = len(keys)
                                break
                            self._stage(k, found[k])
                        self._cond.notify_all()

    def _stage(self, key: bytes, found: tuple[int, torch.Tensor]) -> None:
        """Keep a block read (the lock held), dropping the oldest beyond capacity_bytes."""
        self._staged[key] = found
        self._bytes += found[1].nbytes
        while self._bytes > self.capacity_bytes and self._staged:
            _, (_, old) = self._staged.popitem(last=False)
            self._bytes -= old.nbytes

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (after the block it reads, at most timeout_s) and drop what is staged."""
        with self._cond:
            self._wanted.clear()
        self._jobs.put(None)
        self._thread.join(timeout_s)
        with self._cond:
            self._staged.clear()
            self._bytes = 0
