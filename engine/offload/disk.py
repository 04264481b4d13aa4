"""The disk KV tier: one file per block under a directory, bounded in bytes, each entry checksummed, kept across
worker restarts.

An entry is `<dir>/<namespace>/<hh>/<key hex>.kv`, in `entry`'s format: a header (magic, payload length, BLAKE2b-128 of
the payload) then the block's bytes as the KV cache holds them (`engine.execution.kv_cache`: one block of every layer's
K and V, contiguous). The namespace names the model, its weights, dtype and KV layout (`offloader.tier_namespace`), so
an entry is only ever read back into a cache of the same geometry computed by the same weights. Files are written to a
temporary name and renamed (a reader never sees half an entry); a truncated or corrupted one fails its length or
checksum, is deleted and counts as a miss (its block is recomputed). Writes run on a thread of their own, so the engine
thread only copies the block; a block evicted again before its write lands is served from the queue.
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict, deque
from pathlib import Path

import torch

from pdserve_server.engine.offload import entry
from pdserve_server.engine.offload.entry import HEADER
from pdserve_server.engine.offload.stats import DROPPED_KEYS, TierStats
from pdserve_server.engine.offload.writes import WriteQueue

log = logging.getLogger(__name__)

# A temporary file is renamed within milliseconds of its creation; one this old was left by a writer that died
# mid-write (a crash, a killed worker) and is deleted at start. Younger ones may be another live worker's.
STALE_TMP_S = 3600.0


class DiskTier:
    """KV blocks in files under `directory`/`namespace`, least recently used deleted beyond `capacity_bytes`.

    The engine thread calls contains / get / put; one writer thread writes. Entries already in the directory (a
    previous run's) are indexed at start, oldest access first, so a restarted worker serves them. Several workers
    may share a directory: each reads what any wrote (a file it has not indexed is found by its name) and bounds
    what it wrote itself.

    Args:
        directory: the tier's root (created if missing).
        capacity_bytes: most bytes of entries (headers included) this tier keeps.
        namespace: what the entries are (`offloader.tier_namespace`): a subdirectory.
        entry_bytes: the payload size of one block; an entry of any other size is treated as corrupt.

    Raises:
        ValueError: capacity_bytes smaller than one entry.
        OSError: the directory cannot be created.
    """

    name = "disk"
    local = True  # this host's: its blocks count as held in the worker's KV events
    slow = True  # a load reads a file and checks it: read ahead for queued requests (`engine.offload.prefetch`)

    def __init__(self, directory: str | Path, capacity_bytes: int, namespace: str, entry_bytes: int):
        if capacity_bytes < HEADER.size + entry_bytes:
            raise ValueError(f"a disk KV tier of {capacity_bytes} bytes (--kv-offload-disk-bytes) cannot hold one "
                             f"{entry_bytes}-byte KV block and its header")
        self.root = Path(directory) / namespace
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.entry_bytes = entry_bytes
        self.counters = TierStats(self.name)
        self.dropped: deque[bytes] = deque(maxlen=DROPPED_KEYS)  # keys let go of (either thread appends)
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._bytes = 0
        self._scan()
        self._writes = WriteQueue("kv-disk-tier", self._store, self.counters)
        self._lock = self._writes.lock  # guards _index and _bytes too, between the engine thread and the writer

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / f"{name}.kv"

    def _scan(self) -> None:
        """Index a previous run's entries, oldest access first, and trim to capacity; delete temporary files a
        dead writer left (older than STALE_TMP_S)."""
        stale = time.time() - STALE_TMP_S
        for path in self.root.glob("*/*.tmp"):
            try:
                if path.stat().st_mtime < stale:
                    path.unlink()
            except OSError:
                continue  # renamed or deleted meanwhile
        found = []
        for path in self.root.glob("*/*.kv"):
            try:
                st = path.stat()
                found.append((st.st_mtime_ns, bytes.fromhex(path.stem), st.st_size))
            except (OSError, ValueError):
                continue  # vanished meanwhile, or not ours
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        self._trim()
        if found:
            log.info("disk KV tier %s: %d blocks from a previous run (%.1f MiB)", self.root, len(self._index),
                     self._bytes / 2**20)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            if self._writes.holds(key) or key in self._index:
                return True
        return self._path(key).is_file()

    def get(self, key: bytes) -> torch.Tensor | None:
        """The payload stored under key (1-D uint8 CPU tensor), or None when absent, truncated or corrupt (a bad
        entry is deleted and counted)."""
        payload = self._writes.queued(key)
        if payload is not None:
            return payload
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(key)
            return None
        if entry.payload(data, self.entry_bytes) is None:
            log.warning("disk KV tier: %s is truncated or corrupt; deleted (its block is recomputed)", path.name)
            self.counters.corrupt += 1
            path.unlink(missing_ok=True)
            self._forget(key)
            return None
        with self._lock:
            if key not in self._index:  # another worker's entry: ours to bound from now on
                self._bytes += len(data)
            self._index[key] = len(data)
            self._index.move_to_end(key)
        try:
            os.utime(path)  # its access order survives a restart
        except OSError:
            pass
        return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=HEADER.size)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
        self.dropped.append(key)

    def put(self, key: bytes, payload: torch.Tensor) -> bool:
        """Queue payload (1-D uint8 CPU tensor of entry_bytes, which the caller no longer writes) to be written under
        key; nothing when the key is held already, or when the writer is behind (`WriteQueue`, counted as dropped).
        Returns whether the tier holds key now (queued entries are read from the queue)."""
        return self._writes.put(key, payload, held=lambda k: k in self._index)

    def _store(self, key: bytes, payload: torch.Tensor) -> None:
        """The writer thread's: write one entry, then index it and keep the tier within its size."""
        try:
            size = self._write(key, payload)
        except OSError as e:  # a full or read-only disk: the block is simply not kept
            log.warning("disk KV tier: cannot write a block (%s)", e)
            return
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._bytes += size
                self.counters.stored_bytes += payload.nbytes
            self._trim()

    def _write(self, key: bytes, payload: torch.Tensor) -> int:
        body = payload.numpy().data
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(entry.header(body))
            f.write(body)
        os.replace(tmp, path)
        return HEADER.size + len(body)

    def _trim(self) -> None:
        """Delete the least recently used entries beyond capacity (the lock held, or before the writer starts)."""
        while self._bytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self.counters.evictions += 1
            self._path(key).unlink(missing_ok=True)
            self.dropped.append(key)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then stop the writer (at most timeout_s, seconds)."""
        self._writes.close(timeout_s)
