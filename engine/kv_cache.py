"""The paged KV cache memory of one worker.

Layout (block-major): kv[num_blocks, tp, num_layers, 2, block_size, kv_heads, head_dim], tp the tensor parallel
size (`CacheConfig.tensor_parallel_size`, 1 without tensor parallelism) and kv_heads those a rank stores,
ceil(num_kv_heads / tp) (`engine.parallel.head_split`: num_kv_heads / tp when it divides). One block's K and V for every
layer and every rank are a single contiguous region, so the transfer connectors send and receive whole blocks
straight from/into the cache (no staging copies, one message per block), whatever the TP size: a block carries each
rank's shard, rank-major. Rank r computes on kv[:, r] (its heads). The attention ops see per-layer views
k_cache/v_cache of shape [num_blocks, block_size, kv_heads, head_dim] (strided in dim 0).
Layer-wise streaming needs one layer of many blocks: kv[block, r, layer] (K then V) is slice r * num_layers + layer
of the block's tp * num_layers equal contiguous slices, and `engine/transfer/layer_gather.py` gathers a layer's tp
slices of many blocks into one message per layer and group of blocks (a copy: a message per slice cost more than
the copy).
"""
from __future__ import annotations

import torch

from engine.config import CacheConfig, ModelConfig
from engine.parallel import kv_heads_per_rank


def kv_shape(model: ModelConfig, cache: CacheConfig) -> tuple[int, ...]:
    """The KV tensor's shape: [num_blocks + 1, tp, num_layers, 2, block_size, kv_heads_per_rank, head_dim]. The
    extra block is outside the pool (no request owns it): the padded rows of a captured decode step write there
    (`engine.cuda_graphs`)."""
    tp = cache.tensor_parallel_size
    return (cache.num_blocks + 1, tp, model.num_layers, 2, cache.block_size,
            kv_heads_per_rank(model.num_kv_heads, tp), model.head_dim)


class KVCache:
    """Owns (or wraps) the KV tensor and exposes one rank's per-layer views and per-block byte views.

    Attributes:
        kv: the whole tensor (`kv_shape`), every rank's shard.
        layers: rank `rank`'s (k_cache, v_cache) of each layer, for the attention ops.
        scratch_slot: a KV slot in a block past the pool's, written only by padding (`engine.cuda_graphs`).

    Args:
        model: shapes and dtype.
        cache: block size, count and TP size.
        device: where the cache lives.
        kv: an existing cache tensor of this geometry to wrap (the one an engine process shares with its worker and
            its other TP ranks) instead of a new one.
        rank: the tensor-parallel rank whose layer views `layers` holds.

    Raises:
        ValueError: `kv` does not have the geometry and dtype of `model` and `cache`.
    """

    def __init__(self, model: ModelConfig, cache: CacheConfig, device: torch.device | str = "cpu",
                 kv: torch.Tensor | None = None, rank: int = 0):
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks
        shape = kv_shape(model, cache)
        if kv is None:
            kv = torch.zeros(shape, dtype=model.torch_dtype, device=device)
        elif tuple(kv.shape) != shape or kv.dtype != model.torch_dtype:
            raise ValueError(f"KV cache tensor {tuple(kv.shape)} {kv.dtype} is not {shape} {model.torch_dtype}")
        self.kv = kv
        self.scratch_slot = cache.num_blocks * cache.block_size
        shard = self.kv[:, rank]
        self.layers = [(shard[:, i, 0], shard[:, i, 1]) for i in range(model.num_layers)]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers."""
        return self.kv[0].numel() * self.kv.element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer's K and V) src -> dst, for each (src, dst) pair of block ids: the
        copy-on-write of a forked sample's partial block."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.kv.device)
            dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.kv.device)
            self.kv.index_copy_(0, dst, self.kv.index_select(0, src))

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """One block's memory as a writable 1-D uint8 tensor on the cache's device (a view: no copy), for the
        transfer connectors.

        Raises:
            IndexError: block_id out of range.
        """
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} out of range [0, {self.num_blocks})")
        return self.kv[block_id].view(-1).view(torch.uint8)
