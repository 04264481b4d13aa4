"""What every worker role shares: building its engine, the Worker service (GetInfo, GetStats, Abort), and serving."""
from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc
from prometheus_client import CollectorRegistry

from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.core.async_engine import AsyncEngine, Engine
from pdserve_server.engine.builder import build_engine
from pdserve_server.engine.config import CacheConfig, SchedulerConfig, compat_hash, kv_bytes_per_block
from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.core.engine_core import EngineCore
from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve_server.engine.hardware import resolve_threads, set_threads
from pdserve_server.engine.offload.redis_tier import public_url
from pdserve_server.engine.execution.kv_cache import KvShards
from pdserve_server.engine.scheduling.kv_cache_manager import (max_request_blocks, max_request_tokens,
                                                               sliding_kv_window,
                                                    usable_blocks)
from pdserve_server.engine.core.process_engine import EngineBuildError, ProcessEngine
from pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from pdserve_server.server_common.addresses import advertise_host
from pdserve_server.server_common.errors import CommandError
from pdserve_server.server_common.grpc_server import RunningServer, start_grpc_server, write_ready_file
from pdserve_server.server_common.logs import configure_logging
from pdserve_server.server_common.metrics import metrics_url, start_metrics_server
from pdserve_server.server_common.tracing import Tracing
from pdserve_server.worker_common.config import WorkerConfig
from pdserve_server.worker_common.errors import abort_with
from pdserve_server.worker_common.kv_events import KvEventLog, LagError
from pdserve_server.worker_common.metrics import WorkerMetrics
from pdserve_server.worker_common.supervisor import EngineRestarter

log = logging.getLogger(__name__)


@dataclass
class WorkerEngine:
    """A worker's running engine (a thread here or a process of its own), what it was built as, its KV cache
    memory (every rank's shard: what the KV connectors read and write) and its metrics."""

    engine: Engine
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    kv_cache: KvShards | None  # None while its engine process restarts
    registry: CollectorRegistry
    metrics: WorkerMetrics
    args: EngineArgs  # what the engine was built from (its KV events and offload tiers are read here)

    @property
    def kv_offload_blocks(self) -> int:
        """Blocks the engine's KV offload tiers hold beyond its pool: the largest bounded tier's (they are
        write-through; a Redis tier's bound is the server's, unknown here), 0 without tiers."""
        tier_bytes = max(self.args.kv_offload_cpu_bytes,
                         self.args.kv_offload_disk_bytes if self.args.kv_offload_disk_dir else 0)
        m, c = self.model_config, self.cache_config
        return tier_bytes // kv_bytes_per_block(m, c.block_size, c.tensor_parallel_size, c.cache_dtype)

    @property
    def compat_hash(self) -> str:
        return compat_hash(self.model_config, self.cache_config)

    def block_regions(self, block_id: int) -> list:
        """`KvShards.block_regions` of the engine's current cache (a restarted engine process has a new one).

        Raises:
            EngineError: ENGINE_DIED while the engine process restarts (no cache to read or write).
        """
        if self.kv_cache is None:
            raise EngineError(ErrorKind.ENGINE_DIED, "the engine process is restarting; its KV cache is gone")
        return self.kv_cache.block_regions(block_id)


