"""Plain records that cross the engine's boundaries: scheduler -> runner -> scheduler -> server.

The events an engine hands its owner (`Reserved`, `TokenOutput`, `RequestFailed`) and its `SchedulerStats` are
msgspec Structs, tagged: they cross the engine-core process boundary as they are (`engine.core.ipc`; msgpack, about
13x cheaper than pickle at a 64-request step). The step's internals stay dataclasses: they never leave the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve_server.engine.offload.stats import TierStats
from pdserve_server.engine.request import FinishReason, Request


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute tokens [num_computed_tokens, num_computed_tokens + num_new_tokens).

    sample is True when the chunk reaches the last known token, so the step yields a new token for it.
    spec_token_ids: n-gram draft tokens (`engine.speculative`) computed after the last known token; they are
    the last len(spec_token_ids) of the num_new_tokens, and the step verifies them (a decode, filed under prefills
    as its chunk has several tokens).
    """

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    sample: bool
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """A step: decodes (one new token each) first, then prefill chunks. preempted_ids: running requests this step
    preempted (they recompute later); failed: queued requests it refused (past their deadline), already dropped;
    block_copies: (src, dst) KV blocks to copy before the step's forward (copy-on-write of the partial block of a
    forked sample, `KVCacheManager.fork`)."""

    decodes: list[ScheduledRequest] = field(default_factory=list)
    prefills: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    failed: list[RequestFailed] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_new_tokens for s in self.prefills)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt (or recomputed) tokens in chunks: the step's tokens other than decodes and their drafts."""
        return sum(s.num_new_tokens for s in self.prefills if not s.spec_token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class SampledToken(msgspec.Struct, array_like=True):
    """A sampled token; logprob and top alternatives (natural log, after penalties, before temperature) when asked."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = []


@dataclass
class RunnerOutput:
    """What one step produced: a token for each request whose chunk reached its last token, and the requests whose
    sampling failed (their error; the rest of the batch is unaffected).

    spec_tokens: for a request that carried drafts, the tokens after its sampled one that the step also emits
    (the accepted drafts but the first, then the model's own next token; `engine.speculative.accept_greedy`).
    """

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    failed: dict[str, EngineError] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)


class Reserved(msgspec.Struct, tag=True, array_like=True):
    """Blocks are reserved for a remote-KV request: the prefill worker may send (decode worker).

    block_ids: the request's whole block table for its KV; the first num_cached_blocks of them need nothing sent:
    this worker's prefix-cache hits, already holding that KV, and under a sliding window every layer shares, the
    blocks behind the window, already given back (`KVCacheManager.release_out_of_window`; the null block stands in).
    """

    request_id: str
    block_ids: list[int]
    num_cached_blocks: int = 0


class TokenOutput(msgspec.Struct, tag=True, array_like=True):
    """A new token for a request, possibly with its finish.

    finish_reason PREFILL_DONE (prefill worker): the request's KV is complete and held in block_ids until
    `release`; the caller must release it after the transfer, success or not. num_draft_tokens /
    num_accepted_tokens: the request's speculative-decoding counts so far (acceptance rate = accepted / draft).
    index: which sample (0..n-1) of a request with sampling.n > 1 the token belongs to; each finishes on its own.
    """

    request_id: str
    token: SampledToken
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_cached_tokens: int = 0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    block_ids: list[int] | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    index: int = 0


class RequestFailed(msgspec.Struct, tag=True, array_like=True):
    """The engine gave up on a request and holds nothing for it any more."""

    request_id: str
    kind: ErrorKind
    message: str


class KvBlockStored(msgspec.Struct, tag=True, array_like=True):
    """A full KV block entered this engine's prefix cache (vLLM's BlockStored, one block): its chained hash
    (`engine.scheduling.block_pool.hash_block_tokens`, 16 bytes), its parent's (None for a prompt's first block)
    and its block_size token ids. Emitted only with `EngineArgs.kv_events`."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: list[int]


class KvBlockRemoved(msgspec.Struct, tag=True, array_like=True):
    """A cached block's content was evicted (its block reused for other KV): the prefix it ended is no longer
    held here (vLLM's BlockRemoved)."""

    block_hash: bytes


KV_EVENTS = (KvBlockStored, KvBlockRemoved)  # the events no request owns: the worker's KV event log takes them


class Forgotten(msgspec.Struct, tag=True, array_like=True):
    """The engine applied an owner's abort of request_id (`engine_core.Abort` with ack): no event for that request
    made before it follows, so events for the id after this one belong to a new request under the same id."""

    request_id: str


class SchedulerStats(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """One engine's load and cache counters, made by the scheduler (`Scheduler.make_stats`) after every loop
    iteration; the worker reads only this (GetStats, Prometheus gauges), never the scheduler's internals.

    Attributes:
        num_running: requests in the running batch.
        num_waiting: requests queued: waiting to be scheduled or for a KV reservation.
        num_requests: requests the engine knows in any state (held prefill blocks and KV-pending included).
        num_total_blocks / num_free_blocks: KV pool size and free blocks (cached-but-free blocks count as free).
        num_cached_blocks: free blocks that still hold prefix-cache content.
        prefix_cache_query_tokens / prefix_cache_hit_tokens: cumulative prompt tokens looked up / found cached.
        num_preemptions: cumulative requests preempted (their KV freed, to be recomputed).
        num_steps: engine steps run.
        spec_draft_tokens / spec_accepted_tokens: cumulative n-gram draft tokens verified / accepted.
        num_paused: requests held out of the batch because their reader fell behind (`Scheduler.pause`).
        kv_offload: each offload tier's cumulative counters, fastest first (`engine.offload`); empty without tiers.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_requests: int = 0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    num_paused: int = 0
    kv_offload: tuple[TierStats, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks if self.num_total_blocks else 0.0


class StepRecord(msgspec.Struct):
    """What one engine step ran (kept in a bounded log; shows continuous batching at work)."""

    step: int
    num_tokens: int
    batch_ids: list[str]
    joined_ids: list[str]
    left_ids: list[str]
