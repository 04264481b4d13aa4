"""The shared KV tier on a Redis server: blocks any worker of the same model, weights and KV layout can load, on this
host or another (`--kv-offload-redis-url`), so a prefix one worker computed is not computed again by the others.

A block is one Redis string under `pdserve:kv:<namespace>:<prefix hash hex>` in `entry`'s format (header with length and
checksum, then the block's bytes): a truncated, corrupted or foreign value is deleted and recomputed, never served.
Redis bounds and evicts the store itself: run it with `maxmemory` and `maxmemory-policy allkeys-lru` (docs/deploy.md).
Writes go through a thread of their own with a bounded queue, so the engine thread never waits on the network to store;
a load is an EXISTS and a GET on the engine thread. A Redis that cannot be reached costs misses (blocks recomputed,
warned once per outage), never a request: after a failed command the tier is left alone for RETRY_S, so a server that
hangs stalls the engine thread for one TIMEOUT_S at most in that time, not once per block. A queued request's blocks
are read ahead by the prefetch thread (`engine.offload.prefetch`), several GETs a round trip (`get_many`); the client
is thread-safe (a connection pool).

Only for a store every worker that uses it trusts: a value written under a key is served to whoever asks for that
key (the checksum catches damage, not a writer that lies), as the KV transfer network is trusted.
"""
from __future__ import annotations

import logging
import time
from collections import deque

import torch

from pdserve_server.engine.offload import entry
from pdserve_server.engine.offload.stats import DROPPED_KEYS, TierStats
from pdserve_server.engine.offload.writes import WriteQueue

log = logging.getLogger(__name__)

TIMEOUT_S = 2.0  # connect and per-command socket timeout: a stuck server must not hang the engine thread longer
RETRY_S = 10.0  # after a failed command the tier is skipped (misses, writes dropped) this long before trying again


