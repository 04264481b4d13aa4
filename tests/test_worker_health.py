"""A worker in-process, its engine step patched: a step that faults fails that step's requests and turns the gRPC
health NOT_SERVING (issue 9, isolation); a step that takes seconds does not make the worker look dead."""
import asyncio
import contextlib
import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_worker.server import serve
from engine.args import EngineArgs
from engine.model_runner import ModelRunner
from pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from server_common.config import ServerArgs
from worker_common.config import WorkerConfig

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@contextlib.asynccontextmanager
async def colocated_worker(model_dir, tmp_path, monkeypatch, on_step):
    """A colocated worker serving in this process whose every step first calls on_step(request ids); yields a
    channel to it."""
    execute = ModelRunner.execute

    def patched(self, out):
        on_step({s.request.request_id for s in out.decodes + out.prefills})
        return execute(self, out)

    monkeypatch.setattr(ModelRunner, "execute", patched)
    ready = tmp_path / "ready.json"
    config = WorkerConfig(role="colocated", engine=EngineArgs(model_dir=str(model_dir), kv_tokens=1024,
                                                              max_model_len=256, threads=0),
                          server=ServerArgs(ready_file=str(ready)))
    server = asyncio.create_task(serve(config))
    try:
        while not ready.exists():
            await asyncio.sleep(0.05)
        async with grpc.aio.insecure_channel(json.loads(ready.read_text())["address"]) as channel:
            yield channel
    finally:
        server.cancel()
        with pytest.raises(asyncio.CancelledError):
            await server


def decode_call(channel, rid: str, max_tokens: int):
    return worker_pb2_grpc.DecodeStub(channel).Decode(worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=[5, 6, 7], kv_source=worker_pb2.KV_SOURCE_LOCAL,
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0)), timeout=30)


def test_engine_fault_turns_health_not_serving(tiny_model_dir, tmp_path, monkeypatch):
    def fault_on_boom(ids):
        if "boom" in ids:
            raise RuntimeError("injected device fault")

    async def main():
        async with colocated_worker(tiny_model_dir, tmp_path, monkeypatch, fault_on_boom) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == SERVING
            assert [m async for m in decode_call(ch, "fine", 3)][-1].WhichOneof("response") == "finished"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [m async for m in decode_call(ch, "boom", 3)]
            assert e.value.code() == grpc.StatusCode.INTERNAL
            for _ in range(100):
                status = (await health.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Decode"))).status
                if status == NOT_SERVING:
                    break
                await asyncio.sleep(0.05)
            assert status == NOT_SERVING
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == NOT_SERVING
            assert (await health.Check(health_pb2.HealthCheckRequest(service="pdserve.liveness"))).status \
                == NOT_SERVING  # restart me

    asyncio.run(main())


def test_a_long_step_does_not_make_a_worker_look_dead(tiny_model_dir, tmp_path, monkeypatch):
    """A CPU prefill step can take seconds. Routers' polls (health, GetStats) must still answer at once: they
    used to wait behind the step on the engine thread, time out, and get a busy worker dropped from routing."""
    def slow_for_slow(ids):
        if "slow" in ids:
            time.sleep(3)

    async def main():
        async with colocated_worker(tiny_model_dir, tmp_path, monkeypatch, slow_for_slow) as ch:
            call = decode_call(ch, "slow", 2)
            await call.read()  # reserved: the slow step is under way now
            await asyncio.sleep(0.5)
            start = time.monotonic()
            stats = await worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.WorkerStatsRequest(), timeout=1)
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
            assert time.monotonic() - start < 0.5 and stats.num_requests == 1
            assert health.status == SERVING
            call.cancel()

    asyncio.run(main())
