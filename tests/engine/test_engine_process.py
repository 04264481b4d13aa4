"""The engine core in a process of its own (`engine.core.process_engine`): the same results as the engine on a thread,
the KV cache shared with the worker, and a dead engine process noticed at once, every request failed cleanly."""
import asyncio
import os
import signal
from pathlib import Path

import pytest

from helpers import engine_processes, gone
from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.core.async_engine import AsyncEngine
from pdserve_server.engine.builder import build_engine
from pdserve_server.engine.core.engine_core import EngineCore
from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve_server.engine.kv_stream import KvLayerProgress
from pdserve_server.engine.outputs import TokenOutput
from pdserve_server.engine.core.process_engine import EngineBuildError, ProcessEngine
from pdserve_server.engine.request import FinishReason, Request, SamplingParams

pytestmark = pytest.mark.e2e  # starts real engine processes


def args(model_dir, **kw) -> EngineArgs:
    return EngineArgs(**{"dtype": "float32", "model_dir": str(model_dir), "block_size": 8, "kv_tokens": 1024,
                         "max_model_len": 512, "threads": 1, **kw})


def greedy(rid, prompt, n=12, **kw):
    return Request(rid, list(prompt), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), **kw)


PROMPTS = [list(range(5, 45)), list(range(100, 117)), [7] * 30, list(range(300, 309))]


async def generate(engine, request) -> list[int]:
    out = []
    with engine.request(request) as stream:
        while True:
            ev = await stream.next()
            assert isinstance(ev, TokenOutput)
            out.append(ev.token.token_id)
            if ev.finish_reason is not None:
                return out


def run_process_engine(model_dir, scenario, **kw):
    async def main():
        engine = ProcessEngine(args(model_dir, **kw), threads=1)
        await engine.start()
        try:
            return await scenario(engine)
        finally:
            engine.stop()
    return asyncio.run(main())


def test_process_engine_matches_thread_engine(tiny_model_dir):
    parts = build_engine(args(tiny_model_dir))

    async def thread_main():
        engine = AsyncEngine(lambda emit, on_fault: EngineCore(parts.scheduler, parts.runner, emit, on_fault))
        engine.start()
        try:
            return await asyncio.gather(*(generate(engine, greedy(f"r{i}", p)) for i, p in enumerate(PROMPTS)))
        finally:
            engine.stop()
    expected = asyncio.run(thread_main())

    async def scenario(engine):
        outputs = await asyncio.gather(*(generate(engine, greedy(f"r{i}", p)) for i, p in enumerate(PROMPTS)))
        stats, integrity_ok = await engine.snapshot()
        return outputs, stats, integrity_ok, engine.stats
    outputs, stats, integrity_ok, published = run_process_engine(tiny_model_dir, scenario)
    assert outputs == expected
    assert integrity_ok and stats.num_requests == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert published.num_steps > 0  # stats published by the engine process without a query


def test_kv_cache_is_shared_with_the_worker(tiny_model_dir):
    """The worker's view of the cache is the engine's memory: what a request's prefill wrote is visible here, in
    the request's blocks, without a copy (the KV connectors read and write it in place)."""

    async def scenario(engine):
        (shard,) = engine.kv.shards
        assert shard.is_shared()
        req = Request("held", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0), prefill_only=True)
        with engine.request(req) as stream:
            ev = await stream.next()
            assert ev.finish_reason == FinishReason.PREFILL_DONE and ev.block_ids
            written = shard[ev.block_ids[0]].abs().sum().item()
            unused = shard[engine.cache_config.num_blocks - 1].abs().sum().item()
        return written, unused
    written, unused = run_process_engine(tiny_model_dir, scenario)
    assert written > 0 and unused == 0


def test_layerwise_progress_crosses_the_process(tiny_model_dir):
    async def scenario(engine):
        progress = KvLayerProgress(engine.model_config.num_layers)
        req = Request("lw", PROMPTS[1], SamplingParams(max_tokens=8, temperature=0.0), prefill_only=True,
                      kv_layers=progress)
        with engine.request(req) as stream:
            blocks, num_tokens = await progress.started()
            for layer in range(engine.model_config.num_layers):
                await progress.written(layer)
            ev = await stream.next()
        return blocks, num_tokens, ev
    blocks, num_tokens, ev = run_process_engine(tiny_model_dir, scenario)
    assert num_tokens == len(PROMPTS[1]) and blocks == ev.block_ids


