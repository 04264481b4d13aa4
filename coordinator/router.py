"""Worker handles and least-loaded routing."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc


@dataclass
class WorkerHandle:
    """A connected worker: its address, stubs, GetInfo answer, and requests this coordinator has in flight on it."""

    address: str
    channel: grpc.aio.Channel
    info: worker_pb2.WorkerInfo
    worker: worker_pb2_grpc.WorkerStub
    prefill: worker_pb2_grpc.PrefillStub
    decode: worker_pb2_grpc.DecodeStub
    in_flight: int = 0


@dataclass
class Router:
    """Picks the worker with the fewest in-flight requests, rotating among ties so equal workers share load."""

    prefill: list[WorkerHandle] = field(default_factory=list)
    decode: list[WorkerHandle] = field(default_factory=list)
    _turn: itertools.count = field(default_factory=itertools.count)

    def pick(self, workers: list[WorkerHandle]) -> WorkerHandle:
        """Raises IndexError when the list is empty."""
        start = next(self._turn) % len(workers)
        rotated = workers[start:] + workers[:start]
        return min(rotated, key=lambda w: w.in_flight)
