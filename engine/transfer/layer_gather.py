"""Layer-wise streaming's message shape: one layer of many blocks as few messages (see `LayerGather`)."""
from __future__ import annotations

import asyncio

import torch

LAYER_GROUP_BLOCKS = 64  # blocks per layer-wise message: bounds the gather buffer (1.4 MiB for SmolLM2 in fp32)


class LayerGather:
    """Moves one layer of many blocks as few messages: a layer's slice of up to LAYER_GROUP_BLOCKS blocks is
    gathered into (sender) or scattered from (receiver) one contiguous buffer on the cache's device.

    Why a copy: a message per (block, layer) made 30x the messages of whole blocks, and per-message costs
    dominated. At 2048 tokens of SmolLM2 (bench/kv_transfer.py, loopback), tcp fell from 1847 to 953 MiB/s, ucx
    (its tcp transport) from 220 to 44 and gloo from 1498 to 140. The copy runs at memory speed on the cache's
    device. On CUDA it is ordered on the current stream and waited for (a CUDA event, off the event loop) before a
    transport reads the buffer or the next group overwrites it. Unverified on GPU.

    Under tensor parallelism a block holds every rank's shard, rank-major (`engine/kv_cache.py`), so a layer of a
    block is `num_ranks` slices, one per shard; they travel together, rank order.

    Args:
        views: each block's bytes (1-D uint8, `KVCache.block_bytes`), in transfer order.
        num_layers: the model's layers; each rank's shard of a block is num_layers equal slices, layer-major.
        num_ranks: tensor-parallel shards per block (1 without TP).
    """

    def __init__(self, views: list[torch.Tensor], num_layers: int, num_ranks: int = 1):
        self.views, self.num_layers, self.num_ranks = views, num_layers, num_ranks
        self.slice = views[0].numel() // (num_layers * num_ranks) if views else 0  # bytes of one (rank, layer)
        self.per = self.slice * num_ranks  # bytes of one layer of one block
        size = min(len(views), LAYER_GROUP_BLOCKS) * self.per
        self._buffer = torch.empty(size, dtype=torch.uint8, device=views[0].device if views else "cpu")

    def groups(self) -> list[range]:
        return [range(g, min(g + LAYER_GROUP_BLOCKS, len(self.views)))
                for g in range(0, len(self.views), LAYER_GROUP_BLOCKS)]

    def buffer(self, group: range) -> torch.Tensor:
        return self._buffer[:len(group) * self.per]

    def _slices(self, block: int, layer: int) -> list[torch.Tensor]:
        """Block `block`'s bytes of `layer`, one slice per rank."""
        view, n = self.views[block], self.slice
        return [view[(r * self.num_layers + layer) * n:(r * self.num_layers + layer + 1) * n]
                for r in range(self.num_ranks)]

    async def gather(self, layer: int, group: range) -> torch.Tensor:
        """The group's blocks' slices of `layer`, contiguous (block-major, then rank), ready to send."""
        out = self.buffer(group)
        torch.cat([s for b in group for s in self._slices(b, layer)], out=out)
        await _device_done(out)
        return out

    async def scatter(self, layer: int, group: range, landed: torch.Tensor) -> None:
        """Copy a received group's slices of `layer` into its blocks; done when this returns."""
        n = self.slice
        for i, b in enumerate(group):
            for r, s in enumerate(self._slices(b, layer)):
                s.copy_(landed[(i * self.num_ranks + r) * n:(i * self.num_ranks + r + 1) * n])
        await _device_done(landed)


async def _device_done(t: torch.Tensor) -> None:
    """On CUDA, wait (off the event loop) until the work queued so far on the current stream is done: a
    transport may then read or overwrite `t` outside torch's stream order. Nothing to wait for on CPU."""
    if t.is_cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        await asyncio.to_thread(event.synchronize)
