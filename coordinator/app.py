"""The coordinator process: it finds the workers, then serves every public door on one port over the one request
path (`coordinator.request_path`): pdserve.v1.Generation (`coordinator.doors.generation`), vLLM's engine service
for the smg gateway (`coordinator.doors.vllm_engine`) and KServe v2 (`coordinator.doors.kserve`)."""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from prometheus_client import CollectorRegistry

from pdserve_server.coordinator.capacity import CapacityPlanner
from pdserve_server.coordinator.config import CoordinatorConfig
from pdserve_server.coordinator.kv_relay import KvEventRelay
from pdserve_server.coordinator.membership import Cluster, Membership
from pdserve_server.coordinator.metrics import CoordinatorMetrics
from pdserve_server.coordinator.router import LocalPrefillPolicy, Router
from pdserve_server.coordinator.scheduling import read_tenants
from pdserve_server.coordinator.request_path import RequestPath
from pdserve_server.coordinator.tokenizer import Tokenizer
from pdserve_server.coordinator.validation import request_bytes_limit
from pdserve_server.coordinator.doors import kserve
from pdserve_server.coordinator.doors.generation import GenerationServicer
from pdserve_server.coordinator.doors.vllm_engine import SERVICE_NAME as VLLM_ENGINE_SERVICE, VllmEngineServicer
from pdserve.v1 import generate_pb2_grpc
from pdserve_server.server_common.addresses import advertise_host
from pdserve_server.server_common.errors import CommandError
from pdserve_server.server_common.grpc_server import start_grpc_server, write_ready_file
from pdserve_server.server_common.metrics import metrics_url, start_metrics_server
from pdserve_server.server_common.security import key_id, read_api_keys
from pdserve_server.server_common.tracing import Tracing
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

log = logging.getLogger(__name__)


def _add_servicers(server: grpc.aio.Server, path: RequestPath) -> None:
    """Every door over the one request path: our public API, vLLM's engine service (for the smg gateway) and KServe
    v2's (for tritonclient and other Triton clients)."""
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(path), server)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(path), server)
    kserve.add_to_server(kserve.KServeServicer(path), server)


def _capacity_planner(config: CoordinatorConfig, registry: CollectorRegistry,
                      cluster: Cluster) -> CapacityPlanner | None:
    """The planner's gauges for an autoscaler (`coordinator.capacity`) when --planner-profile names a profile.

    Raises:
        CommandError: an unknown profile (the message lists the shipped ones).
    """
    if not config.planner_profile:
        return None
    try:
        return CapacityPlanner(config.planner_profile, config.planner_ttft_ms, config.planner_itl_ms,
                               config.planner_max_workers, config.planner_window_s, registry, config.model_name,
                               pool_tokens=lambda: _decode_pool_tokens(cluster))
    except ValueError as e:
        raise CommandError(f"--planner-profile: {e}") from None


def _decode_pool_tokens(cluster: Cluster) -> int | None:
    """The smallest live decode worker's KV pool, tokens; None while no decode worker's info is known."""
    pools = [w.info.num_blocks * w.info.block_size for w in cluster.router.live("decode") if w.info is not None]
    return min(pools) if pools else None


async def serve(config: CoordinatorConfig) -> None:
    """Find live workers, then serve the public API until cancelled (SIGTERM drains).

    Serves pdserve.v1.Generation and, on the same port, vllm.grpc.engine.VllmEngine (`coordinator.doors.vllm_engine`)
    and inference.GRPCInferenceService (KServe v2, `coordinator.doors.kserve`).
    Health tells the truth: readiness ("" and both services) is SERVING only while requests can be served
    (`Cluster.ready`: decode workers that may prefill locally keep it SERVING without a prefill worker), and
    follows membership changes; liveness stays SERVING while the process runs.

    Raises:
        CommandError: no live worker of a needed role within config.connect_timeout_s.
    """
    tenants = read_tenants(config.tenant_weights)  # a typo fails the start, before any wait
    tracing = Tracing.from_env("pdserve-coordinator")
    cluster = Cluster(Router(), config.colocated,
                      LocalPrefillPolicy(config.local_prefill_tokens, config.local_prefill_fallback,
                                         config.local_prefill_queue))
    registry = CollectorRegistry()
    capacity = _capacity_planner(config, registry, cluster)  # likewise an unknown profile
    if config.kv_events_relay:  # before the followers start: the relay sees every batch they apply
        cluster.router.prefixes.relay = KvEventRelay()
    membership = Membership(config, cluster, interceptors=tracing.client_interceptors())
    await membership.wait_ready(config.connect_timeout_s)
    tokenizer = await asyncio.to_thread(Tokenizer, config.model_dir)
    api_keys = read_api_keys(config.api_keys_file)
    path = RequestPath(config, cluster, tokenizer, CoordinatorMetrics(registry, config.model_name),
                       on_worker_lost=membership.report_lost, keys_required=bool(api_keys), tenants=tenants,
                       on_finished=capacity.observe if capacity is not None else lambda record: None)
    if api_keys:  # the names --tenant-weights (and the access log's refusals) know the keys by
        log.info("API keys: %d, ids %s", len(api_keys), ", ".join(sorted({key_id(k) for k in api_keys})))
    metrics = (start_metrics_server(config.server.host, config.server.metrics_port, registry)
               if config.server.metrics_port is not None else None)
    max_request_bytes = (config.max_request_bytes
                         or request_bytes_limit(cluster.limits, tokenizer.max_chars_per_token))
    running = await start_grpc_server(
        config.server, lambda server: _add_servicers(server, path),
        ["pdserve.v1.Generation", VLLM_ENGINE_SERVICE, kserve.SERVICE_NAME], tokens=api_keys, what="API key",
        interceptors=tracing.server_interceptors(), max_receive_bytes=max_request_bytes,
        reuse_port=config.reuse_port)
    pending: set[asyncio.Task] = set()

    def follow_membership() -> None:
        if not cluster.ready:
            log.warning("no live %s worker: reporting NOT_SERVING", " or ".join(cluster.missing_roles()))
        elif not cluster.complete:
            log.warning("no live prefill worker: decode workers prefill locally until one is back")
        task = asyncio.get_running_loop().create_task(running.set_serving(cluster.ready))
        pending.add(task)
        task.add_done_callback(pending.discard)

    membership.on_change = follow_membership
    path.metrics.track_workers(cluster.router.live)
    address = f"{advertise_host(config.server.host, config.server.advertise_host)}:{running.port}"
    log.info("coordinator serving %s on %s (%s, %d prefill / %d decode workers live, connector %s, requests up to "
             "%d bytes)", config.model_name, address, "colocated" if config.colocated else "disaggregated",
             len(cluster.router.live("prefill")), len(cluster.router.live("decode")), cluster.connector or "-",
             max_request_bytes)
    write_ready_file(config.server.ready_file, address, tls=config.server.tls,
                     **metrics_url(config.server, metrics))
    poller = asyncio.create_task(membership.run())
    planner = asyncio.create_task(capacity.run()) if capacity is not None else None
    try:
        await running.serve_until_cancelled(config.server.drain_timeout_s, in_flight=lambda: len(cluster.flows),
                                            cut=lambda: [f.shut_down() for f in list(cluster.flows.values())])
    finally:
        for task in (poller, planner):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await membership.close()
        if metrics is not None:
            metrics.close()
        tracing.shutdown()