def test_reused_request_id_never_gets_the_old_requests_events(tiny_model_dir):
    """An owner that leaves early aborts its request; a new request under the same id must not receive the events
    the engine made for the old one before the abort reached it."""

    async def scenario(engine):
        results = []
        for round_ in range(20):
            with engine.request(greedy("same", PROMPTS[round_ % 2], n=40)) as stream:
                await stream.next()  # leave while the engine is still producing tokens for it
            results.append(await generate(engine, greedy("same", PROMPTS[2], n=6)))
        return results
    results = run_process_engine(tiny_model_dir, scenario)

    async def alone(engine):
        return await generate(engine, greedy("x", PROMPTS[2], n=6))
    assert results == [run_process_engine(tiny_model_dir, alone)] * 20


def test_an_output_whose_handling_raises_does_not_stop_the_others(tiny_model_dir, caplog):
    """The worker reads the engine's outputs as its socket wakes it, every queued message a wake: one message whose
    handling raises (a bug) is logged and skipped, and every later message is still read: another request
    completes, and so does the one whose tokens were in the failed message, with the tokens that came after it."""

    async def scenario(engine):
        dispatch, raised = engine.requests.dispatch, []

        def failing_once(events):
            if not raised and any(isinstance(ev, TokenOutput) for ev in events):
                raised.append(events)
                raise RuntimeError("a bug in one message's handling")
            dispatch(events)
        engine.requests.dispatch = failing_once
        first = await asyncio.wait_for(generate(engine, greedy("hit", PROMPTS[0], n=12)), 60)
        second = await asyncio.wait_for(generate(engine, greedy("after", PROMPTS[1], n=12)), 60)
        return raised, first, second
    raised, first, second = run_process_engine(tiny_model_dir, scenario)
    lost = sum(isinstance(ev, TokenOutput) for ev in raised[0])
    assert lost >= 1 and len(first) == 12 - lost and len(second) == 12
    assert "could not be handled" in caplog.text


def test_killed_engine_fails_every_stream_at_once(tiny_model_dir):
    """kill -9 of the engine process: every open stream ends with ENGINE_DIED (the worker maps it to UNAVAILABLE),
    a new request is refused the same way, and the fault listeners hear why."""

    async def scenario(engine):
        faults: list[str] = []
        engine.add_fault_listener(faults.append)
        streams = [engine.request(greedy(f"k{i}", PROMPTS[i % 4], n=400)) for i in range(8)]
        for s in streams:
            s.__enter__()
        for s in streams:
            await s.next()
        os.kill(engine.pid, signal.SIGKILL)
        errors = []
        for s in streams:
            with pytest.raises(EngineError) as e:
                while True:
                    await asyncio.wait_for(s.next(), 10)
            errors.append(e.value)
            s.__exit__(None, None, None)
        with pytest.raises(EngineError) as refused:
            with engine.request(greedy("late", PROMPTS[0])):
                pass
        with pytest.raises(EngineError):
            await engine.snapshot()
        return errors, refused.value, faults
    errors, refused, faults = run_process_engine(tiny_model_dir, scenario)
    assert {e.kind for e in errors} == {ErrorKind.ENGINE_DIED} and refused.kind == ErrorKind.ENGINE_DIED
    assert "killed by SIGKILL" in errors[0].message and faults == [errors[0].message]


def test_build_error_reaches_the_worker(tmp_path):
    async def main():
        engine = ProcessEngine(args(tmp_path / "missing"))
        with pytest.raises(EngineBuildError) as e:
            await engine.start()
        engine.stop()
        return e.value
    error = asyncio.run(main())
    assert error.error_type in ("OSError", "FileNotFoundError", "ValueError") and "missing" in str(error)


def test_stopped_engine_process_is_gone(tiny_model_dir):
    async def scenario(engine):
        return engine.pid, engine._process
    pid, process = run_process_engine(tiny_model_dir, scenario)
    assert not process.is_alive() and process.exitcode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# ---- a worker whose engine process dies ---------------------------------------------------------------------------
def engine_children() -> set[int]:
    """This process's children that are engine processes (spawned; not multiprocessing's resource tracker)."""
    return set(engine_processes(os.getpid()))


async def decode_tokens(channel, rid: str, max_tokens: int, tokens: list | None = None) -> list[int]:
    from pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc

    tokens = [] if tokens is None else tokens
    call = worker_pb2_grpc.DecodeStub(channel).Decode(worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=PROMPTS[0], kv_source=worker_pb2.KV_SOURCE_LOCAL,
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)), timeout=120)
    async for msg in call:
        tokens += [t.token_id for t in msg.tokens.tokens]
    return tokens


