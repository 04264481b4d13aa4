"""KV offload tiers: full prefix-cache blocks the pool evicts go to a lower tier instead of being dropped, and a
prefix-cache lookup that misses the pool loads them back instead of recomputing them (vLLM's KV offloading, SGLang's
HiCache, Dynamo's KV block manager).

- `memory`: a host-memory tier, bounded in bytes (the tier under a GPU pool);
- `disk`: a directory, bounded in bytes, whose entries carry a checksum and outlive the worker (a warm restart);
- `redis_tier`: a Redis server that workers on any host share (a prefix computed once per cluster);
- `entry`: how one block is stored in a file or a Redis value (header with length and checksum, then the bytes);
- `writes`: the disk and Redis tiers' writer thread, with blocks readable while they wait for it;
- `prefetch`: a queued request's blocks read ahead from the disk and Redis tiers on a thread of their own;
- `offloader`: moves one block between the KV cache tensor and the tiers, and counts what each tier did.

The block pool calls the offloader as it evicts (`scheduling.block_pool.BlockPool.on_evict`) and the KV cache
manager as a lookup runs past the pool (`scheduling.kv_cache_manager.KVCacheManager.get_computed_blocks`).
"""