async def start_engine(config: WorkerConfig) -> WorkerEngine:
    """Build the model and KV cache and start the engine's loop: in a process of its own (`config.engine_process`)
    or on a thread of this one, on the running event loop.

    Raises:
        CommandError: the engine could not be built (a missing model, a config or flag it cannot serve, kernels
            that do not load) or its process failed to start: the message, for a one-line error.
    """
    # This process's own torch work (the KV copies; loading too, without an engine process) runs on one thread: the
    # engine's loop gets the intra-op threads, and no process holds two OpenMP pools (`set_threads` says why that
    # doubled a 2-thread step).
    set_threads(1)
    # A prefill worker never runs an all-decode step: capturing decode graphs there would only cost start-up time.
    args = replace(config.engine, enforce_eager=True) if config.role == "prefill" else config.engine
    engine: Engine
    if config.engine_process:
        engine = ProcessEngine(args, threads=config.engine.threads,
                               log_setup=functools.partial(configure_logging, config.log_level, config.log_format),
                               max_unread_tokens=config.max_unread_tokens)
        try:
            await engine.start()
        except (EngineBuildError, RuntimeError) as e:  # EngineBuildError: the build's own error, over there
            raise CommandError(str(e)) from None
        assert engine.model_config and engine.cache_config and engine.scheduler_config and engine.kv is not None
        model, cache, sched = engine.model_config, engine.cache_config, engine.scheduler_config
        kv_cache = engine.kv
    else:
        if args.tensor_parallel_size > 1:  # the ranks are the engine process's children (`engine.core.ranks`)
            raise CommandError("--tensor-parallel-size > 1 needs the engine process (drop --no-engine-process)")
        try:
            parts = build_engine(args)
        except (OSError, ValueError) as e:
            raise CommandError(str(e)) from None
        engine = AsyncEngine(lambda emit, on_fault: EngineCore(parts.scheduler, parts.runner, emit, on_fault,
                                                               threads=config.engine.threads),
                             max_unread_tokens=config.max_unread_tokens)
        engine.start()
        model, cache, sched = parts.model_config, parts.cache_config, parts.scheduler_config
        kv_cache = KvShards(model, cache, [parts.runner.kv_cache.kv])
    registry = CollectorRegistry()
    name = config.served_model_name or model.name
    return WorkerEngine(engine, model, cache, sched, kv_cache, registry,
                        WorkerMetrics(registry, engine, name, config.role), args)


