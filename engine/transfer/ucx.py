"""UCX backend over ucxx (the maintained successor of ucx-py): tag send/recv on one endpoint per channel.

ucxx is imported lazily, inside the worker process (UCX must not be initialised before a fork). Endpoints are
expensive to create (0.4-1 s), so senders keep them open and reuse them (see protocol.KvSender).
"""
from __future__ import annotations

import os

import numpy as np

from engine.transfer.channel import Backend, Channel, ChannelClosed, Listener, OnChannel


def _ucxx():
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx  # noqa: PLC0415 (lazy by design)

    return ucxx


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
        return bytes(await self._io(self.ep.recv_obj()))

    async def send_buffer(self, buf: np.ndarray) -> None:
        await self._io(self.ep.send(buf))

    async def recv_into(self, buf: np.ndarray) -> None:
        await self._io(self.ep.recv(buf))

    def close(self) -> None:
        try:
            self.ep.abort()
        except Exception:  # already closed by the peer
            pass


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
