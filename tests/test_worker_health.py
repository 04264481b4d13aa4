"""A worker whose engine step faults fails that step's requests and reports NOT_SERVING through the standard gRPC
health protocol, instead of silently serving on (issue 9, isolation)."""
import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_worker.server import serve
from engine.args import EngineArgs
from engine.model_runner import ModelRunner
from pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from server_common.config import ServerArgs
from worker_common.config import WorkerConfig


def test_engine_fault_turns_health_not_serving(tiny_model_dir, tmp_path, monkeypatch):
    execute = ModelRunner.execute

    def faulty(self, out):
        if any(s.request.request_id == "boom" for s in out.decodes + out.prefills):
            raise RuntimeError("injected device fault")
        return execute(self, out)

    monkeypatch.setattr(ModelRunner, "execute", faulty)
    ready = tmp_path / "ready.json"
    config = WorkerConfig(role="colocated", engine=EngineArgs(model_dir=str(tiny_model_dir), kv_tokens=1024,
                                                              max_model_len=256, threads=0),
                          server=ServerArgs(ready_file=str(ready)))

    async def decode(stub, rid):
        call = stub.Decode(worker_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=[5, 6, 7], kv_source=worker_pb2.KV_SOURCE_LOCAL,
            sampling=generate_pb2.SamplingParams(max_tokens=3, temperature=0)), timeout=30)
        return [msg async for msg in call]

    async def main():
        server = asyncio.create_task(serve(config))
        try:
            while not ready.exists():
                await asyncio.sleep(0.05)
            address = json.loads(ready.read_text())["address"]
            async with grpc.aio.insecure_channel(address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                stub = worker_pb2_grpc.DecodeStub(ch)
                assert (await health.Check(health_pb2.HealthCheckRequest())).status == \
                    health_pb2.HealthCheckResponse.SERVING
                assert (await decode(stub, "fine"))[-1].WhichOneof("response") == "finished"
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await decode(stub, "boom")
                assert e.value.code() == grpc.StatusCode.INTERNAL
                for _ in range(100):
                    status = (await health.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Decode"))).status
                    if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                        break
                    await asyncio.sleep(0.05)
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
                assert (await health.Check(health_pb2.HealthCheckRequest())).status == \
                    health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            server.cancel()
            with pytest.raises(asyncio.CancelledError):
                await server

    asyncio.run(main())


def test_a_long_step_does_not_make_a_worker_look_dead(tiny_model_dir, tmp_path, monkeypatch):
    """A CPU prefill step can take seconds. Routers' polls (health, GetStats) must still answer at once: they
    used to wait behind the step on the engine thread, time out, and get a busy worker dropped from routing."""
    import time

    execute = ModelRunner.execute

    def slow(self, out):
        if any(s.request.request_id == "slow" for s in out.decodes + out.prefills):
            time.sleep(3)
        return execute(self, out)

    monkeypatch.setattr(ModelRunner, "execute", slow)
    ready = tmp_path / "ready.json"
    config = WorkerConfig(role="colocated", engine=EngineArgs(model_dir=str(tiny_model_dir), kv_tokens=1024,
                                                              max_model_len=256, threads=0),
                          server=ServerArgs(ready_file=str(ready)))

    async def main():
        server = asyncio.create_task(serve(config))
        try:
            while not ready.exists():
                await asyncio.sleep(0.05)
            address = json.loads(ready.read_text())["address"]
            async with grpc.aio.insecure_channel(address) as ch:
                call = worker_pb2_grpc.DecodeStub(ch).Decode(worker_pb2.DecodeRequest(
                    request_id="slow", prompt_token_ids=[5, 6, 7], kv_source=worker_pb2.KV_SOURCE_LOCAL,
                    sampling=generate_pb2.SamplingParams(max_tokens=2, temperature=0)), timeout=30)
                await call.read()  # reserved: the slow step is under way now
                await asyncio.sleep(0.5)
                start = time.monotonic()
                stats = await worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.WorkerStatsRequest(), timeout=1)
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                assert time.monotonic() - start < 0.5 and stats.num_requests == 1
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                call.cancel()
        finally:
            server.cancel()
            with pytest.raises(asyncio.CancelledError):
                await server

    asyncio.run(main())