def describe(config: WorkerConfig, worker: WorkerEngine, ready: dict[str, str]) -> str:
    """What this worker runs with, for its start-up log line: what `--dtype auto` and a threads count of 0 resolved
    to, the KV pool (blocks, tokens, bytes), the limits, and the ready file's extra fields (KV address,
    connector); a mock engine says so first."""
    m, c, s, e = worker.model_config, worker.cache_config, worker.scheduler_config, config.engine
    threads = resolve_threads(e.threads)
    weights = m.dtype + (f" + {e.quantization} linears" if e.quantization != "none" else "")
    if e.mock_engine:  # nothing is computed: say whose step times it plays, and how fast
        weights = f"MOCK ENGINE (step times of {e.mock_engine} x{e.mock_speedup:g} speed)"
    pool_bytes = c.num_blocks * kv_bytes_per_block(m, c.block_size, c.tensor_parallel_size, c.cache_dtype)
    tiers = [f"host memory {e.kv_offload_cpu_bytes / 2**20:.0f} MiB"] if e.kv_offload_cpu_bytes else []
    if e.kv_offload_disk_dir:
        tiers.append(f"disk {e.kv_offload_disk_dir} {e.kv_offload_disk_bytes / 2**30:.1f} GiB")
    if e.kv_offload_redis_url:
        tiers.append(f"Redis {public_url(e.kv_offload_redis_url)}")
    extra = (f"; KV offload to {' and '.join(tiers)}" if tiers else "") \
        + "".join(f", {k} {v}" for k, v in ready.items() if v)
    return (f"model {m.name}, {weights} on {e.device}, {threads} threads"
            f"{f', tensor parallel {c.tensor_parallel_size}' if c.tensor_parallel_size > 1 else ''}; KV pool "
            f"{c.num_blocks} blocks x {c.block_size} tokens = {c.num_blocks * c.block_size} tokens "
            f"({c.dtype_name(m)}, {pool_bytes / 2**20:.1f} MiB"
            f"{', sized from free memory' if e.kv_tokens is None and e.kv_bytes is None else ''}); "
            f"context {s.max_model_len} tokens, up to "
            f"{s.max_num_seqs} sequences and {s.max_num_batched_tokens} tokens a step"
            f"{f' (a burst of arrivals up to {s.burst_prefill_tokens} in one)' if s.bursts else ''}{extra}")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """GetInfo / GetStats / Abort / SubscribeKvEvents over a worker's engine.

    kv_events: the worker's KV event log, fed from its engine (`EngineArgs.kv_events`); None when it publishes
    none."""

    def __init__(self, role: str, worker: WorkerEngine, kv_address: str = "", kv_connector: str = ""):
        self.role, self.worker = role, worker
        self.kv_address, self.kv_connector = kv_address, kv_connector
        self.instance_id = uuid.uuid4().hex  # tells a restart at the same address from a long-lived process
        self.kv_events: KvEventLog | None = None
        if worker.args.kv_events:
            self.kv_events = KvEventLog(worker.cache_config.block_size, lambda: self.instance_id)
            worker.engine.add_kv_event_listener(self.kv_events.publish)

    def info(self) -> worker_pb2.WorkerInfo:
        m, c, s = self.worker.model_config, self.worker.cache_config, self.worker.scheduler_config
        window = sliding_kv_window(m.layer_windows)
        blocks = usable_blocks(c.num_blocks, window)  # what requests can hold
        return worker_pb2.WorkerInfo(
            role=self.role, model=m.name, compat_hash=self.worker.compat_hash, block_size=c.block_size,
            num_blocks=blocks, context_length=s.max_model_len, vocab_size=m.vocab_size,
            eos_token_id=m.eos_token_ids[0] if m.eos_token_ids else 0, kv_address=self.kv_address,
            kv_connector=self.kv_connector,
            max_request_tokens=max_request_tokens(c.num_blocks, c.block_size, window, s.max_model_len),
            instance_id=self.instance_id, tensor_parallel_size=c.tensor_parallel_size, kv_sliding_window=window,
            token_streams=self.role != "prefill",
            max_request_blocks=max_request_blocks(c.num_blocks, c.block_size, window, s.max_num_batched_tokens),
            kv_events=self.kv_events is not None, kv_offload_blocks=self.worker.kv_offload_blocks)

    async def GetInfo(self, request, context):
        return self.info()

    async def GetStats(self, request, context):
        """The worker's load (what routers use) and pool counts, from the scheduler's stats object.

        Routers' polls get the stats the engine published after its last iteration, at once: a poll must not wait
        behind a long step (a CPU prefill step can take seconds) and be taken for a dead worker. With
        check_integrity the stats and the pool's integrity check are taken together on the engine thread (UNAVAILABLE
        while the engine process is dead)."""
        engine = self.worker.engine
        if request.check_integrity:
            try:
                stats, integrity_ok = await engine.snapshot()
            except EngineError as e:
                await abort_with(context, e)
        else:
            stats, integrity_ok = engine.stats, True
        return worker_pb2.WorkerStats(
            num_total_blocks=stats.num_total_blocks, num_free_blocks=stats.num_free_blocks,
            num_cached_blocks=stats.num_cached_blocks, num_running=stats.num_running,
            num_waiting=stats.num_waiting, num_requests=stats.num_requests, num_steps=stats.num_steps,
            prefix_cache_hit_tokens=stats.prefix_cache_hit_tokens,
            prefix_cache_query_tokens=stats.prefix_cache_query_tokens, pool_integrity_ok=integrity_ok,
            instance_id=self.instance_id)

    async def Abort(self, request, context):
        """Abort a request this worker holds; found is False for an unknown id and for a prefill-done request whose
        KV is being sent (`engine_core.Abort`: cancel the coordinator's request instead). UNAVAILABLE while the
        engine process is dead (its requests have failed already)."""
        engine = self.worker.engine
        rid = request.request_id
        try:
            found = await engine.abortable(rid)
        except EngineError as e:
            await abort_with(context, e)
        engine.abort(rid)
        return generate_pb2.AbortResponse(found=found)

    async def SubscribeKvEvents(self, request, context):
        """The worker's KV event batches from request.start_sequence_number on (`KvEventLog.subscribe`), until the
        caller leaves. FAILED_PRECONDITION on a worker started without --kv-events; OUT_OF_RANGE when the batches
        asked for are gone or the caller fell too far behind (resubscribe)."""
        if self.kv_events is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker publishes no KV events: start it with --kv-events")
        try:
            async for batch in self.kv_events.subscribe(request.start_sequence_number):
                yield batch
        except LagError as e:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))


