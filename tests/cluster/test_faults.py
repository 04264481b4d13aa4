"""Regression tests for a hardening review's findings, on a real cluster (tiny random-weight model): what one caller sends
cannot fail another caller's request, and bad input gets a status a caller can act on."""
import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from conftest import hf_greedy
from pdserve import AsyncClient, Client, SamplingParams
from pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from helpers import assert_idle, greedy

pytestmark = pytest.mark.e2e
LEASE_S = 2


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, launch_module):
    return launch_module(tiny_model_dir, worker_args=["--dtype", "float32", "--kv-tokens", "2048",
                                                      "--max-model-len", "512", "--connector", "tcp",
                                                      "--kv-timeout-s", str(LEASE_S)])


PROMPTS = [[5 + i, 17, 300 + i, 4000, 9 + i] * (i + 1) for i in range(6)]


@pytest.mark.parametrize("extreme", [dict(temperature=1e-38), dict(temperature=1e-45),
                                     dict(temperature=1.0, repetition_penalty=1e-38)])
def test_one_extreme_request_fails_no_bystander(cluster, tiny_model_dir, extreme):
    async def main():
        async with AsyncClient(cluster.address) as c:
            odd = c.complete([11, 12, 13], SamplingParams(max_tokens=8, ignore_eos=True, **extreme))
            honest = [c.complete(p, greedy(8, ignore_eos=True)) for p in PROMPTS]
            return await asyncio.gather(odd, *honest)

    odd, *honest = asyncio.run(main())
    assert odd.completion_tokens == 8
    for p, out in zip(PROMPTS, honest):
        assert out.token_ids == hf_greedy(tiny_model_dir, p, 8)
    assert_idle(cluster)


def test_worker_abort_ends_the_client_stream_promptly(cluster):
    """Worker.Abort used to free the request but leave its client waiting for the deadline. (Workers know a
    request by its id scoped to the caller, here this test's peer address: `coordinator.flow.scoped_id`.)"""
    from pdserve_server.coordinator.flow import scoped_id

    with Client(cluster.address) as c:
        stream = c.generate([5, 6, 7], greedy(400, ignore_eos=True), request_id="worker-abort", timeout=60)
        next(stream)
        worker_id = scoped_id("peer:ipv4:127.0.0.1", "worker-abort")
        with grpc.insecure_channel(cluster.worker_addresses["decode-0"]) as ch:
            assert worker_pb2_grpc.WorkerStub(ch).Abort(generate_pb2.AbortRequest(request_id=worker_id),
                                                        metadata=cluster.worker_metadata).found
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
    assert e.value.code() == grpc.StatusCode.ABORTED and time.monotonic() - start < 10
    assert_idle(cluster)


