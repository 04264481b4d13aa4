"""Worker handles and routing: which prefill and which decode worker take a request.

Decode choice: a worker whose KV headroom holds the whole request (prompt + max_tokens), then the fewest
requests this coordinator has running there, then the most free KV blocks. Prefill choice: the shortest queue
(requests sent there that have not produced their first token), then the worker's own reported queue. Ties
rotate, separately per role, so equal workers share load. KV headroom and queues come from `Worker.GetStats`,
polled every `stats_interval_s` (`poll_loads`); between polls the blocks routed since the last report are
subtracted. Prefix-cache-aware prefill choice plugs into `pick_prefill`, which already receives the prompt.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from coordinator.errors import RequestError
from pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class WorkerHandle:
    """A connected worker: address, stubs, its GetInfo answer, and what this coordinator knows of its load.

    Attributes:
        in_flight: requests this coordinator has on the worker now (prefill: until their first token).
        stats: the worker's last GetStats answer, None before the first poll.
        blocks_routed: KV blocks of requests routed here since `stats` was taken (decode headroom estimate).
    """

    address: str
    channel: grpc.aio.Channel
    info: worker_pb2.WorkerInfo
    worker: worker_pb2_grpc.WorkerStub
    prefill: worker_pb2_grpc.PrefillStub
    decode: worker_pb2_grpc.DecodeStub
    in_flight: int = 0
    stats: worker_pb2.WorkerStats | None = None
    blocks_routed: int = 0

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
        if not workers:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"no {role} worker to take the request; retry later")
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

    @property
    def workers(self) -> list[WorkerHandle]:
        return [*self.prefill, *self.decode]


async def poll_loads(router: Router, interval_s: float) -> None:
    """Refresh every worker's `stats` each interval_s, until cancelled. A worker that does not answer keeps its
    last report (its health is not this loop's business)."""
    async def refresh(w: WorkerHandle) -> None:
        routed_before = w.blocks_routed  # routed after this point may be missing from the report: keep them
        try:
            stats = await w.worker.GetStats(worker_pb2.WorkerStatsRequest(), timeout=max(interval_s, 1.0))
        except grpc.aio.AioRpcError as e:
            log.debug("GetStats from %s failed: %s", w.address, e.code())
            return
        w.stats = stats
        w.blocks_routed -= routed_before

    while True:
        await asyncio.gather(*(refresh(w) for w in router.workers))
        await asyncio.sleep(interval_s)
