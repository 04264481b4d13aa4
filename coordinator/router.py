"""Worker handles and routing: which prefill and which decode worker take a request.

Only live workers are candidates (`coordinator.membership` keeps `live` and `stats` current). Decode choice: a
worker whose KV headroom holds the whole request (prompt + max_tokens), then the fewest requests this
coordinator has running there, then the most free KV blocks. Prefill choice: the shortest queue (requests sent
there that have not produced their first token), then the worker's own reported queue. Ties rotate, separately
per role, so equal workers share load. Between polls of `Worker.GetStats` the blocks routed since the last
report are subtracted from the headroom. Prefix-cache-aware prefill choice plugs into `pick_prefill`, which
already receives the prompt.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from coordinator.errors import RequestError
from pdserve.v1 import worker_pb2, worker_pb2_grpc

@dataclass
class WorkerHandle:
    """A worker endpoint: address, stubs, its GetInfo answer, whether it is live, and its load.

    Attributes:
        info: the worker's GetInfo answer (re-read when its instance_id changes); None until first read.
        live: answering health and stats polls, serving, and compatible: a routing candidate.
        failures: consecutive failed polls (`coordinator.membership` takes a worker out after a few).
        in_flight: requests this coordinator has on the worker now (prefill: until their first token).
        stats: the worker's last GetStats answer, None before the first poll.
        blocks_routed: KV blocks of requests routed here since `stats` was taken (decode headroom estimate).
    """

    address: str
    channel: grpc.aio.Channel
    worker: worker_pb2_grpc.WorkerStub
    prefill: worker_pb2_grpc.PrefillStub
    decode: worker_pb2_grpc.DecodeStub
    info: worker_pb2.WorkerInfo | None = None
    live: bool = False
    failures: int = 0
    in_flight: int = 0
    stats: worker_pb2.WorkerStats | None = None
    blocks_routed: int = 0

    @classmethod
    def connect(cls, address: str, channel: grpc.aio.Channel) -> "WorkerHandle":
        """A handle over an open channel; nothing is sent until the first poll."""
        return cls(address, channel, worker_pb2_grpc.WorkerStub(channel), worker_pb2_grpc.PrefillStub(channel),
                   worker_pb2_grpc.DecodeStub(channel))

    @property
    def free_blocks(self) -> int:
        """Estimated free KV blocks: the last report (or the whole pool before one) minus blocks routed since."""
        free = self.stats.num_free_blocks if self.stats is not None else self.info.num_blocks
        return free - self.blocks_routed

    @property
    def reported_queue(self) -> int:
        return 0 if self.stats is None else self.stats.num_waiting + self.stats.num_running


@dataclass
class Router:
    """Picks workers per role (see the module docstring) and counts what this coordinator has on each."""

    prefill: list[WorkerHandle] = field(default_factory=list)
    decode: list[WorkerHandle] = field(default_factory=list)
    _turns: dict[str, itertools.count] = field(
        default_factory=lambda: {"prefill": itertools.count(), "decode": itertools.count()})

    def _rotated(self, role: str, workers: list[WorkerHandle]) -> list[WorkerHandle]:
        workers = [w for w in workers if w.live]
        if not workers:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"no live {role} worker to take the request; retry later")
        start = next(self._turns[role]) % len(workers)
        return workers[start:] + workers[:start]

    def pick_decode(self, num_tokens: int) -> WorkerHandle:
        """The decode (or colocated) worker for a request of `num_tokens` (prompt + max_tokens); counts its blocks
        against that worker's headroom until the next poll.

        Raises:
            RequestError: UNAVAILABLE when there is no decode worker.
        """
        def blocks(w: WorkerHandle) -> int:
            return -(-num_tokens // w.info.block_size)

        worker = min(self._rotated("decode", self.decode),
                     key=lambda w: (blocks(w) > w.free_blocks, w.in_flight, -w.free_blocks))
        worker.blocks_routed += blocks(worker)
        return worker

    def pick_prefill(self, prompt_token_ids: list[int]) -> WorkerHandle:
        """The prefill worker for a prompt (the prompt is where a prefix-cache-aware choice would look).

        Raises:
            RequestError: UNAVAILABLE when there is no prefill worker.
        """
        return min(self._rotated("prefill", self.prefill), key=lambda w: (w.in_flight, w.reported_queue))

    @contextmanager
    def lease(self, worker: WorkerHandle) -> Iterator[WorkerHandle]:
        """Count a request on `worker` for the duration of the block (every exit path gives it back)."""
        worker.in_flight += 1
        try:
            yield worker
        finally:
            worker.in_flight -= 1

    def mark_down(self, address: str) -> None:
        """A call to this worker failed as if it were gone: stop routing to it until membership's next poll finds
        it answering (passive health checking)."""
        for w in self.workers:
            if w.address == address:
                w.live = False

    @property
    def workers(self) -> list[WorkerHandle]:
        return [*self.prefill, *self.decode]

    def live(self, role: str) -> list[WorkerHandle]:
        """The live workers of a role ("prefill" or "decode", which also holds colocated workers)."""
        return [w for w in (self.prefill if role == "prefill" else self.decode) if w.live]