def test_malformed_request_body_is_invalid_argument(cluster):
    with grpc.insecure_channel(cluster.address) as ch:
        call = ch.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            list(call(b"\xff\xff\xff\xff not protobuf", timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid message" in e.value.details()


def test_concurrent_duplicate_ids_never_kill_the_first(cluster):
    """Both used to pass the check while the first was being tokenized; the duplicate then killed the first. The
    first decodes 64 tokens, so it is still in flight when the second arrives however busy the machine (with 6, a
    first that finished before the second's call was admitted left both to succeed: a CI run saw it)."""
    async def main():
        async with AsyncClient(cluster.address) as c:
            return await asyncio.gather(
                *(c.complete("the same id twice " * 100, greedy(64, ignore_eos=True), request_id="dup")
                  for _ in range(2)), return_exceptions=True)

    for _ in range(3):
        results = asyncio.run(main())
        errors = [r for r in results if isinstance(r, Exception)]
        assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.ALREADY_EXISTS, results
        assert "already in flight" in errors[0].details()  # refused at the door, not by a worker mid-flight
        assert [r.completion_tokens for r in results if not isinstance(r, Exception)] == [64]
    assert_idle(cluster)


def test_internal_api_out_of_vocab_token_fails_only_its_call(cluster):
    """A Decode call with an out-of-vocabulary token used to fail every request on that decode worker."""
    async def main():
        async with AsyncClient(cluster.address) as c:
            honest = asyncio.gather(*(c.complete(p, greedy(30, ignore_eos=True)) for p in PROMPTS))
            await asyncio.sleep(0.3)
            async with grpc.aio.insecure_channel(cluster.worker_addresses["decode-0"]) as ch:
                call = worker_pb2_grpc.DecodeStub(ch).Decode(worker_pb2.DecodeRequest(
                    request_id="oov", prompt_token_ids=[5, 10 ** 6], kv_source=worker_pb2.KV_SOURCE_LOCAL,
                    sampling=generate_pb2.SamplingParams(max_tokens=3)), timeout=10, metadata=cluster.worker_metadata)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in call:
                        pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in e.value.details()
            return await honest

    assert all(out.completion_tokens == 30 for out in asyncio.run(main()))
    assert_idle(cluster)


def test_a_caller_cannot_hold_blocks_past_the_workers_lease(cluster):
    """kv_timeout_ms = 2^32-1 used to hold reserved blocks for ~49.7 days."""
    with grpc.insecure_channel(cluster.worker_addresses["decode-0"]) as ch:
        call = worker_pb2_grpc.DecodeStub(ch).Decode(worker_pb2.DecodeRequest(
            request_id="squatter", prompt_token_ids=list(range(5, 405)), kv_source=worker_pb2.KV_SOURCE_REMOTE,
            sampling=generate_pb2.SamplingParams(max_tokens=8), kv_timeout_ms=2 ** 32 - 1), timeout=30,
            metadata=cluster.worker_metadata)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:
                pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "lease" in e.value.details()
    assert time.monotonic() - start < LEASE_S + 5
    assert_idle(cluster)


def test_renewals_hold_a_reservation_and_it_lapses_when_they_stop(cluster):
    async def main():
        async with grpc.aio.insecure_channel(cluster.worker_addresses["decode-0"]) as ch:
            stub, md = worker_pb2_grpc.DecodeStub(ch), cluster.worker_metadata
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.RenewLease(worker_pb2.RenewLeaseRequest(request_id="nobody"), metadata=md)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            call = stub.Decode(worker_pb2.DecodeRequest(
                request_id="renewed", prompt_token_ids=list(range(5, 45)), kv_source=worker_pb2.KV_SOURCE_REMOTE,
                sampling=generate_pb2.SamplingParams(max_tokens=8)), timeout=30, metadata=md)
            reserved = await call.read()
            assert reserved.reserved.lease_ms == LEASE_S * 1000
            start = time.monotonic()
            while time.monotonic() - start < 2.5 * LEASE_S:  # renewed: held past its lease
                renewed = await stub.RenewLease(worker_pb2.RenewLeaseRequest(request_id="renewed"), metadata=md)
                assert renewed.lease_ms == LEASE_S * 1000
                await asyncio.sleep(LEASE_S / 4)
            stopped = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "lease" in e.value.details()
            assert LEASE_S / 2 < time.monotonic() - stopped < LEASE_S + 3

    asyncio.run(main())
    assert_idle(cluster)


def test_a_prefill_queued_past_the_lease_still_completes(cluster, tiny_model_dir):
    """The decode lease used to run while the prefill was still queued: a prefill worker busy (here: paused) for
    longer than the lease failed its requests with DEADLINE_EXCEEDED "KV ... did not arrive within the lease". The
    coordinator now renews the lease until the first token, so only a silent coordinator lets it lapse."""
    prefill = cluster.processes["prefill-0"]
    prompt = [7, 8, 9, 10, 11] * 8
    with Client(cluster.address) as c, ThreadPoolExecutor(1) as pool:
        prefill.send_signal(signal.SIGSTOP)  # before sending: the request then certainly queues behind the pause
        try:
            out = pool.submit(c.complete, prompt, greedy(8, ignore_eos=True), timeout=60)
            time.sleep(3 * LEASE_S)
        finally:
            prefill.send_signal(signal.SIGCONT)
        assert out.result().token_ids == hf_greedy(tiny_model_dir, prompt, 8)
    assert_idle(cluster)


def test_oversized_inputs_are_refused_before_work_with_short_messages(cluster):
    with Client(cluster.address) as c:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:  # past the message size the context window needs: never parsed
            c.complete("x" * 3_000_000, greedy(2))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # within it, but more characters than the context can hold
            c.complete("x" * 500_000, greedy(2))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "characters" in e.value.details()
        assert time.monotonic() - start < 5
        with pytest.raises(grpc.RpcError) as e:
            c.complete("hi", greedy(2), model="m" * 1_000_000)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details()) < 500
        with pytest.raises(grpc.RpcError) as e:
            c.complete("hi", greedy(2), request_id="r" * 100_000)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details()) < 500
    assert_idle(cluster)


def test_a_killed_launcher_leaves_no_server_behind(tiny_model_dir, tmp_path):
    """A launcher (here a Python process standing for `pdserve serve` or a test run) killed with SIGKILL cannot stop
    its cluster; every process it started notices it is gone and shuts down within seconds."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import json, sys, time\n"
        "from pdserve_server.cli.launcher import ServeConfig, start_cluster\n"
        f"c = start_cluster({str(tiny_model_dir)!r}, 'tiny', ServeConfig(log_dir={str(tmp_path)!r}),\n"
        "                  worker_args=['--kv-tokens', '1024', '--max-model-len', '256'])\n"
        "print(json.dumps([p.pid for p in c.processes.values()]), flush=True)\n"
        "time.sleep(600)\n")
    root = Path(__file__).resolve().parents[2]
    launcher = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(launcher.stdout.readline())
        assert len(pids) == 3
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)

        def alive(pid):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) counts as gone
                return f.read().split(") ", 1)[1][0] != "Z"
        deadline = time.monotonic() + 60
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [p for p in pids if alive(p)], "servers outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