class RedisTier:
    """KV blocks in a Redis server, shared by every worker that names it.

    Args:
        url: the server, `redis://[:password@]host:port/db` (`rediss://` for TLS), as redis-py reads it.
        namespace: what the entries are (`offloader.tier_namespace`): part of every key, so workers of other
            models or weights share the server without sharing entries.
        entry_bytes: the payload size of one block; a value of any other size is treated as corrupt.

    Raises:
        ValueError: the URL is not one redis-py understands.
        ConnectionError: the server does not answer a PING within TIMEOUT_S (a worker refuses to start on a tier
            it cannot reach, saying which).
    """

    name = "redis"
    # Shared by every worker, and silent about what it evicts: a block only here is not this worker's in its KV
    # events (reported removed as the pool evicts it), or the coordinator's index of the worker would only grow.
    local = False
    slow = True  # a load is network round trips: read ahead for queued requests (`engine.offload.prefetch`)

    def __init__(self, url: str, namespace: str, entry_bytes: int):
        import redis  # only workers that use this tier need the client

        self.url = url
        self.entry_bytes = entry_bytes
        self.counters = TierStats(self.name)
        # Redis evicts on its own and tells no one: nothing is ever reported let go of (see `local`)
        self.dropped: deque[bytes] = deque(maxlen=DROPPED_KEYS)
        self._prefix = f"pdserve:kv:{namespace}:".encode()
        self._errors = redis.RedisError
        self._client = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        try:
            self._client.ping()
        except redis.RedisError as e:
            self._client.close()
            raise ConnectionError(f"the Redis KV tier at {public_url(url)} does not answer: {e}") from None
        self._failing = False  # warned about an outage already
        self._retry_at = 0.0  # time.monotonic() before which the server is not asked (an outage's back-off)
        self._writes = WriteQueue("kv-redis-tier", self._store, self.counters)

    def _key(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def _ask(self, command: str, key: bytes):
        """One command on the block's key (GET, EXISTS); None during an outage's back-off or when it fails."""
        if time.monotonic() < self._retry_at:
            return None
        try:
            answer = getattr(self._client, command)(self._key(key))
        except self._errors as e:
            self._warn(e)
            return None
        self._failing = False
        return answer

    def _warn(self, e: Exception) -> None:
        """A command failed: back off for RETRY_S; warn once per outage."""
        self._retry_at = time.monotonic() + RETRY_S
        if not self._failing:
            log.warning("Redis KV tier %s: %s (its blocks are recomputed until it answers; next try in %.0f s)",
                        public_url(self.url), e, RETRY_S)
            self._failing = True

    def contains(self, key: bytes) -> bool:
        """Whether the server (or the write queue) holds key: an EXISTS, no payload (asked before every load)."""
        return self._writes.queued(key) is not None or bool(self._ask("exists", key))

    def get(self, key: bytes) -> torch.Tensor | None:
        """The payload stored under key (1-D uint8 CPU tensor), or None when absent, unreachable, truncated or
        corrupt (a bad value is deleted and counted)."""
        pending = self._writes.queued(key)
        if pending is not None:
            return pending
        data = self._ask("get", key)
        return None if data is None else self._payload(key, data)

    def _payload(self, key: bytes, data: bytes) -> torch.Tensor | None:
        """A stored value's payload, or None (the value deleted and counted) when it is truncated or corrupt."""
        body = entry.payload(data, self.entry_bytes)
        if body is None:
            log.warning("Redis KV tier: the value of %s is truncated or corrupt; deleted (its block is recomputed)",
                        key.hex())
            self.counters.corrupt += 1
            try:
                self._client.delete(self._key(key))
            except self._errors as e:
                self._warn(e)
            return None
        return torch.frombuffer(bytearray(body), dtype=torch.uint8)

    def get_many(self, keys: list[bytes]) -> list[torch.Tensor | None]:
        """`get` for several keys in one round trip (a pipeline of GETs): the read-ahead thread's
        (`engine.offload.prefetch`), where a per-block round trip to a server on another host would dominate."""
        out: list[torch.Tensor | None] = [self._writes.queued(key) for key in keys]
        ask = [i for i, payload in enumerate(out) if payload is None]
        if not ask or time.monotonic() < self._retry_at:
            return out
        try:
            pipe = self._client.pipeline(transaction=False)
            for i in ask:
                pipe.get(self._key(keys[i]))
            answers = pipe.execute()
        except self._errors as e:
            self._warn(e)
            return out
        self._failing = False
        for i, data in zip(ask, answers):
            if data is not None:
                out[i] = self._payload(keys[i], data)
        return out

    def put(self, key: bytes, payload: torch.Tensor) -> bool:
        """Queue payload (1-D uint8 CPU tensor of entry_bytes, which the caller no longer writes) to be stored under
        key; dropped (counted) when the writer is behind (`WriteQueue`). Returns whether the tier holds key now as
        far as this worker knows (queued entries are read from the queue)."""
        return self._writes.put(key, payload)

    def _store(self, key: bytes, payload: torch.Tensor) -> None:
        """The writer thread's: an EXISTS, then a SET when the server lacks the block (the offloader queues every
        block it saves here without asking, off the engine thread); nothing during an outage's back-off (then the
        block is dropped)."""
        if time.monotonic() < self._retry_at:
            self.counters.dropped += 1
            return
        body = payload.numpy().data
        try:
            if self._client.exists(self._key(key)):
                return
            # NX: a block is the same whoever computed it; the first copy stands (no rewrite, and its LRU age in
            # Redis is refreshed by the GETs that use it)
            if self._client.set(self._key(key), entry.header(body) + bytes(body), nx=True):
                self.counters.stored_bytes += len(body)
        except self._errors as e:
            self._warn(e)
            self.counters.dropped += 1

    def close(self, timeout_s: float = 30.0) -> None:
        """Store what is queued, then stop the writer (at most timeout_s, seconds) and disconnect."""
        self._writes.close(timeout_s)
        self._client.close()


def public_url(url: str) -> str:
    """The URL without its password, for messages."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
