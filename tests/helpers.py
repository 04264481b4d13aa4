"""What the end-to-end tests share besides fixtures (those are in conftest.py): sampling shorthands, a worker's
stats and the idle check, load with random cancels, Prometheus scrapes, processes found through /proc, bounded
waits, and workers started one by one as an operator would."""
from __future__ import annotations

import asyncio
import os
import socket
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from pdserve import AsyncClient, SamplingParams

# A tiny model's workers: small pools, whole-block KV over TCP.
TINY_WORKER = ["--dtype", "float32", "--kv-tokens", "1024", "--max-model-len", "256", "--connector", "tcp"]
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")  # what Prometheus 2.x sends


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for servers started by a test: Prometheus, smg, Redis)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy(n: int, **kw) -> SamplingParams:
    """Greedy sampling of at most n tokens (kw: any other SamplingParams field)."""
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def worker_stats(cluster, name: str):
    """A worker's GetStats answer, with its pool's integrity checked (the internal API: the cluster secret is
    required, which `cluster.worker_metadata` carries)."""
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(cluster.worker_addresses[name]) as ch:
        return worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.WorkerStatsRequest(check_integrity=True), timeout=10,
                                                       metadata=cluster.worker_metadata)


def assert_idle(cluster, timeout_s: float = 30.0) -> None:
    """Every worker returns to its idle pool counts (no leaked blocks or requests) within timeout_s, pools intact."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {n: worker_stats(cluster, n) for n in cluster.worker_addresses}
        if all(s.num_free_blocks == s.num_total_blocks and s.num_requests == 0 for s in stats.values()):
            assert all(s.pool_integrity_ok for s in stats.values())
            return
        if time.monotonic() > deadline:
            pytest.fail(f"workers not idle: {stats}")
        time.sleep(0.2)


def complete_all(address: str, requests) -> list:
    """Send every (prompt, SamplingParams) of `requests` at once over one channel; their completions, in order
    (`AsyncClient.complete`)."""
    async def main():
        async with AsyncClient(address) as client:
            return await asyncio.gather(*(client.complete(prompt, params) for prompt, params in requests))

    return asyncio.run(main())


def generate_with_random_cancels(address, prompts, rng, max_tokens, cancel_after, concurrency, total_timeout_s,
                                 id_prefix, call_timeout_s=None) -> None:
    """Send every prompt once (greedy, ignore_eos, rng.randint(*max_tokens) tokens) with `concurrency` in flight,
    leaving each stream after rng.choice(cancel_after) chunks (None = read it to the end). Raises TimeoutError
    unless every stream ended within total_timeout_s."""
    async def one(c, i, prompt, sem):
        async with sem:
            n = rng.randint(*max_tokens)
            stop_after = rng.choice(cancel_after)
            got = 0
            async for _ in c.generate(prompt, greedy(n, ignore_eos=True), request_id=f"{id_prefix}-{i}",
                                      timeout=call_timeout_s):
                got += 1
                if stop_after is not None and got > stop_after:
                    break

    async def main():
        sem = asyncio.Semaphore(concurrency)
        async with AsyncClient(address) as c:
            await asyncio.wait_for(asyncio.gather(*(one(c, i, p, sem) for i, p in enumerate(prompts))),
                                   total_timeout_s)

    asyncio.run(main())


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a /metrics page fetched as Prometheus does, parsed by
    prometheus-client's parser (the names must keep their 'pdserve:' prefix)."""
    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(url, headers={"Accept": PROMETHEUS_ACCEPT})
    text = urllib.request.urlopen(request, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels) -> float:
    """The sum of a scrape's samples called `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, val) in ls for k, val in labels.items()))


def scrape_when(url: str, name: str, value: float, timeout_s: float = 30.0, **labels) -> dict[tuple[str, tuple], float]:
    """scrape(url) once total(name, **labels) == value, or the last scrape after timeout_s. A request is recorded
    after its last message is sent, so a client that has its answer can scrape before the server has counted it."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if total(samples, name, **labels) == value or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def children_of(pid: int) -> set[int]:
    """The live child processes of pid (/proc/<pid>/task/*/children); empty once pid is gone."""
    out = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.update(int(p) for p in f.read().split())
        except OSError:
            continue  # the thread ended meanwhile
    return out


def engine_processes(worker_pid: int) -> list[int]:
    """The engine-core processes a worker spawned (multiprocessing's spawn children, not its resource tracker)."""
    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""  # exited meanwhile
    return [p for p in children_of(worker_pid)
            if b"multiprocessing.spawn" in (line := cmdline(p)) and b"resource_tracker" not in line]


def gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie nobody waits for: re-parented to init, it is reaped soon)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_for(predicate, timeout_s: float, what: str):
    """predicate()'s first truthy value, polled every 0.1 s; fails the test naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    pytest.fail(f"{what} within {timeout_s}s")


def readiness(address: str) -> int:
    """The standard gRPC health service's status for the whole server (health_pb2.HealthCheckResponse values)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


class Processes:
    """Workers and a coordinator started one by one, as an operator (or compose) would, sharing one secret; their
    logs are <workdir>/<name>.log."""

    def __init__(self, model_dir: Path, workdir: Path):
        self.model_dir, self.workdir = str(model_dir), workdir
        self.secret = workdir / "cluster.secret"
        self.secret.write_text("membership-test-secret")
        self.procs: dict[str, object] = {}
        self._ready: dict[str, Path] = {}  # name -> the ready file its process writes
        self.env = dict(os.environ)

    def start(self, name: str, *args: str) -> str:
        """Start a role (`args`: its command and flags) and return its address once it serves (180 s at most)."""
        self.spawn(name, *args)
        return self.wait(name)[0]

    def start_all(self, *specs: tuple[str, ...]) -> list[str]:
        """Start several processes side by side, each spec (name, role command, flags...); their addresses, in
        order, once all serve."""
        for name, *args in specs:
            self.spawn(name, *args)
        return self.wait(*(spec[0] for spec in specs))

    def spawn(self, name: str, *args: str) -> None:
        """Start a role without waiting for it (several start side by side; `wait` for their addresses)."""
        from pdserve_server.cli.launcher import _spawn

        (self.workdir / f"{name}.ready").unlink(missing_ok=True)
        proc, self._ready[name], _ = _spawn([*args, "--model", self.model_dir, "--cluster-secret-file",
                                             str(self.secret)], name, self.workdir, self.workdir, self.env)
        self.procs[name] = proc

    def wait(self, *names: str) -> list[str]:
        """The addresses of spawned processes, in `names` order, once all serve (180 s at most)."""
        from pdserve_server.cli.launcher import wait_ready

        infos = wait_ready([(n, self.procs[n], self._ready[n]) for n in names], 180)
        return [info["address"] for info in infos]

    def kill(self, name: str) -> None:
        """SIGKILL one process and reap it."""
        self.procs[name].kill()
        self.procs[name].wait()

    def stop(self) -> None:
        """SIGKILL and reap every process still running."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
