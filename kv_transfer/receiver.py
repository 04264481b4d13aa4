"""The receiving end of the KV transfer protocol (`wire.py`), on a decode worker: `KvReceiver` listens, checks
each sender's handshake, and receives the blocks of each accepted offer in place into the blocks the decode worker
reserved (`ReceiveSink`)."""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
from typing import Protocol

import torch

from pdserve_server.engine.errors import EngineError
from pdserve_server.kv_transfer.channel import Backend, Channel, ChannelClosed, Listener
from pdserve_server.kv_transfer.layer_gather import LayerGather
from pdserve_server.kv_transfer.wire import PROTOCOL_VERSION, BlockView, Offer, decode, encode, handshake_mac, parse_end

log = logging.getLogger(__name__)


class ReceiveSink(Protocol):
    """What the receiver needs from the decode worker (called on the event loop thread)."""

    def begin_receive(self, request_id: str, first_block: int, num_blocks: int, num_tokens: int,
                      trace_context: dict[str, str]) -> list[int]:
        """Return the reserved block ids to fill with the offered blocks (positions first_block .. first_block +
        num_blocks of the request's block table), in order, and mark the request as receiving. trace_context:
        the sender's W3C trace headers (for the receive's span).

        Raises:
            LookupError: reject the offer (unknown or aborted request, or other blocks than those awaited); the
                message is sent back to the prefill worker.
        """

    def end_receive(self, request_id: str, first_token: int, error: str | None) -> None:
        """The blocks are complete (error None) or the transfer failed (the request must be aborted)."""


