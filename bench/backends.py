"""Clients the load generator drives: pdserve's gRPC `Generate` stream and any OpenAI-compatible HTTP server
(`/v1/completions` with `stream: true`: vLLM, llama.cpp's llama-server, `transformers serve`, and the naive
baseline in `naive_server.py`). Each turns one request into a `RequestResult` of client-side timestamps."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from prompts import BenchRequest


@dataclass
class RequestResult:
    """Client-side timing of one request (seconds, `time.perf_counter` clock).

    Attributes:
        start: request sent.
        chunk_times: arrival time of every streamed chunk that carried at least one token.
        output_tokens: tokens generated (server-reported when available, else counted).
        end: stream closed.
        error: "" on success, else the error text.
    """

    start: float
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    end: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.chunk_times)


class PdserveBackend:
    """Streams `Generate` from a pdserve coordinator with token-id prompts and ignore_eos (exact output length)."""

    def __init__(self, address: str):
        from pdserve import AsyncClient

        self.client = AsyncClient(address)

    async def run(self, req: BenchRequest) -> RequestResult:
        from pdserve import SamplingParams

        res = RequestResult(start=time.perf_counter())
        params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
        try:
            async for chunk in self.client.generate(req.prompt_ids, params):
                if chunk.token_ids:
                    res.chunk_times.append(time.perf_counter())
                    res.output_tokens += len(chunk.token_ids)
                if chunk.final is not None:
                    res.output_tokens = chunk.final.completion_tokens
        except Exception as e:  # grpc.aio.AioRpcError and transport errors: recorded, the run goes on
            res.error = f"{type(e).__name__}: {e}"
        res.end = time.perf_counter()
        return res

    async def close(self) -> None:
        await self.client.close()


class OpenAIBackend:
    """Streams `/v1/completions` (SSE) with token-id prompts; asks for usage in the last event and for ignore_eos
    (vLLM, llama.cpp and the naive baseline honour it; others may stop early: output_tokens then says so)."""

    def __init__(self, base_url: str, model: str):
        import httpx

        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0),
                                      limits=httpx.Limits(max_connections=1024))

    async def run(self, req: BenchRequest) -> RequestResult:
        body = {"model": self.model, "prompt": req.prompt_ids, "max_tokens": req.output_len, "temperature": 0.0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        res = RequestResult(start=time.perf_counter())
        counted = 0
        try:
            async with self.http.stream("POST", self.url, json=body) as resp:
                if resp.status_code != 200:
                    res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or res.error:
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("choices") and event["choices"][0].get("text"):
                        res.chunk_times.append(time.perf_counter())
                        counted += 1
                    if event.get("usage"):
                        res.output_tokens = event["usage"].get("completion_tokens", 0)
        except Exception as e:  # httpx transport errors, malformed events: recorded, the run goes on
            res.error = f"{type(e).__name__}: {e}"
        res.output_tokens = res.output_tokens or counted
        res.end = time.perf_counter()
        return res

    async def close(self) -> None:
        await self.http.aclose()
