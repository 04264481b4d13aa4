"""pdserve: gRPC LLM inference with disaggregated prefill and decode.

This package is the Python SDK (`Client`, `AsyncClient`, `SamplingParams`) and the `pdserve` command line. The SDK
depends only on grpcio and protobuf; the servers live in `coordinator`, `prefill_worker` and `decode_worker`.
"""
from pdserve.client import AsyncClient, Client, Completion, GenerateChunk, SamplingParams

__all__ = ["AsyncClient", "Client", "Completion", "GenerateChunk", "SamplingParams"]
