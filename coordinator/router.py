"""Worker handles and routing: which prefill and which decode worker take a request.

Only live workers are candidates (`coordinator.membership` keeps `live` and `stats` current).

- Prefill (and colocated) choice is prefix-cache aware, with NVIDIA Dynamo's cost: the blocks the worker would
  have to compute (the prompt's blocks minus those it probably holds, `coordinator.prefix_index`) plus the prompt
  blocks already queued there by this coordinator; the cheapest wins, then the worker's own reported queue. This
  cost is the queue wait in blocks, with the prefix cache counted; it is not divided by each worker's measured
  rate (`PrefillQueue.tokens_per_s`): a rate sample is a request's prompt over its time to first token, so a worker
  that happened to serve short prompts (where fixed per-request costs dominate) looks many times slower than one
  that served long ones, and a rate-weighted rule would starve it on that artefact. The rate serves only where
  predictions are compared with a time: local prefill (below) and refusing a request whose deadline its worker's
  queue cannot meet (`coordinator.scheduling`).
- Local prefill (disaggregated mode, `Router.local_prefill`, `LocalPrefillPolicy`): a short uncached prompt, any
  prompt while no prefill worker is live, or a prompt whose first token the decode worker is predicted to give
  sooner than the prefill workers' queues would (`coordinator.prefill_queue`), is prefilled by its decode worker
  itself (Dynamo's conditional disaggregation, driven by live queue state).
- Decode choice: a worker whose KV headroom holds the whole request (prompt + max_tokens), then the fewest
  requests this coordinator has running there, then the most free KV blocks. Between polls of `Worker.GetStats`
  the blocks routed since the last report are subtracted from the headroom.

Ties rotate, separately per role, so equal workers share load.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from pdserve_server.coordinator.errors import RequestError
from pdserve_server.coordinator.prefill_queue import PrefillQueue
from pdserve_server.coordinator.prefix_index import PrefixIndex, block_hashes
from pdserve_server.coordinator.token_stream import TokenStream
from pdserve.v1 import worker_pb2, worker_pb2_grpc


def index_capacity(info: worker_pb2.WorkerInfo) -> int:
    """Blocks of a worker the inferred prefix index keeps (`PrefixIndex.record`): its pool and its KV offload tiers,
    which keep what the pool evicts (`WorkerInfo.kv_offload_blocks`)."""
    return info.num_blocks + info.kv_offload_blocks


@dataclass
class WorkerHandle:
    """A worker endpoint: address, stubs, its GetInfo answer, whether it is live, and its load.

    Attributes:
        info: the worker's GetInfo answer (re-read when its instance_id changes); None until first read.
        live: answering health and stats polls, serving, and compatible: a routing candidate.
        failures: consecutive failed polls (`coordinator.membership` takes a worker out after a few).
        in_flight: requests this coordinator has on the worker now (prefill: until their first token).
        queued_blocks: prompt blocks of those requests (prefill: work still to do there).
        stats: the worker's last GetStats answer, None before the first poll.
        blocks_routed: KV blocks of requests routed here since `stats` was taken (decode headroom estimate).
        prefill_queue: prompt tokens routed here for prefill, awaiting their first token, and the measured rate
            (prefill workers; decode workers for their local prefills).
        token_stream: this coordinator's token stream to the worker (`coordinator.token_stream`; decode roles),
            made on the first request that uses it.
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
    queued_blocks: int = 0
    stats: worker_pb2.WorkerStats | None = None
    blocks_routed: int = 0
    prefill_queue: PrefillQueue = field(default_factory=PrefillQueue)
    token_stream: TokenStream | None = None

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


