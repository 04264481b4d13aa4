"""Live membership and truthful health: a dead worker leaves routing and readiness within seconds, a restarted one
(new KV port) and a new one (found through an @FILE address list) are used with no coordinator restart."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers import TINY_WORKER, Processes, children_of, gone, readiness, wait_for
from pdserve import Client, SamplingParams

pytestmark = pytest.mark.e2e
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
WORKER = [*TINY_WORKER, "--log-level", "INFO"]


def test_dead_restarted_and_new_decode_workers(tiny_model_dir, tmp_path):
    p = Processes(tiny_model_dir, tmp_path)
    try:
        prefill, decode = p.start_all(("prefill", "prefill", *WORKER), ("decode-a", "decode", *WORKER))
        decode_list = tmp_path / "decode.list"
        decode_list.write_text(decode + "\n")
        coordinator = p.start("coordinator", "coordinator", "--prefill", prefill, "--decode", f"@{decode_list}",
                              "--stats-interval-s", "0.5", "--discovery-interval-s", "0.5")
        with Client(coordinator) as c:
            assert c.complete([5, 6, 7], GREEDY).completion_tokens == 4
            assert c.model_info().num_decode_workers == 1
        assert readiness(coordinator) == health_pb2.HealthCheckResponse.SERVING

        # The only decode worker dies: readiness turns NOT_SERVING within seconds and requests fail cleanly.
        p.kill("decode-a")
        start = time.monotonic()
        wait_for(lambda: readiness(coordinator) == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "NOT_SERVING")
        print(f"NOT_SERVING {time.monotonic() - start:.2f}s after kill -9")
        with Client(coordinator) as c, pytest.raises(grpc.RpcError) as e:
            c.complete([5, 6, 7], GREEDY)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no live decode worker" in e.value.details()

        # Restarted at the same gRPC address: a new instance with a new KV port; readiness and routing come back.
        old_kv = json.loads((tmp_path / "decode-a.ready").read_text())["kv_address"]
        p.start("decode-a", "decode", *WORKER, "--port", decode.rsplit(":", 1)[1])
        assert json.loads((tmp_path / "decode-a.ready").read_text())["kv_address"] != old_kv
        wait_for(lambda: readiness(coordinator) == health_pb2.HealthCheckResponse.SERVING, 10, "SERVING again")
        with Client(coordinator) as c:
            assert c.complete([5, 6, 7], GREEDY).completion_tokens == 4

        # A new worker on another port joins through the address list; both take requests.
        decode_b = p.start("decode-b", "decode", *WORKER)
        decode_list.write_text(f"{decode}\n{decode_b}\n")
        with Client(coordinator) as c:
            wait_for(lambda: c.model_info().num_decode_workers == 2, 10, "the new worker to join")
            for _ in range(4):
                assert c.complete([5, 6, 7], GREEDY).completion_tokens == 4
        logs = {n: (tmp_path / f"{n}.log").read_text() for n in ("decode-a", "decode-b")}
        assert all("joined=" in log for log in logs.values())  # each decoded at least one request
    finally:
        p.stop()


def test_serve_restart_brings_a_dead_worker_back_and_stop_ends_it(tiny_model_dir, capsys, launch):
    """`pdserve serve --restart` (`Cluster.supervise`): a worker that exits, killed here (a worker whose engine
    faulted exits non-zero the same way: test_worker_health), is started again on its gRPC port and the cluster
    serves through it; `stop`, from another thread, ends the supervision and leaves no process behind."""
    cluster = launch(tiny_model_dir, worker_args=WORKER)
    supervisor = threading.Thread(target=cluster.supervise, args=(True, 0.1))
    try:
        supervisor.start()
        old = cluster.processes["decode-0"]
        old.kill()
        wait_for(lambda: cluster.processes["decode-0"] is not old, 60, "decode-0 started again")

        def served() -> bool:
            try:
                with Client(cluster.address) as c:
                    return c.complete([5, 6, 7], GREEDY, timeout=30).completion_tokens == 4
            except grpc.RpcError:
                return False
        wait_for(served, 180, "a request served through the restarted decode worker")
    finally:
        cluster.stop()
        supervisor.join(60)
    assert not supervisor.is_alive()
    assert all(p.poll() is not None for p in cluster.processes.values())
    out = capsys.readouterr().out
    assert "pdserve: decode-0 exited with code -9" in out and "pdserve: restarted decode-0 on" in out


@pytest.mark.parametrize("ending", ["sigterm", "coordinator_killed"])
def test_serve_leaves_no_process_behind(tiny_model_dir, tmp_path, ending):
    """SIGTERM used to kill `pdserve serve` alone and orphan its coordinator and workers; a dead coordinator used to
    leave `serve` supervising workers nobody could reach, never exiting. SIGTERM: exit 0; the coordinator killed:
    exit 1, saying so. Either way no process of the cluster outlives serve: neither its children nor theirs (each
    worker's engine process and multiprocessing's resource tracker)."""
    proc = subprocess.Popen([sys.executable, "-m", "pdserve_server.cli.main", "serve", "--disaggregated", "--model",
                             str(tiny_model_dir), "--port", "0", "--kv-tokens", "1024", "--max-model-len", "256", "--log-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("pdserve ready on"):
                break
        children = children_of(proc.pid)
        assert len(children) == 3  # coordinator, prefill, decode
        family = children | {g for c in children for g in children_of(c)}
        assert len(family) >= 5  # and the two workers' engine processes
        if ending == "sigterm":
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        else:
            (coordinator,) = [c for c in children if b"coordinator" in Path(f"/proc/{c}/cmdline").read_bytes()]
            os.kill(coordinator, signal.SIGKILL)
            assert proc.wait(60) == 1
            assert "the coordinator exited" in proc.stdout.read()
        deadline = time.monotonic() + 30
        while any(not gone(c) for c in family):
            assert time.monotonic() < deadline, "processes of the cluster outlived serve"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()


def local_prefills(metrics_url: str) -> dict[str, float]:
    """The coordinator's pdserve:request_local_prefills_total by reason."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "pdserve:request_local_prefills" for s in f.samples if s.name.endswith("_total")}


