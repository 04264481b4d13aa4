"""pdserve-client: the Python SDK for a pdserve coordinator (grpcio + protobuf only).

`pdserve.v1` holds the generated stubs (nothing else); `pdserve.client` is the SDK built on them. The servers and
the `pdserve` command line are a separate distribution and are never imported from here.
"""
from pdserve.client import (AsyncClient, Choices, Client, Completion, GenerateChunk, SamplingParams, StructuredOutput,
                            tls_credentials)

__all__ = ["AsyncClient", "Choices", "Client", "Completion", "GenerateChunk", "SamplingParams", "StructuredOutput",
           "tls_credentials"]
