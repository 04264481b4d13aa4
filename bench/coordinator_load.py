"""One coordinator in front of N mock workers at GPU rates: what relaying their streams costs it.

The workers run the mock engine (`--mock-engine PROFILE`: the real scheduler and KV transfer, each step the time
the profile's device takes, tokens derived from the context), one process each (`--no-engine-process`), with KV
blocks of a declared small geometry (a 2-layer config with the served model's vocabulary and tokenizer) so dozens
fit in memory. A closed loop of C clients (the SDK's async stream, token-id prompts, exact output lengths) drives
the coordinator at each level; per level it reports:

- requests/s and streamed tokens/s the clients received;
- the coordinators' CPU seconds (their processes' user + system time, /proc) per 1,000 streamed tokens and per
  request, and their share of one core (`--coordinators K` runs K on the one port, `serve --num-coordinators`;
  the clients' requests are spread over `--channels` connections, which the kernel spreads over the K); the
  workers' and this client process's CPU beside it;
- client-side TTFT and TPOT (p50 / p99; TPOT: a request's time from its first to its last token over the tokens
  after the first) and the 99th percentile gap between chunks; the profile's modelled step at the level's batch is
  what the workers alone would give, so the difference bounds what the coordinator, the client and the shared
  cores add;
- the coordinator's relay (`pdserve:token_relay_latency_seconds`, from its /metrics): per message from a decode
  worker, the worker's send stamp to the coordinator's hand-off of the chunk to the client's stream, p50 / p99 and
  the share within 2 ms. A token's added inter-token latency (its gap at the client minus its gap at the worker) is
  at most its relay, so the relay's p99 bounds the coordinator's added ITL p99;
- failed: requests that ended in an error (those still in flight when a level's time ran out are not counted).

Every process shares this machine's cores: a level whose workers cannot keep their modelled pace shows it in the
workers' `overrun` count... which the coordinator cannot see, so read the CPU columns: the coordinator's cost per
token is the figure that carries to other machines.

    python bench/coordinator_load.py [--decode 8] [--prefill 0] [--profile llama-3.1-8b-h200] \\
        [--concurrency 16 64 256] [--input-len 128] [--output-len 256] [--duration-s 30] [--out FILE]

`--prefill 0` runs colocated mock workers (no KV transfer); with P > 0, P prefill and N decode workers over tcp.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from backends import PdserveBackend  # noqa: E402
from loadgen import run_level  # noqa: E402
from prompts import BenchRequest  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def declared_model(src: Path, out: Path) -> Path:
    """A model directory the mock workers and the coordinator read: `src`'s tokenizer and vocabulary, a 2-layer
    config of 2 KV heads of 32 (512 bytes of bf16 KV a token), no weights."""
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, torch_dtype="bfloat16")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, seconds (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def relay_buckets(urls: list[str]) -> dict[float, float]:
    """The coordinators' pdserve:token_relay_latency_seconds histogram, summed: upper bound (s) -> cumulative
    count of relayed messages."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    out: dict[float, float] = {}
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "pdserve:token_relay_latency_seconds_bucket":
                    le = float(sample.labels["le"])
                    out[le] = out.get(le, 0.0) + sample.value
    return out


