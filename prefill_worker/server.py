"""The Prefill gRPC service and the prefill worker process."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve_server.engine.kv_stream import KvLayerProgress, LayerStreamEnded
from pdserve_server.engine.outputs import TokenOutput
from pdserve_server.engine.request import FinishReason, Request
from pdserve_server.kv_transfer import release_transports
from pdserve_server.kv_transfer.sender import KvSender, TransferError, TransferStats, blocks_to_send, uncancellable
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_server.server_common.security import read_secret
from pdserve_server.server_common.tracing import Tracing, inject_context, record_span, tracer
from pdserve_server.worker_common.config import WorkerConfig
from pdserve_server.worker_common.convert import (FINISH_REASON_TO_PROTO, sampling_from_proto, scheduling_from_proto,
                                                  token_to_proto)
from pdserve_server.worker_common.errors import abort_with
from pdserve_server.worker_common.worker import WorkerEngine, WorkerServicer, serve_worker, start_engine

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    """Runs a prompt to its first token, then sends the held KV blocks and releases them.

    Block ownership: the request's `RequestStream` holds the prefill-done blocks (status HELD) until the handler
    leaves it — after the transfer succeeded, failed or was rejected, or the call was cancelled.

    Layer-wise streaming (`layerwise`): the transfer starts as the last prefill chunk's step starts and sends each
    layer as the forward writes it (`KvSender.send_layers`); the first token then only closes it. The handler
    still leaves the request's stream only after the transfer task ended, so no block is freed while it is read.
    Under a sliding window every layer shares, blocks behind the window go back to the pool when the step ends
    (`KVCacheManager.release_out_of_window`), but none of them is sent: the decode worker reserved them as the null
    block and asked for the blocks after them only (`kv_skip_blocks`, at least as many: same tokens, window and
    block size).

    Args:
        worker: the engine and its metrics.
        sender: the KV sender.
        layerwise: stream KV layer by layer (else whole blocks after the first token).
    """

    def __init__(self, worker: WorkerEngine, sender: KvSender, layerwise: bool = False):
        self.worker, self.sender, self.layerwise = worker, sender, layerwise

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        started = time.time()  # the TTFT deadline counts from the call's start
        try:
            progress = (KvLayerProgress(self.worker.model_config.num_layers)
                        if self.layerwise and request.kv_address else None)
            scheduling = scheduling_from_proto(request.scheduling if request.HasField("scheduling") else None,
                                               started)
            req = Request(rid, list(request.prompt_token_ids), sampling_from_proto(request.sampling),
                          eos_token_ids=self.worker.model_config.eos_token_ids, prefill_only=True,
                          arrival_time=request.arrival_time or started,
                          output_token_ids=list(request.output_token_ids), kv_layers=progress,
                          scheduling=scheduling)
            with self.worker.engine.request(req) as stream:
                streamed = (asyncio.ensure_future(self._send_layers(request, progress)) if progress is not None
                            else None)
                try:
                    ev = await stream.next()
                    prefill_done = time.perf_counter()
                    scheduled = req.arrival_time + ev.queue_ms / 1e3  # the engine's own clock marks, as spans
                    record_span("queue", req.arrival_time, scheduled, {"pdserve.request_id": rid})
                    record_span("prefill", scheduled, scheduled + ev.prefill_ms / 1e3, {
                        "pdserve.request_id": rid, "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
                        "pdserve.cached_prompt_tokens": ev.num_cached_tokens})
                    held = ev.finish_reason == FinishReason.PREFILL_DONE
                    if progress is not None:
                        if held:
                            progress.finish(ev.token.token_id)
                        else:
                            progress.fail("the request finished at its first token")
                    first = worker_pb2.PrefillFirstToken(
                        token=token_to_proto(ev.token), num_cached_tokens=ev.num_cached_tokens,
                        queue_ms=ev.queue_ms, prefill_ms=ev.prefill_ms, finished=not held)
                    if not held:
                        first.finish_reason = FINISH_REASON_TO_PROTO[ev.finish_reason]
                        if ev.stop_token_id is not None:
                            first.stop_token_id = ev.stop_token_id
                    yield worker_pb2.PrefillResponse(first_token=first)
                    if not held or not request.kv_address:
                        return
                    stats = await (streamed if streamed is not None else self._send_blocks(request, ev, req))
                    exposed = time.perf_counter() - prefill_done  # streaming: what did not overlap the forward
                    self.worker.metrics.transfer_done(streamed is not None, exposed, stats.num_bytes,
                                                      stats.staged_bytes)
                    yield worker_pb2.PrefillResponse(transfer_done=worker_pb2.PrefillTransferDone(
                        num_bytes=stats.num_bytes, num_blocks=stats.num_blocks, transfer_ms=exposed * 1e3,
                        layerwise=streamed is not None))
                finally:
                    if streamed is not None:  # the blocks are read until it ends; its outcome, if unused, dropped
                        if not streamed.done():
                            progress.fail("the prefill call ended")
                        await uncancellable(streamed)
        except EngineError as e:
            log.warning("prefill of %s failed: %s", rid, e)
            if isinstance(e, TransferError):
                self.worker.metrics.transfer_failed(e.kind.value)
            await abort_with(context, e)

    async def _send_blocks(self, request: worker_pb2.PrefillRequest, ev: TokenOutput, req: Request) -> TransferStats:
        """Send the held blocks after the first token (those past the decode worker's cached prefix)."""
        skip = request.kv_skip_blocks
        blocks = blocks_to_send(ev.block_ids or [], skip)
        with tracer().start_as_current_span("kv transfer") as span:
            stats = await self.sender.send(request.kv_address, request.request_id, ev.token.token_id, blocks,
                                           req.num_tokens - 1, trace_context=inject_context(), first_block=skip)
            _annotate(span, stats, request, layerwise=False)
        return stats

    async def _send_layers(self, request: worker_pb2.PrefillRequest, progress: KvLayerProgress) -> TransferStats:
        """Stream the blocks past the decode worker's cached prefix layer by layer, as the last chunk computes.

        Raises:
            TransferError: as `KvSender.send`, or TRANSFER_FAILED when the stream ended before the first token.
        """
        with tracer().start_as_current_span("kv transfer") as span:
            try:
                stats = await self.sender.send_layers(request.kv_address, request.request_id, progress,
                                                      first_block=request.kv_skip_blocks,
                                                      trace_context=inject_context())
            except LayerStreamEnded as e:
                raise TransferError(ErrorKind.TRANSFER_FAILED, f"layer-wise KV transfer of {request.request_id} "
                                                               f"ended: {e}") from e
            _annotate(span, stats, request, layerwise=True)
        return stats


def _annotate(span, stats: TransferStats, request: worker_pb2.PrefillRequest, layerwise: bool) -> None:
    span.set_attributes({"pdserve.kv.bytes": stats.num_bytes, "pdserve.kv.blocks": stats.num_blocks,
                         "pdserve.kv.staged_bytes": stats.staged_bytes, "pdserve.kv.peer": request.kv_address,
                         "pdserve.request_id": request.request_id, "pdserve.kv.layerwise": layerwise})


async def serve(config: WorkerConfig) -> None:
    """Run a prefill worker until cancelled."""
    secret = read_secret(config.server.cluster_secret_file)
    tracing = Tracing.from_env("pdserve-prefill")
    worker = await start_engine(config)
    sender = KvSender(worker.compat_hash, worker.block_regions, timeout_s=config.transfer_timeout_s, secret=secret)
    prefill = PrefillServicer(worker, sender, layerwise=config.kv_layerwise)
    try:
        await serve_worker(config, worker, WorkerServicer("prefill", worker),
                           lambda server: worker_pb2_grpc.add_PrefillServicer_to_server(prefill, server),
                           "pdserve.v1.Prefill", secret, tracing)
    finally:
        sender.close()
        release_transports()
        tracing.shutdown()