class KvReceiver:
    """Accepts channels from prefill workers and receives blocks in place into the reserved KV blocks.

    Args:
        backend: transport to listen on.
        compat_hash: this worker's layout hash.
        block_view: block id -> that block's memory, one writable 1-D uint8 tensor per tensor-parallel rank, each
            on its rank's device (`KvShards.block_regions`).
        sink: reservation bookkeeping of the decode worker.
        timeout_s: bound on the handshake and on receiving one request's blocks once accepted, seconds.
        secret: the cluster secret a sender must prove at the handshake; None = anyone may send.
    """

    def __init__(self, backend: Backend, compat_hash: str, block_view: BlockView, sink: ReceiveSink,
                 timeout_s: float = 30.0, secret: str | None = None):
        self.backend, self.compat_hash, self.block_view, self.sink = backend, compat_hash, block_view, sink
        self.timeout_s = timeout_s
        self.secret = secret
        self._listener: Listener | None = None
        self._channels: set[Channel] = set()
        self.host = ""

    async def start(self, host: str, port: int = 0, advertise: str | None = None) -> str:
        """Listen on host:port (0 = any free port) and return the address peers dial, e.g.
        'tcp://10.0.0.7:40123': `advertise` (default: host) with the bound port."""
        self._listener = await self.backend.listen(host, port, self._serve)
        self.host = advertise or host
        return self.address

    @property
    def address(self) -> str:
        assert self._listener is not None
        return f"{self.backend.name}://{self.host}:{self._listener.port}"

    def close(self) -> None:
        """Stop listening and drop every open channel (transfers in flight fail on both sides)."""
        if self._listener is not None:
            self._listener.close()
        for ch in list(self._channels):
            ch.close()

    async def _serve(self, ch: Channel) -> None:
        self._channels.add(ch)
        try:
            nonce = os.urandom(16).hex()
            await ch.send_msg(encode({"type": "challenge", "version": PROTOCOL_VERSION, "nonce": nonce}))
            hello = decode(await asyncio.wait_for(ch.recv_msg(), self.timeout_s))
            # The secret first, over the layout the sender claims: a stranger learns nothing (not even our layout
            # hash), and a peer that proved the secret is told exactly why its layout is refused. Compared as
            # bytes: compare_digest raises TypeError for a non-ASCII str.
            claimed = str(hello.get("compat_hash", ""))
            if self.secret and not hmac.compare_digest(
                    str(hello.get("mac", "")).encode(), handshake_mac(self.secret, nonce, claimed).encode()):
                log.warning("KV handshake refused: the sender did not prove the cluster secret")
                await ch.send_msg(encode({"type": "hello_ack", "ok": False,
                                           "error": "authentication failed: wrong or missing cluster secret"}))
                return
            if hello.get("version") != PROTOCOL_VERSION or claimed != self.compat_hash:
                err = (f"incompatible peer: version {hello.get('version')} / layout {claimed}, "
                       f"expected {PROTOCOL_VERSION} / {self.compat_hash} (same model, dtype and block size?)")
                log.error(err)
                await ch.send_msg(encode({"type": "hello_ack", "ok": False, "error": err}))
                return
            await ch.send_msg(encode({"type": "hello_ack", "ok": True}))
            while True:
                offer = Offer.parse(decode(await ch.recv_msg()))  # idle: no timeout, peer death ends the wait
                if not await self._receive_one(ch, offer):
                    return
        except (ChannelClosed, asyncio.TimeoutError, ValueError) as e:
            log.info("KV channel closed: %s", e)
        finally:
            self._channels.discard(ch)
            ch.close()

    async def _receive_one(self, ch: Channel, offer: Offer) -> bool:
        """Handle one offer; returns False when the channel must be dropped."""
        rid = offer.request_id
        try:
            block_ids = self.sink.begin_receive(rid, offer.first_block, offer.num_blocks, offer.num_tokens,
                                                offer.trace_context)
            regions = self.block_view(block_ids[0]) if offer.num_blocks else []
            expected = (len(regions), sum(r.nbytes for r in regions))
            if regions and (offer.num_ranks, offer.block_nbytes) != expected:
                self.sink.end_receive(rid, 0, "block layout mismatch")
                raise LookupError(f"blocks of {offer.block_nbytes} bytes in {offer.num_ranks} rank region(s), "
                                  f"expected {expected[1]} in {expected[0]}")
            if offer.num_layers and offer.block_nbytes % (offer.num_layers * offer.num_ranks):
                self.sink.end_receive(rid, 0, "layer size mismatch")
                raise LookupError(f"a block of {offer.block_nbytes} bytes does not split into {offer.num_layers} "
                                  f"layers of {offer.num_ranks} rank(s)")
        except (LookupError, EngineError) as e:  # EngineError: no cache to receive into (its engine restarts)
            await ch.send_msg(encode({"type": "accept", "ok": False, "error": str(e)}))
            return True
        await ch.send_msg(encode({"type": "accept", "ok": True}))
        try:
            async with asyncio.timeout(self.timeout_s):
                blocks = [self.block_view(b) for b in block_ids]
                if offer.num_layers:
                    end = await self._receive_layers(ch, blocks, offer.num_layers)
                else:
                    await ch.recv_into_all([region for regions in blocks for region in regions])
                    end = decode(await ch.recv_msg())
                first_token, error = parse_end(end)
        except BaseException as e:
            self.sink.end_receive(rid, 0, f"KV transfer interrupted: {type(e).__name__}: {e}")
            raise
        self.sink.end_receive(rid, first_token, error)
        await ch.send_msg(encode({"type": "done", "ok": True}))
        return True

    @staticmethod
    async def _receive_layers(ch: Channel, blocks: list[list[torch.Tensor]], num_layers: int) -> dict:
        """Receive a layer-wise offer's layers into the blocks (each block's regions, rank order); returns the end
        message (which may come early: the sender gave up on the request). Raises ValueError on a message out of
        order."""
        gather = LayerGather(blocks, num_layers)
        for layer in range(num_layers):
            msg = decode(await ch.recv_msg())
            if msg.get("type") == "end":
                return msg
            if msg.get("type") != "layer" or msg.get("layer") != layer:
                raise ValueError(f"expected the header of layer {layer}, got {msg}")
            for group in gather.groups():
                landing = gather.buffers(group)
                await ch.recv_into_all(landing)
                await gather.scatter(layer, group, landing)
        return decode(await ch.recv_msg())
