"""The one request path every public door takes (`coordinator/doors/`): admission and per-caller limits
(`coordinator.admission`), the door's own validation and tokenization, scheduling, routing, the prefill -> KV
transfer -> decode flow (or a colocated worker), migration when a worker is lost, streaming with stop handling, the
access record, metrics and trace attributes, and cleanup on every exit.

A door maps its protocol onto a `DoorRequest` (what to prepare, how to send each message back) and a `Call` (who
asks, until when), calls `RequestPath.run`, and maps a RequestError onto its own wire. Nothing here knows a door's
protocol: messages out are pdserve.v1 `GenerateResponse`s (chunks, then one Final per sample).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import grpc
from opentelemetry import trace

from pdserve.v1 import generate_pb2
from pdserve_server.coordinator import flow as flows
from pdserve_server.coordinator.admission import MAX_REQUEST_ID_CHARS, Admission
from pdserve_server.coordinator.config import CoordinatorConfig
from pdserve_server.coordinator.errors import RequestError
from pdserve_server.coordinator.membership import Cluster
from pdserve_server.coordinator.metrics import CoordinatorMetrics
from pdserve_server.coordinator.record import RequestRecord, log_access
from pdserve_server.coordinator.scheduling import (RequestScheduling, SchedulingAsk, Tenant, grant_priority,
                                                   resolve_tenant)
from pdserve_server.coordinator.stream import Progress, SampleStream, merged, request_record
from pdserve_server.coordinator.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# The client's deadline timer starts before ours (ours counts from the call's arrival), so its cancellation at its
# deadline reaches us with a little of our own left: a cancellation this close to the deadline is the deadline.
CLIENT_DEADLINE_SLACK_S = 0.1


@dataclass(frozen=True)
class Call:
    """What the path needs of a door's call, whatever its protocol.

    Attributes:
        caller: who asks (`doors.grpc_call.caller`): rate limits, per-caller limits and the scope of request ids.
        deadline: time.monotonic() of the client's deadline, None without one.
    """

    caller: str
    deadline: float | None = None

    def remaining_s(self) -> float | None:
        """Seconds to the client's deadline (negative once passed), None without one."""
        return None if self.deadline is None else self.deadline - time.monotonic()


class DoorRequest(Protocol):
    """One request as a door hands it to the path."""

    request_id: str  # the client's id (unique among the caller's requests in flight), or one the door made
    operation: str  # "chat" or "text_completion", for the trace

    async def prepare(self) -> tuple[list[int], generate_pb2.SamplingParams]:
        """(prompt token ids, resolved sampling: `validation.resolve_sampling`'s form); called once admitted.
        Raises RequestError (INVALID_ARGUMENT, NOT_FOUND...)."""

    def scheduling(self) -> SchedulingAsk:
        """The request's priority, tenant field and TTFT objective (SchedulingAsk() for the defaults); called after
        prepare. Raises RequestError (INVALID_ARGUMENT)."""

    async def send(self, msg: generate_pb2.GenerateResponse) -> None:
        """Hand one message (chunks in order, then each sample's Final) to the door's client, in its protocol.
        Raises RequestError (a stalled client: DEADLINE_EXCEEDED) or grpc.aio.InternalError (the client went)."""


