"""Layer-wise streaming's message shape: one layer of many blocks as few messages (see `LayerGather`)."""
from __future__ import annotations

import asyncio

import torch

LAYER_GROUP_BLOCKS = 64  # blocks per layer-wise message: bounds the gather buffer (1.4 MiB for SmolLM2 in fp32)


class LayerGather:
    """Moves one layer of many blocks as few messages: a layer's slice of up to LAYER_GROUP_BLOCKS blocks is
    gathered into (sender) or scattered from (receiver) one contiguous buffer per tensor-parallel rank, on that
    rank's device.

    Why a copy: a message per (block, layer) made 30x the messages of whole blocks, and per-message costs
    dominated. At 2048 tokens of SmolLM2 (bench/transfer_rate.py, loopback), tcp fell from 1847 to 953 MiB/s, ucx
    (its tcp transport) from 220 to 44 and gloo from 1498 to 140. The copy runs at memory speed on the cache's
    device. On CUDA it is ordered on the current stream and waited for (a CUDA event, off the event loop) before a
    transport reads the buffer or the next group overwrites it.

    Under tensor parallelism a block is one region per rank (`engine.execution.kv_cache.KvShards`), possibly on
    different devices, so a group's layer is one message per rank, rank order (ranks on several GPUs: unverified).

    Args:
        blocks: each block's regions (1-D uint8, one per rank, `KvShards.block_regions`), in transfer order.
        num_layers: the model's layers; each region is num_layers equal slices, layer-major.
    """

    def __init__(self, blocks: list[list[torch.Tensor]], num_layers: int):
        self.blocks = blocks
        firsts = blocks[0] if blocks else []
        self.slice = firsts[0].numel() // num_layers if firsts else 0  # bytes of one layer of one region
        size = min(len(blocks), LAYER_GROUP_BLOCKS) * self.slice
        self._buffers = [torch.empty(size, dtype=torch.uint8, device=r.device) for r in firsts]

    def groups(self) -> list[range]:
        return [range(g, min(g + LAYER_GROUP_BLOCKS, len(self.blocks)))
                for g in range(0, len(self.blocks), LAYER_GROUP_BLOCKS)]

    def buffers(self, group: range) -> list[torch.Tensor]:
        """The group's landing (or sending) buffer of each rank."""
        return [b[:len(group) * self.slice] for b in self._buffers]

    def _slice(self, block: int, rank: int, layer: int) -> torch.Tensor:
        n = self.slice
        return self.blocks[block][rank][layer * n:(layer + 1) * n]

    async def gather(self, layer: int, group: range) -> list[torch.Tensor]:
        """The group's blocks' slices of `layer`, one contiguous buffer per rank (block order), ready to send."""
        out = self.buffers(group)
        for rank, buf in enumerate(out):
            torch.cat([self._slice(b, rank, layer) for b in group], out=buf)
        await _device_done(out)
        return out

    async def scatter(self, layer: int, group: range, landed: list[torch.Tensor]) -> None:
        """Copy a received group's slices of `layer` (one buffer per rank) into its blocks; done when this
        returns."""
        n = self.slice
        for rank, buf in enumerate(landed):
            for i, b in enumerate(group):
                self._slice(b, rank, layer).copy_(buf[i * n:(i + 1) * n])
        await _device_done(landed)


async def _device_done(bufs: list[torch.Tensor]) -> None:
    """On CUDA, wait (off the event loop) until the work queued so far on the current stream of each buffer's
    device is done: a transport may then read or overwrite them outside torch's stream order. Nothing to wait for
    on CPU."""
    events = []
    for t in bufs:
        if t.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            events.append(event)
    for event in events:
        await asyncio.to_thread(event.synchronize)
