"""Continuous-batching step scheduler with a token budget (`engine.scheduling.step_budget`), chunked prefill, prefix
caching, remote-KV reservations (`engine.scheduling.reservations`), parallel sampling's fork
(`engine.scheduling.sample_fork`), preemption by recompute (the vLLM v1 scheme: count tokens, not phases) and n-gram
speculative decoding. Which request goes first is the policy's (`engine.scheduling.policy`: priority, fair share between
tenants, arrival); this module applies it.

Each step: queued requests past their first-token deadline are refused; running requests go first, in policy order
(one token each for decodes, plus n-gram drafts while the batch is small; the next chunk for partial prefills, unless
a request of higher priority is waiting: then the chunk yields its budget), preempting the last running request
(lowest priority, newest) when blocks run out; then waiting requests join in policy order while budget, batch slots
and blocks allow, preempting running requests of lower priority for a slot or blocks. A preempted request frees its
blocks and recomputes its prompt and output later: no token is lost. With an ITL target, a step that decodes takes
only the prefill tokens its measured costs allow (`engine.scheduling.step_cost`); with a burst budget, a step where
as many requests arrive as decode takes up to that many prompt tokens (`_step_tokens`). Owned by the engine thread;
not thread-safe.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

from pdserve_server.engine.scheduling.admission import max_context, refusal
from pdserve_server.engine.config import SchedulerConfig
from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve_server.engine.scheduling.kv_cache_manager import KVCacheManager
from pdserve_server.engine.scheduling.policy import RequestQueue, SchedulingPolicy
from pdserve_server.engine.scheduling.reservations import Reservations
from pdserve_server.engine.outputs import (Reserved, RequestFailed, RunnerOutput, SampledToken, ScheduledRequest,
                                           SchedulerOutput, SchedulerStats, TokenOutput)
from pdserve_server.engine.request import FinishReason, Request, RequestStatus
from pdserve_server.engine.scheduling.sample_fork import SampleFamilies
from pdserve_server.engine.speculative import propose_ngram
from pdserve_server.engine.scheduling.step_budget import StepBudget
from pdserve_server.engine.scheduling.stops import stop_after
from pdserve_server.engine.scheduling.step_cost import StepCost

if TYPE_CHECKING:
    from pdserve_server.engine.structured import GrammarCompiler

log = logging.getLogger(__name__)


class Scheduler:
    """Decides what each step computes and applies each step's sampled tokens.

    Args:
        config: step limits.
        kv: block tables and pool.
        grammars: compiles requests' structured-output constraints (`engine.structured`); None = such requests
            are refused (INVALID_REQUEST).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, grammars: GrammarCompiler | None = None):
        self.config = config
        self.kv = kv
        self.grammars = grammars
        self.requests: dict[str, Request] = {}
        self.policy = SchedulingPolicy()
        self.waiting = RequestQueue(self.policy)
        self.running: list[Request] = []  # in policy order (`SchedulingPolicy.static_key`): the last gives way first
        self.reservations = Reservations(self.policy, self.kv)  # remote-KV requests waiting for blocks
        self.paused: dict[str, Request] = {}  # out of the batch while their reader is behind (`pause`)
        self.families = SampleFamilies()  # parallel sampling: the samples forked from each request
        self._block_copies: list[tuple[int, int]] = []  # copy-on-write owed before the next step's forward
        self.step_cost = StepCost()  # fed by the engine loop (`observe_step`), read by the prefill cap
        self.num_preemptions = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0

    # ---- admission -------------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> RequestFailed | None:
        """Queue a request. Returns a failure when it can never fit this worker's KV pool or context."""
        if request.request_id in self.requests:
            return RequestFailed(request.request_id, ErrorKind.DUPLICATE_REQUEST,
                                 f"request id {request.request_id!r} is in use")
        if failure := refusal(request, self.config, self.kv, self._chunk_limit(request)):
            return failure
        if request.sampling.structured_output is not None and (failure := self._attach_matcher(request)):
            return failure
        self.requests[request.request_id] = request
        self.policy.admit(request)
        if request.remote_kv:
            self.reservations.push(request)
        else:
            request.status = RequestStatus.WAITING
            self.waiting.push(request)
            self.kv.prefetch(request)  # its blocks in slow offload tiers are read while it waits
        return None

    def _attach_matcher(self, request: Request) -> RequestFailed | None:
        """Compile the request's constraint (cached per text) into its matcher and replay the output it brings
        (a migrated request). Returns a failure (INVALID_REQUEST, naming the problem) when the constraint does not
        compile or the output it brings is outside its language; nothing has been computed for it then."""
        if self.grammars is None:
            return RequestFailed(request.request_id, ErrorKind.INVALID_REQUEST,
                                 "structured outputs are not available on this engine (no tokenizer)")
        try:
            request.matcher = self.grammars.matcher(request.sampling.structured_output)
        except EngineError as e:
            return RequestFailed(request.request_id, e.kind, e.message)
        for i, t in enumerate(request.output_token_ids):
            if not request.matcher.accept(t):
                return RequestFailed(request.request_id, ErrorKind.INVALID_REQUEST,
                                     f"output_token_ids[{i}] = {t} is outside the structured output's language")
        return None

    def reserve(self) -> list[Reserved]:
        """Reserve blocks for queued remote-KV requests (`engine.scheduling.reservations`), in policy order, while the
        pool allows.

        Requests already waiting to run come first: a reservation never takes the blocks they still need (for
        their first step: one more block after their KV arrived, everything after a preemption). Without that, a
        burst of reservations filled the pool, each request needed one block more once its KV arrived, and the
        worker stalled until leases lapsed."""
        if not self.reservations:  # called every engine loop: skip the scan when nothing waits to reserve
            return []
        owed = sum(max(0, min(self.kv.blocks_needed(r.num_tokens) - len(self.kv.get_block_table(r.request_id)),
                              self.kv.peak_blocks(r.num_tokens, self._chunk_limit(r))))
                   for r in self.waiting)
        # A request longer than the pool (under a sliding window) needs up to its whole window's peak as it runs: a
        # reservation that took those blocks would have it preempt itself and recompute from its first token.
        owed += sum(self._window_growth(r) for r in self.running)
        return self.reservations.reserve(owed)

    def kv_arrived(self, request_id: str, first_token: int) -> RequestFailed | None:
        """The prompt's KV landed in the reserved blocks: the request joins the batch with its first token.

        Does nothing when the request is not waiting for KV (aborted meanwhile). Returns a failure (the request is
        dropped) when the first token is outside the vocabulary."""
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.WAITING_FOR_KV:
            return None
        if not 0 <= first_token < self.config.vocab_size:
            self.abort(request_id)
            return RequestFailed(request_id, ErrorKind.INVALID_REQUEST,
                                 f"first token {first_token} from the prefill worker is outside the vocabulary")
        if req.matcher is not None and not req.matcher.accept(first_token):
            self.abort(request_id)
            return RequestFailed(request_id, ErrorKind.INVALID_REQUEST,
                                 f"first token {first_token} from the prefill worker is outside the structured "
                                 "output's language")
        req.num_computed_tokens = req.num_tokens
        req.append_output(first_token)
        req.first_token_time = time.time()
        req.status = RequestStatus.WAITING
        self.waiting.push(req)
        return None

    def pause(self, request_id: str) -> bool:
        """Hold a request out of the batch because its reader fell behind (tokens it has not taken pile up): it
        frees its batch slot at once and keeps its KV blocks until blocks are short (then it is the first to give
        them up, and recomputes on `resume`). Only a request producing tokens here (running or waiting to run, not
        prefill-only) can be paused; the samples forked from it (n > 1) pause with it. Returns whether any was."""
        paused = False
        for rid in self.families.family(request_id):
            paused |= self._pause_one(rid)
        return paused

    def _pause_one(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.prefill_only or req.status not in (RequestStatus.RUNNING, RequestStatus.WAITING,
                                                                 RequestStatus.PREEMPTED):
            return False
        if not self._remove_running(req):
            self.waiting.remove(req)
        req.status = RequestStatus.PAUSED
        self.paused[request_id] = req
        return True

    def resume(self, request_id: str) -> bool:
        """Let a paused request (and its samples) back into the queue (its reader caught up), in policy order.
        Returns whether any was paused."""
        resumed = False
        for rid in self.families.family(request_id):
            req = self.paused.pop(rid, None)
            if req is not None:
                req.status = RequestStatus.WAITING
                self.waiting.push(req)
                resumed = True
        return resumed

    def _preempt_paused(self) -> bool:
        """Free the blocks of a paused request that holds any (lowest priority, newest first): it recomputes when
        resumed. Returns False when none holds blocks."""
        for req in sorted(self.paused.values(), key=self.policy.static_key, reverse=True):
            if self.kv.get_block_table(req.request_id):
                self._release_for_recompute(req)
                req.status = RequestStatus.PAUSED
                return True
        return False

    # ---- scheduling --------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> SchedulerOutput:
        """Decide the next step (see the module docstring). Requests refused for their deadline are in
        `SchedulerOutput.failed`; they are gone from the scheduler."""
        out = SchedulerOutput()
        self._expire(out)
        step_tokens = self._step_tokens()
        budget = StepBudget(step_tokens, self._prefill_cap())
        spec = self.config.speculative
        speculate = spec.enabled and len(self.running) <= spec.disable_batch_size
        head = self.waiting.peek()
        kv_preempted = False
        i = 0
        while i < len(self.running) and budget:
            req = self.running[i]
            if req.fork_pending and req.num_computed_tokens >= self._target(req) and not self._fork(req):
                i += 1  # no block for the samples' copies yet: the fork waits for one
                continue
            n = budget.chunk(self._target(req) - req.num_computed_tokens, self._chunk_limit(req, step_tokens))
            # A prefill chunk gives its budget to a more important waiting request (decodes still run), and waits
            # when the decodes' latency target is spent.
            if n is None or (n > 1 and head is not None and self.policy.outranks(head, req)):
                i += 1
                continue
            decoding = self._target(req) - req.num_computed_tokens == 1  # not a prefill capped to one token
            drafts = self._propose(req, budget.tokens) if speculate and decoding else []
            if drafts and not self._allocate_drafts(req, len(drafts), budget.tokens):
                drafts = []  # no blocks to spare: decode plainly (drafts never cost another request its blocks)
            while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
                if self._preempt_paused():  # a paused request's blocks go before a running request's
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                kv_preempted = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # req preempted itself: nothing after it is left either
            self._add_scheduled(out, req, n, drafts)
            budget.take(n, len(drafts))
            i += 1

        # No admissions after a preemption for blocks: the pool is short, and the preempted go first next step.
        while not kv_preempted and budget and (req := self.waiting.peek()) is not None:
            if len(self.running) >= self.config.max_num_seqs:
                if not self._preempt_for(req, out):
                    break
                budget.recount(out.num_tokens)
                continue
            computed_blocks: list[int] = []
            if req.num_computed_tokens == 0 and self.running and self.kv.reading_ahead(req):
                break  # its blocks are being read from a slow tier: the running requests step without waiting
            if req.num_computed_tokens == 0:
                computed_blocks = self.kv.get_computed_blocks(req, self.step_cost.marginal_ms_per_prefill_token)
            num_computed = req.num_computed_tokens or len(computed_blocks) * self.kv.block_size
            n = budget.chunk(self._target(req) - num_computed, self._chunk_limit(req, step_tokens))
            if n is None:  # the decodes' latency target is spent: admissions wait for the next step
                break
            if not self.kv.allocate_slots(req.request_id, num_computed + n, computed_blocks, num_computed):
                if self._preempt_paused():
                    continue
                if self.running:  # a running request of lower priority gives its blocks, else wait for blocks
                    if not self._preempt_for(req, out):
                        break
                    budget.recount(out.num_tokens)
                # Nothing running will free a block: free a later waiting request's instead (it recomputes).
                elif not self._preempt_waiting(req):
                    break
                continue
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
                if not req.remote_kv:
                    req.num_cached_tokens = num_computed
                    self.kv.record_prefix_query(req.num_tokens, num_computed)
            req.num_computed_tokens = num_computed
            if n == 0:
                # A parallel-sampling request whose shared part is computed already (a prefix-cache hit up to its
                # last prompt token, or a one-token prompt): fork now (full blocks only: nothing to copy), and
                # the samples, this one first, join in policy order.
                self._fork(req)
                continue
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=self.policy.static_key)
            self._add_scheduled(out, req, n)
            budget.take(n)
        if not out.is_empty:
            out.block_copies, self._block_copies = self._block_copies, []
        return out

    def _step_tokens(self) -> int:
        """The step's token budget: max_num_batched_tokens, or, in a burst, `SchedulerConfig.burst_prefill_tokens` plus
        a token for each running request. A burst: the requests with prompt tokens still to compute (waiting ones,
        and running ones with an unfinished chunk) are at least as many as those decoding; the step then takes the
        prompt tokens left up to the burst budget (whole prompts in order, the last one perhaps a chunk). Why:
        sixteen arrivals at once prefilled 512 tokens a step stalled the requests already decoding at every step
        until the last prompt was in, each stall a long inter-token gap; one step stalls them once (what vLLM's
        2,048-token default budget does to such a burst). Past the budget, steps of it: sixteen arrivals of 1,000
        tokens went in 32 steps of 512, each carrying the decodes already started; in two of 8,192 (the second
        beside the first eight's decodes: as many arrive as decode) the cohort finished in 26.7-28.6 s against
        30.9-31.8, its last first token at 16.2-17.8 s against 20.6-21.4 (offline engine, docs/benchmarks.md). Where
        more requests decode than arrive (a closed loop's steady state at 64), one big step would stall all of
        them for a few arrivals: measured 4% of throughput at S c=64 (docs/benchmarks.md), so the usual steps."""
        base, burst = self.config.max_num_batched_tokens, self.config.burst_prefill_tokens
        if not self.config.bursts or not self.waiting:
            return base
        prefilling, decoding = len(self.waiting), 0
        for req in self.running:
            if self._target(req) - req.num_computed_tokens > 1:
                prefilling += 1
            else:
                decoding += 1
        return burst + len(self.running) if prefilling >= decoding else base

    def _chunk_limit(self, req: Request, step_tokens: int | None = None) -> int:
        """Most tokens one step computes for req: the step's budget (`step_tokens`, default max_num_batched_tokens),
        less for a request longer than the pool under a sliding window (`KVCacheManager.max_chunk`), so that its
        window and one chunk fit the pool alone. A request that fits whole is never capped."""
        budget = step_tokens or self.config.max_num_batched_tokens
        cap = self.kv.max_chunk
        if cap is None or self.kv.blocks_needed(max_context(req)) <= self.kv.num_usable_blocks:
            return budget
        return min(budget, cap)

    def _window_growth(self, req: Request) -> int:
        """Blocks a running request longer than the pool may still take before its window's peak (0 for any other
        request: those give blocks back by preemption, as before)."""
        need = max_context(req)
        if self.kv.blocks_needed(need) <= self.kv.num_usable_blocks:
            return 0
        held = len(self.kv.get_block_table(req.request_id)) - self.kv.num_released(req.request_id)
        return max(0, self.kv.peak_blocks(need, self._chunk_limit(req)) - held)

    def _prefill_cap(self) -> int | None:
        """Prefill tokens this step may take (`SchedulerConfig.itl_target_ms`, `StepCost.prefill_budget`, at least
        a block), or None for no cap: no target, no request decoding (nobody waits between tokens), or the costs
        not measured yet."""
        target = self.config.itl_target_ms
        if target <= 0 or not any(self._target(r) - r.num_computed_tokens == 1 for r in self.running):
            return None
        return self.step_cost.prefill_budget(target, floor=self.kv.block_size)

    def observe_step(self, out: SchedulerOutput, step_ms: float) -> None:
        """The engine loop reports how long a step (`out`, forward and sampling) took, ms: the prefill cap's
        cost model learns from it."""
        num_prefill = out.num_prefill_tokens
        self.step_cost.observe(out.num_tokens - num_prefill, num_prefill, step_ms)

    @staticmethod
    def _target(req: Request) -> int:
        """Tokens the request computes before it samples: all it has; for a parallel-sampling request not yet
        forked, all but the last prompt token (each sample computes that one itself, into blocks of its own)."""
        return req.num_tokens - 1 if req.fork_pending else req.num_tokens

    def _fork(self, req: Request) -> bool:
        """Fork a parallel-sampling request into its samples (`SampleFamilies.fork`) and queue them in policy
        order. Returns False, changing nothing, when the pool lacks a block for each partial-block copy."""
        fork = self.families.fork(req, self.kv, self.grammars)
        if fork is None:
            return False
        self._block_copies += fork.block_copies
        for sample in fork.samples:
            self.requests[sample.request_id] = sample
            self.policy.admit(sample)
            self.waiting.push(sample)
        return True

    def _expire(self, out: SchedulerOutput) -> None:
        """Refuse the queued requests whose first-token deadline has passed with nothing computed for them (they
        would spend prefill on an answer nobody waits for)."""
        now = time.time()
        late = [r for r in self.waiting if r.scheduling.deadline is not None and r.scheduling.deadline < now
                and r.first_scheduled_time is None and not r.remote_kv]
        for req in late:
            waited_ms = (now - req.arrival_time) * 1e3
            self.abort(req.request_id)
            out.failed.append(RequestFailed(req.request_id, ErrorKind.DEADLINE,
                                            f"not started before its first-token deadline (queued {waited_ms:.0f} ms"
                                            " behind other work); nothing was computed for it"))

    def _preempt_for(self, head: Request, out: SchedulerOutput) -> bool:
        """Preempt the last running request (lowest priority, newest) if `head` outranks it, taking it out of this
        step's batch if it was scheduled. Returns whether one was preempted."""
        if not self.running or not self.policy.outranks(head, self.running[-1]):
            return False
        victim = self.running.pop()
        for batch in (out.decodes, out.prefills):
            batch[:] = [x for x in batch if x.request is not victim]
        self._preempt(victim)
        out.preempted_ids.append(victim.request_id)
        return True

    def _propose(self, req: Request, budget: int) -> list[int]:
        """n-gram drafts for a running decode (`engine.speculative`), as many as the step's budget, the
        request's max_tokens and the context window leave room to emit; none unless its next token is a plain argmax,
        which the step can verify without changing the output."""
        spec = self.config.speculative
        if req.prefill_only or not req.argmax_next or req.matcher is not None:  # a draft would skip the mask
            return []
        if req.fork_pending:  # its one token is the last before the fork, not a decode: nothing to verify
            return []
        room = min(spec.num_tokens, budget - 1, req.sampling.max_tokens - len(req.output_token_ids) - 1,
                   self.config.max_model_len - req.num_tokens - 1)
        return propose_ngram(req.all_token_ids, room, spec.lookup_min, spec.lookup_max)

    def _allocate_drafts(self, req: Request, num_drafts: int, budget: int) -> bool:
        """Slots for a decode's drafts, only from blocks no other request could need this step: at most one block
        per running request, and the blocks of the budget's remaining tokens. Returns False, allocating nothing,
        otherwise."""
        total = req.num_computed_tokens + 1 + num_drafts
        extra = self.kv.blocks_needed(total) - len(self.kv.get_block_table(req.request_id))
        margin = len(self.running) + self.kv.blocks_needed(budget)
        if extra > 0 and self.kv.pool.num_free_blocks - extra < margin:
            return False
        return self.kv.allocate_slots(req.request_id, total)

    def _add_scheduled(self, out: SchedulerOutput, req: Request, n: int, drafts: list[int] | None = None) -> None:
        """n known tokens, then the drafts (if any) to verify after them."""
        drafts = drafts or []
        s = ScheduledRequest(req, n + len(drafts), self.kv.get_block_table(req.request_id),
                             sample=req.num_computed_tokens + n == req.num_tokens, spec_token_ids=drafts)
        (out.decodes if s.num_new_tokens == 1 else out.prefills).append(s)

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks; it recomputes its prompt + output later (queued in policy order: by
        its arrival, ahead of later arrivals of its priority)."""
        self._release_for_recompute(req)
        self.waiting.push(req)

    def _release_for_recompute(self, req: Request) -> None:
        """Free the request's blocks and count a preemption: it computes its prompt + output again when scheduled."""
        self.kv.free(req.request_id)
        self.num_preemptions += 1
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED

    def _preempt_waiting(self, head: Request) -> bool:
        """Free the blocks of the last waiting request in policy order (lowest priority, newest) that holds any (not
        `head`): it recomputes later, from its place in the queue. Returns False when no waiting request holds
        blocks."""
        for req in self.waiting.worst_first():
            if req is not head and self.kv.get_block_table(req.request_id):
                self._release_for_recompute(req)
                return True
        return False

    # ---- results -----------------------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[TokenOutput | RequestFailed]:
        """Advance computed counts, register full blocks, append sampled tokens (several for a request whose drafts
        were accepted) and finish requests; a request whose sampling failed is dropped (blocks freed) with a
        RequestFailed."""
        events: list[TokenOutput | RequestFailed] = []
        for s in out.decodes + out.prefills:
            req = s.request
            self.policy.charge(req, s.num_new_tokens)
            if req.request_id in result.failed:
                error = result.failed[req.request_id]
                self.abort(req.request_id)
                events.append(RequestFailed(req.external_id, error.kind, error.message))
                continue
            if not s.sample:
                req.num_computed_tokens += s.num_new_tokens
                self._computed(req)
                if req.fork_pending and req.num_computed_tokens >= self._target(req):
                    self._fork(req)  # else the running loop retries when a block is free
                continue
            tokens = [result.sampled[req.request_id]]
            if s.spec_token_ids:
                extra = result.spec_tokens.get(req.request_id, [])
                tokens += [SampledToken(t) for t in extra]
                req.num_draft_tokens += len(s.spec_token_ids)
                req.num_accepted_tokens += len(extra)
                self.spec_draft_tokens += len(s.spec_token_ids)
                self.spec_accepted_tokens += len(extra)
            ev = self._emit(req, tokens, events)
            # The step's KV is valid for the known tokens and for each draft that an emitted token confirmed; the
            # slots of rejected drafts are rewritten by later steps.
            req.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids) + len(tokens) - 1
            self._computed(req)
            if ev.finish_reason is not None:
                req.finish_reason, req.stop_token_id = ev.finish_reason, ev.stop_token_id
                self._remove_running(req)
                if ev.finish_reason == FinishReason.PREFILL_DONE:
                    req.status = RequestStatus.HELD
                    ev.block_ids = list(self.kv.get_block_table(req.request_id))
                else:
                    self._finish(req)
        return events

    def _computed(self, req: Request) -> None:
        """After a step advanced req's computed tokens: register its new full blocks in the prefix cache, then give
        back the blocks its window has left behind (sliding-window models only)."""
        self.kv.cache_full_blocks(req)
        self.kv.release_out_of_window(req.request_id, req.num_computed_tokens)

    def _emit(self, req: Request, tokens: list[SampledToken], events: list) -> TokenOutput:
        """Append tokens to the request, one TokenOutput each, up to the first that finishes it; drops the tokens
        after that from `tokens` (in place) and returns the last event."""
        for i, token in enumerate(tokens):
            req.append_output(token.token_id)
            if req.matcher is not None and not req.matcher.accept(token.token_id):
                # The sampler only draws allowed tokens, so this is a bug; the matcher is now stopped and
                # stop_after ends the request here rather than let it go on unconstrained.
                log.warning("request %s: token %d rejected by its structured output (%s)", req.request_id,
                            token.token_id, req.matcher.error)
            ev = TokenOutput(req.external_id, token, num_cached_tokens=req.num_cached_tokens,
                             num_draft_tokens=req.num_draft_tokens, num_accepted_tokens=req.num_accepted_tokens,
                             index=req.sample_index)
            if req.first_token_time is None:
                now = time.time()
                req.first_token_time = now
                ev.queue_ms = (req.first_scheduled_time - req.arrival_time) * 1e3
                ev.prefill_ms = (now - req.first_scheduled_time) * 1e3
            ev.finish_reason, ev.stop_token_id = stop_after(req, token.token_id, self.config.max_model_len)
            events.append(ev)
            if ev.finish_reason is not None:
                del tokens[i + 1:]
                break
        return ev

    def _finish(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        self.kv.free(req.request_id)
        del self.requests[req.request_id]
        self.policy.release(req)
        self.families.finished(req, owner_known=req.external_id in self.requests)

    def _remove_running(self, req: Request) -> bool:
        """Take req out of the running batch (by identity: a dataclass's == compares every field)."""
        for i, r in enumerate(self.running):
            if r is req:
                del self.running[i]
                return True
        return False

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks, with every sample forked from it (n > 1). Returns
        False if unknown (idempotent)."""
        found = False
        for rid in reversed(self.families.family(request_id)):  # samples before the request they came from
            found |= self._abort_one(rid)
        return found

    def _abort_one(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.waiting.remove(req)
        self.reservations.remove(req)
        self.paused.pop(request_id, None)
        self._remove_running(req)
        if req.finish_reason is None:
            req.finish_reason = FinishReason.ABORT
        self._finish(req)
        return True

    def num_requests(self) -> int:
        return len(self.requests)

    def make_stats(self, num_steps: int) -> SchedulerStats:
        """A snapshot of load and cache counters (O(1): safe to make every step)."""
        pool = self.kv.pool
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting) + len(self.reservations),
            num_requests=len(self.requests), num_total_blocks=self.kv.num_usable_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_free_blocks, prefix_cache_query_tokens=self.kv.prefix_query_tokens,
            prefix_cache_hit_tokens=self.kv.prefix_hit_tokens, num_preemptions=self.num_preemptions,
            num_steps=num_steps, spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens, num_paused=len(self.paused),
            kv_offload=self.kv.offload.stats() if self.kv.offload is not None else ())
