"""Request migration (NVIDIA Dynamo's): a worker lost mid-request and the client's stream goes on, on other workers,
with no error and no token repeated or lost; greedy output equals the run without a loss. Bounded by
--max-migrations, then a clean UNAVAILABLE.

The tests that kill a worker after some tokens run mock engines whose modelled steps are slowed (SmolLM2's H200
profile at 0.1x: ~23 ms per decode step), so the ~210 tokens still to come take seconds, however fast the machine;
on the real tiny model a loaded CI machine could see the whole request end before the kill (it did once). Their
streams are checked against the mock's derived tokens, which a resumed request continues exactly as the lost
worker would have (they depend on the context only)."""
import json
import os
import signal
import threading
import time

import grpc
import pytest

from conftest import hf_greedy
from pdserve_server.engine.mock.runner import continuation
from pdserve import Client, SamplingParams
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from helpers import Processes, wait_for
from test_membership import WORKER

pytestmark = pytest.mark.e2e
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111]
SLOW_MOCK = [*WORKER, "--mock-engine", "smollm2-135m-h200", "--mock-speedup", "0.1"]


def derived(model_dir, prompt: list[int], n: int) -> list[int]:
    """The greedy tokens a mock engine streams for `prompt` with the model's vocabulary (EOS 2 never drawn)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return continuation(prompt, n, cfg["vocab_size"], frozenset({cfg["eos_token_id"]}))


def requests_on(p: Processes, address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        stats = worker_pb2_grpc.WorkerStub(ch).GetStats(
            worker_pb2.WorkerStatsRequest(), timeout=5,
            metadata=(("authorization", f"Bearer {p.secret.read_text()}"),))
    return stats.num_requests


def kill_the_one_serving(p: Processes, names: list[str], addresses: dict[str, str], kill=None) -> str:
    """kill(name) (default: SIGKILL) the one of `names` that holds a request; returns its name."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for name in names:
            if requests_on(p, addresses[name]):
                (kill or p.kill)(name)
                return name
    pytest.fail(f"none of {names} holds the request")


def stream_with_a_kill(address: str, n: int, kill) -> tuple[list[int], object]:
    """Stream a greedy request, call kill() once 20 tokens arrived; returns (all token ids, final)."""
    ids, final, killed = [], None, None
    with Client(address) as c:
        for chunk in c.generate(PROMPT, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), timeout=120):
            if chunk.final is not None:
                final = chunk.final
            ids += chunk.token_ids
            if killed is None and len(ids) >= 20:
                killed = kill()
    return ids, final


@pytest.mark.parametrize("topology", ["disaggregated", "colocated"])
def test_decode_worker_lost_mid_stream(tiny_model_dir, tmp_path, topology):
    p = Processes(tiny_model_dir, tmp_path)
    try:
        colocated = topology == "colocated"
        role = "colocated" if colocated else "decode"
        for n in ("d0", "d1"):
            p.spawn(n, role, *SLOW_MOCK)
        if not colocated:
            p.spawn("p0", "prefill", *SLOW_MOCK)
        addresses = dict(zip(("d0", "d1"), p.wait("d0", "d1")))
        args = ["coordinator", "--stats-interval-s", "0.5", *(f"--decode={a}" for a in addresses.values())]
        if colocated:
            args.append("--colocated")
        else:
            args.append(f"--prefill={p.wait('p0')[0]}")
        coordinator = p.start("coordinator", *args)
        n = 230
        ids, final = stream_with_a_kill(coordinator, n, lambda: kill_the_one_serving(p, ["d0", "d1"], addresses))
        assert final.finish_reason == "length" and final.completion_tokens == n == len(ids)
        assert ids == derived(tiny_model_dir, PROMPT, n)  # nothing repeated, nothing lost
        log = (tmp_path / "coordinator.log").read_text()
        assert "resuming on other workers after" in log and "(migration 1 of at most 2)" in log
    finally:
        p.stop()


def test_a_frozen_decode_worker_is_cut_loose_and_its_request_migrates(tiny_model_dir, tmp_path):
    """A decode worker frozen mid-stream (SIGSTOP: no error ever comes, its connection stays open) leaves routing
    after two failed polls, and membership then cuts its calls: the request resumes on the other worker about 10 s
    after the freeze (two polls' 5 s deadlines). Before, the frozen call held the stream until HTTP/2 keepalive ended
    it (20 s + 10 s at best; once not within 60 s in CI) or the request's deadline did."""
    p = Processes(tiny_model_dir, tmp_path)
    try:
        for n in ("d0", "d1"):
            p.spawn(n, "decode", *SLOW_MOCK)
        p.spawn("p0", "prefill", *SLOW_MOCK)
        addresses = dict(zip(("d0", "d1"), p.wait("d0", "d1")))
        coordinator = p.start("coordinator", "coordinator", "--stats-interval-s", "0.5", f"--prefill={p.wait('p0')[0]}",
                              *(f"--decode={a}" for a in addresses.values()))
        n = 230
        freeze = lambda name: os.kill(p.procs[name].pid, signal.SIGSTOP)  # noqa: E731
        ids, final = stream_with_a_kill(coordinator, n, lambda: kill_the_one_serving(p, ["d0", "d1"], addresses,
                                                                                     freeze))
        assert final.finish_reason == "length" and final.completion_tokens == n == len(ids)
        assert ids == derived(tiny_model_dir, PROMPT, n)  # nothing repeated, nothing lost
        log = (tmp_path / "coordinator.log").read_text()
        assert "stopped answering health checks" in log and "(migration 1 of at most 2)" in log
    finally:
        p.stop()  # SIGKILL ends a stopped process too


