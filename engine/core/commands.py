"""The commands an engine takes (`EngineCore.submit`): one vocabulary on both sides of the process boundary.

`Abort`, `KvArrived` and `Pause` are msgspec Structs that cross to an engine process as they are (`engine.core.ipc`'s
command pipe). Two carry what cannot cross as it is: `AddRequest` holds a live `Request` (its layer-progress sink
among it), which crosses as `ipc.NewRequest`, the request's fields; `Call` runs a function on the engine thread and
crosses as `ipc.Query`, one of the named questions an engine process answers.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import msgspec

from pdserve_server.engine.request import Request

if TYPE_CHECKING:
    from pdserve_server.engine.scheduling.scheduler import Scheduler


@dataclass
class AddRequest:
    """Queue a new request (`Scheduler.add_request`)."""

    request: Request


class Abort(msgspec.Struct, tag=True, array_like=True):
    """Drop a request and free its blocks. notify: tell its owner with RequestFailed(ABORTED) (an abort from
    outside, e.g. Worker.Abort); the owner's own cleanup aborts silently (it stopped listening). An abort from
    outside leaves a prefill-done request (HELD) alone: its blocks are being read by its KV transfer, and freeing
    them under it would let another request overwrite KV in flight; its owner frees them when the send ends.
    ack: emit `Forgotten` once applied, known request or not (an owner that stops listening drops the request's
    events until then, so a new request under the same id never receives the old one's)."""

    request_id: str
    notify: bool = False
    ack: bool = False


class KvArrived(msgspec.Struct, tag=True, array_like=True):
    """A remote-KV request's prompt KV landed in its reserved blocks; first_token: the token the prefill worker
    sampled (`Scheduler.kv_arrived`)."""

    request_id: str
    first_token: int


class Pause(msgspec.Struct, tag=True, array_like=True):
    """Hold a request out of the batch (its reader fell behind: `Scheduler.pause`), or with resume=True let it
    back in (`Scheduler.resume`). Unknown or finished requests are ignored."""

    request_id: str
    resume: bool = False


@dataclass
class Call:
    """Run fn(scheduler) on the engine thread and resolve future with its result (stats, integrity checks)."""

    fn: Callable[[Scheduler], Any]
    future: Future


Command = Union[AddRequest, Abort, KvArrived, Pause, Call]
