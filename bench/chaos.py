"""Chaos: a live cluster under load while things go wrong, then a check that nothing leaked and nobody hung.

A coordinator in front of 2 prefill + 2 decode workers (ports fixed, so a restarted process comes back at its
address) serves a steady closed-loop load of greedy requests. Each round, faults are injected at random moments:
random client cancellations, Abort storms, kill -9 and restart of a worker, SIGSTOP/SIGCONT of a worker, a
coordinator restart, slow readers, a 256-stream burst, a garbage writer on a decode worker's KV port, malformed
gRPC bodies. A round ends with the load stopped and every worker checked: KV pool back at idle, integrity OK, no
request left; every stream must have ended with a final message or a clean status (a stream still open at its
deadline counts as hung); greedy outputs of requests that finished must equal the reference run, migrated or not.

    .venv/bin/python bench/chaos.py --minutes 30 [--connector ucx] [--kv-layerwise] [--model-dir DIR] [--out FILE.json]

tests/bench/test_chaos.py runs one short round on the tiny model in CI.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

HERE = Path(__file__).resolve().parent
STREAM_DEADLINE_S = 120.0
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    """Processes on fixed ports, started and restarted like an operator would (one secret for all)."""

    model_dir: str
    workdir: Path
    worker_args: list[str]
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    restarts: int = 0

    def __post_init__(self) -> None:
        self.secret = self.workdir / "cluster.secret"
        self.secret.write_text(os.urandom(16).hex())
        self.ports = {name: free_port() for name in ("coordinator", *WORKERS)}

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def args(self, name: str) -> list[str]:
        role = name.split("-")[0]
        if role == "coordinator":
            return ["coordinator", "--stats-interval-s", "0.5", "--request-timeout-s", str(STREAM_DEADLINE_S),
                    *(f"--prefill={self.address(n)}" for n in WORKERS if n.startswith("prefill")),
                    *(f"--decode={self.address(n)}" for n in WORKERS if n.startswith("decode"))]
        return [role, *self.worker_args, "--kv-timeout-s", "10", "--transfer-timeout-s", "10"]

    def start(self, name: str, wait: bool = True) -> None:
        from pdserve_server.cli.launcher import wait_ready

        ready = self.workdir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        log = open(self.workdir / f"{name}.log", "a")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "pdserve_server.cli.main", *self.args(name), "--model", self.model_dir, "--port",
             str(self.ports[name]), "--cluster-secret-file", str(self.secret), "--ready-file", str(ready),
             # The coordinator at INFO: its access log names each failed request's status and cause.
             "--log-level", "INFO" if name == "coordinator" else "WARNING"], stdout=log, stderr=subprocess.STDOUT)
        if wait:
            wait_ready([(name, self.procs[name], ready)], 300)

    def kill(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].wait()

    def restart(self, name: str) -> None:
        self.kill(name)
        self.start(name)
        self.restarts += 1

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    def stats(self, name: str):
        from pdserve.v1 import worker_pb2, worker_pb2_grpc

        with grpc.insecure_channel(self.address(name)) as ch:
            return worker_pb2_grpc.WorkerStub(ch).GetStats(
                worker_pb2.WorkerStatsRequest(check_integrity=True), timeout=10,
                metadata=(("authorization", f"Bearer {self.secret.read_text()}"),))


@dataclass
class Tally:
    """Outcomes of every stream of a run."""

    outcomes: Counter = field(default_factory=Counter)  # "ok", "cancelled", "aborted", or a status code name
    wrong_outputs: int = 0
    hung: int = 0
    sent: int = 0
    faults: Counter = field(default_factory=Counter)


class Load:
    """Closed-loop clients sending greedy requests whose reference outputs are known (`references`)."""

    def __init__(self, address: str, prompts: list[list[int]], references: dict[int, list[int]], max_tokens: int,
                 tally: Tally, rng: random.Random):
        self.address, self.prompts, self.references = address, prompts, references
        self.max_tokens, self.tally, self.rng = max_tokens, tally, rng
        self.in_flight: dict[str, object] = {}

    async def one(self, client, slow: bool = False, cancel_after: int | None = None) -> str:
        """One request; returns its outcome (also counted in the tally)."""
        from pdserve import SamplingParams

        i = self.rng.randrange(len(self.prompts))
        rid = f"chaos-{self.tally.sent}-{self.rng.randrange(1 << 30)}"
        self.tally.sent += 1
        ids, final = [], None
        try:
            async with asyncio.timeout(STREAM_DEADLINE_S + 30):
                stream = client.generate(self.prompts[i], SamplingParams(max_tokens=self.max_tokens, temperature=0,
                                                                         ignore_eos=True),
                                         request_id=rid, timeout=STREAM_DEADLINE_S)
                self.in_flight[rid] = stream
                async for chunk in stream:
                    ids += chunk.token_ids
                    final = chunk.final or final
                    if slow:
                        await asyncio.sleep(0.05)
                    if cancel_after is not None and len(ids) >= cancel_after:
                        await stream.aclose()
                        self.tally.outcomes["cancelled"] += 1
                        return "cancelled"
        except TimeoutError:
            self.tally.hung += 1
            return "hung"
        except grpc.aio.AioRpcError as e:
            self.tally.outcomes[e.code().name] += 1
            return e.code().name
        finally:
            self.in_flight.pop(rid, None)
        outcome = "no final" if final is None else "aborted" if final.finish_reason == "abort" else "ok"
        self.tally.outcomes[outcome] += 1
        if outcome == "ok" and ids != self.references[i]:
            self.tally.wrong_outputs += 1
        return outcome

    async def client_loop(self, stop: asyncio.Event) -> None:
        from pdserve import AsyncClient

        while not stop.is_set():
            async with AsyncClient(self.address) as client:  # a fresh channel: coordinator restarts happen
                while not stop.is_set():
                    roll = self.rng.random()
                    outcome = await self.one(client, slow=roll < 0.1, cancel_after=(
                        self.rng.randrange(self.max_tokens) if roll > 0.85 else None))
                    if outcome not in ("ok", "cancelled", "aborted"):
                        await asyncio.sleep(0.25)  # back off, as a client would while the service recovers


class Faults:
    """The faults, each a coroutine that leaves the cluster meant to recover by itself (or restarts what it
    killed)."""

    def __init__(self, cluster: Cluster, load: Load, tally: Tally, rng: random.Random):
        self.cluster, self.load, self.tally, self.rng = cluster, load, tally, rng

    async def kill_worker(self) -> None:
        name = self.rng.choice(WORKERS)
        self.cluster.kill(name)
        await asyncio.sleep(self.rng.uniform(0.5, 3))
        await asyncio.to_thread(self.cluster.start, name)
        self.cluster.restarts += 1

    async def pause_worker(self) -> None:
        proc = self.cluster.procs[self.rng.choice(WORKERS)]
        proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(self.rng.uniform(1, 4))
        proc.send_signal(signal.SIGCONT)

    async def restart_coordinator(self) -> None:
        await asyncio.to_thread(self.cluster.restart, "coordinator")

    async def abort_storm(self) -> None:
        from pdserve import AsyncClient

        async with AsyncClient(self.cluster.address("coordinator")) as client:
            for rid in list(self.load.in_flight)[: self.rng.randint(1, 20)]:
                try:
                    await client.abort(rid)
                except grpc.aio.AioRpcError:
                    pass

    async def burst(self) -> None:
        from pdserve import AsyncClient

        async with AsyncClient(self.cluster.address("coordinator")) as client:
            await asyncio.gather(*(self.load.one(client) for _ in range(256)))

    async def garbage_kv(self) -> None:
        from pdserve.v1 import worker_pb2, worker_pb2_grpc

        async with grpc.aio.insecure_channel(self.cluster.address(self.rng.choice(["decode-0", "decode-1"]))) as ch:
            try:
                info = await worker_pb2_grpc.WorkerStub(ch).GetInfo(
                    worker_pb2.WorkerInfoRequest(), timeout=5,
                    metadata=(("authorization", f"Bearer {self.cluster.secret.read_text()}"),))
            except grpc.aio.AioRpcError:
                return  # the worker is down right now
        host, port = info.kv_address.split("://")[1].rsplit(":", 1)
        try:
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(struct.pack("!I", 1 << 30) + os.urandom(4096))
            await writer.drain()
            writer.close()
        except OSError:
            pass

    async def malformed(self) -> None:
        async with grpc.aio.insecure_channel(self.cluster.address("coordinator")) as ch:
            call = ch.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
            try:
                async for _ in call(os.urandom(64), timeout=5):
                    pass
            except grpc.aio.AioRpcError as e:
                self.tally.outcomes[f"malformed:{e.code().name}"] += 1

    async def run(self, stop: asyncio.Event, period_s: float) -> None:
        actions = [self.kill_worker, self.pause_worker, self.restart_coordinator, self.abort_storm, self.burst,
                   self.garbage_kv, self.malformed]
        while not stop.is_set():
            # Every kind once per cycle, in a random order: any 7 faults in a row cover them all (a random choice
            # each time needed ~18 on average), so a short round is as thorough as a long one.
            for action in self.rng.sample(actions, len(actions)):
                await asyncio.sleep(self.rng.uniform(0.5, 1.5) * period_s)
                if stop.is_set():
                    return
                self.tally.faults[action.__name__] += 1
                await action()


def references(model_dir: str, prompts: list[list[int]], max_tokens: int) -> dict[int, list[int]]:
    """Greedy outputs from HF transformers on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=2)
        out[i] = gen[0, len(p):].tolist()
    return out