def test_prefill_worker_lost_before_the_first_token(tiny_model_dir, tmp_path):
    """The prefill worker computing a request's prompt is lost before its first token: the request resumes on the
    other prefill worker after 0 tokens. The order is forced, not raced (a prefill of 240 tokens takes ~40 ms on a
    fast machine): p0, the only listed prefill worker, is frozen (SIGSTOP) before the request comes, so the Prefill
    call that follows the decode worker's reservation waits in p0; p1 (started beforehand, so it joins long before
    the frozen p0 misses enough polls to leave routing) then joins through the address list, and p0 is killed."""
    p = Processes(tiny_model_dir, tmp_path)
    try:
        p0, p1, decode = p.start_all(("p0", "prefill", *WORKER), ("p1", "prefill", *WORKER), ("d0", "decode", *WORKER))
        prefill = {"p0": p0, "p1": p1}
        prefill_list = tmp_path / "prefill.list"
        prefill_list.write_text(prefill["p0"] + "\n")
        coordinator = p.start("coordinator", "coordinator", "--stats-interval-s", "0.5", "--discovery-interval-s",
                              "0.5", "--no-local-prefill-queue", f"--decode={decode}", f"--prefill=@{prefill_list}")
        prompt = list(range(1000, 1240))
        os.kill(p.procs["p0"].pid, signal.SIGSTOP)
        with Client(coordinator) as c:
            stream = c.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), timeout=120)
            result = {}
            reader = threading.Thread(target=lambda: result.update(chunks=list(stream)))
            reader.start()
            # The reservation is made, so the Prefill call to p0 (the only prefill worker) follows at once.
            wait_for(lambda: requests_on(p, decode), 30, "the decode worker to reserve KV blocks")
            prefill_list.write_text(f"{prefill['p0']}\n{prefill['p1']}\n")
            wait_for(lambda: c.model_info().num_prefill_workers == 2, 30, "p1 to join")
            p.kill("p0")
            reader.join(120)
        ids = [t for ch in result["chunks"] for t in ch.token_ids]
        assert ids == hf_greedy(tiny_model_dir, prompt, 8) and result["chunks"][-1].final.completion_tokens == 8
        assert "resuming on other workers after 0 token(s)" in (tmp_path / "coordinator.log").read_text()
    finally:
        p.stop()


def test_migration_budget_spent_is_a_clean_unavailable(tiny_model_dir, tmp_path):
    p = Processes(tiny_model_dir, tmp_path)
    try:
        d0, p0 = p.start_all(("d0", "decode", *SLOW_MOCK), ("p0", "prefill", *SLOW_MOCK))
        decode = {"d0": d0}
        coordinator = p.start("coordinator", "coordinator", "--max-migrations", "0", "--stats-interval-s", "0.5",
                              f"--prefill={p0}", f"--decode={decode['d0']}")
        with pytest.raises(grpc.RpcError) as e:
            stream_with_a_kill(coordinator, 230, lambda: kill_the_one_serving(p, ["d0"], decode))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "most allowed" in e.value.details()
    finally:
        p.stop()


def test_a_decode_worker_lost_mid_transfer_is_blamed_not_the_prefill_worker(tiny_model_dir, tmp_path):
    """The decode worker holding the reservation is killed while the prefill worker's KV transfer to it is in flight:
    both the prefill worker's TRANSFER_FAILED and the lost Decode stream must blame the decode worker. The prefill
    worker's report used to win and name the prefill worker, so membership took the healthy prefill worker out of
    routing while the dead decode worker stayed in it. The order is forced with SIGSTOP: the prefill worker is
    frozen before the request comes, the decode worker once it holds the reservation, then the prefill worker runs
    (first token, then a transfer that cannot finish) and the decode worker is killed."""
    p = Processes(tiny_model_dir, tmp_path)
    try:
        prefill, d0, d1 = p.start_all(("p0", "prefill", *WORKER), ("d0", "decode", *WORKER), ("d1", "decode", *WORKER))
        decode = {"d0": d0, "d1": d1}
        coordinator = p.start("coordinator", "coordinator", "--stats-interval-s", "60", f"--prefill={prefill}",
                              "--no-local-prefill-queue", "--log-level", "DEBUG",
                              *(f"--decode={a}" for a in decode.values()))
        prompt, n = list(range(1000, 1100)), 24
        first, result = threading.Event(), {}

        def read():
            try:
                with Client(coordinator) as c:
                    chunks = []
                    for chunk in c.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                            timeout=120):
                        chunks.append(chunk)
                        first.set()
                    result["chunks"] = chunks
            except grpc.RpcError as e:
                result["error"] = e
                first.set()

        os.kill(p.procs["p0"].pid, signal.SIGSTOP)
        reader = threading.Thread(target=read)
        reader.start()
        # The coordinator's log, not the decode worker's stats: a worker counts the request before its reservation
        # reply is written, and one stopped in between would hold the coordinator before it calls the prefill worker.
        log_file = tmp_path / "coordinator.log"
        held = wait_for(lambda: next((name for name, a in decode.items()
                                      if f"KV blocks reserved on {a}," in log_file.read_text()), None), 60,
                        "the coordinator has a decode worker's reservation")
        os.kill(p.procs[held].pid, signal.SIGSTOP)
        os.kill(p.procs["p0"].pid, signal.SIGCONT)
        assert first.wait(60), "the prefill worker's first token reached the client"
        p.kill(held)
        reader.join(120)
        assert "error" not in result, result.get("error")
        ids = [t for ch in result["chunks"] for t in ch.token_ids]
        assert ids == hf_greedy(tiny_model_dir, prompt, n)  # migrated to the other decode worker
        log = (tmp_path / "coordinator.log").read_text()
        assert f"worker {decode[held]} left the routing set" in log
        assert f"worker {prefill} left the routing set" not in log
    finally:
        p.stop()