def histogram_quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets (upper bound -> count): linear within the bucket
    the q-th observation falls in; None without observations."""
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] <= 0:
        return None
    rank, lower, below = q * buckets[edges[-1]], 0.0, 0.0
    for le in edges:
        if buckets[le] >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(buckets[le] - below, 1e-12)
        lower, below = le, buckets[le]
    return lower


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Spread:
    """Requests spread round-robin over several client channels (connections): SO_REUSEPORT balances
    connections, not requests, so several coordinators on one port each get a share only of many connections."""

    def __init__(self, address: str, channels: int):
        self.backends = [PdserveBackend(address) for _ in range(channels)]
        self.next = 0

    async def run(self, req: BenchRequest):
        self.next += 1
        return await self.backends[self.next % len(self.backends)].run(req)

    async def close(self) -> None:
        for b in self.backends:
            await b.close()


async def level(address: str, concurrency: int, input_len: int, output_len: int, duration_s: float,
                rng: random.Random, vocab: int, channels: int) -> tuple[list, float]:
    backend = Spread(address, min(channels, concurrency))
    try:
        # enough requests that the closed loop never runs dry before the time is up
        n = concurrency * 4 + int(duration_s * concurrency)
        reqs = [BenchRequest([rng.randrange(10, vocab) for _ in range(input_len)], output_len) for _ in range(n)]
        return await run_level(backend, reqs, concurrency, duration_s)
    finally:
        await backend.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--decode", type=int, default=8, help="decode (or colocated) mock workers")
    p.add_argument("--prefill", type=int, default=0, help="prefill mock workers; 0 = colocated workers")
    p.add_argument("--profile", default="llama-3.1-8b-h200")
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--duration-s", type=float, default=30.0, help="closed-loop time per level, s")
    p.add_argument("--model-dir", help="tokenizer + config.json source (default: the packaged model)")
    p.add_argument("--coordinator-args", default="", help="extra coordinator flags, space separated")
    p.add_argument("--worker-args", default="", help="extra worker flags, space separated (e.g. --stream-interval 4)")
    p.add_argument("--coordinators", type=int, default=1, help="coordinator processes on the one port")
    p.add_argument("--channels", type=int, default=16, help="client connections the requests are spread over")
    p.add_argument("--py-spy", help="py-spy binary: record the coordinator's stacks per level (OUT.C<c>.folded)")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)

    from pdserve_server.cli.launcher import ServeConfig, start_cluster
    from pdserve_server.cli.models import resolve_model

    work = Path(tempfile.mkdtemp(prefix="coord-load-"))
    model = declared_model(Path(a.model_dir) if a.model_dir else resolve_model(None), work / "model")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    worker_args = ["--mock-engine", a.profile, "--mock-speedup", str(a.speedup), "--no-engine-process",
                   "--kv-tokens", "131072", "--max-num-seqs", "256", "--max-num-batched-tokens", "4096",
                   "--max-model-len", "8192", "--threads", "1"]
    if a.prefill:
        worker_args += ["--connector", "tcp"]
    worker_args += a.worker_args.split()
    cfg = ServeConfig(num_prefill=a.prefill or 1, num_decode=a.decode, log_dir=str(work / "logs"),
                      num_coordinators=a.coordinators)
    role = "decode" if a.prefill else "colocated"
    print(f"starting {a.coordinators} coordinator(s) + {a.prefill} prefill + {a.decode} {role} mock workers "
          f"({a.profile}, x{a.speedup:g})", flush=True)
    cluster = start_cluster(str(model), "mock", cfg, colocated=a.prefill == 0, worker_args=worker_args,
                            coordinator_args=[*a.coordinator_args.split(), "--metrics-port", "0"])
    doc = dict(machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                            python=platform.python_version()),
               args={k: str(v) for k, v in vars(a).items()}, levels=[])
    try:
        coords = [proc.pid for name, proc in cluster.processes.items() if name.startswith("coordinator")]
        workers = [proc.pid for name, proc in cluster.processes.items() if not name.startswith("coordinator")]
        coord_metrics = [url for name, url in cluster.metrics_urls.items() if name.startswith("coordinator")]
        rng = random.Random(0)
        asyncio.run(level(cluster.address, 4, a.input_len, 8, 5.0, rng, vocab, a.channels))  # warm-up
        print(f"{'C':>5} {'req/s':>7} {'tok/s':>8} {'coord CPU-s/1k tok':>19} {'coord ms/req':>12} "
              f"{'coord core':>10} {'workers core':>12} {'client core':>11} {'TTFT p50/p99 ms':>16} "
              f"{'TPOT p50/p99 ms':>15} {'gap p99':>7} {'relay p50/p99 ms':>16} {'<=2ms':>6} {'failed':>6}",
              flush=True)
        for c in a.concurrency:
            spy = (subprocess.Popen([a.py_spy, "record", "-p", str(coords[0]), "-f", "raw", "-r", "200", "-d",
                                     str(int(a.duration_s)), "-o", f"{a.out or 'coordinator'}.C{c}.folded"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if a.py_spy else None)
            relay_before = relay_buckets(coord_metrics)
            before = (sum(map(cpu_seconds, coords)), sum(map(cpu_seconds, workers)), time.process_time())
            results, wall = asyncio.run(level(cluster.address, c, a.input_len, a.output_len, a.duration_s, rng,
                                              vocab, a.channels))
            after = (sum(map(cpu_seconds, coords)), sum(map(cpu_seconds, workers)), time.process_time())
            relay = {le: n - relay_before.get(le, 0.0) for le, n in relay_buckets(coord_metrics).items()}
            relayed = relay.get(float("inf"), 0.0)
            if spy is not None:
                spy.wait(60)
            ok = [r for r in results if r.ok and r.output_tokens == a.output_len]
            cut = [r for r in results if r.error == "time limit"]  # in flight when the level's time ran out
            tokens = sum(r.output_tokens for r in results if r.ok)
            coord_cpu, workers_cpu, client_cpu = (y - x for x, y in zip(before, after))
            ttft = [(r.chunk_times[0] - r.start) * 1e3 for r in ok]
            # per token: a request's decode time over its tokens after the first (chunks of several tokens share it)
            tpot = [(r.chunk_times[-1] - r.chunk_times[0]) * 1e3 / (r.output_tokens - 1) for r in ok
                    if r.output_tokens > 1]
            gaps = [(t1 - t0) * 1e3 for r in ok for t0, t1 in zip(r.chunk_times, r.chunk_times[1:])]
            row = dict(concurrency=c, wall_s=wall, requests=len(ok), failed=len(results) - len(ok) - len(cut),
                       tokens=tokens, req_per_s=len(ok) / wall, tok_per_s=tokens / wall,
                       coord_cpu_s=coord_cpu, coord_cpu_s_per_1k_tokens=coord_cpu / max(tokens, 1) * 1e3,
                       coord_ms_per_request=coord_cpu / max(len(ok), 1) * 1e3, coord_core=coord_cpu / wall,
                       workers_core=workers_cpu / wall, client_core=client_cpu / wall,
                       ttft_ms_p50=pct(ttft, 0.5), ttft_ms_p99=pct(ttft, 0.99),
                       tpot_ms_p50=pct(tpot, 0.5), tpot_ms_p99=pct(tpot, 0.99), chunk_gap_ms_p99=pct(gaps, 0.99),
                       relayed_messages=relayed,
                       relay_ms_p50=(histogram_quantile(relay, 0.5) or 0.0) * 1e3,
                       relay_ms_p99=(histogram_quantile(relay, 0.99) or 0.0) * 1e3,
                       relay_within_2ms=relay.get(0.002, 0.0) / relayed if relayed else None)
            doc["levels"].append(row)
            print(f"{c:>5} {row['req_per_s']:>7.1f} {row['tok_per_s']:>8.0f} "
                  f"{row['coord_cpu_s_per_1k_tokens']:>19.3f} {row['coord_ms_per_request']:>12.2f} "
                  f"{row['coord_core']:>10.2f} {row['workers_core']:>12.2f} {row['client_core']:>11.2f} "
                  f"{row['ttft_ms_p50'] or 0:>7.1f}/{row['ttft_ms_p99'] or 0:<8.1f} "
                  f"{row['tpot_ms_p50'] or 0:>6.1f}/{row['tpot_ms_p99'] or 0:<8.1f} "
                  f"{row['chunk_gap_ms_p99'] or 0:>7.1f} {row['relay_ms_p50']:>7.2f}/{row['relay_ms_p99']:<8.2f} "
                  f"{row['relay_within_2ms'] or 0:>6.3f} {row['failed']:>6}", flush=True)
            if a.out:
                a.out.write_text(json.dumps(doc, indent=1))
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
