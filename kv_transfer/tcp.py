"""TCP backend on asyncio's low-level socket API: CPU blocks are sent from and received straight into the cache
(recv_into); device blocks go through `HostStaging` (a socket reads and writes host memory only)."""
from __future__ import annotations

import asyncio
import socket
import struct

import torch

from pdserve_server.kv_transfer.channel import (Backend, Channel, ChannelClosed, HostStaging, Listener, OnChannel,
                                                check_control_size)

_LEN = struct.Struct("!I")


class TcpChannel(Channel):
    """A TCP connection carrying length-prefixed control messages and raw block bytes.

    Args:
        stage_always: copy even CPU blocks through a host buffer (to measure the staging cost on CPU).
    """

    def __init__(self, sock: socket.socket, stage_always: bool = False):
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.staging = HostStaging(always=stage_always)

    @property
    def staged_bytes(self) -> int:
        return self.staging.staged_bytes

    async def send_msg(self, msg: bytes) -> None:
        await self._send(_LEN.pack(len(msg)) + msg)

    async def recv_msg(self) -> bytes:
        header = bytearray(_LEN.size)
        await self._recv_exact(memoryview(header))
        (n,) = _LEN.unpack(header)
        check_control_size(n)  # never allocate what a stranger's 4-byte header asks for
        body = bytearray(n)
        await self._recv_exact(memoryview(body))
        return bytes(body)

    async def send_buffer(self, buf: torch.Tensor) -> None:
        await self._send(self.staging.readable(buf))

    async def _send(self, data) -> None:
        try:
            await self.loop.sock_sendall(self.sock, data)
        except OSError as e:  # broken pipe / reset: the peer is gone
            raise ChannelClosed(f"tcp peer error: {e}") from e

    async def recv_into(self, buf: torch.Tensor) -> None:
        view, commit = self.staging.writable(buf)
        await self._recv_exact(view)
        commit()

    async def _recv_exact(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                n = await self.loop.sock_recv_into(self.sock, view[got:])
            except OSError as e:
                raise ChannelClosed(f"tcp peer error: {e}") from e
            if n == 0:
                raise ChannelClosed("tcp peer closed the connection")
            got += n

    def close(self) -> None:
        self.sock.close()


class TcpListener(Listener):
    def __init__(self, sock: socket.socket, task: asyncio.Task, handlers: set[asyncio.Task]):
        self._sock, self._task, self._handlers = sock, task, handlers

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def close(self) -> None:
        self._task.cancel()
        for t in list(self._handlers):
            t.cancel()
        self._sock.close()


class TcpBackend(Backend):
    """Plain TCP. stage_always: every block goes through host staging, CPU ones too (for tests and benchmarks of
    the device path on machines without a GPU)."""

    name = "tcp"

    def __init__(self, stage_always: bool = False):
        self.stage_always = stage_always

    async def listen(self, host: str, port: int, on_channel: OnChannel) -> Listener:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        handlers: set[asyncio.Task] = set()

        async def accept_loop() -> None:
            while True:
                conn, _ = await loop.sock_accept(sock)
                t = asyncio.create_task(on_channel(TcpChannel(conn, self.stage_always)))
                handlers.add(t)
                t.add_done_callback(handlers.discard)

        return TcpListener(sock, asyncio.create_task(accept_loop()), handlers)

    async def connect(self, host: str, port: int) -> Channel:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, port))
        except OSError as e:
            sock.close()
            raise ChannelClosed(f"cannot connect to tcp://{host}:{port}: {e}") from e
        return TcpChannel(sock, self.stage_always)
