"""pdserve.v1.Generation, our own door: Generate (text, chat or token ids in; text chunks, token ids and one Final
per sample out), Abort and GetModelInfo, over the one request path (`coordinator.request_path`)."""
from __future__ import annotations

import asyncio
import uuid

import grpc

from pdserve.v1 import generate_pb2, generate_pb2_grpc
from pdserve_server.coordinator.doors import grpc_call
from pdserve_server.coordinator.errors import RequestError, invalid
from pdserve_server.coordinator.request_path import RequestPath
from pdserve_server.coordinator.scheduling import SchedulingAsk
from pdserve_server.coordinator.validation import (check_chat, check_prompt, check_prompt_length, check_text_length,
                                                   resolve_sampling, shorten)


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """Generate / Abort / GetModelInfo: validate and tokenize, then the request path streams the reply.

    Args:
        path: the coordinator's request path (shared by every door).
    """

    def __init__(self, path: RequestPath):
        self.path = path
        self.config, self.cluster, self.tokenizer = path.config, path.cluster, path.tokenizer

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Stream one completion (written with context.write, so a client that stops reading is noticed). Errors
        end the call with the path's statuses (INVALID_ARGUMENT, RESOURCE_EXHAUSTED with RetryInfo, ALREADY_EXISTS,
        UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL)."""
        await grpc_call.run(self.path, context, _Generate(self, request, context))

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

    async def Abort(self, request, context):
        caller = grpc_call.caller(context, self.path.keys_required)
        return generate_pb2.AbortResponse(found=self.path.abort(caller, request.request_id))

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


class _Generate:
    """One Generate call as the request path takes it (`request_path.DoorRequest`): our own messages, sent as they
    are."""

    def __init__(self, door: GenerationServicer, request: generate_pb2.GenerateRequest,
                 context: grpc.aio.ServicerContext):
        self.door, self.request, self.context = door, request, context
        self.request_id = request.request_id or uuid.uuid4().hex
        self.operation = "chat" if request.WhichOneof("input") == "chat" else "text_completion"

    async def prepare(self) -> tuple[list[int], generate_pb2.SamplingParams]:
        return await self.door._prepare(self.request)

    def scheduling(self) -> SchedulingAsk:
        return SchedulingAsk.from_request(self.request)

    async def send(self, msg: generate_pb2.GenerateResponse) -> None:
        await grpc_call.write(self.context, msg, self.door.config.stall_timeout_s)
