"""The `nccl` backend: control messages over TCP, KV blocks over a two-rank torch.distributed process group.

Each channel is one pair of processes: the connecting side (the prefill worker's sender) is rank 0, the accepting
side (the decode worker's receiver) rank 1. The process group is made at the channel's first block, after the
shared protocol's handshake (layout hash, cluster-secret HMAC) and an accepted offer, so nobody who failed the
handshake reaches it:

    receiver (first recv_into)                 sender (first send_buffer)
    TCPStore master on an ephemeral port
    control: {"store_port", "backend"}  ───►   checks the backend matches its own block's device
    ProcessGroup(store, rank 1, size 2)  ◄──►  ProcessGroup(store, rank 0, size 2)

The torch.distributed backend follows the KV cache's device: NCCL for CUDA blocks, gloo for CPU blocks (same code
path; the tests run it with gloo). Point-to-point operations on a pair are matched in issue order, and a channel
carries one transfer at a time in a fixed order (offer, accept, blocks, done), so no tags are needed: every send
meets the recv for the same block. A transfer's sends are posted at once, its receives a window at a time, so
blocks do not wait on event-loop round trips. Blocking `work.wait()` calls run on the channel's own thread, never
on the event loop; that thread is bounded by the process group's timeout when a peer stalls.

CUDA (NCCL) path: between two GPUs, unverified. On one GPU NCCL refuses the pair (seen on an H100), so a channel
whose ends share a GPU fails at setup with a message that says so. Written to torch's documented behaviour:
`ProcessGroupNCCL(store, rank, size)`, `send`/`recv` on CUDA tensors enqueue on NCCL's stream, `work.wait()`
orders the current stream after it, and the current stream is synchronised before returning so a sender's caller
may free (and reuse) its blocks at once.
"""
from __future__ import annotations

import asyncio
import datetime
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from pdserve_server.kv_transfer.channel import Backend, Channel, ChannelClosed, Listener, OnChannel
from pdserve_server.kv_transfer.tcp import TcpBackend, TcpChannel

log = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 60.0  # bounds a rendezvous or a block operation whose peer stalls (the protocol's own is shorter)
LANDING_WINDOW = 8  # receives posted at once; each lands in a channel-owned buffer of one block


def dist_backend_for(device: torch.device) -> str:
    """The torch.distributed backend that moves tensors on `device`: "nccl" for CUDA, "gloo" otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def device_id(device: torch.device) -> str:
    """What tells two processes' devices apart: a CUDA device's UUID, "" for any other device. NCCL refuses a
    pair of ranks on one GPU ("Duplicate GPU detected", seen on an H100), so the channel checks this first."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def _make_group(store: dist.Store, rank: int, backend: str) -> dist.ProcessGroup:
    """A two-rank process group over `store` (blocks until the peer joins, at most GROUP_TIMEOUT_S).

    Raises:
        RuntimeError: the peer never joined, or the backend is not built into this torch.
    """
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


