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

    Args:
        views: each block's bytes (1-D uint8, `KVCache.block_bytes`), in transfer order.
        num_layers: equal slices per block, layer-major within the block (`engine/kv_cache.py`).
    """

    def __init__(self, views: list[torch.Tensor], num_layers: int):
        self.views = views
        self.per = views[0].numel() // num_layers if views else 0
        size = min(len(views), LAYER_GROUP_BLOCKS) * self.per
        self._buffer = torch.empty(size, dtype=torch.uint8, device=views[0].device if views else "cpu")

    def groups(self) -> list[range]:
        return [range(g, min(g + LAYER_GROUP_BLOCKS, len(self.views)))
                for g in range(0, len(self.views), LAYER_GROUP_BLOCKS)]

    def buffer(self, group: range) -> torch.Tensor:
        return self._buffer[:len(group) * self.per]

    def _slice(self, block: int, layer: int) -> torch.Tensor:
        return self.views[block][layer * self.per:(layer + 1) * self.per]

    async def gather(self, layer: int, group: range) -> torch.Tensor:
        """The group's blocks' slices of `layer`, contiguous, ready to send."""
        out = self.buffer(group)
        torch.cat([self._slice(b, layer) for b in group], out=out)
        await _device_done(out)
        return out

    async def scatter(self, layer: int, group: range, landed: torch.Tensor) -> None:
        """Copy a received group's slices of `layer` into its blocks; done when this returns."""
        for i, b in enumerate(group):
            self._slice(b, layer).copy_(landed[i * self.per:(i + 1) * self.per])
        await _device_done(landed)


async def _device_done(t: torch.Tensor) -> None:
    """On CUDA, wait (off the event loop) until the work queued so far on the current stream is done: a
    transport may then read or overwrite `t` outside torch's stream order. Nothing to wait for on CPU."""
    if t.is_cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        await asyncio.to_thread(event.synchronize)