async def serve_worker(config: WorkerConfig, worker: WorkerEngine, servicer: WorkerServicer,
                       add_role: Callable[[grpc.aio.Server], None], role_service: str, secret: str | None,
                       tracing: Tracing, on_drain: Callable[[], None] | None = None, **ready: str) -> None:
    """Serve the Worker service plus the role's own until cancelled, then stop the server and the engine. An engine
    fault ends it too: readiness and liveness NOT_SERVING, the drain of a SIGTERM, then CommandError.

    Args:
        add_role: registers the role's servicer (Prefill or Decode) on the server.
        role_service: its full name, e.g. "pdserve.v1.Prefill" (for health and reflection).
        secret: the cluster secret callers must present (None: no authentication).
        tracing: the process's tracing (its server interceptors continue the coordinator's traces).
        on_drain: called as a SIGTERM's drain starts (`RunningServer.serve_until_cancelled`).
        ready: extra fields for the ready file (e.g. kv_address).

    An engine process that dies is restarted in place instead when `config.engine_restart` is on
    (`EngineRestarter`).

    Raises:
        CommandError: the engine faulted (its message); the process should exit non-zero and be restarted.
    """
    def add(server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        add_role(server)

    running: RunningServer = await start_grpc_server(config.server, add, ["pdserve.v1.Worker", role_service],
                                                     tokens=[secret] if secret else [], what="cluster secret",
                                                     interceptors=tracing.server_interceptors())

    pending: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
    serving_task = asyncio.current_task()
    assert serving_task is not None
    faults: list[str] = []
    engine = worker.engine
    def set_kv_cache(kv: KvShards | None) -> None:
        worker.kv_cache = kv
        if kv is None and servicer.kv_events is not None:
            servicer.kv_events.cleared()  # the restarted engine starts with an empty prefix cache

    restarter = (EngineRestarter(engine, running.set_serving, set_kv_cache,
                                 lambda instance: setattr(servicer, "instance_id", instance),
                                 stopping=lambda: serving_task.cancelling() > 0)
                 if config.engine_restart and isinstance(engine, ProcessEngine) else None)

    def on_fault(message: str) -> None:
        """The engine cannot be trusted any more: stop taking traffic, drain as on SIGTERM, then exit non-zero
        (below), so `serve --restart` or the orchestrator restarts the worker. A live process that only
        reported NOT_SERVING was never restarted by anything but a liveness probe. A dead engine process is
        restarted in place instead when asked (its requests have failed already)."""
        if restarter is not None and isinstance(engine, ProcessEngine) and engine.died is not None:
            restarter.restart(message)
            return
        log.error("engine fault (%s): draining, then exiting for a restart", message)
        faults.append(message)
        task = asyncio.get_running_loop().create_task(running.set_live(False))
        pending.add(task)
        task.add_done_callback(pending.discard)
        serving_task.cancel()

    worker.engine.add_fault_listener(on_fault)
    address = f"{advertise_host(config.server.host, config.server.advertise_host)}:{running.port}"
    log.info("%s worker serving on %s: %s", config.role, address, describe(config, worker, ready))
    metrics = (start_metrics_server(config.server.host, config.server.metrics_port, worker.registry)
               if config.server.metrics_port is not None else None)
    write_ready_file(config.server.ready_file, address, tls=config.server.tls, **ready,
                     **metrics_url(config.server, metrics))
    try:
        await running.serve_until_cancelled(config.server.drain_timeout_s,
                                            in_flight=lambda: len(worker.engine.streams), on_drain=on_drain)
    except asyncio.CancelledError:
        if not faults:
            raise
        raise CommandError(f"engine fault ({faults[0]}); the worker exited so that it is restarted") from None
    finally:
        if restarter is not None:
            restarter.cancel()
        worker.engine.stop()
        if metrics is not None:
            metrics.close()
