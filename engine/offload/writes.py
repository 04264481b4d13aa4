"""The writes of a tier that stores blocks somewhere slow (a disk, a Redis server): done in order by a thread of
its own, so the engine thread only hands the block over; a block queued and not yet written is read from the queue.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from pdserve_server.engine.offload.stats import TierStats

QUEUE_BLOCKS = 256  # blocks waiting for the writer at most; more are not stored (counted as dropped)


class WriteQueue:
    """Blocks waiting for `store(key, payload)` on a writer thread.

    Args:
        name: the thread's name.
        store: writes one block (1-D uint8 CPU tensor); it records what it stored itself, under `lock` where it
            shares state with the engine thread, and handles its own errors (an exception ends nothing but logs).
        counters: the tier's, whose `dropped` counts blocks refused while the writer is QUEUE_BLOCKS behind.

    Attributes:
        lock: guards the queued blocks; a tier may guard its own state with it too.
    """

    def __init__(self, name: str, store: Callable[[bytes, torch.Tensor], None], counters: TierStats):
        self.lock = threading.Lock()
        self._store = store
        self._counters = counters
        self._pending: dict[bytes, torch.Tensor] = {}
        self._queue: queue.Queue = queue.Queue(QUEUE_BLOCKS)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def queued(self, key: bytes) -> torch.Tensor | None:
        """The block queued under key, or None. Takes `lock`."""
        with self.lock:
            return self._pending.get(key)

    def holds(self, key: bytes) -> bool:
        """Whether key is queued; the caller holds `lock`."""
        return key in self._pending

    def put(self, key: bytes, payload: torch.Tensor, held: Callable[[bytes], bool] = lambda key: False) -> bool:
        """Queue payload under key unless it is queued or `held(key)` (checked under `lock`: the tier has it already).
        Returns whether the tier holds key now; False when the writer is QUEUE_BLOCKS behind (counted as dropped)."""
        with self.lock:
            if key in self._pending or held(key):
                return True
            self._pending[key] = payload
        try:
            self._queue.put_nowait((key, payload))
        except queue.Full:
            with self.lock:
                self._pending.pop(key, None)
            self._counters.dropped += 1
            return False
        return True

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            key, payload = item
            try:
                self._store(key, payload)
            finally:
                with self.lock:
                    self._pending.pop(key, None)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then stop the thread (at most timeout_s, seconds)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