@dataclass(frozen=True)
class LocalPrefillPolicy:
    """When a disaggregated request is prefilled on its decode worker instead of a prefill worker: NVIDIA Dynamo's
    conditional disaggregation by prefill length and by queue state, plus its fallback to decode-only serving. A
    local prefill saves the transfer and the second hop but joins the decode batch, whose steps it slows while it
    is computed (chunked, under the worker's token budget). A rule of "local while the prefill queue is long" was
    measured and left out: on 2 cores it moved so much prefill onto the decode worker that 128/32 at c=64 lost 20%
    of its throughput and ITL p99 went from 45 to 317 ms (docs/history/benchmarks.md, "Conditional disaggregation"). The
    queue rule here compares predicted times instead, each worker at its own measured rate, so the decode worker
    takes a prompt only while it would finish it first (`coordinator.prefill_queue`).

    Attributes:
        max_uncached_tokens: local when at most this many of the context's tokens are outside the decode worker's
            prefix cache, as far as this coordinator knows (`coordinator.prefix_index`: the prompts that worker
            prefilled or received KV for); 0 = never for length. Where the index is wrong (the worker evicted the
            blocks, or another coordinator's requests filled it), more is computed locally than planned; the
            output is the same.
        fallback: local while no prefill worker is live, rather than failing the request with UNAVAILABLE.
        queue: while every prefill worker has prompts queued, local when the least loaded decode worker is
            predicted to give the first token sooner than the least loaded prefill worker: each one's queued prompt
            tokens plus this prompt, at the rate it has been measured to prefill (a decode worker with no
            measurement yet is taken to be as fast as the fastest prefill worker). Nothing is predicted before a
            prefill worker has produced a first token.
    """

    max_uncached_tokens: int = 0
    fallback: bool = True
    queue: bool = True


