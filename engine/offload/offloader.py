"""Moves one full KV block at a time between the KV cache tensor and the offload tiers, and builds the tiers a worker
asked for."""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import msgspec
import torch

from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.offload.disk import DiskTier
from pdserve_server.engine.offload.memory import MemoryTier
from pdserve_server.engine.offload.prefetch import Prefetcher
from pdserve_server.engine.offload.redis_tier import RedisTier
from pdserve_server.engine.offload.stats import TierStats

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Weight of the newest load in a tier's moving mean of load time per block: about the last 10 loads count.
LOAD_EWMA_ALPHA = 0.2
# Under the cost rule, one block in this many that a tier measured too slow for is loaded anyway: the only way to
# notice that the tier got faster (a warm page cache, a quieter disk) once its loads stop.
PROBE_EVERY = 32


class KvOffloader:
    """The tiers under one KV pool, fastest first. Engine thread only.

    A block the pool evicts is copied to host memory once and handed to every tier (write-through: the disk tier
    keeps what the host tier drops, and survives a restart). A load takes the block from the fastest tier that has
    it and hands it to the faster ones too, so the next load is quicker.

    With `store_computed` every full block is saved as it enters the prefix cache as well (`save`), not only as it
    is evicted: workers sharing a disk directory then find each other's prefixes without waiting for an eviction.

    The cost rule (`load_rule="cost"`): a load runs on the engine thread, between steps, so it is only worth doing
    when it takes less time than computing the block in a prefill chunk. Each tier's load time per block is
    measured (a moving mean over its recent loads: read, checksum, copy into the KV cache); a tier measured slower
    than the caller's recompute cost is passed over (its block recomputed, counted as `declined`), except one load
    in `PROBE_EVERY`, which keeps measuring it. On a CPU a block's prefill costs milliseconds and every tier pays;
    under a GPU, a disk tier read at well under a GB/s can cost several times the prefill it would save.

    Read-ahead (`prefetch`): a queued request's blocks in the slow tiers (disk, Redis) are read by a thread of
    their own while it waits, and a load of one of those is a memory copy (counted `prefetched`, not timed into the
    tier's mean: the cost rule judges the loads the engine does itself). A staged block is loaded whatever the
    cost rule says: its read is paid already.

    Args:
        kv: the KV cache shard, [num_blocks + 1, num_layers, 2, block_size, kv_heads, head_dim] of the model's dtype
            (`engine.execution.kv_cache.KVCache.kv`, block-major: one block is one contiguous region).
        tiers: `MemoryTier` / `DiskTier` objects, fastest first (at least one).
        store_computed: save each block as it is computed too (`KVCacheManager.cache_full_blocks`).
        load_rule: "cost" (above) or "always" (load whenever a tier holds the block).
        prefetch_bytes: most bytes of read-ahead blocks staged (`engine.offload.prefetch`); 0 = no read-ahead.
    """

    def __init__(self, kv: torch.Tensor, tiers: list, store_computed: bool = False, load_rule: str = "cost",
                 prefetch_bytes: int = 0):
        if not tiers:
            raise ValueError("a KV offloader needs at least one tier")
        self.kv = kv
        self.tiers = tiers
        self.store_computed = store_computed
        self.load_rule = load_rule
        self.load_ms: list[float | None] = [None] * len(tiers)  # each tier's moving mean, ms per block
        self._declined_since_probe = [0] * len(tiers)
        slow = [(i, tier) for i, tier in enumerate(tiers) if tier.slow]
        self.prefetcher = Prefetcher(slow, prefetch_bytes, pin=kv.is_cuda) if slow and prefetch_bytes else None
        # what `source` took from the stage for `load_from`: (key, tier index, payload, seconds it waited for it)
        self._staged: tuple[bytes, int, torch.Tensor, float] | None = None

    def _region(self, block_id: int) -> torch.Tensor:
        return self.kv[block_id].view(-1).view(torch.uint8)

    def _copy_out(self, block_id: int) -> torch.Tensor:
        """A host copy of pool block `block_id` (1-D uint8). From a GPU pool it lands in pinned memory: the copy
        runs at DMA speed both ways (a 2 MiB Llama-3.1-8B block from pageable memory loaded at 5.5 GB/s on an H200),
        and torch's caching host allocator reuses the pinned buffers of entries the tiers let go of."""
        region = self._region(block_id)
        if not region.is_cuda:
            return region.clone()
        out = torch.empty(region.numel(), dtype=torch.uint8, pin_memory=True)
        out.copy_(region)
        return out

    def save(self, block_id: int, key: bytes) -> bool:
        """Keep pool block `block_id` (full and computed: evicted now, or just registered) under its prefix hash
        `key` in every tier that lacks it. Returns whether a tier of this worker's own (host memory, disk: not a
        shared Redis, which any worker reads and which never reports what it evicts) holds it now, i.e. whether the
        worker's KV events should still count the block as held (a disk tier whose writer is behind may not take
        it)."""
        payload, held = None, False
        for tier in self.tiers:
            # a shared tier is not asked first: a network round trip on the engine thread for every evicted block;
            # its writer thread asks (`RedisTier._store`)
            if tier.local and tier.contains(key):
                held = True
                continue
            if payload is None:  # one copy off the pool for every tier that lacks the block
                payload = self._copy_out(block_id)
            held = (tier.put(key, payload) and tier.local) or held
        return held

    def prefetch(self, keys: list[bytes]) -> bytes | None:
        """Read ahead the blocks with these prefix hashes (a queued request's, in chain order, past what its pool
        holds) that no fast tier holds. Engine thread; does not block. Returns the last key asked for (the reading
        is done when it is no longer `Prefetcher.pending`), None when nothing was (no read-ahead, nothing to read,
        or too many requests queued for it)."""
        if self.prefetcher is None:
            return None
        fast = [tier for tier in self.tiers if not tier.slow]
        keys = [key for key in keys if not any(tier.contains(key) for tier in fast)]
        return keys[-1] if keys and self.prefetcher.submit(keys) else None

    def source(self, key: bytes, recompute_ms: float | None = None) -> int | None:
        """The tier a load of the block with prefix hash `key` reads: the fastest that holds it and that the cost
        rule does not pass over (each tier passed over counts the block as declined); None when there is none. The
        KV cache manager asks before it takes a pool block for the load (taking one may evict a cached block).

        Args:
            recompute_ms: what prefilling this block would cost, ms (`StepCost.marginal_ms_per_prefill_token` x
                block size); None = not measured yet: load. Used by the cost rule only.
        """
        if self.prefetcher is not None:
            start = time.perf_counter()
            staged = self.prefetcher.take(key)
            if staged is not None:
                self._staged = (key, *staged, time.perf_counter() - start)
                return staged[0]
        for i, tier in enumerate(self.tiers):
            if not tier.contains(key):
                continue
            if self._too_slow(i, recompute_ms):
                tier.counters.declined += 1
                continue
            return i
        return None

    def load_from(self, i: int, block_id: int, key: bytes) -> bool:
        """Copy the block with prefix hash `key` from tier `i` (`source`'s) into pool block `block_id`, and hand it
        to the faster tiers. Returns False (the block untouched) when the tier has no good copy after all (a disk
        or Redis entry that failed its checksum, or was deleted meanwhile)."""
        tier = self.tiers[i]
        start = time.perf_counter()
        staged, self._staged = self._staged, None
        prefetched = staged is not None and staged[:2] == (key, i)
        payload = staged[2] if prefetched else tier.get(key)
        if payload is None:
            return False
        self._region(block_id).copy_(payload)
        seconds = time.perf_counter() - start + (staged[3] if prefetched else 0.0)  # a wait in `source` too
        for faster in self.tiers[:i]:
            faster.put(key, payload)
        counters = tier.counters
        counters.hits += 1
        counters.loaded_bytes += payload.nbytes
        counters.load_seconds += seconds
        if prefetched:
            counters.prefetched += 1
            return True
        old = self.load_ms[i]
        self.load_ms[i] = seconds * 1e3 if old is None else old + LOAD_EWMA_ALPHA * (seconds * 1e3 - old)
        return True

    def load(self, block_id: int, key: bytes, recompute_ms: float | None = None) -> bool:
        """`source`, then `load_from`: False when no tier has a good copy, or none is worth loading from."""
        i = self.source(key, recompute_ms)
        return i is not None and self.load_from(i, block_id, key)

    def _too_slow(self, i: int, recompute_ms: float | None) -> bool:
        """Whether the cost rule passes tier `i` over for a block that costs `recompute_ms` to prefill (every
        `PROBE_EVERY`-th such block is loaded anyway, to keep measuring the tier)."""
        if self.load_rule != "cost" or recompute_ms is None or self.load_ms[i] is None \
                or self.load_ms[i] <= recompute_ms:
            return False
        self._declined_since_probe[i] += 1
        if self._declined_since_probe[i] >= PROBE_EVERY:
            self._declined_since_probe[i] = 0
            return False
        return True

    def take_dropped(self) -> list[bytes]:
        """Prefix hashes that some tier let go of since the last call (evicted to stay within its size, or found
        corrupt) and that no tier of this worker's own holds any more (`save`); for the worker's KV events."""
        keys: dict[bytes, None] = {}
        for tier in self.tiers:
            while tier.dropped:
                keys[tier.dropped.popleft()] = None
        return [key for key in keys if not any(t.local and t.contains(key) for t in self.tiers)]

    def stats(self) -> tuple[TierStats, ...]:
        """Every tier's counters now, fastest first."""
        return tuple(msgspec.structs.replace(tier.counters) for tier in self.tiers)

    def close(self) -> None:
        """Stop reading ahead and finish the tiers' pending writes (a disk tier's queue), so a restart finds them."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        for tier in self.tiers:
            tier.close()


def tier_namespace(compat: str, args: EngineArgs) -> str:
    """What a tier's entries are, as a 16-hex-digit name: the KV geometry and dtype (`engine.config.compat_hash`),
    the quantization, and the weights (each weight file's name, size and sampled content, `_file_fingerprint`; the
    seed for random weights). Different weights of the same shape never share entries; the same files copied to
    another host share them (a shared Redis tier)."""
    h = hashlib.sha256(f"{compat}|{args.quantization}".encode())
    if args.random_weights:
        h.update(f"|random:{args.seed}".encode())
    else:
        for path in sorted(p for p in Path(args.model_dir).iterdir() if p.suffix in WEIGHT_SUFFIXES):
            h.update(f"|{path.name}:{path.stat().st_size}:{_file_fingerprint(path)}".encode())
    return h.hexdigest()[:16]


def _file_fingerprint(path: Path, sample: int = 2**20) -> str:
    """BLAKE2b of a weight file's first and last MiB and one MiB at every GiB: ~18 MiB read for a 16 GB model
    (hashing all of it would take most of a minute at start). Two trainings of one shape differ in nearly every
    tensor, so in every sample; a file's modification time would differ between two copies of the same weights."""
    h = hashlib.blake2b(digest_size=16)
    size = path.stat().st_size
    with path.open("rb") as f:
        for offset in sorted({0, *range(2**30, size, 2**30), max(0, size - sample)}):
            f.seek(offset)
            h.update(f.read(sample))
    return h.hexdigest()