def check_idle(cluster: Cluster, timeout_s: float = 60) -> dict:
    """Wait until every worker holds nothing; returns {name: (free, total, requests, integrity_ok)}."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = {}
        for name in WORKERS:
            try:
                s = cluster.stats(name)
                state[name] = (s.num_free_blocks, s.num_total_blocks, s.num_requests, s.pool_integrity_ok)
            except grpc.RpcError as e:
                state[name] = ("unreachable", e.code().name)
        if all(len(v) == 4 and v[0] == v[1] and v[2] == 0 and v[3] for v in state.values()):
            return state
        if time.monotonic() > deadline:
            return state
        time.sleep(0.5)


async def _round(cluster: Cluster, load: Load, faults: Faults, seconds: float, clients: int,
                 fault_period_s: float, enough: Callable[[], bool] = lambda: True,
                 max_seconds: float | None = None) -> None:
    """Load and faults for `seconds`, then on until enough() (counted events, so a slow or busy machine gets the
    same amount of chaos, only later), at most max_seconds in all."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(load.client_loop(stop)) for _ in range(clients)]
    tasks.append(asyncio.create_task(faults.run(stop, fault_period_s)))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(seconds, max_seconds or seconds)
    await asyncio.sleep(seconds)
    while not enough() and loop.time() < deadline:
        await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*tasks)