@dataclass
class Router:
    """Picks workers per role (see the module docstring) and counts what this coordinator has on each."""

    prefill: list[WorkerHandle] = field(default_factory=list)
    decode: list[WorkerHandle] = field(default_factory=list)
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    _turns: dict[str, itertools.count] = field(
        default_factory=lambda: {"prefill": itertools.count(), "decode": itertools.count()})

    def _rotated(self, role: str, workers: list[WorkerHandle]) -> list[WorkerHandle]:
        workers = [w for w in workers if w.live]
        if not workers:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"no live {role} worker to take the request; retry later")
        start = next(self._turns[role]) % len(workers)
        return workers[start:] + workers[:start]

    def pick_decode(self, num_tokens: int, prompt_token_ids: list[int] | None = None,
                    cache_salt: str = "") -> WorkerHandle:
        """The decode worker for a request of `num_tokens` (prompt + max_tokens); counts its blocks against that
        worker's headroom until the next poll. With `prompt_token_ids` (colocated: the worker also prefills) the
        prefix-aware prefill cost decides among the workers with headroom, and the prompt is recorded there.
        `cache_salt`: the request's (`SchedulingHints.cache_salt`): its blocks are keyed apart, here as there.

        Raises:
            RequestError: UNAVAILABLE when there is no decode worker.
        """
        def blocks(w: WorkerHandle) -> int:  # a windowed worker's requests hold at most their window's blocks
            return min(-(-num_tokens // w.info.block_size), w.info.max_request_blocks or num_tokens)

        candidates = self._rotated("decode", self.decode)
        if prompt_token_ids is None:
            worker = min(candidates, key=lambda w: (blocks(w) > w.free_blocks, w.in_flight, -w.free_blocks))
        else:
            hashes = block_hashes(prompt_token_ids, candidates[0].info.block_size, cache_salt)
            worker = min(candidates, key=lambda w: (blocks(w) > w.free_blocks,
                                                    self._prefill_cost(w, len(prompt_token_ids), hashes),
                                                    w.in_flight, -w.free_blocks))
            self.prefixes.record(worker.address, hashes, index_capacity(worker.info))
        worker.blocks_routed += blocks(worker)
        return worker

    def pick_prefill(self, prompt_token_ids: list[int], cache_salt: str = "") -> WorkerHandle:
        """The prefill worker for a prompt: least new work (prompt blocks it does not hold, plus blocks queued
        there), then its reported queue; the prompt is recorded as held there (`cache_salt` as in `pick_decode`).

        Raises:
            RequestError: UNAVAILABLE when there is no prefill worker.
        """
        candidates = self._rotated("prefill", self.prefill)
        hashes = block_hashes(prompt_token_ids, candidates[0].info.block_size, cache_salt)
        worker = min(candidates, key=lambda w: (self._prefill_cost(w, len(prompt_token_ids), hashes),
                                                w.reported_queue))
        self.prefixes.record(worker.address, hashes, index_capacity(worker.info))
        return worker

    def record_prefix(self, worker: WorkerHandle, token_ids: list[int], received: bool = False,
                      cache_salt: str = "") -> None:
        """The worker will hold these tokens' full blocks in its prefix cache (keyed with `cache_salt`): it computes
        them, or (`received`) it receives their KV. A worker that gives back blocks behind a sliding window
        (`WorkerInfo.kv_sliding_window`) caches none of a received prompt that a lookup could reach (the blocks
        behind the window never enter its cache, and lookups start at the first block), so nothing is recorded."""
        if received and worker.info.kv_sliding_window:
            return
        self.prefixes.record(worker.address, block_hashes(token_ids, worker.info.block_size, cache_salt),
                             index_capacity(worker.info))

    def local_prefill(self, context: list[int], policy: LocalPrefillPolicy, cache_salt: str = "") -> str | None:
        """Conditional disaggregation: whether a disaggregated request should be prefilled on its decode worker
        instead of a prefill worker (`LocalPrefillPolicy`), and why.

        Args:
            context: the tokens to compute (prompt, plus the tokens already sent when a request resumes).
            policy: when to.
            cache_salt: the request's, as in `pick_decode`.

        Returns:
            "no_prefill_worker", "short" or "queue" to prefill locally, None to go to a prefill worker. With no live
            decode worker, None (the disaggregated path then raises UNAVAILABLE naming the decode role).
        """
        decode = self.live("decode")
        if not decode:
            return None
        prefill = self.live("prefill")
        if policy.fallback and not prefill:
            return "no_prefill_worker"
        if policy.max_uncached_tokens > 0:
            block_size = decode[0].info.block_size
            hashes = block_hashes(context, block_size, cache_salt)
            cached = max(self.prefixes.overlap(w.address, hashes) for w in decode) * block_size
            if len(context) - cached <= policy.max_uncached_tokens:
                return "short"
        if policy.queue and all(w.prefill_queue.pending_tokens for w in prefill):  # only a queue is worth avoiding
            remote = [t for w in prefill if (t := w.prefill_queue.predicted_wait_s(len(context))) is not None]
            if remote:
                prior = max(w.prefill_queue.tokens_per_s or 0.0 for w in prefill)
                local = min(w.prefill_queue.predicted_wait_s(len(context), prior) for w in decode)
                if local < min(remote):
                    return "queue"
        return None

    def _prefill_cost(self, w: WorkerHandle, num_tokens: int, hashes: list[bytes]) -> int:
        """Dynamo's KV-router cost with overlap weight 1: blocks to compute here plus blocks queued here."""
        prompt_blocks = -(-num_tokens // w.info.block_size)
        return prompt_blocks - self.prefixes.overlap(w.address, hashes) + w.queued_blocks

    @contextmanager
    def lease(self, worker: WorkerHandle, num_tokens: int = 0) -> Iterator[WorkerHandle]:
        """Count a request (of num_tokens prompt tokens) on `worker` for the duration of the block (every exit path
        gives it back)."""
        blocks = -(-num_tokens // worker.info.block_size) if worker.info else 0
        worker.in_flight += 1
        worker.queued_blocks += blocks
        try:
            yield worker
        finally:
            worker.in_flight -= 1
            worker.queued_blocks -= blocks

    @property
    def workers(self) -> list[WorkerHandle]:
        return [*self.prefill, *self.decode]

    def live(self, role: str) -> list[WorkerHandle]:
        """The live workers of a role ("prefill" or "decode", which also holds colocated workers)."""
        return [w for w in (self.prefill if role == "prefill" else self.decode) if w.live]
