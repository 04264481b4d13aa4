"""The public Generation service and the coordinator process."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc

from coordinator import flow as flows
from coordinator.config import CoordinatorConfig
from coordinator.errors import RequestError, invalid
from coordinator.router import Router, WorkerHandle, poll_loads
from coordinator.text import IncrementalDetokenizer, StopMatcher
from coordinator.tokenizer import Tokenizer
from coordinator.validation import (Limits, check_chat, check_prompt, check_text_length, resolve_sampling,
                                   shorten)
from pdserve.v1 import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from server_common.grpc_server import MAX_MESSAGE_BYTES, start_grpc_server, write_ready_file

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256  # ids are echoed in errors, logs and traces


@dataclass
class Cluster:
    """The workers behind this coordinator and what they agreed on at start."""

    router: Router
    limits: Limits
    eos_token_id: int
    block_size: int
    connector: str
    flows: dict[str, flows.Flow] = field(default_factory=dict)


async def connect_worker(address: str, timeout_s: float) -> WorkerHandle:
    """Open a channel and wait (bounded) until the worker answers GetInfo.

    Raises:
        TimeoutError: the worker did not answer within timeout_s.
    """
    channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    stub = worker_pb2_grpc.WorkerStub(channel)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = await stub.GetInfo(worker_pb2.WorkerInfoRequest(), timeout=5, wait_for_ready=True)
            break
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                await channel.close()
                raise TimeoutError(f"worker {address} not ready after {timeout_s:.0f}s") from None
            await asyncio.sleep(0.5)
    return WorkerHandle(address, channel, info, stub, worker_pb2_grpc.PrefillStub(channel),
                        worker_pb2_grpc.DecodeStub(channel))


async def build_cluster(config: CoordinatorConfig) -> Cluster:
    """Connect to every worker and check that they agree on model and KV layout.

    Raises:
        ValueError: a worker has the wrong role or an incompatible layout (different compat_hash).
        TimeoutError: a worker did not answer within config.connect_timeout_s.
    """
    prefill = await asyncio.gather(*(connect_worker(a, config.connect_timeout_s) for a in config.prefill))
    decode = await asyncio.gather(*(connect_worker(a, config.connect_timeout_s) for a in config.decode))
    want_decode = "colocated" if config.colocated else "decode"
    for w in prefill:
        if w.info.role != "prefill":
            raise ValueError(f"{w.address} is a {w.info.role} worker, listed as prefill")
    for w in decode:
        if w.info.role != want_decode:
            raise ValueError(f"{w.address} is a {w.info.role} worker, expected {want_decode}")
    if not decode or (not config.colocated and not prefill):
        raise ValueError("need at least one decode worker, and one prefill worker unless colocated")
    everyone = [*prefill, *decode]
    if len({w.info.compat_hash for w in everyone}) != 1:
        raise ValueError("workers disagree on model/dtype/block size: " +
                         ", ".join(f"{w.address}={w.info.compat_hash}" for w in everyone))
    limits = Limits(context_length=min(w.info.context_length for w in everyone),
                    kv_capacity_tokens=min(w.info.max_request_tokens for w in everyone),
                    vocab_size=decode[0].info.vocab_size)
    return Cluster(Router(list(prefill), list(decode)), limits, decode[0].info.eos_token_id,
                   decode[0].info.block_size, "" if config.colocated else decode[0].info.kv_connector)


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """Generate / Abort / GetModelInfo: validate and tokenize, route, stream text back, free on every exit."""

    def __init__(self, config: CoordinatorConfig, cluster: Cluster, tokenizer: Tokenizer):
        self.config, self.cluster, self.tokenizer = config, cluster, tokenizer

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival_wall, t0 = time.time(), flows.now_ms()
        rid = request.request_id or uuid.uuid4().hex
        try:
            self._admit(rid)
        except RequestError as e:
            await context.abort(e.code, e.message)
        flow = flows.Flow(rid)
        self.cluster.flows[rid] = flow  # the id is taken before the first await: a duplicate cannot slip in
        try:
            prompt, sampling = await self._prepare(request)
            async for msg in self._stream(flow, request, prompt, sampling, arrival_wall, t0):
                yield msg
        except RequestError as e:
            await context.abort(e.code, f"request {rid}: {e.message}")
        finally:
            flow.cancel()
            self.cluster.flows.pop(rid, None)

    def _admit(self, rid: str) -> None:
        """Raises RequestError unless a request with this id may start now."""
        if len(rid) > MAX_REQUEST_ID_CHARS:
            raise invalid(f"request_id has {len(rid)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed")
        if rid in self.cluster.flows:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in flight")
        if len(self.cluster.flows) >= self.config.max_in_flight:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"server at capacity ({self.config.max_in_flight} requests in flight); retry later")

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
            prompt = await asyncio.to_thread(self.tokenizer.encode_chat, messages, add_gen)
        else:
            prompt = list(request.token_ids.ids)
        check_prompt(prompt, limits)
        return prompt, resolve_sampling(request.sampling, len(prompt), limits)

    async def _stream(self, flow: flows.Flow, request: generate_pb2.GenerateRequest, prompt: list[int],
                      sampling: generate_pb2.SamplingParams, arrival_wall: float, t0: float):
        cfg = self.config
        if cfg.colocated:
            source = flows.run_colocated(self.cluster.router, flow, prompt, sampling, cfg.request_timeout_s)
        else:
            source = flows.run_disaggregated(self.cluster.router, flow, prompt, sampling, arrival_wall,
                                             cfg.request_timeout_s)
        detok = IncrementalDetokenizer(self.tokenizer, prompt)
        stops = StopMatcher(list(request.sampling.stop), request.sampling.include_stop_str_in_output)
        num_out, cached, ttft, first_ms = 0, 0, 0.0, None
        reason = generate_pb2.FINISH_REASON_UNSPECIFIED
        stop_string: str | None = None
        stop_token_id: int | None = None
        try:
            async for item in source:
                if isinstance(item, flows.WorkerFinish):
                    reason, stop_token_id = item.finish_reason, item.stop_token_id
                    break
                cached = item.num_cached_tokens or cached
                ids = [t.token_id for t in item.tokens]
                num_out += len(ids)
                text, stop_string = stops.feed(detok.add(ids))
                chunk = generate_pb2.Chunk(token_ids=ids, text=text)
                if sampling.HasField("logprobs"):
                    chunk.logprobs.extend(self._logprobs(item.tokens))
                if first_ms is None:
                    first_ms = flows.now_ms()
                    ttft = first_ms - t0
                yield generate_pb2.GenerateResponse(chunk=chunk)
                if stop_string is not None:
                    reason = generate_pb2.FINISH_REASON_STOP
                    break
        except asyncio.CancelledError:
            if not flow.aborted:
                raise
            reason = generate_pb2.FINISH_REASON_ABORT
        finally:
            await source.aclose()
        if stop_string is None and (tail := stops.flush()):  # text held back for a stop string that never came
            yield generate_pb2.GenerateResponse(chunk=generate_pb2.Chunk(text=tail))
        end = flows.now_ms()
        t = flow.timings
        matched = stop_string if stop_string is not None else ("" if stop_token_id is None else str(stop_token_id))
        yield generate_pb2.GenerateResponse(final=generate_pb2.Final(
            finish_reason=reason, matched_stop=matched, request_id=flow.request_id,
            usage=generate_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=num_out,
                                     cached_prompt_tokens=cached),
            timings=generate_pb2.Timings(queue_ms=t.queue_ms, prefill_ms=t.prefill_ms, transfer_ms=t.transfer_ms,
                                         ttft_ms=ttft, decode_ms=(end - first_ms) if first_ms else 0.0,
                                         e2e_ms=end - t0)))

    def _logprobs(self, tokens) -> list[generate_pb2.PositionLogprobs]:
        out = []
        for t in tokens:
            lp = generate_pb2.PositionLogprobs()
            lp.CopyFrom(t.logprobs)
            lp.sampled.text = self.tokenizer.token_text(lp.sampled.token_id)
            for alt in lp.top:
                alt.text = self.tokenizer.token_text(alt.token_id)
            out.append(lp)
        return out

    async def Abort(self, request, context):
        flow = self.cluster.flows.get(request.request_id)
        if flow is None:
            return generate_pb2.AbortResponse(found=False)
        flow.aborted = True
        flow.cancel()
        return generate_pb2.AbortResponse(found=True)

    async def GetModelInfo(self, request, context):
        c = self.cluster
        return generate_pb2.ModelInfo(
            model=self.config.model_name, context_length=c.limits.context_length, block_size=c.block_size,
            vocab_size=c.limits.vocab_size, eos_token_id=c.eos_token_id,
            topology="colocated" if self.config.colocated else "disaggregated",
            num_prefill_workers=len(c.router.prefill), num_decode_workers=len(c.router.decode),
            kv_connector=c.connector)


async def serve(config: CoordinatorConfig) -> None:
    """Connect to the workers, then serve the public API until cancelled."""
    cluster = await build_cluster(config)
    tokenizer = await asyncio.to_thread(Tokenizer, config.model_dir)
    servicer = GenerationServicer(config, cluster, tokenizer)
    running = await start_grpc_server(
        config.server.host, config.server.port,
        lambda server: generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server),
        ["pdserve.v1.Generation"])
    address = f"{config.server.host}:{running.port}"
    log.info("coordinator serving %s on %s (%s, %d prefill / %d decode workers, connector %s)",
             config.model_name, address, "colocated" if config.colocated else "disaggregated",
             len(cluster.router.prefill), len(cluster.router.decode), cluster.connector or "-")
    write_ready_file(config.server.ready_file, address)
    poller = asyncio.create_task(poll_loads(cluster.router, config.stats_interval_s))
    try:
        await running.server.wait_for_termination()
    finally:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
        await running.server.stop(grace=1)
        for w in cluster.router.workers:
            await w.channel.close()
