"""A worker in-process, its engine step patched: a step that faults fails that step's requests and turns the gRPC
health NOT_SERVING (isolation); a step that takes seconds does not make the worker look dead."""
import asyncio
import contextlib
import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve_server.decode_worker.server import serve
from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.execution.model_runner import ModelRunner
from pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from pdserve_server.server_common.config import ServerArgs
from pdserve_server.worker_common.config import WorkerConfig

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@contextlib.asynccontextmanager
async def colocated_worker(model_dir, tmp_path, monkeypatch, on_step, served: list | None = None):
    """A colocated worker serving in this process whose every step first calls on_step(request ids); yields a
    channel to it. `served`, when given, receives the serve task (to see how it ended)."""
    execute = ModelRunner.execute

    def patched(self, out):
        on_step({s.request.request_id for s in out.decodes + out.prefills})
        return execute(self, out)

    monkeypatch.setattr(ModelRunner, "execute", patched)
    ready = tmp_path / "ready.json"
    # The engine on a thread of this process: the patch above must reach its steps.
    config = WorkerConfig(role="colocated", engine_process=False,
                          engine=EngineArgs(dtype="float32", model_dir=str(model_dir), kv_tokens=1024,
                                            max_model_len=256, threads=0),
                          # The fault's drain waits for open calls (the fault test's health watches) up to this
                          server=ServerArgs(ready_file=str(ready), drain_timeout_s=2.0))
    server = asyncio.create_task(serve(config))
    if served is not None:
        served.append(server)
    try:
        while not ready.exists():
            await asyncio.sleep(0.05)
        async with grpc.aio.insecure_channel(json.loads(ready.read_text())["address"]) as channel:
            yield channel
    finally:
        if not server.done():
            server.cancel()
            with pytest.raises(asyncio.CancelledError):
                await server


def decode_call(channel, rid: str, max_tokens: int):
    return worker_pb2_grpc.DecodeStub(channel).Decode(worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=[5, 6, 7], kv_source=worker_pb2.KV_SOURCE_LOCAL,
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0)), timeout=30)


def test_engine_fault_stops_serving_and_exits_for_a_restart(tiny_model_dir, tmp_path, monkeypatch):
    """A faulted engine cannot be trusted: the worker stops taking traffic (readiness and liveness NOT_SERVING),
    drains as on SIGTERM, then serve() ends with CommandError, which the command line turns into exit status 1, so
    `serve --restart` or an orchestrator restarts it. It used to stay up, NOT_SERVING, forever."""
    from pdserve_server.server_common.errors import CommandError

    def fault_on_boom(ids):
        if "boom" in ids:
            raise RuntimeError("injected device fault")

    async def main():
        served = []
        async with colocated_worker(tiny_model_dir, tmp_path, monkeypatch, fault_on_boom, served) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            # Watches opened before the fault see every change however fast the server then goes away.
            watches = [health.Watch(health_pb2.HealthCheckRequest(service=name))
                       for name in ("pdserve.v1.Decode", "", "pdserve.liveness")]
            assert [(await w.read()).status for w in watches] == [SERVING] * 3
            assert [m async for m in decode_call(ch, "fine", 3)][-1].WhichOneof("response") == "finished"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [m async for m in decode_call(ch, "boom", 3)]
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert [(await asyncio.wait_for(w.read(), 60)).status for w in watches] == [NOT_SERVING] * 3
            with pytest.raises(CommandError, match="engine fault .*injected device fault.*restarted"):
                await asyncio.wait_for(served[0], 60)
            for w in watches:
                w.cancel()

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


def test_an_out_of_vocabulary_migrated_output_fails_only_its_request(tiny_model_dir, tmp_path, monkeypatch):
    """A resumed (migrated) request brings the output generated elsewhere as context: an id outside the vocabulary
    there used to fail the whole step (bystanders too) and fault the engine. It is refused like a bad prompt."""
    async def main():
        served = []
        async with colocated_worker(tiny_model_dir, tmp_path, monkeypatch, lambda ids: None, served) as ch:
            bystander = decode_call(ch, "bystander", 8)
            await bystander.read()
            bad = worker_pb2_grpc.DecodeStub(ch).Decode(worker_pb2.DecodeRequest(
                request_id="resumed", prompt_token_ids=[5, 6, 7], output_token_ids=[8, 10 ** 6],
                kv_source=worker_pb2.KV_SOURCE_LOCAL,
                sampling=generate_pb2.SamplingParams(max_tokens=4, temperature=0)), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [m async for m in bad]
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "output_token_ids" in e.value.details() and "outside the vocabulary" in e.value.details()
            last = await bystander.read()
            while last is not grpc.aio.EOF and last.WhichOneof("response") != "finished":
                last = await bystander.read()
            assert last is not grpc.aio.EOF  # it finished, untouched by the bad request
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert health.status == SERVING and not served[0].done()

    asyncio.run(main())
