"""The sending end of the KV transfer protocol (`wire.py`), on a prefill worker: `KvSender` pushes a request's
held blocks, whole or layer by layer, to a decode worker over a small pool of channels per peer, retrying once a
transfer whose pooled channel turned out dead."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve_server.engine.kv_stream import KvLayerProgress, LayerStreamEnded
from pdserve_server.kv_transfer.backends import get_backend, parse_address
from pdserve_server.kv_transfer.channel import Backend, Channel, ChannelClosed
from pdserve_server.kv_transfer.layer_gather import LayerGather
from pdserve_server.kv_transfer.wire import PROTOCOL_VERSION, BlockView, decode, encode, handshake_mac

log = logging.getLogger(__name__)


class TransferError(EngineError):
    """A transfer failed; `kind` is TRANSFER_FAILED, KV_TIMEOUT, INCOMPATIBLE_PEER or TRANSFER_REJECTED."""


@dataclass
class TransferStats:
    """One request's send: blocks and bytes sent, wall seconds from offer to acknowledgement, and the bytes the
    sender's transport copied between device and host memory to do it (0 when it moved them in place)."""

    num_blocks: int
    num_bytes: int
    seconds: float
    staged_bytes: int = 0


class _StaleChannel(ChannelClosed):
    """A channel taken from the idle pool failed before the receiver answered the offer (see `KvSender._transfer`)."""


MAX_CHANNELS_PER_PEER = 4  # transfers to one decode worker share the link; more channels only add endpoints


class _PeerChannels:
    """Channels to one decode worker: at most `limit` open, opened one at a time, each used by one transfer."""

    def __init__(self, limit: int):
        self.slots = asyncio.Semaphore(limit)  # one per transfer in flight to this peer
        self.opening = asyncio.Lock()          # endpoint creation is serialised per peer
        self.idle: list[Channel] = []


