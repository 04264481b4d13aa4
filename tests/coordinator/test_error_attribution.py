"""Which worker a failed call blames: a worker's own report carries its kind (google.rpc.ErrorInfo, worker.proto's
WorkerErrorReason), so a TRANSFER_FAILED from a live prefill worker blames the decode worker it was sending to, while
a lost connection blames the worker called. Before, a decode worker killed mid-transfer took the healthy prefill
worker out of routing."""
import asyncio
import socket

import grpc
import pytest

from pdserve_server.coordinator import flow as flows
from pdserve_server.coordinator.errors import RequestError, from_rpc_error, worker_reason
from pdserve_server.coordinator.router import Router, WorkerHandle
from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve.v1 import generate_pb2, worker_pb2
from pdserve_server.worker_common.errors import abort_with

PEER = "10.0.0.9:7001"


async def failed_call(kind: ErrorKind | None) -> tuple[grpc.aio.AioRpcError, str]:
    """The error of a call to a real gRPC server whose handler ends with `abort_with(kind)` (None: a call to a port
    nobody listens on), and the address called."""
    server = grpc.aio.server()

    async def handler(request: bytes, context) -> bytes:
        await abort_with(context, EngineError(kind, f"the {kind.value} happened"))

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.Worker", {"Call": grpc.unary_unary_rpc_method_handler(handler)})])
    port = server.add_insecure_port("127.0.0.1:0")
    if kind is None:
        with socket.socket() as s:  # a port that was free a moment ago and has no listener
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    else:
        await server.start()
    address = f"127.0.0.1:{port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await channel.unary_unary("/t.Worker/Call")(b"", timeout=30)
        return e.value, address
    finally:
        await server.stop(None)


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_every_kind_a_worker_reports_reaches_the_coordinator(kind):
    error, address = asyncio.run(failed_call(kind))
    assert worker_reason(error) == worker_pb2.WorkerErrorReason.Value(f"WORKER_ERROR_REASON_{kind.name}")
    assert error.details() == f"the {kind.value} happened"
    blamed = from_rpc_error(error, "prefill", address, peer=PEER)
    if kind is ErrorKind.TRANSFER_FAILED:  # the worker answered: it lives, the transfer's other end is suspected
        assert blamed.worker == PEER and PEER in blamed.message and blamed.code == grpc.StatusCode.UNAVAILABLE
    else:
        assert blamed.worker == address
    assert from_rpc_error(error, "prefill", address).worker == address  # no peer (a colocated call): the worker
    # The client reads the worker's own words, never an internal address (the log has the address)
    assert blamed.client_message.startswith("prefill worker: the ") and address not in blamed.client_message
    assert PEER not in blamed.client_message and address in from_rpc_error(error, "prefill", address).message


def test_a_lost_connection_blames_the_worker_called():
    error, address = asyncio.run(failed_call(None))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert worker_reason(error) == worker_pb2.WORKER_ERROR_REASON_UNSPECIFIED
    blamed = from_rpc_error(error, "prefill", address, peer=PEER)
    assert blamed.worker == address and address in blamed.message
    # gRPC's and the transport's text stays in the log ("decode worker 127.0.0.1:PORT: Stream
    # removed (recvmsg:Connection reset by peer (104))" reached the client)
    assert blamed.client_message == "the prefill worker serving this request was lost (UNAVAILABLE)"


# ---- the request path: which worker a failed disaggregated request names -----------------------------------------
class Call:
    """A worker's streaming call: its responses, then `error` raised (None: wait until cancelled, then end as a
    cancelled call does)."""

    def __init__(self, responses, error: grpc.aio.AioRpcError | None = None):
        self.responses, self.error, self.cancelled = responses, error, asyncio.Event()

    def __aiter__(self):
        async def gen():
            for r in self.responses:
                yield r
            if self.error is not None:
                raise self.error
            await self.cancelled.wait()
            raise grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "Locally cancelled by application!")
        return gen()

    def cancel(self):
        self.cancelled.set()


class Stubs:
    def __init__(self, call: Call):
        self.call = call

    def Decode(self, request, timeout=None):
        return self.call

    Prefill = Decode


def worker(name: str, role: str, call: Call) -> WorkerHandle:
    info = worker_pb2.WorkerInfo(role=role, num_blocks=100, block_size=16, kv_address=f"{name}:kv")
    return WorkerHandle(name, None, None, Stubs(call), Stubs(call), info=info, live=True)


RESERVED = worker_pb2.DecodeResponse(reserved=worker_pb2.DecodeReserved(num_blocks=7))
FIRST = worker_pb2.PrefillResponse(first_token=worker_pb2.PrefillFirstToken(
    token=worker_pb2.SampledToken(token_id=5)))


async def failing_request(prefill: Call, decode: Call) -> RequestError:
    """The error a disaggregated request ends with after its first token."""
    router = Router([worker("p0", "prefill", prefill)], [worker("d0", "decode", decode)])
    stream = flows.run_disaggregated(router, flows.Flow("r"), "r", list(range(40)), [],
                                     generate_pb2.SamplingParams(max_tokens=8), 0.0, 30.0)
    try:
        assert isinstance(await stream.__anext__(), flows.Tokens)
        with pytest.raises(RequestError) as e:
            await stream.__anext__()
        return e.value
    finally:
        await stream.aclose()


def test_a_prefill_workers_failed_transfer_blames_the_decode_worker():
    """The decode worker died mid-transfer: the prefill worker reports TRANSFER_FAILED (and the coordinator cancels
    the Decode stream); the request names the decode worker, so membership takes it, not p0, out of routing."""
    async def run():
        transfer_failed, _ = await failed_call(ErrorKind.TRANSFER_FAILED)
        return await failing_request(Call([FIRST], transfer_failed), Call([RESERVED]))
    error = asyncio.run(run())
    assert error.worker == "d0" and error.code == grpc.StatusCode.UNAVAILABLE and "prefill worker p0" in error.message


def test_a_decode_workers_failed_transfer_blames_the_prefill_worker():
    """The prefill worker died mid-transfer and the decode worker's receive failed first: p0 is named."""
    async def run():
        transfer_failed, _ = await failed_call(ErrorKind.TRANSFER_FAILED)
        return await failing_request(Call([FIRST]), Call([RESERVED], transfer_failed))
    assert asyncio.run(run()).worker == "p0"


def test_a_prefill_worker_gone_mid_transfer_is_blamed():
    async def run():
        lost, _ = await failed_call(None)
        return await failing_request(Call([FIRST], lost), Call([RESERVED]))
    assert asyncio.run(run()).worker == "p0"
