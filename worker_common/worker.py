"""Process bootstrap and the Worker service (GetInfo, GetStats, Abort) common to every worker role."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.async_engine import AsyncEngine
from engine.builder import EngineArgs, EngineParts, build_engine, set_threads
from engine.config import compat_hash
from engine.engine_core import EngineCore
from engine.scheduler import Scheduler
from pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """Configuration of one worker process, read once from the CLI.

    Attributes:
        role: "prefill", "decode" or "colocated".
        host, port: gRPC bind address (port 0 picks a free one; see ready_file).
        engine: engine knobs.
        threads: torch intra-op threads (0 = torch default).
        connector: KV connector for decode workers: "auto", "ucx" or "tcp".
        kv_timeout_s: decode: how long reserved blocks wait for the KV (the lease), seconds.
        transfer_timeout_s: bound on one request's KV transfer, seconds.
        ready_file: where to write {"address": ...} once serving (for launchers and tests).
        random_weights: build the model from its config with random weights (tests and GPU-less benchmarks).
    """

    role: str
    engine: EngineArgs
    host: str = "127.0.0.1"
    port: int = 0
    threads: int = 1
    connector: str = "auto"
    kv_timeout_s: float = 60.0
    transfer_timeout_s: float = 30.0
    ready_file: str | None = None
    random_weights: bool = False


def build_async_engine(config: WorkerConfig) -> tuple[AsyncEngine, EngineParts]:
    set_threads(config.threads)
    parts = build_engine(config.engine, random_weights=config.random_weights)
    engine = AsyncEngine(lambda emit: EngineCore(parts.scheduler, parts.runner, emit))
    return engine, parts


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """GetInfo / GetStats / Abort over an AsyncEngine."""

    def __init__(self, role: str, engine: AsyncEngine, parts: EngineParts, kv_address: str = "",
                 kv_connector: str = ""):
        self.role, self.engine, self.parts = role, engine, parts
        self.kv_address, self.kv_connector = kv_address, kv_connector

    def info(self) -> worker_pb2.WorkerInfo:
        m, c, s = self.parts.model_config, self.parts.cache_config, self.parts.scheduler_config
        return worker_pb2.WorkerInfo(
            role=self.role, model=m.name, compat_hash=compat_hash(m, c), block_size=c.block_size,
            num_blocks=c.num_blocks, context_length=s.max_model_len, vocab_size=m.vocab_size,
            eos_token_id=m.eos_token_ids[0] if m.eos_token_ids else 0, kv_address=self.kv_address,
            kv_connector=self.kv_connector, max_request_tokens=min(s.max_model_len, c.num_blocks * c.block_size))

    async def GetInfo(self, request, context):
        return self.info()

    async def GetStats(self, request, context):
        def snapshot(s: Scheduler) -> worker_pb2.WorkerStats:
            pool = s.kv.pool
            return worker_pb2.WorkerStats(
                num_total_blocks=pool.num_blocks, num_free_blocks=pool.num_free_blocks,
                num_cached_blocks=pool.num_cached_free_blocks, num_running=len(s.running),
                num_waiting=len(s.waiting) + len(s.reserving), num_requests=s.num_requests(),
                num_steps=self.engine.core.num_steps, prefix_cache_hit_tokens=s.kv.prefix_hit_tokens,
                prefix_cache_query_tokens=s.kv.prefix_query_tokens, pool_integrity_ok=not pool.check_integrity())
        return await self.engine.call(snapshot)

    async def Abort(self, request, context):
        found = await self.engine.call(lambda s: request.request_id in s.requests)
        self.engine.abort(request.request_id)
        return generate_pb2.AbortResponse(found=found)


async def start_grpc_server(host: str, port: int, add_servicers,
                            service_names: list[str]) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server with health checking and reflection; returns (server, bound port).

    add_servicers(server) registers the role's services. Health reports SERVING for "" and each service name.
    """
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    add_servicers(server)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for name in ["", *service_names]:
        await _set_serving(health_servicer, name)
    return server, port


async def _set_serving(servicer, name: str) -> None:
    result = servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if hasattr(result, "__await__"):
        await result


def write_ready_file(path: str | None, address: str, **extra) -> None:
    """Atomically write {"address": address, ...} so a launcher polling the file never reads half of it."""
    if not path:
        return
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid(), **extra}))
    tmp.rename(path)
