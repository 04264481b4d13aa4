"""The workers behind a coordinator: connecting to them (credentials, bounded wait) and checking they agree."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from coordinator import flow as flows
from coordinator.config import CoordinatorConfig
from coordinator.router import Router, WorkerHandle
from coordinator.validation import Limits
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from server_common.grpc_server import MAX_MESSAGE_BYTES
from server_common.security import internal_channel, read_secret


@dataclass
class Cluster:
    """The workers behind this coordinator and what they agreed on at start."""

    router: Router
    limits: Limits
    eos_token_id: int
    block_size: int
    connector: str
    flows: dict[str, flows.Flow] = field(default_factory=dict)


async def connect_worker(address: str, timeout_s: float, tls_ca: str | None, secret: str | None) -> WorkerHandle:
    """Open a channel (TLS when tls_ca is given; the cluster secret on every call) and wait, bounded, until the
    worker answers GetInfo.

    Raises:
        TimeoutError: the worker did not answer within timeout_s.
        PermissionError: the worker refused our credentials (wrong or missing cluster secret).
    """
    channel = internal_channel(address, tls_ca, secret,
                               options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    stub = worker_pb2_grpc.WorkerStub(channel)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = await stub.GetInfo(worker_pb2.WorkerInfoRequest(), timeout=5, wait_for_ready=True)
            break
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                await channel.close()
                raise PermissionError(f"worker {address} refused the coordinator: {e.details()}") from None
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
        PermissionError: a worker refused the cluster secret.
    """
    secret = read_secret(config.server.cluster_secret_file)

    async def connect(address: str) -> WorkerHandle:
        return await connect_worker(address, config.connect_timeout_s, config.worker_tls_ca, secret)

    prefill = await asyncio.gather(*(connect(a) for a in config.prefill))
    decode = await asyncio.gather(*(connect(a) for a in config.decode))
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