def build_offloader(args: EngineArgs, compat: str, kv: torch.Tensor) -> KvOffloader | None:
    """The tiers `args` asks for (`kv_offload_cpu_bytes`, `kv_offload_disk_dir`, `kv_offload_redis_url`), fastest
    first, under the KV shard `kv`, or None when it asks for none.

    Raises:
        ValueError: tiers without prefix caching (they hold prefix-cache blocks), or with tensor parallelism (a
            block is split across ranks' shards: not supported yet), or a size that cannot hold one block (the disk
            tier's own check, `DiskTier`).
        OSError: the disk tier's directory cannot be created.
        ConnectionError: the Redis tier's server does not answer (`RedisTier`).
    """
    if not args.kv_offload_cpu_bytes and not args.kv_offload_disk_dir and not args.kv_offload_redis_url:
        return None
    if not args.enable_prefix_caching:
        raise ValueError("KV offload tiers keep prefix-cache blocks: they need prefix caching "
                         "(drop --no-enable-prefix-caching)")
    if args.tensor_parallel_size > 1:
        raise ValueError("KV offload tiers do not support --tensor-parallel-size > 1 yet")
    block_bytes = kv[0].nbytes
    tiers: list = []
    if args.kv_offload_cpu_bytes:
        if args.kv_offload_cpu_bytes < block_bytes:
            raise ValueError(f"--kv-offload-cpu-bytes {args.kv_offload_cpu_bytes} cannot hold one KV block "
                             f"({block_bytes} bytes)")
        tiers.append(MemoryTier(args.kv_offload_cpu_bytes))
    namespace = tier_namespace(compat, args) if args.kv_offload_disk_dir or args.kv_offload_redis_url else ""
    if args.kv_offload_disk_dir:
        tiers.append(DiskTier(args.kv_offload_disk_dir, args.kv_offload_disk_bytes, namespace, block_bytes))
    if args.kv_offload_redis_url:
        tiers.append(RedisTier(args.kv_offload_redis_url, namespace, block_bytes))
    return KvOffloader(kv, tiers, store_computed=args.kv_offload_store == "computed", load_rule=args.kv_offload_load,
                       prefetch_bytes=args.kv_offload_prefetch_bytes)