def test_conditional_disaggregation_and_decode_workers_prefilling_without_a_prefill_worker(tiny_model_dir,
                                                                                           tmp_path):
    """Dynamo's conditional disaggregation: an uncached part of at most --local-prefill-tokens is prefilled on the
    decode worker (no KV transfer), a longer one on the prefill worker; the decode worker's prefix cache counts
    (a prompt whose KV it received goes local the next time). With the prefill worker gone, decode workers
    prefill every request and readiness stays SERVING. Greedy output equals HF's on every path."""
    from conftest import hf_greedy

    p = Processes(tiny_model_dir, tmp_path)
    try:
        prefill, decode = p.start_all(("prefill", "prefill", *WORKER), ("decode", "decode", *WORKER))
        coordinator = p.start("coordinator", "coordinator", "--prefill", prefill, "--decode", decode,
                              "--stats-interval-s", "0.5", "--local-prefill-tokens", "8", "--metrics-port", "0")
        metrics_url = json.loads((tmp_path / "coordinator.ready").read_text())["metrics_url"]
        long_prompt = [(7 * i + 3) % 500 + 10 for i in range(40)]  # 40 tokens: 2 full blocks of 16 + 8
        with Client(coordinator) as c:
            def run(prompt: list[int], cached: int = 0) -> float:
                out = c.complete(prompt, GREEDY)
                assert out.token_ids == hf_greedy(tiny_model_dir, prompt, 4), prompt
                assert out.cached_prompt_tokens == cached
                return out.timings["transfer_ms"]

            assert run(long_prompt) > 0  # 40 uncached tokens > 8: the prefill worker, then a transfer
            assert run([5, 6, 7, 8, 9]) == 0  # 5 <= 8: prefilled on the decode worker
            # The decode worker kept the 32 tokens of full blocks it received: 8 left to compute, locally.
            assert run(long_prompt, cached=32) == 0
            assert local_prefills(metrics_url) == {"short": 2.0}

            p.kill("prefill")
            wait_for(lambda: c.model_info().num_prefill_workers == 0, 10, "the prefill worker to leave")
            assert readiness(coordinator) == health_pb2.HealthCheckResponse.SERVING
            other = [(11 * i + 5) % 500 + 10 for i in range(40)]
            assert run(other) == 0
            assert local_prefills(metrics_url) == {"short": 2.0, "no_prefill_worker": 1.0}
        assert "decode workers prefill locally" in (tmp_path / "coordinator.log").read_text()
    finally:
        p.stop()