def _trace_request(operation: str, sampling: generate_pb2.SamplingParams, model: str, rid: str) -> None:
    """The request's OpenTelemetry GenAI attributes on the current (server) span; operation is "chat" or
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


class RequestPath:
    """Runs requests from every door over the cluster's workers.

    Args:
        config: the coordinator's configuration (limits, timeouts, topology, migrations).
        cluster: the routing view and the requests in flight (`Cluster.flows`, shared by every door).
        tokenizer: detokenizes streamed tokens (stop strings, text chunks).
        metrics: the coordinator's Prometheus metrics.
        on_worker_lost: (address, why), called when a worker call failed as if the worker were gone
            (`Membership.report_lost`, which owns liveness).
        keys_required: the port authenticates API keys (a presented key then names the caller and the tenant).
        tenants: tenant -> weight and priority floor (`scheduling.read_tenants`); others weigh 1 with the default
            floor.
        on_finished: called with each request's record as it ends (`capacity.CapacityPlanner.observe`).
    """

    def __init__(self, config: CoordinatorConfig, cluster: Cluster, tokenizer: Tokenizer,
                 metrics: CoordinatorMetrics, on_worker_lost: Callable[[str, str], None] = lambda address, why: None,
                 keys_required: bool = False, tenants: Mapping[str, Tenant] | None = None,
                 on_finished: Callable[[RequestRecord], None] = lambda record: None):
        self.config, self.cluster, self.tokenizer, self.metrics = config, cluster, tokenizer, metrics
        self.on_worker_lost = on_worker_lost
        self.on_finished = on_finished
        self.keys_required = keys_required
        self.tenants = dict(tenants or {})
        self.admission = Admission(config, cluster.flows)

    async def run(self, call: Call, request: DoorRequest) -> None:
        """Run one request to its end, sending its messages through `request.send`; cleanup on every exit.

        Raises:
            RequestError: the status the door answers with. Refused at admission: its message as is; after: led
                by "request <id>: ". A bug is INTERNAL, logged with its traceback, naming no internals.
            asyncio.CancelledError, grpc.aio.InternalError: the client went (recorded as CANCELLED or
                DEADLINE_EXCEEDED unless every Final was already being sent), re-raised.
        """
        rid, caller = request.request_id, call.caller
        arrival_wall, arrival, t0 = time.time(), time.monotonic(), flows.now_ms()
        try:
            self.admission.admit(rid, caller)
        except RequestError as e:
            self._finished(RequestRecord(rid[:MAX_REQUEST_ID_CHARS], error_code=e.code.name), e.message)
            raise
        flow = flows.Flow(rid, caller=caller)
        remaining = call.remaining_s()  # the client's deadline bounds every worker call, not only ours
        flow.deadline = arrival + min(self.config.request_timeout_s, remaining if remaining is not None else
                                      float("inf"))
        deadline_why = ("the call's deadline" if remaining is not None and remaining < self.config.request_timeout_s
                        else f"the request timeout ({self.config.request_timeout_s:g} s)")
        self.cluster.flows[flow.key] = flow  # the id is taken before the first await: a duplicate cannot slip in
        self.metrics.in_flight.inc()
        error: RequestError | None = None
        finals_due, finals_sent = -1, 0  # a client that goes once its last Final is sent got the whole request
        try:
            prompt, sampling = await request.prepare()
            flow.record.prompt_tokens = len(prompt)  # kept if the request fails: the access log says how big it was
            ask = request.scheduling()
            tenant = resolve_tenant(caller, ask.tenant, self.keys_required)
            entry = self.tenants.get(tenant, Tenant())
            ask = grant_priority(ask, entry, self.config.scheduling_policy, self.keys_required)
            flow.scheduling = RequestScheduling(ask, tenant, entry.weight, arrival, deadline_why,
                                                cache_salt=tenant if self.config.isolate_prefix_cache_by_tenant
                                                else "")
            _trace_request(request.operation, sampling, self.config.model_name, rid)
            samples = sampling.n or 1
            self.admission.take_slots(flow, samples)
            self.admission.check_queued_tokens(caller, len(prompt))  # before the rate limit charges: a refusal is free
            # n samples share one prefill (they fork from it) and each may decode max_tokens
            self.admission.charge(caller, len(prompt) + samples * sampling.max_tokens)
            # No await since the check: concurrent requests of the caller see each other's tokens.
            flow.queued_tokens = len(prompt)
            finals_due = samples
            async for msg in self._stream(flow, prompt, sampling, arrival_wall, t0):
                # Counted once handed over: a client that closes as soon as it reads its last Final cancels the
                # call while that write still awaits gRPC's completion.
                finals_sent += msg.HasField("final")
                await request.send(msg)
        except RequestError as e:
            error = e
            if e.prompt_tokens is not None and not flow.record.prompt_tokens:
                flow.record.prompt_tokens = e.prompt_tokens
            raise e.naming(rid) from None
        except (asyncio.CancelledError, grpc.aio.InternalError):
            # The client went: gRPC cancels this task, or, when a send races the cancellation, the send fails with
            # InternalError (ExecuteBatchError), which gRPC ignores for a closed call. Either way: say which it was,
            # unless every Final was already being sent (the request was complete when the client went).
            if finals_sent >= finals_due > 0:
                raise
            remaining = call.remaining_s()
            error = (RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline passed")
                     if remaining is not None and remaining <= CLIENT_DEADLINE_SLACK_S
                     else RequestError(grpc.StatusCode.CANCELLED, "the client cancelled the call"))
            raise
        except Exception:  # a bug: this request fails with a status that names no internals; no other is touched
            log.exception("request %r: internal error", rid)
            error = RequestError(grpc.StatusCode.INTERNAL,
                                 "internal error; the coordinator's log has it under this request id")
            raise error.naming(rid) from None
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

    def abort(self, caller: str, rid: str) -> bool:
        """Stop one of `caller`'s in-flight requests (its stream ends with finish reason ABORT; the workers free its
        KV). False when the caller has no request with this id in flight: another caller's is out of reach."""
        flow = self.cluster.flows.get(flows.scoped_id(caller, rid))
        if flow is None:
            return False
        flow.aborted = True
        flow.cancel()
        return True

    def _finished(self, record: RequestRecord, error: str) -> None:
        """Metrics, trace attributes and the access log line, once per request however it ended."""
        self.metrics.observe(record)
        self.on_finished(record)
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({
                "gen_ai.usage.input_tokens": record.prompt_tokens, "gen_ai.usage.output_tokens": record.output_tokens,
                "gen_ai.response.finish_reasons": [record.finish_reason or "error"],
                "pdserve.cached_prompt_tokens": record.cached_tokens, "pdserve.ttft_ms": record.ttft_s * 1e3,
                "pdserve.prefill_worker": record.prefill_worker, "pdserve.decode_worker": record.decode_worker})
        log_access(record, error)

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
        # the fewest requests a worker needs from us for a request to join its token stream (None: never)
        streams = self.config.token_streams_min_requests if self.config.token_streams else None
        if self.config.colocated or sampling.n > 1:  # samples fork from a prompt computed where they decode
            return flows.run_colocated(router, flow, worker_rid, prompt, p.generated, sampling, timeout_s, hints, due,
                                       streams)
        local = router.local_prefill(prompt + p.generated, self.cluster.local_prefill,
                                     hints.cache_salt if hints is not None else "")
        if local is not None:
            self.metrics.local_prefills.labels(self.config.model_name, local).inc()
            return flows.run_colocated(router, flow, worker_rid, prompt, p.generated, sampling, timeout_s, hints, due,
                                       streams)
        return flows.run_disaggregated(router, flow, worker_rid, prompt, p.generated, sampling, arrival_wall,
                                       timeout_s, hints, due, streams)

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
