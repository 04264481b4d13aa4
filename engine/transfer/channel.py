"""The one abstraction a transport backend implements: a bidirectional, ordered, framed channel."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

import numpy as np


class ChannelClosed(ConnectionError):
    """The peer closed the channel or died."""


class Channel(ABC):
    """Ordered message + buffer stream between two workers. Not safe for concurrent use: one transfer at a time."""

    @abstractmethod
    async def send_msg(self, msg: bytes) -> None: ...

    @abstractmethod
    async def recv_msg(self) -> bytes:
        """Raises ChannelClosed when the peer is gone."""

    @abstractmethod
    async def send_buffer(self, buf: np.ndarray) -> None:
        """Send a contiguous uint8 array without copying it."""

    @abstractmethod
    async def recv_into(self, buf: np.ndarray) -> None:
        """Fill a contiguous, writable uint8 array exactly, in place. Raises ChannelClosed when the peer is gone."""

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