def test_a_decode_worker_prefills_while_the_prefill_queue_is_long_then_disaggregation_resumes(tiny_model_dir,
                                                                                                tmp_path):
    """Conditional disaggregation on live queue state: a slow prefill worker (4 prompt tokens a step, bursts off)
    gets a burst of long prompts; the first is routed to it, and while it is queued there the decode worker, which
    would give a first token sooner, prefills some of the others itself. Once the burst is served a request goes to
    the prefill worker again (its queue is empty). Greedy output equals HF's either way."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import hf_greedy

    p = Processes(tiny_model_dir, tmp_path)
    try:
        prefill, decode = p.start_all(("prefill", "prefill", *WORKER, "--max-num-batched-tokens", "4",
                                       "--burst-prefill-tokens", "0"),
                                      ("decode", "decode", *WORKER))
        coordinator = p.start("coordinator", "coordinator", "--prefill", prefill, "--decode", decode,
                              "--metrics-port", "0")
        metrics_url = json.loads((tmp_path / "coordinator.ready").read_text())["metrics_url"]
        prompts = [[(k * 31 + 7 * i) % 900 + 10 for i in range(120)] for k in range(7)]
        with Client(coordinator) as c:
            def run(prompt: list[int]) -> None:
                out = c.complete(prompt, GREEDY)
                assert out.token_ids == hf_greedy(tiny_model_dir, prompt, 4), prompt

            # Where each request was prefilled is read from the coordinator's count of local prefills (a request's
            # transfer_ms is no witness: layer-wise streaming can finish the transfer with the first token, 0 ms).
            run(prompts[0])  # alone: the prefill worker (its rate is measured), then a transfer
            assert not any(local_prefills(metrics_url).values())
            with ThreadPoolExecutor(5) as pool:
                list(pool.map(run, prompts[1:6]))
            burst = local_prefills(metrics_url)
            assert burst.get("queue", 0) >= 1 and {k for k, v in burst.items() if v} == {"queue"}, burst
            run(prompts[6])  # the queue drained: disaggregated again
            assert local_prefills(metrics_url) == burst
    finally:
        p.stop()


def test_a_worker_lost_under_load_turns_readiness_off_at_once(tiny_model_dir, tmp_path):
    """A decode worker killed while requests stream: the failed requests take it out of routing through membership,
    so readiness turns NOT_SERVING before any poll could have noticed (polls every 60 s here, and two must fail).
    It used to stay SERVING: the request path marked the worker down behind membership's back, the polls then
    saw no change, and load balancers kept sending traffic that was refused."""
    p = Processes(tiny_model_dir, tmp_path)
    # The longest request the tiny model allows (512 positions), so it is still decoding when the kill lands however
    # busy the machine: with 200 tokens a CI run once saw the request finish first, and nothing fail.
    long = [*WORKER, "--max-model-len", "512"]
    try:
        prefill, decode = p.start_all(("prefill", "prefill", *long), ("decode", "decode", *long))
        coordinator = p.start("coordinator", "coordinator", "--prefill", prefill, "--decode", decode,
                              "--stats-interval-s", "60", "--no-local-prefill-fallback")
        with grpc.insecure_channel(coordinator) as ch, Client(coordinator) as c:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=50)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            stream = c.generate([5, 6, 7], SamplingParams(max_tokens=505, temperature=0, ignore_eos=True))
            # The first token comes from the prefill worker, before its KV transfer ends; the later ones from the
            # decode worker, so the request is decoding there. (Killed mid-transfer, the prefill worker's report
            # blames its peer: test_migration's mid-transfer case.)
            for _ in range(4):
                next(stream)
            p.kill("decode")
            with pytest.raises(grpc.RpcError) as e:
                list(stream)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # well before a 2nd poll
            watch.cancel()
        log = (tmp_path / "coordinator.log").read_text()
        assert f"worker {decode} left the routing set: a request's call failed" in log
    finally:
        p.stop()


def test_a_slow_poll_keeps_a_worker_and_a_long_dead_one_rejoins_soon_after_it_serves(tiny_model_dir, tmp_path):
    """Polls every 0.5 s. A decode worker frozen (SIGSTOP) for 4 s answers its polls late but stays in routing:
    with the old 1 s poll deadline, any 4 s without an answer fails two polls in a row (a poll every 1.5 s: 1 s
    deadline, 0.5 s interval) and idle workers on a busy host flapped out; the deadline is 5 s now. Then the worker
    is killed and left dead for 20 s, long enough for gRPC's default reconnect backoff to grow past 10 s, and
    started again: it is back in routing within a few polls of serving, not the 26-65 s it took with the default
    backoff (the channels' backoff is held near the poll interval)."""
    p = Processes(tiny_model_dir, tmp_path)
    try:
        prefill, decode = p.start_all(("prefill", "prefill", *WORKER), ("decode", "decode", *WORKER))
        coordinator = p.start("coordinator", "coordinator", "--prefill", prefill, "--decode", decode,
                              "--stats-interval-s", "0.5", "--no-local-prefill-fallback")
        with Client(coordinator) as c:
            assert c.complete([5, 6, 7], GREEDY).completion_tokens == 4
            pid = p.procs["decode"].pid
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(4.0)  # the freeze itself (under the old deadline both failed polls end inside it)
            finally:
                os.kill(pid, signal.SIGCONT)
            assert c.model_info().num_decode_workers == 1
            assert c.complete([5, 6, 7], GREEDY).completion_tokens == 4
        assert f"worker {decode} left the routing set" not in (tmp_path / "coordinator.log").read_text()

        p.kill("decode")
        wait_for(lambda: readiness(coordinator) == health_pb2.HealthCheckResponse.NOT_SERVING, 30, "NOT_SERVING")
        time.sleep(20.0)
        p.start("decode", "decode", *WORKER, "--port", decode.rsplit(":", 1)[1])
        restarted = time.monotonic()
        wait_for(lambda: readiness(coordinator) == health_pb2.HealthCheckResponse.SERVING, 8, "rejoined")
        print(f"rejoined {time.monotonic() - restarted:.2f}s after the restarted worker served")
        with Client(coordinator) as c:
            assert c.complete([5, 6, 7], GREEDY).completion_tokens == 4
    finally:
        p.stop()


@pytest.mark.parametrize("drain_s", [120.0, 2.5])
def test_sigterm_drains_the_coordinator(tiny_model_dir, tmp_path, drain_s):
    """SIGTERM: readiness off, then in-flight streams get --drain-timeout-s to finish. They used to be cut when the
    2 s drain notice ended, as CANCELLED, filed by the access log as client cancels with 0 output tokens. Streams
    that finish in time finish OK; those still running when it runs out end UNAVAILABLE "shutting down; retry",
    and the access log counts the tokens they had streamed. (With --max-num-seqs 1 the decode worker runs the eight
    253-token streams one after another; for the short drain it is also paused from before the requests until the
    coordinator has exited, so streams are still running when the drain runs out however fast the machine: on a
    fast CPU the eight streams once fitted in 2.5 s.)"""
    from pdserve.v1 import generate_pb2, generate_pb2_grpc

    p = Processes(tiny_model_dir, tmp_path)
    try:
        prefill, decode = p.start_all(("prefill", "prefill", *WORKER),
                                      ("decode", "decode", *WORKER, "--max-num-seqs", "1"))
        coordinator = p.start("coordinator", "coordinator", "--prefill", prefill, "--decode", decode,
                              "--drain-timeout-s", str(drain_s), "--metrics-port", "0")
        metrics_url = json.loads((tmp_path / "coordinator.ready").read_text())["metrics_url"]
        paused = drain_s < 100  # no stream can finish before the drain runs out, however fast the machine
        if paused:
            os.kill(p.procs["decode"].pid, signal.SIGSTOP)
        with grpc.insecure_channel(coordinator) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            calls = [stub.Generate(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=[5 + i, 6, 7]),
                sampling=generate_pb2.SamplingParams(max_tokens=253, temperature=0, ignore_eos=True)), timeout=300)
                for i in range(8)]
            # Admitted: in flight or already finished (a fast machine finishes the first ones at once)
            wait_for(lambda: in_flight(metrics_url) + finished(metrics_url) == 8, 60, "eight requests admitted")
            p.procs["coordinator"].send_signal(signal.SIGTERM)
            ends, counts = [], []
            for call in calls:
                counts.append(0)
                try:
                    for msg in call:
                        counts[-1] += len(msg.chunk.token_ids)
                    ends.append("OK")
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE and "shutting down; retry" in e.details(), e
                    ends.append("UNAVAILABLE")
        assert p.procs["coordinator"].wait(timeout=drain_s + 60) == 0
        if paused:
            os.kill(p.procs["decode"].pid, signal.SIGCONT)
        if drain_s > 100:
            assert ends == ["OK"] * 8 and counts == [253] * 8
        else:
            assert "UNAVAILABLE" in ends
        log = (tmp_path / "coordinator.log").read_text()
        for end, count in zip(ends, counts):
            assert f"{end}: 3 prompt + {count} output tokens" in log
        assert "CANCELLED" not in log
    finally:
        if p.procs.get("decode") is not None and p.procs["decode"].poll() is None:
            os.kill(p.procs["decode"].pid, signal.SIGCONT)  # a stopped process cannot take the SIGTERM of stop()
        p.stop()


def finished(metrics_url: str) -> float:
    """The coordinator's pdserve:request_success_total, every finish reason."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "pdserve:request_success"
               for s in f.samples if s.name.endswith("_total"))


def in_flight(metrics_url: str) -> float:
    """The coordinator's pdserve:num_requests_in_flight."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "pdserve:num_requests_in_flight"
               for s in f.samples)
