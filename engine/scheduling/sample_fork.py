"""Parallel sampling (n > 1, vLLM's `n`): one request's prompt is computed once, then the request forks into its n
samples, which share the prompt's full KV blocks and each copy its partial last block (copy-on-write).

`SampleFamilies` makes the forks and remembers which samples came from which request, so that pausing, resuming
and aborting a request reach its samples too. The scheduler decides when to fork (`Scheduler._target`: a request
not yet forked computes all but its last prompt token) and queues the samples it gets back. Engine thread only.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pdserve_server.engine.scheduling.kv_cache_manager import KVCacheManager
from pdserve_server.engine.request import SAMPLE_ID_SEPARATOR, Request, RequestStatus

if TYPE_CHECKING:
    from pdserve_server.engine.structured import GrammarCompiler


@dataclasses.dataclass
class Fork:
    """A fork's new samples (1..n-1, status WAITING, not yet queued) and the (src, dst) block copies the next step
    must make before its forward (`ModelRunner`'s block_copies)."""

    samples: list[Request]
    block_copies: list[tuple[int, int]]


class SampleFamilies:
    """Which samples each forked request has: request id -> its samples' ids (request `i`'s sample `k` is
    f"{i}{SAMPLE_ID_SEPARATOR}{k}")."""

    def __init__(self) -> None:
        self.children: dict[str, list[str]] = {}

    def family(self, request_id: str) -> list[str]:
        """The request and the samples forked from it, parent first; a new list (callers may remove them)."""
        return [request_id, *self.children.get(request_id, ())]

    def has_samples(self, request_id: str) -> bool:
        """Whether samples forked from request_id are still known."""
        return bool(self.children.get(request_id))

    def fork(self, req: Request, kv: KVCacheManager, grammars: GrammarCompiler | None) -> Fork | None:
        """Fork req, whose prompt but the last token is computed, into its n samples: req is sample 0; samples
        1..n-1 are new requests sharing its full blocks, each with a copy of its partial last block
        (`KVCacheManager.fork`), seeds req's seed + k. Clears req.fork_pending. Returns None, changing nothing,
        when the pool lacks a block for each copy."""
        num = req.num_computed_tokens
        n = req.sampling.n
        if num % kv.block_size and kv.pool.num_free_blocks < n - 1:
            return None
        fork = Fork([], [])
        for i in range(1, n):
            seed = None if req.sampling.seed is None else req.sampling.seed + i
            sample = Request(f"{req.request_id}{SAMPLE_ID_SEPARATOR}{i}", req.prompt_token_ids,
                             dataclasses.replace(req.sampling, seed=seed), eos_token_ids=req.eos_token_ids,
                             arrival_time=req.arrival_time, scheduling=req.scheduling, parent_id=req.request_id,
                             sample_index=i)
            if (copy := kv.fork(req.request_id, sample.request_id, num)) is not None:
                fork.block_copies.append(copy)
            sample.num_computed_tokens = num
            sample.num_cached_tokens = req.num_cached_tokens
            sample.first_scheduled_time = req.first_scheduled_time
            if req.matcher is not None:
                sample.matcher = grammars.matcher(req.sampling.structured_output)  # compiled once, cached
            sample.status = RequestStatus.WAITING
            fork.samples.append(sample)
            self.children.setdefault(req.request_id, []).append(sample.request_id)
        req.fork_pending = False
        return fork

    def finished(self, req: Request, owner_known: bool) -> None:
        """req left the engine; owner_known: whether the request it belongs to (itself, or its parent) still is.
        A family is forgotten once all of it is gone."""
        owner = req.external_id
        siblings = self.children.get(owner)
        if siblings is None:
            return
        if req.parent_id is not None:
            siblings.remove(req.request_id)
        if not siblings and not owner_known:
            del self.children[owner]
