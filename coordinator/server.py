"""The public Generation service, and the one request path every public door uses (`GenerationServicer.serve`).
The coordinator process that serves it beside the other doors is `coordinator.app`."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from collections.abc import Mapping
from typing import Any

import grpc
from opentelemetry import trace

from coordinator import flow as flows
from coordinator.config import CoordinatorConfig
from coordinator.errors import RequestError, invalid
from coordinator.ratelimit import RateLimiter
from coordinator.membership import Cluster, Membership
from coordinator.metrics import CoordinatorMetrics
from coordinator.record import RequestRecord, log_access
from coordinator.stream import Progress, SampleStream, merged, request_record
from coordinator.scheduling import RequestScheduling, SchedulingAsk, Tenant, grant_priority, resolve_tenant
from coordinator.tokenizer import Tokenizer
from coordinator.validation import (check_chat, check_prompt, check_prompt_length, check_text_length,
                                   resolve_sampling, shorten)
from pdserve.v1 import generate_pb2, generate_pb2_grpc
from server_common.security import key_id, presented_token

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256  # ids are echoed in errors, logs and traces
CAPACITY_RETRY_S = 1.0  # RetryInfo of "server at capacity": about one short request's time, a hint not a promise
# The client's deadline timer starts before ours (ours counts from the call's arrival), so its cancellation at its
# deadline reaches us with a little of our own left: a cancellation this close to the deadline is the deadline.
CLIENT_DEADLINE_SLACK_S = 0.1


def _trace_request(operation: str, sampling: generate_pb2.SamplingParams, model: str, rid: str) -> None:
    """The request's OpenTelemetry GenAI attributes on the current (Generate server) span; operation is "chat" or
    "text_completion"."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attributes({
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "pdserve", "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": sampling.max_tokens, "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p, "gen_ai.request.top_k": sampling.top_k,
        "pdserve.request_id": rid})


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """Generate / Abort / GetModelInfo: validate and tokenize, route, stream text back, free on every exit."""

    def __init__(self, config: CoordinatorConfig, cluster: Cluster, tokenizer: Tokenizer,
                 metrics: CoordinatorMetrics, on_worker_lost: Callable[[str, str], None] = lambda address, why: None,
                 keys_required: bool = False, tenants: Mapping[str, Tenant] | None = None):
        """on_worker_lost(address, why): a worker call failed as if the worker were gone
        (`Membership.report_lost`, which owns liveness). keys_required: the port authenticates API keys (`caller`
        then trusts the presented key). tenants: tenant -> weight and priority floor (`scheduling.read_tenants`);
        tenants not in it weigh 1 with the default floor."""
        self.config, self.cluster, self.tokenizer, self.metrics = config, cluster, tokenizer, metrics
        self.on_worker_lost = on_worker_lost
        self.keys_required = keys_required
        self.tenants = dict(tenants or {})
        self.limiter = RateLimiter(config.rate_limit_requests_per_s, config.rate_limit_tokens_per_s,
                                   config.rate_limit_burst_s)

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Stream one completion (written with context.write, so a client that stops reading is noticed)."""
        operation = "chat" if request.WhichOneof("input") == "chat" else "text_completion"
        await self.serve(context, request.request_id or uuid.uuid4().hex, lambda: self._prepare(request), operation,
                         lambda msg: self.write(context, msg), lambda: SchedulingAsk.from_request(request))

    async def serve(self, context: grpc.aio.ServicerContext, rid: str,
                    prepare: Callable[[], Awaitable[tuple[list[int], generate_pb2.SamplingParams]]], operation: str,
                    send: Callable[[generate_pb2.GenerateResponse], Awaitable[None]],
                    scheduling: Callable[[], SchedulingAsk] | None = None) -> None:
        """The one request path behind every public door (this service's Generate, `coordinator.vllm_engine`'s):
        admission, validation, routing, migration, stop handling, metrics and the access log, and cleanup on every
        exit. A RequestError (from `prepare`, the path or `send`) ends the call with its status; any other exception
        ends it with INTERNAL (logged with its traceback), never grpc's UNKNOWN with a Python class name.

        Args:
            context: the door's call (deadline, caller identity, abort).
            rid: the request id (unique among requests in flight, else ALREADY_EXISTS).
            prepare: returns (prompt token ids, resolved sampling: `validation.resolve_sampling`'s form) or raises
                RequestError; called after admission.
            operation: "chat" or "text_completion", for the trace.
            send: takes each of the request's `generate_pb2.GenerateResponse` messages (chunks, then one final) in
                order and hands it on to the door's client.
            scheduling: returns the door's priority, tenant field and TTFT objective, or raises RequestError
                (INVALID_ARGUMENT); called after `prepare`. None: the defaults (priority 0, no tenant field, no
                objective).
        """
        arrival_wall, arrival, t0 = time.time(), time.monotonic(), flows.now_ms()
        caller = self.caller(context)
        try:
            self._admit(rid, caller)
        except RequestError as e:
            self._finished(RequestRecord(rid[:MAX_REQUEST_ID_CHARS], error_code=e.code.name), e.message)
            await context.abort(e.code, e.client_message, e.trailing_metadata())
        flow = flows.Flow(rid, caller=caller)
        remaining = context.time_remaining()  # the client's deadline bounds every worker call, not only ours
        flow.deadline = arrival + min(self.config.request_timeout_s, remaining or float("inf"))
        deadline_why = ("the call's deadline" if remaining is not None and remaining < self.config.request_timeout_s
                        else f"the request timeout ({self.config.request_timeout_s:g} s)")
        self.cluster.flows[flow.key] = flow  # the id is taken before the first await: a duplicate cannot slip in
        self.metrics.in_flight.inc()
        error: RequestError | None = None
        finals_due, finals_sent = -1, 0  # a client that goes once its last Final is sent got the whole request
        try:
            prompt, sampling = await prepare()
            flow.record.prompt_tokens = len(prompt)  # kept if the request fails: the access log says how big it was
            ask = scheduling() if scheduling is not None else SchedulingAsk()
            tenant = resolve_tenant(caller, ask.tenant, self.keys_required)
            entry = self.tenants.get(tenant, Tenant())
            ask = grant_priority(ask, entry, self.config.scheduling_policy, self.keys_required)
            flow.scheduling = RequestScheduling(ask, tenant, entry.weight, arrival, deadline_why)
            _trace_request(operation, sampling, self.config.model_name, rid)
            samples = sampling.n or 1
            self._take_slots(flow, samples)
            self._check_queued_tokens(caller, len(prompt))  # before the rate limit charges: a refusal costs nothing
            # n samples share one prefill (they fork from it) and each may decode max_tokens
            self._charge(caller, len(prompt) + samples * sampling.max_tokens)
            # No await since the check: concurrent requests of the caller see each other's tokens.
            flow.queued_tokens = len(prompt)
            finals_due = samples
            async for msg in self._stream(flow, prompt, sampling, arrival_wall, t0):
                # Counted once handed over: a client that closes as soon as it reads its last Final cancels the
                # call while that write still awaits gRPC's completion.
                finals_sent += msg.HasField("final")
                await send(msg)
        except RequestError as e:
            error = e
            if e.prompt_tokens is not None and not flow.record.prompt_tokens:
                flow.record.prompt_tokens = e.prompt_tokens
            await context.abort(e.code, f"request {rid}: {e.client_message}", e.trailing_metadata())
        except (asyncio.CancelledError, grpc.aio.InternalError):
            # The client went: gRPC cancels this task, or, when a send races the cancellation, the send fails with
            # InternalError (ExecuteBatchError), which gRPC ignores for a closed call. Either way: say which it was,
            # unless every Final was already being sent (the request was complete when the client went).
            if finals_sent >= finals_due > 0:
                raise
            remaining = context.time_remaining()
            error = (RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline passed")
                     if remaining is not None and remaining <= CLIENT_DEADLINE_SLACK_S
                     else RequestError(grpc.StatusCode.CANCELLED, "the client cancelled the call"))
            raise
        except grpc.aio.AbortError:
            raise  # a door aborted the call itself (its status is set)
        except Exception:  # a bug: this request fails with a status that names no internals; no other is touched
            log.exception("request %r: internal error", rid)
            error = RequestError(grpc.StatusCode.INTERNAL,
                                 "internal error; the coordinator's log has it under this request id")
            await context.abort(error.code, f"request {rid}: {error.message}")
        finally:
            flow.cancel()
            self.cluster.flows.pop(flow.key, None)
            self.metrics.in_flight.dec()
            record = flow.record
            if error is not None:
                record.error_code = error.code.name
                record.prefill_worker = record.prefill_worker or flow.prefill_worker  # where it was when it failed
                record.decode_worker = record.decode_worker or flow.decode_worker
            record.e2e_s = record.e2e_s or (flows.now_ms() - t0) / 1e3
            self._finished(record, error.message if error else "")

    async def write(self, context: grpc.aio.ServicerContext, msg: Any) -> None:
        """Send one message of a server-streaming call (any door's response type); a client that has not taken it
        within stall_timeout_s (flow control held it) is given up on, so it cannot keep a batch slot and KV blocks
        on the workers. Every door writes through this, so the limit is the same everywhere.

        Raises:
            RequestError: DEADLINE_EXCEEDED for a stalled client.
        """
        try:
            async with asyncio.timeout(self.config.stall_timeout_s):  # a timer, not wait_for's task per message
                await context.write(msg)
        except TimeoutError:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"the client read nothing for {self.config.stall_timeout_s:g} s; request cancelled "
                               "and its KV freed") from None

    def _finished(self, record: RequestRecord, error: str) -> None:
        """Metrics, trace attributes and the access log line, once per request however it ended."""
        self.metrics.observe(record)
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({
                "gen_ai.usage.input_tokens": record.prompt_tokens, "gen_ai.usage.output_tokens": record.output_tokens,
                "gen_ai.response.finish_reasons": [record.finish_reason or "error"],
                "pdserve.cached_prompt_tokens": record.cached_tokens, "pdserve.ttft_ms": record.ttft_s * 1e3,
                "pdserve.prefill_worker": record.prefill_worker, "pdserve.decode_worker": record.decode_worker})
        log_access(record, error)

    def _charge(self, caller: str, num_tokens: int) -> None:
        """Take the request's tokens from the caller's rate limit. Raises RequestError RESOURCE_EXHAUSTED."""
        wait = self.limiter.admit(caller, "tokens", num_tokens)
        if wait == float("inf"):  # retrying cannot help: the request itself is too big for the limit
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"prompt + n x max_tokens = {num_tokens} tokens exceeds this key's token burst "
                               f"({self.config.rate_limit_tokens_per_s:g}/s for {self.config.rate_limit_burst_s:g} s);"
                               " lower max_tokens or n")
        if wait:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"token rate limit reached ({self.config.rate_limit_tokens_per_s:g} tokens/s); "
                               f"retry after {wait:.2f} s", retry_after_s=wait)

    def _admit(self, rid: str, caller: str) -> None:
        """Raises RequestError unless a request with this id may start now."""
        if wait := self.limiter.admit(caller, "requests", 1):
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"request rate limit reached ({self.config.rate_limit_requests_per_s:g} requests/s); "
                               f"retry after {wait:.2f} s", retry_after_s=wait)
        if len(rid) > MAX_REQUEST_ID_CHARS:
            raise invalid(f"request_id has {len(rid)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed")
        if not rid.isprintable():  # ids are written into logs: a newline or an ANSI escape would forge lines
            raise invalid(f"request_id {shorten(rid)} contains control or unprintable characters; use printable "
                          "text")
        if flows.scoped_id(caller, rid) in self.cluster.flows:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in flight")
        self._check_slots(caller, 1)

    def _slots(self, caller: str | None = None) -> int:
        """Sequences in flight (a request of n samples counts n), of every caller or of `caller`."""
        return sum(f.samples for f in self.cluster.flows.values() if caller is None or f.caller == caller)

    def _check_slots(self, caller: str, wanted: int, held: int = 0) -> None:
        """Raises RequestError RESOURCE_EXHAUSTED (with a retry hint) unless a request holding `held` of the slots in
        flight may hold `wanted` instead under --max-in-flight and --max-in-flight-per-caller."""
        if self._slots() - held + wanted > self.config.max_in_flight:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"server at capacity ({self.config.max_in_flight} sequences in flight, a request of n "
                               "samples counting n); retry later", retry_after_s=CAPACITY_RETRY_S)
        per_caller = self.config.max_in_flight_per_caller
        others = self._slots(caller) - held
        if per_caller and others + wanted > per_caller:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"this caller has {others} sequences in flight and asks for {wanted} more; one caller "
                               f"may have {per_caller} (a request of n samples counts n); retry when one finishes",
                               retry_after_s=CAPACITY_RETRY_S)

    def _take_slots(self, flow: flows.Flow, n: int) -> None:
        """The request turned out to have n samples: it takes n slots instead of the 1 `_admit` checked.

        Raises:
            RequestError: INVALID_ARGUMENT when n alone exceeds a limit (retrying cannot help), else as
                `_check_slots`.
        """
        if n <= flow.samples:
            return
        for limit, flag in ((self.config.max_in_flight, "--max-in-flight"),
                            (self.config.max_in_flight_per_caller, "--max-in-flight-per-caller")):
            if limit and n > limit:
                raise invalid(f"sampling.n = {n} needs {n} sequences, more than this server admits at once ({flag} "
                              f"{limit}); lower n")
        self._check_slots(flow.caller, n, held=flow.samples)
        flow.samples = n  # no await since the check

    def queued_tokens(self, caller: str) -> int:
        """Prompt tokens of `caller`'s requests in flight that have not had their first token yet. Summed over the
        flows in flight (at most max_in_flight), so a request that ended in any way (finish, error, cancel, abort,
        migration's failure) has stopped counting: there is no counter to leak."""
        return sum(f.queued_tokens for f in self.cluster.flows.values() if f.caller == caller)

    def _check_queued_tokens(self, caller: str, num_prompt_tokens: int) -> None:
        """Raises RequestError unless the caller may queue num_prompt_tokens more (max_queued_tokens_per_caller):
        RESOURCE_EXHAUSTED with a retry hint while its other requests wait for their first token, INVALID_ARGUMENT
        for a prompt the limit can never admit."""
        limit = self.config.max_queued_tokens_per_caller
        if not limit:
            return
        if num_prompt_tokens > limit:  # retrying cannot help
            raise invalid(f"the prompt has {num_prompt_tokens} tokens, more than the {limit} prompt tokens one caller "
                          "may have queued (--max-queued-tokens-per-caller); shorten the prompt")
        queued = self.queued_tokens(caller)
        if queued + num_prompt_tokens > limit:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"this caller has {queued} prompt tokens waiting for their first token; with this "
                               f"prompt's {num_prompt_tokens} that passes the {limit} one caller may have queued; "
                               f"retry after {CAPACITY_RETRY_S:g} s or when one of its requests starts "
                               "streaming", retry_after_s=CAPACITY_RETRY_S)

    async def _prepare(self, request: generate_pb2.GenerateRequest) -> tuple[list[int], generate_pb2.SamplingParams]:
        """(prompt token ids, resolved sampling). Raises RequestError with the status to return."""
        if request.model and request.model != self.config.model_name:
            raise invalid(f"unknown model {shorten(request.model)}; this server serves {self.config.model_name!r}")
        kind = request.WhichOneof("input")
        if kind is None:
            raise invalid("one of text, chat or token_ids is required")
        limits = self.cluster.limits
        if kind == "text":
            if not request.text:
                raise invalid("prompt is empty: text must be non-empty")
            check_text_length(len(request.text), self.tokenizer.max_chars_per_token, limits)
            prompt = await asyncio.to_thread(self.tokenizer.encode, request.text)
        elif kind == "chat":
            check_chat(request.chat)
            check_text_length(sum(len(m.content) for m in request.chat.messages), self.tokenizer.max_chars_per_token,
                              limits)
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            add_gen = (request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt")
                       else True)
            prompt = await asyncio.to_thread(self.tokenizer.encode_chat, messages, add_gen,
                                             request.chat.parse_special_tokens)
        else:
            check_prompt_length(len(request.token_ids.ids), limits)  # before copying: ids may be millions
            prompt = list(request.token_ids.ids)
        check_prompt(prompt, limits)
        return prompt, resolve_sampling(request.sampling, len(prompt), limits)

    async def _stream(self, flow: flows.Flow, prompt: list[int], sampling: generate_pb2.SamplingParams,
                      arrival_wall: float, t0: float):
        """Relay the workers' tokens as text chunks, then the final message. When a worker is lost mid-request
        (UNAVAILABLE from a worker call), the request resumes on other workers with the tokens already sent
        (migration, at most config.max_migrations times): the client's stream goes on, no token repeated or lost.
        """
        if sampling.n > 1:
            async for msg in self._stream_samples(flow, prompt, sampling, arrival_wall, t0):
                yield msg
            return
        sample = SampleStream(self.tokenizer, prompt, sampling)
        p = sample.progress
        try:
            while not p.ended:
                source = self._attempt(flow, prompt, sampling, arrival_wall, p)
                try:
                    async for msg in self._relay(source, sample, flow):
                        yield msg
                except RequestError as e:
                    self._migrate_or_raise(e, flow, p, sampling)
                finally:
                    await source.aclose()
        except asyncio.CancelledError:
            if not flow.aborted:
                flow.record = request_record(flow, len(prompt), p, t0)  # what was streamed before the cancel
                raise
            p.reason = generate_pb2.FINISH_REASON_ABORT
        except BaseException:
            flow.record = request_record(flow, len(prompt), p, t0)
            raise
        end = flows.now_ms()
        flow.record = request_record(flow, len(prompt), p, t0, end)
        for msg in sample.ending(flow, len(prompt), t0, end):
            yield msg

    async def _stream_samples(self, flow: flows.Flow, prompt: list[int], sampling: generate_pb2.SamplingParams,
                              arrival_wall: float, t0: float):
        """sampling.n > 1: each sample's chunks as they come (Chunk.index), and each sample's final message as it
        ends; the stream ends with the last. Each attempt runs on a worker that prefills the prompt once and forks
        the samples. A lost worker is retried on another (at most config.max_migrations times) while no sample has
        streamed a token; after that it ends the request with UNAVAILABLE (the samples have sent different tokens,
        so there is no one resumption). A sample that matches a stop string ends there; the worker's further
        tokens for it are dropped (it stops at its own EOS or max_tokens)."""
        samples = [SampleStream(self.tokenizer, prompt, sampling, i) for i in range(sampling.n)]
        attempt = Progress()  # its migrations name each retry's worker-side request id (`_attempt`)
        streamed = False
        ended = 0
        try:
            while True:
                source = self._attempt(flow, prompt, sampling, arrival_wall, attempt)
                try:
                    async for item in source:
                        sample = samples[item.index]
                        if sample.progress.ended:
                            continue  # ended by a stop string here
                        if isinstance(item, flows.WorkerFinish):
                            sample.finish(item)
                        else:
                            streamed = True
                            yield sample.chunk(item, flow.first_token)
                            if not sample.progress.ended:
                                continue
                        ended += 1
                        for msg in sample.ending(flow, len(prompt), t0, flows.now_ms()):
                            yield msg
                        if ended == sampling.n:
                            break
                    else:
                        raise RequestError(grpc.StatusCode.INTERNAL, "the worker stream ended without a finish")
                    break
                except RequestError as e:
                    if not streamed:  # nothing sent yet: a fresh attempt elsewhere, as a single request migrates
                        self._migrate_or_raise(e, flow, attempt, sampling)
                        continue
                    if e.code == grpc.StatusCode.UNAVAILABLE and e.worker:
                        self.on_worker_lost(e.worker, e.message)
                    raise
                finally:
                    await source.aclose()
        except asyncio.CancelledError:
            if not flow.aborted:
                raise
            for sample in samples:  # Abort RPC: the samples still going end with ABORT
                if not sample.progress.ended:
                    sample.progress.reason = generate_pb2.FINISH_REASON_ABORT
                    for msg in sample.ending(flow, len(prompt), t0, flows.now_ms()):
                        yield msg
        finally:
            flow.record = request_record(flow, len(prompt), merged([s.progress for s in samples]), t0)

    def _attempt(self, flow: flows.Flow, prompt: list[int], sampling: generate_pb2.SamplingParams,
                 arrival_wall: float, p: Progress):
        """The worker calls of one attempt; a resumed attempt carries the tokens sent so far and its own worker-side
        request id (the lost attempt's may still be winding down on a worker that is alive)."""
        router = self.cluster.router
        worker_rid = flow.key if not p.migrations else f"{flow.key}~{p.migrations}"
        timeout_s = max(0.001, flow.deadline - time.monotonic())
        first_sent = p.first_ms is not None
        sched = flow.scheduling
        hints = sched.hints(first_sent) if sched is not None else None
        due = sched.first_token_due(flow.deadline, first_sent) if sched is not None else None
        if self.config.colocated or sampling.n > 1:  # samples fork from a prompt computed where they decode
            return flows.run_colocated(router, flow, worker_rid, prompt, p.generated, sampling, timeout_s, hints, due)
        local = router.local_prefill(prompt + p.generated, self.cluster.local_prefill)
        if local is not None:
            self.metrics.local_prefills.labels(self.config.model_name, local).inc()
            return flows.run_colocated(router, flow, worker_rid, prompt, p.generated, sampling, timeout_s, hints, due)
        return flows.run_disaggregated(router, flow, worker_rid, prompt, p.generated, sampling, arrival_wall,
                                       timeout_s, hints, due)

    @staticmethod
    async def _relay(source, sample: SampleStream, flow: flows.Flow):
        """Turn one attempt's worker events into the sample's chunks, until the worker finishes it or a stop
        string matches (sample.progress.reason is then set)."""
        async for item in source:
            if isinstance(item, flows.WorkerFinish):
                sample.finish(item)
                return
            yield sample.chunk(item, flow.first_token)
            if sample.progress.ended:  # a stop string matched
                return
        raise RequestError(grpc.StatusCode.INTERNAL, "the worker stream ended without a finish")  # a bug

    def _migrate_or_raise(self, error: RequestError, flow: flows.Flow, p: Progress,
                          sampling: generate_pb2.SamplingParams) -> None:
        """After a failed attempt: resume elsewhere (the lost worker leaves routing until it answers a poll
        again), end with LENGTH when every token was already sent, or re-raise."""
        if error.code != grpc.StatusCode.UNAVAILABLE or not error.worker:
            raise error
        self.on_worker_lost(error.worker, error.message)
        if len(p.generated) >= sampling.max_tokens:  # the finish message was lost, not a token
            p.reason = generate_pb2.FINISH_REASON_LENGTH
            return
        if p.migrations >= self.config.max_migrations:
            after = f" (after {p.migrations} migration(s), the most allowed)"
            raise RequestError(grpc.StatusCode.UNAVAILABLE, error.message + after,
                               public=error.client_message + after) from error
        p.migrations += 1
        log.warning("request %s: %s; resuming on other workers after %d token(s) (migration %d of at most %d)",
                    flow.request_id, error.message, len(p.generated), p.migrations, self.config.max_migrations)

    async def Abort(self, request, context):
        return generate_pb2.AbortResponse(found=self.abort(self.caller(context), request.request_id))

    def caller(self, context: grpc.aio.ServicerContext) -> str:
        """Who a call is for (rate limits, per-caller limits, the scope of its request ids): its API key's id when
        the port requires keys (the interceptor has checked it), else the peer's address without the port. A key
        presented where none is required is not trusted: random keys made every request a new caller."""
        token = presented_token(context.invocation_metadata())
        if self.keys_required and token is not None:
            return "key:" + key_id(token)
        return "peer:" + context.peer().rsplit(":", 1)[0]

    def abort(self, caller: str, rid: str) -> bool:
        """Stop one of `caller`'s in-flight requests (its stream ends with finish reason ABORT; the workers free its
        KV). False when the caller has no request with this id in flight: another caller's is out of reach."""
        flow = self.cluster.flows.get(flows.scoped_id(caller, rid))
        if flow is None:
            return False
        flow.aborted = True
        flow.cancel()
        return True

    async def GetModelInfo(self, request, context):
        c = self.cluster
        try:
            c.limits  # noqa: B018 - UNAVAILABLE before any worker was seen (grpc would say UNKNOWN)
        except RequestError as e:
            await context.abort(e.code, e.client_message)
        return generate_pb2.ModelInfo(
            model=self.config.model_name, context_length=c.limits.context_length, block_size=c.block_size,
            vocab_size=c.limits.vocab_size, eos_token_id=c.eos_token_id,
            topology="colocated" if self.config.colocated else "disaggregated",
            num_prefill_workers=len(c.router.live("prefill")), num_decode_workers=len(c.router.live("decode")),
            kv_connector=c.connector)
