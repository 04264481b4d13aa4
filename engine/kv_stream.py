"""Layer-wise KV streaming: the engine thread tells the KV sender, layer by layer, that a request's last prefill
chunk has written its K/V, so the transfer of layer l overlaps the forward of layers l+1..

Earlier chunks' KV is complete for every layer when the last chunk starts, so once layer l of the last chunk is
written, layer l of every block of the request is final and can go.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch


class LayerStreamEnded(Exception):
    """The stream ended before what was awaited (the request failed, was cancelled, or finished at its first
    token); the message says why."""


class KvLayerProgress:
    """How far one request's last prefill chunk has written its KV: from the engine thread to the event loop.

    Engine thread (`ModelRunner.execute`): `begin(block_ids, num_tokens)` as the last chunk's step starts, then
    `layer_written(layer, device)` after each layer's attention wrote its K/V. Event loop (the KV sender):
    `await started()`, `await written(layer)`, `await first_token()`. The owner (the prefill servicer) ends the
    stream with `finish(token_id)` or `fail(reason)`; after a failure every wait raises `LayerStreamEnded`.

    Device memory: on CUDA the forward is asynchronous, so `layer_written` records a CUDA event on the engine
    thread's current stream and `written` waits for it before the sender reads the layer (ucx reads device memory
    outside torch's stream order). Checked on an H100 (2026-11-22, layer-wise clusters on tcp and ucx). On CPU
    the write is complete when the call is made.

    Args:
        num_layers: the model's decoder layers.
        loop: the event loop the sender runs on (default: the running one).
    """

    def __init__(self, num_layers: int, loop: asyncio.AbstractEventLoop | None = None):
        self.num_layers = num_layers
        self._loop = loop or asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self.block_ids: list[int] | None = None
        self.num_tokens = 0
        self._written: list[torch.cuda.Event | None] = []
        self._first_token: int | None = None
        self._error: str | None = None

    # ---- engine thread ---------------------------------------------------------------------------------------
    def begin(self, block_ids: list[int], num_tokens: int) -> None:
        """The last chunk's step starts: the KV will fill `block_ids` (the request's block table) for
        `num_tokens` tokens."""
        self._post(self._set_begin, list(block_ids), num_tokens)

    def layer_written(self, layer: int, device: torch.device) -> None:
        """Layer `layer`'s K/V of the step is written (enqueued, on CUDA) into the cache on `device`."""
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        self._post(self._set_written, layer, event)

    def _post(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the worker is shutting down and nobody waits any more
            pass

    # ---- event loop ------------------------------------------------------------------------------------------
    def finish(self, token_id: int) -> None:
        """The prefill sampled `token_id` and holds the blocks: the transfer may complete. The engine posts
        `begin` before the token's event, so a stream never begun here is a bug: it fails rather than hang."""
        if self.block_ids is None:
            self.fail("the engine sampled the first token without streaming the request's layers")
            return
        self._first_token = token_id
        self._changed.set()

    def fail(self, reason: str) -> None:
        """End the stream without a first token; the first reason given is kept."""
        if self._error is None:
            self._error = reason
        self._changed.set()

    async def started(self) -> tuple[list[int], int]:
        """(block_ids, num_tokens) once the last chunk's step started. Raises LayerStreamEnded."""
        await self._until(lambda: self.block_ids is not None)
        assert self.block_ids is not None
        return self.block_ids, self.num_tokens

    async def written(self, layer: int) -> None:
        """Returns once layer `layer` of every block is final in the cache. Raises LayerStreamEnded."""
        await self._until(lambda: len(self._written) > layer)
        event = self._written[layer]
        if event is not None:
            await asyncio.to_thread(event.synchronize)

    async def first_token(self) -> int:
        """The sampled first token, once every layer is written and the prefill is done. Raises LayerStreamEnded."""
        await self._until(lambda: self._first_token is not None)
        assert self._first_token is not None
        return self._first_token

    async def _until(self, ready: Callable[[], bool]) -> None:
        while True:
            if self._error is not None:  # checked first: after a failure nothing more is sent
                raise LayerStreamEnded(self._error)
            if ready():
                return
            self._changed.clear()
            await self._changed.wait()

    def _set_begin(self, block_ids: list[int], num_tokens: int) -> None:
        self.block_ids, self.num_tokens = block_ids, num_tokens
        self._changed.set()

    def _set_written(self, layer: int, event: torch.cuda.Event | None) -> None:
        if layer == len(self._written):
            self._written.append(event)
            self._changed.set()
