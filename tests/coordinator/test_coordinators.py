"""Coordinators scaled out: several coordinator processes on one public port (SO_REUSEPORT), each routing over
every worker, in front of mock workers (the relay is what is under test, not the model)."""
import re
import time
from pathlib import Path

import pytest

from pdserve import Client, SamplingParams
from test_mock_engine import chain

pytestmark = pytest.mark.e2e

MOCK = ["--mock-engine", "smollm2-135m-h200", "--mock-speedup", "20", "--kv-tokens", "2048", "--max-model-len", "512"]


def test_two_coordinators_share_the_port_and_each_routes_to_every_worker(tiny_model_dir, launch):
    """16 clients, each on its own connection: the kernel spreads the connections over both coordinators (all 16 on
    one has odds 2 / 2^16), every stream is right, each coordinator found both workers and served requests; when
    one coordinator is gone the other still serves the port."""
    c = launch(tiny_model_dir, colocated=True, worker_args=MOCK, num_decode=2, num_coordinators=2)
    assert set(c.processes) >= {"coordinator", "coordinator-1"}
    for i in range(16):
        prompt = [50 + i] * (10 + i)
        with Client(c.address) as client:  # a new channel: a new connection
            out = client.complete(prompt, SamplingParams(max_tokens=6, temperature=0.0), timeout=60)
        assert out.token_ids == chain(prompt, 6)
    # A request's access line is written after its final message is sent: wait (bounded) for all 16 lines. A
    # client that closes its channel at once after the final message got the whole request: logged OK.
    deadline = time.monotonic() + 30
    while True:
        logs = {name: Path(c.log_files[name]).read_text() for name in ("coordinator", "coordinator-1")}
        served = {name: len(re.findall(r"request \S+ OK: \d+ prompt \+ 6 output tokens, finish length", text))
                  for name, text in logs.items()}
        if sum(served.values()) >= 16 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sum(served.values()) == 16 and all(n > 0 for n in served.values()), served
    for name, text in logs.items():
        for address in c.worker_addresses.values():
            assert f"worker {address} joined the routing set" in text, (name, address)
    c.processes["coordinator"].terminate()
    c.processes["coordinator"].wait(30)
    for i in range(4):
        with Client(c.address) as client:
            assert client.complete([9, 9, i], SamplingParams(max_tokens=3, temperature=0.0),
                                   timeout=60).token_ids == chain([9, 9, i], 3)
