"""The Prefill gRPC service and the prefill worker process."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engine.async_engine import AsyncEngine
from engine.config import compat_hash
from engine.outputs import RequestFailed, TokenOutput
from engine.request import FinishReason, Request
from engine.transfer.protocol import KvSender, TransferError
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from worker_common.convert import FINISH_REASON_TO_PROTO, sampling_from_proto, token_to_proto
from worker_common.worker import (WorkerConfig, WorkerServicer, build_async_engine, start_grpc_server,
                                  write_ready_file)

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    """Runs a prompt to its first token, then sends the held KV blocks and releases them.

    Block ownership: the engine holds a prefill-done request's blocks (status HELD) until this handler aborts it
    in its finally — after the transfer succeeded, failed, was rejected, or the call was cancelled.
    """

    def __init__(self, engine: AsyncEngine, sender: KvSender, eos_token_ids: tuple[int, ...]):
        self.engine, self.sender, self.eos_token_ids = engine, sender, eos_token_ids

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        req = Request(rid, list(request.prompt_token_ids), sampling_from_proto(request.sampling),
                      eos_token_ids=self.eos_token_ids, prefill_only=True,
                      arrival_time=request.arrival_time or time.time())
        events = self.engine.add_request(req)
        try:
            ev = await events.get()
            if isinstance(ev, RequestFailed):
                await context.abort(grpc.StatusCode[ev.code], ev.message)
            assert isinstance(ev, TokenOutput)
            held = ev.finish_reason == FinishReason.PREFILL_DONE
            first = worker_pb2.PrefillFirstToken(
                token=token_to_proto(ev.token), num_cached_tokens=ev.num_cached_tokens, queue_ms=ev.queue_ms,
                prefill_ms=ev.prefill_ms, finished=not held)
            if not held:
                first.finish_reason = FINISH_REASON_TO_PROTO[ev.finish_reason]
                if ev.stop_token_id is not None:
                    first.stop_token_id = ev.stop_token_id
            yield worker_pb2.PrefillResponse(first_token=first)
            if not held or not request.kv_address:
                return
            try:
                stats = await self.sender.send(request.kv_address, rid, ev.token.token_id, ev.block_ids or [],
                                               len(request.prompt_token_ids))
            except TransferError as e:
                log.warning("transfer of %s failed: %s", rid, e)
                await context.abort(grpc.StatusCode[e.code], str(e))
            yield worker_pb2.PrefillResponse(transfer_done=worker_pb2.PrefillTransferDone(
                num_bytes=stats.num_bytes, num_blocks=stats.num_blocks, transfer_ms=stats.seconds * 1e3))
        finally:
            # Frees HELD blocks, or a request still queued/running when the call was cancelled. Idempotent.
            self.engine.abort(rid)
            self.engine.forget(rid)


async def serve(config: WorkerConfig) -> None:
    """Run a prefill worker until cancelled."""
    engine, parts = build_async_engine(config)
    engine.start()
    sender = KvSender(compat_hash(parts.model_config, parts.cache_config), parts.runner.kv_cache.block_bytes,
                      timeout_s=config.transfer_timeout_s)
    worker = WorkerServicer("prefill", engine, parts)

    def add(server):
        worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
        worker_pb2_grpc.add_PrefillServicer_to_server(
            PrefillServicer(engine, sender, parts.model_config.eos_token_ids), server)

    server, port = await start_grpc_server(config.host, config.port, add, ["pdserve.v1.Worker", "pdserve.v1.Prefill"])
    address = f"{config.host}:{port}"
    log.info("prefill worker serving on %s (%d KV blocks of %d tokens)", address, parts.cache_config.num_blocks,
             parts.cache_config.block_size)
    write_ready_file(config.ready_file, address)
    try:
        await server.wait_for_termination()
    finally:
        sender.close()
        await server.stop(grace=1)
        engine.stop()