def run(model_dir: str, seconds: float, round_s: float = 60.0, clients: int = 6, max_tokens: int = 24,
        fault_period_s: float = 5.0, seed: int = 0, worker_args: list[str] | None = None, min_faults: int = 0,
        min_ok: int = 0, max_round_s: float | None = None) -> dict:
    """Run chaos rounds for `seconds`; returns the report (see the module docstring). Each round also goes on until
    min_faults faults were injected and min_ok requests finished OK in all (at most max_round_s a round)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(4, 60))] for _ in range(12)]
    refs = references(model_dir, prompts, max_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    cluster = Cluster(model_dir, workdir, worker_args or ["--dtype", "float32", "--kv-tokens", "2048",
                                                          "--max-model-len", "256",
                                                          "--connector", "tcp"])
    tally = Tally()
    rounds = []
    try:
        for name in WORKERS:
            cluster.start(name)
        cluster.start("coordinator")
        load = Load(cluster.address("coordinator"), prompts, refs, max_tokens, tally, rng)
        faults = Faults(cluster, load, tally, rng)
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            asyncio.run(_round(cluster, load, faults, min(round_s, seconds), clients, fault_period_s,
                               enough=lambda: (sum(tally.faults.values()) >= min_faults
                                               and tally.outcomes.get("ok", 0) >= min_ok),
                               max_seconds=max_round_s))
            for name, proc in cluster.procs.items():  # anything that died outside a fault is restarted, counted
                if proc.poll() is not None:
                    cluster.start(name)
                    cluster.restarts += 1
            idle = check_idle(cluster)
            leaked = sum(v[1] - v[0] for v in idle.values() if len(v) == 4)
            rounds.append({"idle": idle, "leaked_blocks": leaked,
                           "integrity_ok": all(len(v) == 4 and v[3] for v in idle.values())})
            print(f"round {len(rounds)}: sent {tally.sent}, outcomes {dict(tally.outcomes)}, hung {tally.hung}, "
                  f"wrong {tally.wrong_outputs}, leaked blocks {leaked}, faults {dict(tally.faults)}", flush=True)
        migrations = _scrape_migrations(cluster)
    finally:
        cluster.stop()
    return {"seconds": seconds, "rounds": len(rounds), "sent": tally.sent, "outcomes": dict(tally.outcomes),
            "hung": tally.hung, "wrong_outputs": tally.wrong_outputs, "faults": dict(tally.faults),
            "restarts": cluster.restarts, "migrations_last_coordinator": migrations,
            "leaked_blocks": [r["leaked_blocks"] for r in rounds],
            "integrity_ok": all(r["integrity_ok"] for r in rounds), "logs": str(workdir)}


def _scrape_migrations(cluster: Cluster) -> int | None:
    """Migrations the current coordinator counted (its log: a restart starts the count afresh)."""
    log = (cluster.workdir / "coordinator.log").read_text(errors="replace")
    return log.count("resuming on other workers")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--round-s", type=float, default=120.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--model-dir", default=None, help="default: a 2-layer random Llama built here (fast)")
    p.add_argument("--connector", default="tcp", choices=("tcp", "ucx", "nccl"), help="KV connector of the workers")
    p.add_argument("--kv-layerwise", action="store_true", help="prefill workers stream KV layer by layer")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model_dir = args.model_dir or tiny_model(Path(tempfile.mkdtemp(prefix="pdserve-chaos-model-")))
    report = run(model_dir, args.minutes * 60, round_s=args.round_s, clients=args.clients,
                 worker_args=["--dtype", "float32", "--kv-tokens", "2048", "--max-model-len", "256", "--connector",
                              args.connector,
                              *(["--kv-layerwise"] if args.kv_layerwise else [])])
    report["connector"] = args.connector
    report["kv_layerwise"] = args.kv_layerwise
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    clean = report["hung"] == 0 and report["wrong_outputs"] == 0 and not any(report["leaked_blocks"]) \
        and report["integrity_ok"]
    return 0 if clean else 1


def tiny_model(out: Path) -> str:
    """A 2-layer random-weight Llama with SmolLM2's tokenizer (as tests/conftest.py builds)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pdserve_server.cli.models import resolve_model

    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(out))
    real = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real / name).exists():
            shutil.copy(real / name, out / name)
    return str(out)


if __name__ == "__main__":
    sys.exit(main())
