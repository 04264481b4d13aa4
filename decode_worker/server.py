"""The Decode gRPC service and the decode / colocated worker process."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from pdserve_server.kv_transfer.choice import choose_backend
from pdserve_server.decode_worker.reservations import Reservation, Reservations, ReservationState
from pdserve_server.decode_worker.token_streams import Draining, TokenOutbox, TokenStreamClosed, TokenStreams
from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve_server.engine.core.async_engine import RequestStream
from pdserve_server.engine.request import Request
from pdserve_server.kv_transfer import release_transports
from pdserve_server.kv_transfer.receiver import KvReceiver
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_server.server_common.addresses import advertise_host
from pdserve_server.server_common.errors import CommandError
from pdserve_server.server_common.security import read_secret
from pdserve_server.server_common.tracing import Tracing, record_span
from pdserve_server.worker_common.config import WorkerConfig
from pdserve_server.worker_common.convert import (FINISH_REASON_TO_PROTO, sampling_from_proto, scheduling_from_proto,
                                                  token_to_proto)
from pdserve_server.worker_common.errors import abort_with
from pdserve_server.worker_common.worker import WorkerEngine, WorkerServicer, serve_worker, start_engine

log = logging.getLogger(__name__)


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    """Reserve -> wait for KV (bounded by the lease) -> join the running batch -> stream tokens.

    Block ownership: the request's `RequestStream` frees its blocks when the call ends, unless a receive is still
    writing into them; then the receiver frees them when it stops (`Reservations.hold`).
    """

    def __init__(self, worker: WorkerEngine, reservations: Reservations, kv_timeout_s: float,
                 stream_interval: int = 1):
        self.worker, self.reservations, self.kv_timeout_s = worker, reservations, kv_timeout_s
        self.stream_interval = stream_interval
        self.token_streams = TokenStreams(lambda parts: self.worker.metrics.token_stream_sent(parts))

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        remote = request.kv_source == worker_pb2.KV_SOURCE_REMOTE
        started = time.time()  # the TTFT deadline counts from the call's start
        outbox: TokenOutbox | None = None
        try:
            if request.token_stream_id:  # tokens go on the caller's StreamTokens stream, a message a step for all
                try:
                    outbox = self.token_streams.use(request.token_stream_id)
                except Draining as e:  # the caller reads it as a lost worker: the request goes elsewhere
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                except LookupError as e:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            # A remote-KV request gets its first token from the prefill worker: no deadline here, the rest applies.
            scheduling = scheduling_from_proto(request.scheduling if request.HasField("scheduling") else None,
                                               started, with_deadline=not remote)
            req = Request(rid, list(request.prompt_token_ids), sampling_from_proto(request.sampling),
                          eos_token_ids=self.worker.model_config.eos_token_ids, remote_kv=remote,
                          output_token_ids=list(request.output_token_ids), scheduling=scheduling)
            with self.worker.engine.request(req) as stream:
                if remote:
                    reserved = await stream.next()
                    # A caller may shorten the lease, never extend it past this worker's own: blocks held for a
                    # peer are bounded unless the peer keeps renewing.
                    lease_s = min(request.kv_timeout_ms / 1e3 or self.kv_timeout_s, self.kv_timeout_s)
                    with self.reservations.hold(rid, reserved.block_ids, reserved.num_cached_blocks, stream,
                                                lease_s) as reservation:
                        yield worker_pb2.DecodeResponse(reserved=worker_pb2.DecodeReserved(
                            num_blocks=len(reserved.block_ids), num_cached_blocks=reserved.num_cached_blocks,
                            lease_ms=round(lease_s * 1e3)))
                        await self._wait_for_kv(rid, reservation)
                    stream.kv_arrived(reservation.first_token)
                    record_span("wait for kv", reservation.reserved_at, time.time(),
                                {"pdserve.request_id": rid, "pdserve.kv.blocks": len(reserved.block_ids)})
                else:
                    yield worker_pb2.DecodeResponse(reserved=worker_pb2.DecodeReserved())
                async for tokens, finished, last in self._messages(stream, req):
                    if outbox is not None:
                        # The last entry waits for its write: this call then ends OK after its tokens were sent.
                        await outbox.put(worker_pb2.RequestTokens(request_id=rid, tokens=tokens, finished=finished),
                                         wait=last)
                        continue
                    tokens.sent_at = time.time()
                    yield worker_pb2.DecodeResponse(tokens=tokens)
                    for msg in finished:
                        yield worker_pb2.DecodeResponse(finished=msg)
        except EngineError as e:
            await abort_with(context, e)
        except TokenStreamClosed as e:  # the caller's token stream ended: its requests cannot be delivered
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            if outbox is not None:
                outbox.release()

    async def _messages(self, stream: RequestStream, req: Request
                        ) -> AsyncIterator[tuple[worker_pb2.DecodeTokens, list[worker_pb2.DecodeFinished], bool]]:
        """The request's tokens as it should send them: (tokens, the DecodeFinished of samples they ended, whether
        it is the request's last), `stream_interval` tokens at a time (the first tokens and a finish at once).

        Raises:
            EngineError: as `RequestStream.next`.
        """
        decode_started, num_tokens = time.time(), 0
        samples_left = req.sampling.n  # parallel sampling: one DecodeFinished per sample, the last ends it
        pending: list = []  # --stream-interval: tokens held until N are due (the first and a finish go at once)
        while True:
            new = await stream.next_batch()
            pending += new
            # held tokens carry no finish (a finish is sent at once): only the new ones need looking at
            if num_tokens and len(pending) < self.stream_interval and all(ev.finish_reason is None for ev in new):
                continue
            batch, pending = pending, []
            num_tokens += len(batch)
            tokens = worker_pb2.DecodeTokens(tokens=[token_to_proto(ev.token, ev.index) for ev in batch],
                                             num_cached_tokens=max(ev.num_cached_tokens for ev in batch))
            finished = []
            for done in (ev for ev in batch if ev.finish_reason is not None):
                samples_left -= 1
                msg = worker_pb2.DecodeFinished(finish_reason=FINISH_REASON_TO_PROTO[done.finish_reason],
                                                num_draft_tokens=done.num_draft_tokens,
                                                num_accepted_tokens=done.num_accepted_tokens, index=done.index)
                if done.stop_token_id is not None:
                    msg.stop_token_id = done.stop_token_id
                finished.append(msg)
            if samples_left == 0:
                # Recorded before the last message: a caller that has what it needs may end the call, and the
                # stream is then closed at the caller's yield (code after it never runs).
                record_span("decode", decode_started, time.time(),
                            {"pdserve.request_id": req.request_id, "gen_ai.usage.output_tokens": num_tokens})
            yield tokens, finished, samples_left == 0
            if samples_left == 0:
                return

    async def StreamTokens(self, requests: AsyncIterator[worker_pb2.TokenStreamRequest],
                           context: grpc.aio.ServicerContext):
        """Open the caller's token stream (`token_streams.TokenOutbox`) under the id its first message names, move
        its window with each later message's `taken`, and send its messages until the caller cancels it or the
        worker drains. INVALID_ARGUMENT / ALREADY_EXISTS for a missing, empty or open stream_id."""
        first = await anext(aiter(requests), None)
        try:
            outbox = self.token_streams.open(first.stream_id if first is not None else "")
        except ValueError as e:
            code = grpc.StatusCode.ALREADY_EXISTS if first is not None and first.stream_id \
                else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(e))

        async def read_taken() -> None:
            with contextlib.suppress(Exception):  # the call's end shows in the writes; nothing to report here
                async for request in requests:
                    outbox.taken(request.taken)

        reader = asyncio.get_running_loop().create_task(read_taken())
        try:
            async for batch in outbox.batches():
                yield batch
        finally:
            reader.cancel()
            self.token_streams.close(outbox)

    async def RenewLease(self, request: worker_pb2.RenewLeaseRequest, context: grpc.aio.ServicerContext):
        try:
            lease_s = self.reservations.renew(request.request_id)
        except LookupError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return worker_pb2.RenewLeaseResponse(lease_ms=round(lease_s * 1e3))

    async def _wait_for_kv(self, rid: str, reservation: Reservation) -> None:
        """Wait for the receiver to settle the reservation; the lease (renewable) bounds the wait until bytes flow.

        Raises:
            EngineError: KV_TIMEOUT when the lease ran out before any KV came; TRANSFER_FAILED when it broke.
        """
        while not reservation.settled.is_set():
            if reservation.state == ReservationState.RECEIVING:
                await reservation.settled.wait()  # the receiver's own timeout bounds this
                break
            remaining = reservation.expires_at - time.monotonic()
            if remaining <= 0:
                self.worker.metrics.reservations_expired.inc()
                raise EngineError(ErrorKind.KV_TIMEOUT, f"KV for {rid} did not arrive within the "
                                                        f"{reservation.lease_s:.1f}s lease; blocks freed")
            with contextlib.suppress(TimeoutError):  # then re-read the deadline: a renewal may have moved it
                await asyncio.wait_for(reservation.settled.wait(), remaining)
        if reservation.state == ReservationState.FAILED:
            self.worker.metrics.transfer_failed(ErrorKind.TRANSFER_FAILED.value)
            raise EngineError(ErrorKind.TRANSFER_FAILED, f"KV transfer for {rid} failed: {reservation.error}")


async def serve(config: WorkerConfig) -> None:
    """Run a decode worker (role 'decode') or a colocated worker (role 'colocated') until cancelled."""
    secret = read_secret(config.server.cluster_secret_file)
    tracing = Tracing.from_env(f"pdserve-{config.role}")
    tp = config.engine.tensor_parallel_size
    if config.role == "decode" and config.connector == "nccl" and tp > 1 and config.engine.device.startswith("cuda"):
        # Its process group moves one device's memory; this worker's KV shards are on one GPU per rank.
        raise CommandError(f"--connector nccl moves KV on one GPU per worker; --tensor-parallel-size {tp} puts a KV "
                           "shard on each of its GPUs: use --connector ucx or tcp")
    worker = await start_engine(config)
    reservations = Reservations()
    receiver = None
    kv_address = connector = ""
    if config.role == "decode":
        backend = await choose_backend(config.connector, worker.compat_hash, config.server.host,
                                       config.engine.device)
        receiver = KvReceiver(backend, worker.compat_hash, worker.block_regions, reservations,
                              timeout_s=config.transfer_timeout_s, secret=secret)
        kv_address = await receiver.start(config.server.host, config.kv_port,
                                          advertise=advertise_host(config.server.host, config.server.advertise_host))
        connector = backend.name
    decode = DecodeServicer(worker, reservations, config.kv_timeout_s, config.stream_interval)
    try:
        await serve_worker(config, worker, WorkerServicer(config.role, worker, kv_address, connector),
                           lambda server: worker_pb2_grpc.add_DecodeServicer_to_server(decode, server),
                           "pdserve.v1.Decode", secret, tracing, on_drain=decode.token_streams.drain,
                           kv_address=kv_address)
    finally:
        if receiver is not None:
            receiver.close()
        release_transports()
        tracing.shutdown()