class KvSender:
    """Pushes held KV blocks to decode workers over a small pool of long-lived channels per peer.

    Robust to cancellation by construction: a channel is never torn down because its caller went away. Opening
    a channel (a UCX endpoint takes 0.4-1 s and a two-way exchange) runs in a task of its own that a cancelled
    caller leaves to finish into the pool, and once an offer is on the wire the transfer runs to its end (bounded
    by `timeout_s`) even if `send` is cancelled: cancelling a transfer mid-message meant aborting the endpoint
    with operations in flight, which crashed ucxx (a segfault in `create_endpoint` and lost completions).
    Only a transfer that fails or times out closes its channel.

    A pooled channel may be dead: the decode worker behind the address restarted (same KV port) since it was last
    used. So a transfer whose channel came from the idle pool and failed (ChannelClosed) while the offer was
    sent or its answer awaited is retried once, on a freshly opened channel (`_transfer`). Nothing of the transfer
    was accepted then: the receiver writes blocks only after it sent its accept, and a receiver that did accept
    before the channel died marked its reservation receiving, so it rejects the retry's offer rather than take the
    blocks twice; that receive failed with the channel, so the transfer ends TRANSFER_FAILED (retried or migrated by
    the coordinator), not TRANSFER_REJECTED. Never retried: a failure on a fresh channel, one after the accept arrived
    (blocks may have been written), a timeout, a malformed answer, or a transfer whose caller was cancelled.

    Args:
        compat_hash: this worker's `engine.config.compat_hash`; the receiver refuses a mismatch.
        block_view: block id -> that block's memory, one 1-D uint8 tensor per tensor-parallel rank, each on its
            rank's device (`KvShards.block_regions`); every block has the same regions' sizes.
        timeout_s: bound on waiting for a channel + connecting + the whole transfer, seconds.
        secret: the cluster secret, proven at each handshake (`handshake_mac`); None = none configured.
        max_channels_per_peer: channels (and so concurrent transfers) per decode worker; more transfers queue.
    """

    def __init__(self, compat_hash: str, block_view: BlockView, timeout_s: float = 30.0, secret: str | None = None,
                 max_channels_per_peer: int = MAX_CHANNELS_PER_PEER):
        self.compat_hash = compat_hash
        self.block_view = block_view
        self.timeout_s = timeout_s
        self.secret = secret
        self.max_channels_per_peer = max_channels_per_peer
        self._peers: dict[str, _PeerChannels] = {}
        self._backends: dict[str, Backend] = {}
        self._connecting: set[asyncio.Task] = set()  # strong references: a cancelled caller drops its own

    async def send(self, address: str, request_id: str, first_token: int, block_ids: list[int],
                   num_tokens: int, trace_context: dict[str, str] | None = None,
                   first_block: int = 0) -> TransferStats:
        """Send one request's blocks in order; returns when the receiver acknowledged them. trace_context (W3C
        headers) travels in the offer. first_block: where `block_ids` start in the request's block table (the
        decode worker already holds the blocks before it).

        Raises:
            TransferError: rejected, incompatible, peer died, or timed out (KV_TIMEOUT). The caller still owns
                (and must free) the blocks.
            asyncio.CancelledError: the caller cancelled. Before the offer went out nothing is sent; after, the
                transfer is finished first (the blocks are read until this returns, so the caller may free them
                then), and the decode worker drops the KV when its own request is gone.
        """
        offer = {"request_id": request_id, "first_block": first_block, "num_blocks": len(block_ids),
                 "num_tokens": num_tokens, "num_layers": 0, "trace_context": trace_context or {}}

        async def body(ch: Channel) -> None:
            await ch.send_buffers([region for b in block_ids for region in self.block_view(b)])
            await ch.send_msg(encode({"type": "end", "ok": True, "first_token": first_token}))
        return await self._transfer(address, offer, block_ids, body)

    async def send_layers(self, address: str, request_id: str, progress: KvLayerProgress, first_block: int = 0,
                          trace_context: dict[str, str] | None = None) -> TransferStats:
        """Layer-wise streaming of one request's KV. Waits for its last prefill chunk to start
        (`progress.started`), offers the request's blocks from `first_block` on, sends layer l of every one of
        them as soon as the forward has written it (`progress.written`), and ends with the first token
        (`progress.first_token`). The decode worker uses the KV only once that end message arrived.

        Raises:
            LayerStreamEnded: the stream ended before the first token (the request failed, was cancelled, or
                finished at its first token). The receiver was told with an end message and dropped what came.
            EngineError: INVALID_REQUEST when first_block leaves no block to send (`blocks_to_send`).
            TransferError, asyncio.CancelledError: as `send`; a cancelled caller also ends the stream.
        """
        block_ids, num_tokens = await progress.started()
        blocks = [self.block_view(b) for b in blocks_to_send(block_ids, first_block)]
        layers = progress.num_layers
        offer = {"request_id": request_id, "first_block": first_block, "num_blocks": len(blocks),
                 "num_tokens": num_tokens, "num_layers": layers, "trace_context": trace_context or {}}

        async def body(ch: Channel) -> None:
            ended = None
            try:
                gather = LayerGather(blocks, layers)
                for layer in range(layers):
                    await progress.written(layer)
                    await ch.send_msg(encode({"type": "layer", "layer": layer}))
                    for group in gather.groups():
                        await ch.send_buffers(await gather.gather(layer, group))
                end = {"type": "end", "ok": True, "first_token": await progress.first_token()}
            except LayerStreamEnded as e:
                ended, end = e, {"type": "end", "ok": False, "error": str(e)}
            await ch.send_msg(encode(end))
            if ended is not None:
                raise ended
        return await self._transfer(address, offer, block_ids[first_block:], body,
                                    on_cancel=lambda: progress.fail("the prefill call ended"))

    async def _transfer(self, address: str, offer: dict, block_ids: list[int],
                        body: Callable[[Channel], Awaitable[None]],
                        on_cancel: Callable[[], None] = lambda: None) -> TransferStats:
        """Acquire a channel, then offer -> accept -> `body` (the blocks and the end message) -> done, shielded
        from the caller's cancellation once started (`on_cancel` runs first, to make `body` end soon)."""
        start = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        request_id = offer["request_id"]
        try:
            ch, pooled = await self._acquire(address, deadline)
            retried = False
            while True:
                exchange = asyncio.ensure_future(
                    self._exchange(address, ch, deadline, offer, block_ids, body, pooled=pooled))
                try:
                    stats = await asyncio.shield(exchange)
                    break
                except _StaleChannel as e:  # once: the retry's channel is fresh (see the class docstring)
                    log.info("KV channel to %s was dead (%s): retrying %s on a fresh channel", address, e,
                             request_id)
                    retried = True
                    ch, pooled = await self._acquire(address, deadline, fresh=True)
                except TransferError as e:
                    if retried and e.kind == ErrorKind.TRANSFER_REJECTED:
                        # The receiver had accepted the first offer before that channel died: that receive
                        # failed with it, so the transfer failed (the coordinator retries or migrates), rather
                        # than ending the request as rejected.
                        raise TransferError(ErrorKind.TRANSFER_FAILED, f"KV transfer of {request_id} to {address} "
                                            f"failed: its channel died mid-offer and the retry was refused "
                                            f"({e.message})") from e
                    raise
                except asyncio.CancelledError:
                    on_cancel()
                    await uncancellable(exchange)
                    raise
        except TimeoutError as e:
            raise TransferError(ErrorKind.KV_TIMEOUT,
                                f"KV transfer of {request_id} to {address} exceeded {self.timeout_s:.1f}s") from e
        except ChannelClosed as e:
            raise TransferError(ErrorKind.TRANSFER_FAILED,
                                f"KV transfer of {request_id} to {address} failed: {e}") from e
        stats.seconds = time.perf_counter() - start
        return stats

    async def _exchange(self, address: str, ch: Channel, deadline: float, offer: dict, block_ids: list[int],
                        body: Callable[[Channel], Awaitable[None]], pooled: bool = False) -> TransferStats:
        """offer -> accept -> body -> done on `ch`, which this owns and gives back (or closes) at the end.

        Raises:
            _StaleChannel: `pooled` (ch came from the idle pool) and the channel failed before the offer's answer.
        """
        request_id = offer["request_id"]
        regions = self.block_view(block_ids[0]) if block_ids else []  # every block of a cache has the same regions
        nbytes = sum(r.nbytes for r in regions)
        staged_before = ch.staged_bytes
        reusable = False
        try:
            async with asyncio.timeout_at(deadline):
                try:
                    await ch.send_msg(encode({"type": "offer", **offer, "block_nbytes": nbytes,
                                              "num_ranks": max(1, len(regions))}))
                    raw = await ch.recv_msg()
                except ChannelClosed as e:
                    if pooled:
                        raise _StaleChannel(str(e)) from e
                    raise
                reply = decode(raw)
                if not reply.get("ok"):
                    reusable = True
                    raise TransferError(ErrorKind.TRANSFER_REJECTED,
                                        f"decode worker rejected {request_id}: {reply.get('error')}")
                try:
                    await body(ch)
                except LayerStreamEnded:  # told the receiver; its done message keeps the channel in step
                    decode(await ch.recv_msg())
                    reusable = True
                    raise
                done = decode(await ch.recv_msg())
                reusable = True
                if not done.get("ok"):
                    raise TransferError(ErrorKind.TRANSFER_FAILED,
                                        f"decode worker failed {request_id}: {done.get('error')}")
        except ValueError as e:  # the peer sent a malformed reply
            raise ChannelClosed(f"malformed reply: {e}") from e
        finally:
            self._release(address, ch, reusable)
        return TransferStats(len(block_ids), nbytes * len(block_ids), 0.0,
                             staged_bytes=ch.staged_bytes - staged_before)

    async def _acquire(self, address: str, deadline: float, fresh: bool = False) -> tuple[Channel, bool]:
        """(An idle channel to `address`, True), or (a new one, False); `fresh`: a new one even if some are idle.
        Waits while `max_channels_per_peer` transfers are on the peer."""
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peers[address] = _PeerChannels(self.max_channels_per_peer)
        async with asyncio.timeout_at(deadline):
            await peer.slots.acquire()
            try:
                async with peer.opening:
                    if peer.idle and not fresh:
                        return peer.idle.pop(), True
                    opening = asyncio.ensure_future(self.connect(address))
                    self._connecting.add(opening)
                    opening.add_done_callback(lambda t: self._opened(peer, t))
                    # A cancelled or timed-out caller leaves the endpoint to finish opening into the pool.
                    ch = await asyncio.shield(opening)
                    # `_opened` (which ran first) pooled it; nothing else takes from the pool without `opening`,
                    # but `close` may have emptied it meanwhile.
                    if ch not in peer.idle:
                        raise ChannelClosed(f"the KV sender was closed while a channel to {address} opened")
                    peer.idle.remove(ch)
                    return ch, False
            except BaseException:
                peer.slots.release()
                raise

    def _opened(self, peer: _PeerChannels, task: asyncio.Task) -> None:
        self._connecting.discard(task)
        if not task.cancelled() and task.exception() is None:
            self._keep(peer, task.result())

    def _release(self, address: str, ch: Channel, reusable: bool) -> None:
        peer = self._peers[address]
        if reusable:
            self._keep(peer, ch)
        else:
            ch.close()
        peer.slots.release()

    def _keep(self, peer: _PeerChannels, ch: Channel) -> None:
        """Pool an idle channel; beyond the limit (callers cancelled while theirs opened) close the oldest idle one
        (the newest stays: `_acquire` takes the channel it just opened out of the pool)."""
        peer.idle.append(ch)
        if len(peer.idle) > self.max_channels_per_peer:
            peer.idle.pop(0).close()

    async def connect(self, address: str) -> Channel:
        """Open a channel to `address` and complete the handshake (version, layout hash, cluster secret).

        Raises:
            TransferError: INCOMPATIBLE_PEER (refused handshake or another protocol).
            ChannelClosed: cannot connect, or the peer went away during the handshake.
        """
        scheme, host, port = parse_address(address)
        backend = self._backends.get(scheme)
        if backend is None:
            backend = self._backends[scheme] = get_backend(scheme)
        ch = await backend.connect(host, port)
        try:
            challenge = decode(await ch.recv_msg())
            await ch.send_msg(encode({"type": "hello", "version": PROTOCOL_VERSION, "compat_hash": self.compat_hash,
                                       "mac": handshake_mac(self.secret, str(challenge.get("nonce")),
                                                            self.compat_hash)}))
            ack = decode(await ch.recv_msg())
        except ValueError as e:
            ch.close()
            raise TransferError(ErrorKind.INCOMPATIBLE_PEER, f"KV peer {address} speaks another protocol: {e}") from e
        except BaseException:
            ch.close()
            raise
        if not ack.get("ok"):
            ch.close()
            raise TransferError(ErrorKind.INCOMPATIBLE_PEER,
                                f"decode worker {address} refused the handshake: {ack.get('error')}")
        return ch

    def close(self) -> None:
        """Close the idle channels (in-flight transfers close or return theirs when they end)."""
        for peer in self._peers.values():
            for ch in peer.idle:
                ch.close()
            peer.idle.clear()


def blocks_to_send(block_ids: list[int], first_block: int) -> list[int]:
    """The blocks of a request's table past the `first_block` the decode worker already holds.

    Raises:
        EngineError: INVALID_REQUEST when that leaves none of a non-empty table: the decode side computes nothing
            of the prompt, so it must receive at least the last block.
    """
    if first_block >= len(block_ids) > 0:
        raise EngineError(ErrorKind.INVALID_REQUEST, f"kv_skip_blocks {first_block} leaves none of the "
                                                     f"{len(block_ids)} blocks to send")
    return block_ids[first_block:]


async def uncancellable(task: asyncio.Future) -> None:
    """Wait for `task` to end however often the waiter is cancelled meanwhile; its outcome is dropped (and
    retrieved, so asyncio does not log it)."""
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            continue
        except Exception:  # noqa: BLE001 - the caller is cancelled; it only needs the task finished
            break
    if task.done() and not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved

