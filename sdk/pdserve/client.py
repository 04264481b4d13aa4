"""Python client for the pdserve coordinator (sync and asyncio), over the generated gRPC stubs.

    from pdserve import Client, SamplingParams
    with Client("127.0.0.1:50051") as c:
        for chunk in c.generate("Hello", SamplingParams(max_tokens=32, temperature=0)):
            print(chunk.text, end="", flush=True)

Errors surface as grpc.RpcError with the server's status code and message.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.v1 import generate_pb2, generate_pb2_grpc

FINISH_REASONS = {generate_pb2.FINISH_REASON_STOP: "stop", generate_pb2.FINISH_REASON_LENGTH: "length",
                  generate_pb2.FINISH_REASON_ABORT: "abort"}


SamplingParams = generate_pb2.SamplingParams
"""Sampling parameters: the `pdserve.v1.SamplingParams` message itself (one definition, in generate.proto).

Build it with keyword arguments, e.g. `SamplingParams(max_tokens=32, temperature=0, stop=["\\n"])`; a field left
unset (or given as None) takes the server's documented default. Semantics follow vLLM's SamplingParams.
"""

StructuredOutput = generate_pb2.StructuredOutput
"""A constraint on the output, `SamplingParams(structured_output=StructuredOutput(json_schema=json.dumps(schema)))`:
one of json_schema, regex, grammar (GBNF or Lark), json_object=True, choice=Choices(choices=[...]) (generate.proto)."""

Choices = generate_pb2.Choices
"""The strings of `StructuredOutput(choice=...)`."""


@dataclass
class GenerateChunk:
    """One streamed piece: new token ids and their text; `final` is set on the last item only (with sampling.n > 1:
    on the last item of each sample). index: the sample (0 .. n-1) the piece belongs to."""

    token_ids: list[int]
    text: str
    logprobs: list = field(default_factory=list)
    final: Completion | None = None
    index: int = 0


@dataclass
class Completion:
    """The end of a stream: finish reason ("stop", "length", "abort"), usage and timings (ms).

    spec_draft_tokens / spec_accepted_tokens: speculative decoding's draft tokens verified and accepted (0 when
    the workers run without it); their ratio is the acceptance rate."""

    request_id: str
    finish_reason: str
    matched_stop: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    timings: dict[str, float]
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    index: int = 0


def build_request(prompt: str | Sequence[int] | Sequence[dict], sampling: SamplingParams | None, request_id: str,
                  model: str, priority: int = 0, tenant: str = "",
                  ttft_slo_ms: int = 0) -> generate_pb2.GenerateRequest:
    """The GenerateRequest for a prompt: a str is text; a sequence of ints is token ids; a sequence of
    {"role", "content"} dicts is chat (rendered with the model's chat template by the server). priority, tenant
    and ttft_slo_ms are the scheduling fields (see `Client.generate`).

    Raises:
        ValueError: priority outside int32, or ttft_slo_ms outside [0, 2**32).
    """
    req = generate_pb2.GenerateRequest(request_id=request_id, model=model, sampling=sampling, priority=priority,
                                       tenant=tenant, ttft_slo_ms=ttft_slo_ms)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.chat.messages.extend(generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
        if not prompt:
            req.token_ids.SetInParent()
    return req


def _convert(resp: generate_pb2.GenerateResponse) -> GenerateChunk:
    if resp.WhichOneof("response") == "chunk":
        c = resp.chunk
        return GenerateChunk(list(c.token_ids), c.text, list(c.logprobs), index=c.index)
    f = resp.final
    t = f.timings
    return GenerateChunk([], "", index=f.index, final=Completion(index=f.index,
        request_id=f.request_id, finish_reason=FINISH_REASONS.get(f.finish_reason, "unspecified"),
        matched_stop=f.matched_stop, prompt_tokens=f.usage.prompt_tokens,
        completion_tokens=f.usage.completion_tokens, cached_prompt_tokens=f.usage.cached_prompt_tokens,
        timings={"queue_ms": t.queue_ms, "prefill_ms": t.prefill_ms, "transfer_ms": t.transfer_ms,
                 "ttft_ms": t.ttft_ms, "decode_ms": t.decode_ms, "e2e_ms": t.e2e_ms},
        spec_draft_tokens=f.usage.spec_draft_tokens, spec_accepted_tokens=f.usage.spec_accepted_tokens))


class _CompletionBuilder:
    """Accumulates streamed chunks of `n` samples; `add` returns every sample's Completion (with its whole text
    and ids), by index, once the last final message came."""

    def __init__(self, n: int = 1):
        self.text: list[list[str]] = [[] for _ in range(n)]
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.done: list[Completion | None] = [None] * n

    def add(self, chunk: GenerateChunk) -> list[Completion] | None:
        i = chunk.index
        if chunk.final is None:
            self.text[i].append(chunk.text)
            self.ids[i].extend(chunk.token_ids)
            return None
        chunk.final.text, chunk.final.token_ids = "".join(self.text[i]), self.ids[i]
        self.done[i] = chunk.final
        return None if any(c is None for c in self.done) else self.done  # type: ignore[return-value]


def _num_samples(sampling: SamplingParams | None) -> int:
    return sampling.n if sampling is not None and sampling.HasField("n") and sampling.n > 1 else 1


def _single(sampling: SamplingParams | None) -> None:
    if _num_samples(sampling) > 1:
        raise ValueError("complete() returns one completion: use complete_samples() for sampling.n > 1")


_NO_FINAL = "stream ended without a final message"


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def tls_credentials(ca_file: str | None = None, cert_file: str | None = None,
                    key_file: str | None = None) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files: the CA that signed the server's certificate (None: the system's
    roots), and a client certificate + key for servers that require mTLS."""
    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()
    return grpc.ssl_channel_credentials(read(ca_file), read(key_file), read(cert_file))


class Client:
    """Blocking client. Use as a context manager or call close().

    Args:
        address: the coordinator's "host:port".
        credentials: TLS channel credentials (e.g. `tls_credentials(ca_file=...)`); None = plaintext.
        api_key: sent as `authorization: Bearer <api_key>` on every call, for coordinators started with API keys.
    """

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None,
                 api_key: str | None = None):
        self.channel = (grpc.secure_channel(address, credentials) if credentials is not None
                        else grpc.insecure_channel(address))
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.metadata = _auth_metadata(api_key)

    def generate(self, prompt, sampling: SamplingParams | None = None, request_id: str = "", model: str = "",
                 timeout: float | None = None, metadata: Sequence[tuple[str, str]] = (), priority: int = 0,
                 tenant: str = "", ttft_slo_ms: int = 0) -> Iterator[GenerateChunk]:
        """Stream chunks; the last one carries `final`. Closing the iterator early cancels the request.

        Args:
            timeout: the call's deadline, seconds; a request whose first token is predicted to come later is
                refused at once (DEADLINE_EXCEEDED).
            metadata: extra call metadata, e.g. a W3C ("traceparent", ...) that the server's trace continues.
            priority: lower runs sooner (vLLM's convention); default 0. May preempt running requests of a higher
                value.
            tenant: whose fair share the request counts against, on a coordinator without API keys (with keys,
                the key decides); "" = this client's address.
            ttft_slo_ms: the first token is wanted within this many ms; a request that cannot make it is refused
                with DEADLINE_EXCEEDED before any compute. 0 = no objective.

        Raises:
            grpc.RpcError: the server's status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED,
                UNAUTHENTICATED, ...).
            ValueError: priority or ttft_slo_ms out of their proto ranges (int32, uint32).
        """
        call = self.stub.Generate(build_request(prompt, sampling, request_id, model, priority, tenant, ttft_slo_ms),
                                  timeout=timeout, metadata=(*self.metadata, *metadata))
        try:
            for resp in call:
                yield _convert(resp)
        finally:
            call.cancel()

    def complete(self, prompt, sampling: SamplingParams | None = None, **kw) -> Completion:
        """Run to the end and return the Completion with the whole text and token ids.

        Raises:
            grpc.RpcError: the server's status; RuntimeError: the stream ended without a final message;
            ValueError: sampling.n > 1 (`complete_samples`).
        """
        _single(sampling)
        return self.complete_samples(prompt, sampling, **kw)[0]

    def complete_samples(self, prompt, sampling: SamplingParams | None = None, **kw) -> list[Completion]:
        """Run to the end and return one Completion per sample (sampling.n of them, by index).

        Raises:
            grpc.RpcError: the server's status; RuntimeError: the stream ended before every final message.
        """
        builder = _CompletionBuilder(_num_samples(sampling))
        for chunk in self.generate(prompt, sampling, **kw):
            if (done := builder.add(chunk)) is not None:
                return done
        raise RuntimeError(_NO_FINAL)

    def abort(self, request_id: str) -> bool:
        """Abort an in-flight request by id; False when none has that id. Its stream ends with finish "abort"."""
        return self.stub.Abort(generate_pb2.AbortRequest(request_id=request_id), metadata=self.metadata).found

    def model_info(self) -> generate_pb2.ModelInfo:
        """The served model, context length, KV block size and topology."""
        return self.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client. Use with `async with` or call `await close()`. Arguments as for `Client`."""

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None,
                 api_key: str | None = None):
        self.channel = (grpc.aio.secure_channel(address, credentials) if credentials is not None
                        else grpc.aio.insecure_channel(address))
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.metadata = _auth_metadata(api_key)

    async def generate(self, prompt, sampling: SamplingParams | None = None, request_id: str = "",
                       model: str = "", timeout: float | None = None, metadata: Sequence[tuple[str, str]] = (),
                       priority: int = 0, tenant: str = "", ttft_slo_ms: int = 0) -> AsyncIterator[GenerateChunk]:
        """Stream chunks; the last one carries `final`. Leaving the loop early cancels the request. Arguments as
        for `Client.generate`."""
        call = self.stub.Generate(build_request(prompt, sampling, request_id, model, priority, tenant, ttft_slo_ms),
                                  timeout=timeout, metadata=(*self.metadata, *metadata))
        try:
            async for resp in call:
                yield _convert(resp)
        finally:
            call.cancel()

    async def complete(self, prompt, sampling: SamplingParams | None = None, **kw) -> Completion:
        """The asyncio twin of `Client.complete`."""
        _single(sampling)
        return (await self.complete_samples(prompt, sampling, **kw))[0]

    async def complete_samples(self, prompt, sampling: SamplingParams | None = None, **kw) -> list[Completion]:
        """The asyncio twin of `Client.complete_samples`."""
        builder = _CompletionBuilder(_num_samples(sampling))
        async for chunk in self.generate(prompt, sampling, **kw):
            if (done := builder.add(chunk)) is not None:
                return done
        raise RuntimeError(_NO_FINAL)

    async def abort(self, request_id: str) -> bool:
        """The asyncio twin of `Client.abort`."""
        return (await self.stub.Abort(generate_pb2.AbortRequest(request_id=request_id), metadata=self.metadata)).found

    async def model_info(self) -> generate_pb2.ModelInfo:
        """The asyncio twin of `Client.model_info`."""
        return await self.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
