"""UCX backend over ucxx (the maintained successor of ucx-py): tag send/recv on one endpoint per channel.

Blocks move in place on either device: ucxx sends and receives any object exposing `__cuda_array_interface__`
(a CUDA torch tensor does) with UCX's CUDA transports (cuda_copy, cuda_ipc, RDMA with GPUDirect where the UCX build
has it), and a CPU tensor through the numpy view of its own memory. No staging copy. The CUDA branch follows
ucxx's and torch's documented interfaces and is unverified on GPU (no GPU has run it).

ucxx is imported lazily, inside the worker process (UCX must not be initialised before a fork). Endpoints are
expensive to create (0.4-1 s), so senders keep them open and reuse them (see sender.KvSender).

Completions reach asyncio through ucxx's notifier thread (UCXPY_ENABLE_PYTHON_FUTURE=1, set here unless the
environment says otherwise). Without it ucxx awaits every request by polling the event loop (`wait_yield`), so a
decode worker's receiver, which always has a receive posted for the next offer, spun a core at 100% while idle.
The notifier thread is bound to the event loop UCX started on: `reset` must run when that loop ends.
"""
from __future__ import annotations

import array
import logging
import os
import sys

import torch

from pdserve_server.kv_transfer.channel import Backend, Channel, ChannelClosed, Listener, OnChannel, check_control_size

log = logging.getLogger(__name__)


def _ucxx():
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
    # SO_REUSEADDR on the listener: a decode worker killed with KV channels open leaves their sockets in TIME-WAIT
    # on its --kv-port, and without it the restarted worker could not bind that port for a minute. It does not let
    # two live listeners share a port (that would be SO_REUSEPORT): a busy port is still refused.
    os.environ.setdefault("UCX_CM_REUSEADDR", "y")
    import ucxx  # noqa: PLC0415 (lazy by design)

    return ucxx


def reset() -> None:
    """Stop this process's UCX context and its notifier thread, if UCX was started (else nothing). The next use
    starts a fresh one on the then-running event loop."""
    ucxx = sys.modules.get("ucxx")
    if ucxx is None:
        return
    try:
        ucxx.reset()
    except ucxx.exceptions.UCXError as e:  # stopped anyway; something still held an endpoint or listener
        log.warning("UCX reset with objects still alive: %s", e)


class UcxChannel(Channel):
    def __init__(self, ep):
        self.ep = ep
        self._errors = _ucxx().exceptions.UCXError

    async def _io(self, coro):
        try:
            return await coro
        except self._errors as e:
            raise ChannelClosed(f"ucx peer error: {type(e).__name__}: {e}") from e

    async def send_msg(self, msg: bytes) -> None:
        await self._io(self.ep.send_obj(msg))

    async def recv_msg(self) -> bytes:
        """One control message in ucxx's `send_obj` framing (an 8-byte native length, then the bytes). ucxx's own
        `recv_obj` allocates whatever length arrives, before the hello is authenticated: 8 bytes from a stranger
        grew a decode worker by 1 GiB. The length is checked first (`check_control_size`).

        Raises:
            ChannelClosed: the peer is gone, or it announced more than a control message may hold.
        """
        header = array.array("Q", [0])
        await self._io(self.ep.recv(header))
        check_control_size(header[0])
        body = bytearray(header[0])
        await self._io(self.ep.recv(body))
        return bytes(body)

    async def send_buffer(self, buf: torch.Tensor) -> None:
        await self._io(self.ep.send(_ucx_buffer(buf)))

    async def recv_into(self, buf: torch.Tensor) -> None:
        await self._io(self.ep.recv(_ucx_buffer(buf)))

    def close(self) -> None:
        try:
            self.ep.abort()
        except Exception:  # already closed by the peer
            pass


def _ucx_buffer(t: torch.Tensor):
    """What ucxx takes for a tensor's memory: the CUDA tensor itself (`__cuda_array_interface__`), or the numpy view
    of a CPU tensor's memory (no copy either way)."""
    return t if t.is_cuda else t.numpy()


class UcxListener(Listener):
    def __init__(self, listener):
        self._listener = listener

    @property
    def port(self) -> int:
        return self._listener.port

    def close(self) -> None:
        self._listener.close()


class UcxBackend(Backend):
    name = "ucx"

    async def listen(self, host: str, port: int, on_channel: OnChannel) -> Listener:
        """Listen on `port`. ucxx's listener takes a port only, so it accepts on every interface whatever `host`
        says (UCX_NET_DEVICES narrows the devices UCX uses); a stranger who reaches it gets nothing past the
        hello's HMAC and cannot make it allocate more than a control message (`UcxChannel.recv_msg`)."""
        ucxx = _ucxx()

        async def handler(ep) -> None:
            await on_channel(UcxChannel(ep))

        return UcxListener(ucxx.create_listener(handler, port=port))

    async def connect(self, host: str, port: int) -> Channel:
        ucxx = _ucxx()
        try:
            ep = await ucxx.create_endpoint(host, port)
        except ucxx.exceptions.UCXError as e:
            raise ChannelClosed(f"cannot connect to ucx://{host}:{port}: {e}") from e
        return UcxChannel(ep)
