"""The Decode gRPC service and the decode / colocated worker process."""
from __future__ import annotations

import asyncio
import logging

import grpc

from decode_worker.reservations import Reservations, ReservationState
from engine.async_engine import AsyncEngine
from engine.config import compat_hash
from engine.outputs import Reserved, RequestFailed, TokenOutput
from engine.request import Request
from engine.transfer import available_backends, get_backend
from engine.transfer.protocol import KvReceiver, KvSender
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from worker_common.convert import FINISH_REASON_TO_PROTO, sampling_from_proto, token_to_proto
from worker_common.worker import (WorkerConfig, WorkerServicer, build_async_engine, start_grpc_server,
                                  write_ready_file)

log = logging.getLogger(__name__)


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    """Reserve -> wait for KV (bounded by the lease) -> join the running batch -> stream tokens."""

    def __init__(self, engine: AsyncEngine, reservations: Reservations, eos_token_ids: tuple[int, ...],
                 kv_timeout_s: float):
        self.engine, self.reservations = engine, reservations
        self.eos_token_ids, self.kv_timeout_s = eos_token_ids, kv_timeout_s

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        remote = request.kv_source == worker_pb2.KV_SOURCE_REMOTE
        req = Request(rid, list(request.prompt_token_ids), sampling_from_proto(request.sampling),
                      eos_token_ids=self.eos_token_ids, remote_kv=remote)
        events = self.engine.add_request(req)
        finished = False
        try:
            if remote:
                ev = await events.get()
                if isinstance(ev, RequestFailed):
                    finished = True  # rejected at admission: the engine holds nothing
                    await context.abort(grpc.StatusCode[ev.code], ev.message)
                assert isinstance(ev, Reserved)
                reservation = self.reservations.add(rid, ev.block_ids)
                yield worker_pb2.DecodeResponse(reserved=worker_pb2.DecodeReserved(num_blocks=len(ev.block_ids)))
                await self._wait_for_kv(rid, reservation, request, context)
                self.engine.kv_arrived(rid, reservation.first_token)
            else:
                yield worker_pb2.DecodeResponse(reserved=worker_pb2.DecodeReserved())
            while True:
                batch = [await events.get()]
                while not events.empty():  # coalesce tokens produced while we were sending
                    batch.append(events.get_nowait())
                tokens, done, cached = [], None, 0
                for ev in batch:
                    if isinstance(ev, RequestFailed):
                        finished = True  # the engine already dropped it
                        await context.abort(grpc.StatusCode[ev.code], ev.message)
                    tokens.append(token_to_proto(ev.token))
                    cached = max(cached, ev.num_cached_tokens)
                    if ev.finish_reason is not None:
                        done = ev
                if tokens:
                    yield worker_pb2.DecodeResponse(tokens=worker_pb2.DecodeTokens(
                        tokens=tokens, num_cached_tokens=cached))
                if done is not None:
                    finished = True
                    msg = worker_pb2.DecodeFinished(finish_reason=FINISH_REASON_TO_PROTO[done.finish_reason])
                    if done.stop_token_id is not None:
                        msg.stop_token_id = done.stop_token_id
                    yield worker_pb2.DecodeResponse(finished=msg)
                    return
        finally:
            self.reservations.release(rid, finished)
            if not remote and not finished:
                self.engine.abort(rid)
            self.engine.forget(rid)

    async def _wait_for_kv(self, rid: str, reservation, request, context) -> None:
        """Wait for the receiver to settle the reservation; the lease bounds the wait unless bytes are flowing."""
        lease_s = request.kv_timeout_ms / 1e3 if request.kv_timeout_ms else self.kv_timeout_s
        try:
            await asyncio.wait_for(reservation.settled.wait(), lease_s)
        except TimeoutError:
            if reservation.state != ReservationState.RECEIVING:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"KV for {rid} did not arrive within the {lease_s:.1f}s lease; blocks freed")
            await reservation.settled.wait()  # receiving: the receiver's own timeout bounds this
        if reservation.state == ReservationState.FAILED:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer for {rid} failed: {reservation.error}")


async def choose_backend(name: str, compat: str, host: str, device: str):
    """Resolve 'auto': ucx when the KV cache is on a GPU and ucxx completes a loopback handshake, else tcp.

    On CPU-only hosts ucx is not picked: UCX's TCP path is slower than plain TCP on loopback (DESIGN.md §5), and
    we saw ucxx abort the process when many in-flight endpoints were cancelled at once (100 concurrent
    client cancellations). UCX's value is GPU memory (cuda_ipc/cuda_copy) and RDMA. Logs the pick and why.
    """
    if name != "auto":
        return get_backend(name)
    if not device.startswith("cuda"):
        log.info("KV connector auto -> tcp (CPU KV cache: ucx brings no transport benefit here)")
        return get_backend("tcp")
    if "ucx" in available_backends():
        try:
            backend = get_backend("ucx")
            probe = KvReceiver(backend, compat, lambda b: None, sink=None)  # type: ignore[arg-type]
            address = await probe.start(host)
            sender = KvSender(compat, lambda b: None, timeout_s=10)
            try:
                ch = await asyncio.wait_for(sender._checkout(address), 10)
                ch.close()
            finally:
                sender.close()
                probe.close()
            log.info("KV connector auto -> ucx (handshake ok)")
            return backend
        except Exception as e:  # noqa: BLE001 - any failure means "not usable here"
            log.warning("KV connector auto: ucx unusable (%s); using tcp", e)
    else:
        log.info("KV connector auto -> tcp (ucxx not installed)")
    return get_backend("tcp")


async def serve(config: WorkerConfig) -> None:
    """Run a decode worker (role 'decode') or a colocated worker (role 'colocated') until cancelled."""
    engine, parts = build_async_engine(config)
    engine.start()
    reservations = Reservations(engine)
    compat = compat_hash(parts.model_config, parts.cache_config)
    receiver = None
    kv_address = connector = ""
    if config.role == "decode":
        backend = await choose_backend(config.connector, compat, config.host, config.engine.device)
        receiver = KvReceiver(backend, compat, parts.runner.kv_cache.block_bytes, reservations,
                              timeout_s=config.transfer_timeout_s)
        kv_address, connector = await receiver.start(config.host), backend.name
    worker = WorkerServicer(config.role, engine, parts, kv_address=kv_address, kv_connector=connector)

    def add(server):
        worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
        worker_pb2_grpc.add_DecodeServicer_to_server(
            DecodeServicer(engine, reservations, parts.model_config.eos_token_ids, config.kv_timeout_s), server)

    server, port = await start_grpc_server(config.host, config.port, add, ["pdserve.v1.Worker", "pdserve.v1.Decode"])
    address = f"{config.host}:{port}"
    log.info("%s worker serving on %s (KV %s via %s, %d blocks of %d tokens)", config.role, address,
             kv_address or "-", connector or "-", parts.cache_config.num_blocks, parts.cache_config.block_size)
    write_ready_file(config.ready_file, address, kv_address=kv_address)
    try:
        await server.wait_for_termination()
    finally:
        if receiver is not None:
            receiver.close()
        await server.stop(grace=1)
        engine.stop()