class DistChannel(Channel):
    """A control connection (TCP) plus, from the first block on, a two-rank process group for the block bytes.

    Receives land in the channel's own buffers and are copied into the cache once complete: a gloo or NCCL receive
    cannot be cancelled (ProcessGroup.abort does not stop a posted gloo recv), so a receive given up on (timeout,
    cancellation) must not be able to write into cache blocks that are freed and reused meanwhile. The copy into
    the cache happens under a lock that the giving-up side takes to mark the channel abandoned.

    Args:
        control: the TCP channel carrying the protocol's messages (and the group's rendezvous).
        rank: 0 on the connecting (sending) side, 1 on the accepting (receiving) side.
        peer_host: rank 0 only: the receiver's host, where its store listens ("" for rank 1).
    """

    def __init__(self, control: TcpChannel, rank: int, peer_host: str):
        self.control, self.rank, self.peer_host = control, rank, peer_host
        self._group: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None  # rank 1's master store; kept alive as long as the group
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kv-dist")  # one op at a time, off the loop
        self._landing: list[torch.Tensor] = []
        self._lock = threading.Lock()  # held while landed bytes are copied into the cache
        self._abandoned = False

    async def send_msg(self, msg: bytes) -> None:
        await self.control.send_msg(msg)

    async def recv_msg(self) -> bytes:
        return await self.control.recv_msg()

    async def send_buffer(self, buf: torch.Tensor) -> None:
        await self.send_buffers([buf])

    async def recv_into(self, buf: torch.Tensor) -> None:
        await self.recv_into_all([buf])

    async def send_buffers(self, bufs: list[torch.Tensor]) -> None:
        """Post every block's send at once (matched in order by the peer's receives), then wait for them all."""
        if not bufs:
            return
        group, peer = await self._ensure_group(_one_device(bufs)), 1 - self.rank

        def run() -> None:
            works = [group.send([b], peer, 0) for b in bufs]
            for w in works:
                w.wait()
            _sync(bufs[0])
        await self._run(run)

    async def recv_into_all(self, bufs: list[torch.Tensor]) -> None:
        """Receive up to LANDING_WINDOW blocks at a time into landing buffers, then copy them into `bufs`."""
        if not bufs:
            return
        group, peer = await self._ensure_group(_one_device(bufs)), 1 - self.rank
        landing = self._landing_buffers(bufs[0])

        def run() -> None:
            for start in range(0, len(bufs), LANDING_WINDOW):
                window = bufs[start:start + LANDING_WINDOW]
                works = [group.recv([landing[i]], peer, 0) for i in range(len(window))]
                for w in works:
                    w.wait()
                with self._lock:
                    if self._abandoned:
                        return
                    for i, dst in enumerate(window):
                        dst.copy_(landing[i])
                    _sync(window[0])
        await self._run(run)

    def _landing_buffers(self, like: torch.Tensor) -> list[torch.Tensor]:
        if not self._landing or self._landing[0].shape != like.shape or self._landing[0].device != like.device:
            self._landing = [torch.empty_like(like) for _ in range(LANDING_WINDOW)]
        return self._landing

    async def _run(self, fn):
        """Run `fn` on the channel's thread. If the caller gives up (cancellation), the channel is abandoned first:
        the thread may go on receiving, into landing buffers only."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn)
        except asyncio.CancelledError:
            self._abandon()
            raise
        except (RuntimeError, ValueError) as e:  # gloo/NCCL and the store report a dead or stalled peer this way
            self._abandon()
            raise ChannelClosed(f"process-group peer error: {e}") from e

    def _abandon(self) -> None:
        with self._lock:  # waits out a copy into the cache already under way (a window: at most a few ms)
            self._abandoned = True

    async def _ensure_group(self, device: torch.device) -> dist.ProcessGroup:
        """Rendezvous on first use (see the module docstring). Raises ChannelClosed on a mismatch or failure."""
        if self._abandoned:
            raise ChannelClosed("channel abandoned after a failed or cancelled transfer")
        if self._group is not None:
            return self._group
        backend = dist_backend_for(device)
        if self.rank == 1:
            self._store = await self._run(lambda: dist.TCPStore(
                "0.0.0.0", 0, 2, True, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
                wait_for_workers=False))
            await self.control.send_msg(json.dumps({"store_port": self._store.port, "backend": backend,
                                                    "device": device_id(device)}).encode())
            store = self._store
        else:
            try:
                setup = json.loads(await self.control.recv_msg())
                port, peer_backend = int(setup["store_port"]), str(setup["backend"])
            except (ValueError, KeyError, TypeError) as e:
                raise ChannelClosed(f"malformed process-group setup from the peer: {e}") from e
            if peer_backend != backend:
                raise ChannelClosed(f"the peer moves KV with {peer_backend}, this side's blocks need {backend} "
                                    "(KV caches on different device types)")
            if backend == "nccl" and setup.get("device") == device_id(device):
                raise ChannelClosed(f"the nccl connector needs the prefill and decode workers on different GPUs; "
                                    f"both are on GPU {setup['device']} (NCCL refuses two ranks on one device): "
                                    "use --connector ucx or tcp")
            store = await self._run(lambda: dist.TCPStore(
                self.peer_host, port, 2, False, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S)))
        self._group = await self._run(lambda: _make_group(store, self.rank, backend))
        log.info("KV channel process group up: %s, rank %d", backend, self.rank)
        return self._group

    def close(self) -> None:
        self._abandon()
        self.control.close()
        self._group = self._store = None  # the thread drops its reference when its op ends or times out
        self._thread.shutdown(wait=False)


def _one_device(bufs: list[torch.Tensor]) -> torch.device:
    """The one device `bufs` are on. A channel's process group moves one device's memory: a tensor-parallel
    worker's shards on several GPUs would need a group per GPU pair (not built; decode workers refuse at start).

    Raises:
        ChannelClosed: the buffers span several devices.
    """
    devices = {b.device for b in bufs}
    if len(devices) > 1:
        raise ChannelClosed(f"the nccl connector moves KV on one device per worker, not {sorted(map(str, devices))} "
                            "(tensor-parallel shards on several GPUs): use --connector ucx or tcp")
    return bufs[0].device


def _sync(buf: torch.Tensor) -> None:
    """On CUDA, wait until the waited-for ops and copies are really done, not only ordered on the current stream."""
    if buf.is_cuda:
        torch.cuda.current_stream(buf.device).synchronize()


class NcclBackend(Backend):
    """Listens and connects like `tcp` (the control connection); blocks then move over a process group."""

    name = "nccl"

    def __init__(self) -> None:
        self._tcp = TcpBackend()

    async def listen(self, host: str, port: int, on_channel: OnChannel) -> Listener:
        async def accepted(control: Channel) -> None:
            await on_channel(DistChannel(control, 1, ""))  # type: ignore[arg-type]

        return await self._tcp.listen(host, port, accepted)

    async def connect(self, host: str, port: int) -> Channel:
        return DistChannel(await self._tcp.connect(host, port), 0, host)  # type: ignore[arg-type]
