"""The Prefill gRPC service and the prefill worker process."""
from __future__ import annotations

import logging
import time

import grpc

from engine.errors import EngineError, ErrorKind
from engine.request import FinishReason, Request
from engine.transfer import release_transports
from engine.transfer.protocol import KvSender, TransferError
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from server_common.security import read_secret
from server_common.tracing import Tracing, inject_context, record_span, tracer
from worker_common.config import WorkerConfig
from worker_common.convert import FINISH_REASON_TO_PROTO, sampling_from_proto, token_to_proto
from worker_common.errors import abort_with
from worker_common.worker import WorkerEngine, WorkerServicer, serve_worker, start_engine

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    """Runs a prompt to its first token, then sends the held KV blocks and releases them.

    Block ownership: the request's `RequestStream` holds the prefill-done blocks (status HELD) until the handler
    leaves it — after the transfer succeeded, failed or was rejected, or the call was cancelled.
    """

    def __init__(self, worker: WorkerEngine, sender: KvSender):
        self.worker, self.sender = worker, sender

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        try:
            req = Request(rid, list(request.prompt_token_ids), sampling_from_proto(request.sampling),
                          eos_token_ids=self.worker.parts.model_config.eos_token_ids, prefill_only=True,
                          arrival_time=request.arrival_time or time.time(),
                          output_token_ids=list(request.output_token_ids))
            with self.worker.engine.request(req) as stream:
                ev = await stream.next()
                scheduled = req.arrival_time + ev.queue_ms / 1e3  # the engine's own clock marks, as spans
                record_span("queue", req.arrival_time, scheduled, {"pdserve.request_id": rid})
                record_span("prefill", scheduled, scheduled + ev.prefill_ms / 1e3, {
                    "pdserve.request_id": rid, "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
                    "pdserve.cached_prompt_tokens": ev.num_cached_tokens})
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
                blocks, skip = ev.block_ids or [], request.kv_skip_blocks
                if skip >= len(blocks) > 0:  # the decode side computes nothing, so it must receive the last block
                    raise EngineError(ErrorKind.INVALID_REQUEST, f"kv_skip_blocks {skip} leaves none of the "
                                                                 f"{len(blocks)} blocks to send")
                with tracer().start_as_current_span("kv transfer") as span:
                    stats = await self.sender.send(request.kv_address, rid, ev.token.token_id, blocks[skip:],
                                                   req.num_tokens - 1, trace_context=inject_context(),
                                                   first_block=skip)
                    span.set_attributes({"pdserve.kv.bytes": stats.num_bytes, "pdserve.kv.blocks": stats.num_blocks,
                                         "pdserve.kv.staged_bytes": stats.staged_bytes,
                                         "pdserve.kv.peer": request.kv_address, "pdserve.request_id": rid})
                self.worker.metrics.transfer_time.observe(stats.seconds)
                self.worker.metrics.transfer_bytes.observe(stats.num_bytes)
                self.worker.metrics.staged_bytes.inc(stats.staged_bytes)
                yield worker_pb2.PrefillResponse(transfer_done=worker_pb2.PrefillTransferDone(
                    num_bytes=stats.num_bytes, num_blocks=stats.num_blocks, transfer_ms=stats.seconds * 1e3))
        except EngineError as e:
            log.warning("prefill of %s failed: %s", rid, e)
            if isinstance(e, TransferError):
                self.worker.metrics.transfer_failed(e.kind.value)
            await abort_with(context, e)


async def serve(config: WorkerConfig) -> None:
    """Run a prefill worker until cancelled."""
    secret = read_secret(config.server.cluster_secret_file)
    tracing = Tracing.from_env("pdserve-prefill")
    worker = start_engine(config)
    sender = KvSender(worker.compat_hash, worker.parts.runner.kv_cache.block_bytes,
                      timeout_s=config.transfer_timeout_s, secret=secret)
    prefill = PrefillServicer(worker, sender)
    try:
        await serve_worker(config, worker, WorkerServicer("prefill", worker),
                           lambda server: worker_pb2_grpc.add_PrefillServicer_to_server(prefill, server),
                           "pdserve.v1.Prefill", secret, tracing)
    finally:
        sender.close()
        release_transports()
        tracing.shutdown()
