"""The one abstraction a transport backend implements: a bidirectional, ordered, framed channel.

Buffers are torch tensors (1-D, contiguous, uint8) on whatever device the KV cache lives: the connector API never
asks for `.numpy()` of device memory. A backend that can move device memory itself (UCX: CUDA tensors expose
`__cuda_array_interface__`, which ucxx sends and receives in place) does so; one that reads and writes host memory
only (tcp) goes through `HostStaging`, an explicit copy that is counted (`Channel.staged_bytes`) and logged.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI reads BACKEND_NAMES through this module and must not load torch
    import torch

log = logging.getLogger(__name__)


MAX_CONTROL_MESSAGE_BYTES = 1 << 20  # control messages are small JSON; a bigger length header is an attack or a bug


class ChannelClosed(ConnectionError):
    """The peer closed the channel or died."""


def check_control_size(num_bytes: int) -> None:
    """Refuse a control message's announced length before anything is allocated for it: the first message on a
    channel (the hello) comes before authentication, so its size is a stranger's to choose.

    Raises:
        ChannelClosed: num_bytes exceeds MAX_CONTROL_MESSAGE_BYTES (the caller drops the channel).
    """
    if num_bytes > MAX_CONTROL_MESSAGE_BYTES:
        raise ChannelClosed(f"control message of {num_bytes} bytes announced; at most {MAX_CONTROL_MESSAGE_BYTES}")


class HostStaging:
    """Host views of KV blocks for host-only transports: a CPU tensor's own memory (no copy), or, for device
    memory (or when `always` is set, to measure the copy's cost on CPU), a reusable host buffer copied to or from.

    Attributes:
        staged_bytes: bytes copied between device and host so far (send and receive).
    """

    def __init__(self, always: bool = False):
        self.always = always
        self.staged_bytes = 0
        self._buffer: torch.Tensor | None = None

    def _host(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            import torch

            pin = torch.cuda.is_available()  # pinned memory makes device<->host copies DMA; needs a CUDA runtime
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            log.info("KV transfer stages device memory through %s host memory (%d bytes buffer): this transport "
                     "reads and writes host memory only", "pinned" if pin else "pageable", nbytes)
        return self._buffer[:nbytes]

    def readable(self, t: torch.Tensor) -> memoryview:
        """Bytes of `t` to send: its own memory on the CPU, else a host copy (synchronous: the bytes are final)."""
        if t.device.type == "cpu" and not self.always:
            return memoryview(t.numpy())
        host = self._host(t.numel())
        host.copy_(t)
        self.staged_bytes += t.numel()
        return memoryview(host.numpy())

    def writable(self, t: torch.Tensor) -> tuple[memoryview, Callable[[], None]]:
        """(where to receive `t`'s bytes, what to call once they are all there): `t`'s own memory on the CPU,
        else a host buffer whose content the callback copies into `t`."""
        if t.device.type == "cpu" and not self.always:
            return memoryview(t.numpy()), lambda: None
        host = self._host(t.numel())

        def commit() -> None:
            t.copy_(host)
            self.staged_bytes += t.numel()
        return memoryview(host.numpy()), commit


class Channel(ABC):
    """Ordered message + buffer stream between two workers. Not safe for concurrent use: one transfer at a time.

    Attributes:
        staged_bytes: bytes this channel copied between device and host memory (0 when it moves them in place).
    """

    staged_bytes: int = 0

    @abstractmethod
    async def send_msg(self, msg: bytes) -> None: ...

    @abstractmethod
    async def recv_msg(self) -> bytes:
        """Raises ChannelClosed when the peer is gone."""

    @abstractmethod
    async def send_buffer(self, buf: torch.Tensor) -> None:
        """Send a 1-D contiguous uint8 tensor (any device) without copying it where the transport allows."""

    @abstractmethod
    async def recv_into(self, buf: torch.Tensor) -> None:
        """Fill a 1-D contiguous uint8 tensor (any device) exactly, in place. Raises ChannelClosed when the peer
        is gone."""

    async def send_buffers(self, bufs: list[torch.Tensor]) -> None:
        """Send several buffers in order (one transfer's blocks); a backend may overlap them."""
        for buf in bufs:
            await self.send_buffer(buf)

    async def recv_into_all(self, bufs: list[torch.Tensor]) -> None:
        """Fill several buffers in order, as `recv_into` each. When this raises or is cancelled, nothing writes
        into `bufs` any more (the caller may free them)."""
        for buf in bufs:
            await self.recv_into(buf)

    @abstractmethod
    def close(self) -> None: ...


class Listener(ABC):
    @property
    @abstractmethod
    def port(self) -> int: ...

    @abstractmethod
    def close(self) -> None: ...


OnChannel = Callable[[Channel], Awaitable[None]]


class Backend(ABC):
    """A transport: `listen` accepts channels, `connect` opens one."""

    name: str

    @abstractmethod
    async def listen(self, host: str, port: int, on_channel: OnChannel) -> Listener: ...

    @abstractmethod
    async def connect(self, host: str, port: int) -> Channel: ...