@pytest.mark.parametrize("restart", [False, True], ids=["exit", "restart"])
def test_worker_survives_its_engine_process_being_killed(tiny_model_dir, tmp_path, restart):
    """kill -9 of a worker's engine process under 8 streams: each stream ends with UNAVAILABLE naming the dead
    engine, long before its 400 tokens, and readiness turns NOT_SERVING. Without --engine-restart the worker then
    exits with CommandError (exit status 1: the orchestrator restarts it); with it, the worker serves again from a
    new engine process under a new instance id, greedy output unchanged. No engine process outlives the worker."""
    import json
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve_server.decode_worker.server import serve
    from pdserve.v1 import worker_pb2, worker_pb2_grpc
    from pdserve_server.server_common.config import ServerArgs
    from pdserve_server.server_common.errors import CommandError
    from pdserve_server.worker_common.config import WorkerConfig

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    before = engine_children()
    ready = tmp_path / "ready.json"
    # The mock engine at a tenth of an H200's speed (steps of tens of ms, the same scheduler and process): the kill
    # comes once every stream has a token, and the real tiny model's 400 steps once all ended before the test's
    # event loop (the worker's too) got there on a loaded machine.
    engine = args(tiny_model_dir, mock_engine="smollm2-135m-h200", mock_speedup=0.1)
    config = WorkerConfig(role="colocated", engine=engine, engine_restart=restart,
                          server=ServerArgs(ready_file=str(ready), drain_timeout_s=5))

    async def main():
        server = asyncio.create_task(serve(config))
        while not ready.exists():
            assert not server.done(), server.exception()
            await asyncio.sleep(0.05)
        (engine_pid,) = engine_children() - before
        async with grpc.aio.insecure_channel(json.loads(ready.read_text())["address"]) as ch:
            worker = worker_pb2_grpc.WorkerStub(ch)
            instance = (await worker.GetInfo(worker_pb2.WorkerInfoRequest())).instance_id
            expected = await decode_tokens(ch, "before", 8)
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == serving
            partial = [[] for _ in range(8)]
            calls = [asyncio.create_task(decode_tokens(ch, f"s{i}", 400, partial[i])) for i in range(8)]
            while not all(partial):
                await asyncio.sleep(0.01)
            os.kill(engine_pid, signal.SIGKILL)
            killed = time.monotonic()
            ended = []
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                ended.append(time.monotonic() - killed)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "engine process died (killed by SIGKILL)" in e.value.details()
            assert all(len(p) < 400 for p in partial)
            print(f"streams failed {max(ended) * 1e3:.0f} ms after the kill")
            assert (await asyncio.wait_for(watch.read(), 60)).status == not_serving
            if not restart:
                with pytest.raises(CommandError, match="engine process died"):
                    await asyncio.wait_for(server, 60)
                return
            assert (await asyncio.wait_for(watch.read(), 120)).status == serving
            assert await decode_tokens(ch, "after", 8) == expected
            assert (await worker.GetInfo(worker_pb2.WorkerInfoRequest())).instance_id != instance
            (restarted,) = engine_children() - before
            assert restarted != engine_pid
            watch.cancel()
        server.cancel()
        with pytest.raises(asyncio.CancelledError):
            await server

    asyncio.run(main())
    assert engine_children() - before == set()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT to the group", "SIGKILL"])
def test_no_engine_process_outlives_its_worker(tiny_model_dir, tmp_path, how):
    """A worker stopped by SIGTERM, by a terminal's Ctrl-C (SIGINT to the whole process group: the engine ignores
    it and the worker stops it) or killed with SIGKILL (the kernel kills the engine: PR_SET_PDEATHSIG) leaves no
    engine process behind; the clean stops exit 0 without a traceback."""
    import json
    import subprocess
    import sys
    import time

    ready, log = tmp_path / "ready.json", tmp_path / "worker.log"
    root = Path(__file__).resolve().parents[2]
    with open(log, "w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "pdserve_server.cli.main", "colocated", "--model", str(tiny_model_dir), "--dtype",
             "float32",
             "--kv-tokens", "1024", "--max-model-len", "256", "--threads", "1", "--port", "0",
             "--ready-file", str(ready)], cwd=root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert worker.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the worker never became ready"
            time.sleep(0.1)
        assert json.loads(ready.read_text())["address"]
        engines = engine_processes(worker.pid)
        assert len(engines) == 1, engines
        if how == "SIGTERM":
            worker.send_signal(signal.SIGTERM)
        elif how == "SIGKILL":
            worker.kill()
        else:
            os.killpg(worker.pid, signal.SIGINT)
        code = worker.wait(120)
        deadline = time.monotonic() + 60
        while not gone(engines[0]):
            assert time.monotonic() < deadline, f"engine process {engines[0]} outlived its worker ({how})"
            time.sleep(0.1)
        if how != "SIGKILL":
            assert code == 0 and "Traceback" not in log.read_text(), log.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
