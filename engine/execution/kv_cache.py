"""The paged KV cache memory: one tensor-parallel rank's shard (`KVCache`, where that rank computes) and every
rank's shards as a worker's KV connectors see them (`KvShards`).

Layout of a shard (block-major): kv[num_blocks + 1, num_layers, 2, block_size, kv_heads, head_dim], kv_heads those
the rank stores, ceil(num_kv_heads / tp) (`engine.parallel.tensor_parallel.head_split`: num_kv_heads / tp when it
divides). One block's K and V for every layer of a rank are a single contiguous region, so the connectors send and
receive whole blocks straight from/into the cache (no staging copies), one region per rank (`KvShards.block_regions`):
each rank allocates its shard on its own device (CPU shared memory, or its GPU) and hands it to the worker
(`export_shard`). The attention ops see per-layer views k_cache/v_cache of shape [num_blocks, block_size, kv_heads,
head_dim] (strided in dim 0). Layer-wise streaming needs one layer of many blocks: kv[block, layer] (K then V) is slice
`layer` of the block's region, and `kv_transfer/layer_gather.py` gathers a layer's slices of many blocks into
one message per rank, layer and group of blocks (a copy: a message per slice cost more than the copy).
"""
from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch  # registers torch.multiprocessing's reductions with ForkingPickler

from pdserve_server.engine.config import CacheConfig

from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.parallel.tensor_parallel import kv_heads_per_rank


def kv_shape(model: ModelConfig, cache: CacheConfig) -> tuple[int, ...]:
    """One rank's shard: [num_blocks + 1, num_layers, 2, block_size, kv_heads_per_rank, head_dim]. The extra block
    is outside the pool (no request owns it): the padded rows of a captured decode step write there
    (`engine.execution.cuda_graphs`)."""
    return (cache.num_blocks + 1, model.num_layers, 2, cache.block_size,
            kv_heads_per_rank(model.num_kv_heads, cache.tensor_parallel_size), model.head_dim)


class KVCache:
    """Owns one rank's KV shard and exposes its per-layer views.

    Attributes:
        kv: the shard (`kv_shape`), zeros at start.
        layers: each layer's (k_cache, v_cache), for the attention ops.
        scratch_slot: a KV slot in a block past the pool's, written only by padding (`engine.execution.cuda_graphs`).

    Args:
        model: shapes (and the dtype, unless the cache has its own).
        cache: block size, count, TP size and dtype.
        device: where the shard lives (the rank's device).
    """

    def __init__(self, model: ModelConfig, cache: CacheConfig, device: torch.device | str = "cpu"):
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks
        self.kv = torch.zeros(kv_shape(model, cache), dtype=cache.torch_dtype(model), device=device)
        self.scratch_slot = cache.num_blocks * cache.block_size
        self.layers = [(self.kv[:, i, 0], self.kv[:, i, 1]) for i in range(model.num_layers)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer's K and V) src -> dst, for each (src, dst) pair of block ids: the
        copy-on-write of a forked sample's partial block (each rank copies its own shard)."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.kv.device)
            dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.kv.device)
            self.kv.index_copy_(0, dst, self.kv.index_select(0, src))


class KvShards:
    """Every rank's KV shard as a worker's KV connectors move them: a block is one region per rank, rank order.

    Args:
        model, cache: the geometry every shard must have (`kv_shape`).
        shards: one tensor per tensor-parallel rank, rank order, each on its rank's device (the engine's own,
            shared: CPU shared memory or CUDA IPC, `import_shard`).

    Raises:
        ValueError: not one shard per rank, or a shard without the geometry and dtype of `model` and `cache`.
    """

    def __init__(self, model: ModelConfig, cache: CacheConfig, shards: list[torch.Tensor]):
        shape, dtype = kv_shape(model, cache), cache.torch_dtype(model)
        if len(shards) != cache.tensor_parallel_size:
            raise ValueError(f"{len(shards)} KV shards for {cache.tensor_parallel_size} tensor-parallel ranks")
        for s in shards:
            if tuple(s.shape) != shape or s.dtype != dtype:
                raise ValueError(f"KV shard {tuple(s.shape)} {s.dtype} is not {shape} {dtype}")
        self.shards = list(shards)
        self.num_blocks = cache.num_blocks

    def block_regions(self, block_id: int) -> list[torch.Tensor]:
        """One block's memory: a writable 1-D uint8 tensor per rank (views: no copy), each on its rank's device, of
        num_layers x 2 x block_size x kv_heads_per_rank x head_dim elements.

        Raises:
            IndexError: block_id out of range.
        """
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} out of range [0, {self.num_blocks})")
        return [s[block_id].view(-1).view(torch.uint8) for s in self.shards]


def share(kv: torch.Tensor) -> torch.Tensor:
    """Move a CPU shard into shared memory (in place: views follow it), so another process can map it; a CUDA
    shard is shared as it is (CUDA IPC). Returns `kv`.

    Raises:
        RuntimeError: /dev/shm cannot hold it (the message says what to change).
    """
    if kv.device.type == "cpu" and not kv.is_shared():
        try:
            kv.share_memory_()
        except RuntimeError as e:
            raise RuntimeError(f"{e}; the KV cache ({kv.nbytes / 2**20:.0f} MiB) is shared memory between the "
                               "worker and its engine process: enlarge /dev/shm (docker --shm-size, compose "
                               "shm_size) or lower --kv-tokens") from e
    return kv


def export_shard(kv: torch.Tensor) -> bytes:
    """A shared shard (`share`) as bytes another process opens with `import_shard`, through torch.multiprocessing's
    reductions (a shared-memory file descriptor served by this process, or a CUDA IPC handle). Bytes, not the
    tensor, so a rank's shard can pass through rank 0 to the worker without rank 0 mapping it (nor opening a CUDA
    context on the rank's GPU). This process must keep the shard alive while others use it; a CPU shard's bytes
    open once."""
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(kv)
    return buf.getvalue()


def import_shard(data: bytes) -> torch.Tensor:
    """The shard `export_shard` gave, mapped into this process (the same memory)."""
    return ForkingPickler.loads(data)
