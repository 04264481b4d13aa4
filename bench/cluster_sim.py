"""A simulated GPU cluster on this machine: one coordinator, P prefill and D decode mock workers (KV over tcp), an
open-loop trace, and every stream checked.

The workers run the mock engine (`--mock-engine PROFILE`, real time by default): the real scheduler, prefix cache
and KV transfer protocol, each step the profiled device's time, tokens derived from the context
(`engine.mock.runner.next_token`). The trace: Poisson arrivals at `--rate` requests/s for `--duration-s`; prompt
lengths log-normal around `--prompt-median` tokens; outputs uniform in [--output-min, --output-max]; a share
`--followups` of requests continue an earlier conversation (its prompt, its output, a new turn), so prefixes repeat
as in multi-turn chat. Every request is checked:

- wrong: its tokens are not the chain derived from its prompt, or not exactly max_tokens of them;
- failed: it ended in an error;
- hung: it had not ended `--hang-s` seconds after it was sent.

Reports the counts, throughput, goodput (requests/s within --ttft-slo-ms and --tpot-slo-ms), TTFT / TPOT
percentiles, the first token's relay (the coordinator's TTFT less the queue and prefill times the prefill worker
reports: from the token sampled to it sent to the client), the prompt tokens the workers' prefix caches served
(`prefix_hit`) against an oracle's (`oracle_hit`: the leading full blocks of each prompt that some earlier
request's prompt computed before this one was sent, i.e. one unbounded cache for the cluster and routing that
always finds it; `prefix_hit_of_oracle` is the ratio), and the coordinator's CPU per 1,000 streamed tokens.
`--worker-args=--kv-events` routes by the workers' KV events instead of the coordinator's inferred index.

    python bench/cluster_sim.py [--prefill 8] [--decode 24] [--rate 20] [--duration-s 600] [--out FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from coordinator_load import cpu_seconds, declared_model, pct  # noqa: E402


def build_requests(a, vocab: int, eos: frozenset[int]) -> list[tuple[float, list[int], int, list[int]]]:
    """The trace, (send time s, prompt, output tokens, the tokens the mock will stream) per request, built up front
    (module docstring): a follow-up turn's prompt is its conversation's context so far (the earlier prompt and its
    output) and a new turn, cut to --max-prompt tokens."""
    from pdserve_server.engine.mock.runner import continuation

    rng = random.Random(a.seed)
    t, out, history = 0.0, [], []
    while True:
        t += rng.expovariate(a.rate)
        if t >= a.duration_s:
            return out
        plen = int(min(a.max_prompt, max(8, rng.lognormvariate(math.log(a.prompt_median), 1.0))))
        n = rng.randint(a.output_min, a.output_max)
        if history and rng.random() < a.followups:
            conv = rng.randrange(len(history))
            prompt = (history[conv] + [rng.randrange(10, vocab) for _ in range(max(8, plen // 4))])[-a.max_prompt:]
        else:
            conv, prompt = len(history), [rng.randrange(10, vocab) for _ in range(plen)]
            history.append([])
        expected = continuation(prompt, n, vocab, eos)
        history[conv] = prompt + expected
        out.append((t, prompt, n, expected))


async def main_async(a, address: str, plan: list[tuple[float, list[int], int, list[int]]]) -> dict:
    from pdserve import AsyncClient, SamplingParams

    clients = [AsyncClient(address) for _ in range(a.channels)]
    ok: list[int] = []
    stats = dict(requests=len(plan), ok=0, wrong=0, failed=0, hung=0, tokens=0, prompt_tokens=0, cached_tokens=0,
                 within_slo=0)
    ttft, tpot, errors, added = [], [], [], []
    computed_at: list[float | None] = [None] * len(plan)  # each request's first token (its prompt cached), s
    sent_at: list[float] = [0.0] * len(plan)
    t0 = time.perf_counter()

    async def one(i: int, prompt: list[int], n: int, expected: list[int]) -> None:
        start, first, got = time.perf_counter(), None, []
        sent_at[i] = start - t0
        try:
            async def stream():
                nonlocal first
                async for chunk in clients[i % len(clients)].generate(prompt, SamplingParams(max_tokens=n,
                                                                                           temperature=0.0)):
                    if chunk.token_ids:
                        if first is None:
                            first = time.perf_counter()
                            computed_at[i] = first - t0
                        got.extend(chunk.token_ids)
                    if chunk.final is not None:
                        stats["cached_tokens"] += chunk.final.cached_prompt_tokens
                        t = chunk.final.timings  # first token sampled (worker) -> sent to the client (coordinator)
                        added.append(t["ttft_ms"] - t["queue_ms"] - t["prefill_ms"])
            await asyncio.wait_for(stream(), a.hang_s)
        except asyncio.TimeoutError:
            stats["hung"] += 1
            return
        except Exception as e:  # an RPC error: counted, the trace goes on
            stats["failed"] += 1
            errors.append(f"{type(e).__name__}: {str(e)[:200]}")
            return
        end = time.perf_counter()
        if got != expected:
            stats["wrong"] += 1
            return
        stats["ok"] += 1
        ok.append(i)
        stats["tokens"] += n
        stats["prompt_tokens"] += len(prompt)
        ttft.append((first - start) * 1e3)
        if n > 1:
            tpot.append((end - first) * 1e3 / (n - 1))
        if ttft[-1] <= a.ttft_slo_ms and (n == 1 or tpot[-1] <= a.tpot_slo_ms):
            stats["within_slo"] += 1

    tasks = []
    for i, (at, prompt, n, expected) in enumerate(plan):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, prompt, n, expected)))
        if a.progress and i % 500 == 0:
            print(f"  t={time.perf_counter() - t0:6.0f}s sent {i} ok {stats['ok']} wrong {stats['wrong']} "
                  f"failed {stats['failed']} hung {stats['hung']}", flush=True)
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    for c in clients:
        await c.close()
    stats.update(wall_s=wall, tok_per_s=stats["tokens"] / wall, req_per_s=stats["ok"] / wall,
                 goodput=stats["within_slo"] / wall,
                 prefix_hit=stats["cached_tokens"] / max(stats["prompt_tokens"], 1),
                 oracle_hit=oracle_hit(plan, ok, sent_at, computed_at, a.block_size),
                 ttft_ms_p50=pct(ttft, 0.5), ttft_ms_p99=pct(ttft, 0.99), tpot_ms_p50=pct(tpot, 0.5),
                 tpot_ms_p99=pct(tpot, 0.99), relay_ttft_ms_p50=pct(added, 0.5),
                 relay_ttft_ms_p99=pct(added, 0.99), errors=errors[:20])
    return stats


def oracle_hit(plan, ok: list[int], sent_at: list[float], computed_at: list[float | None],
               block_size: int) -> float:
    """The share of the ok requests' prompt tokens an oracle serves from cache (module docstring): per request, its
    leading full blocks (at most (len - 1) // block_size, as the engine leaves a token to compute) whose chained
    hash some request computed before this one was sent (that request's first token came earlier)."""
    from pdserve_server.coordinator.prefix_index import block_hashes

    order = sorted((t, i) for i, t in enumerate(computed_at) if t is not None)
    cached: set[bytes] = set()
    served = total = j = 0
    for i in sorted(ok, key=lambda k: sent_at[k]):
        while j < len(order) and order[j][0] < sent_at[i]:
            cached.update(block_hashes(plan[order[j][1]][1], block_size))
            j += 1
        prompt = plan[i][1]
        hits = 0
        for h in block_hashes(prompt, block_size)[:(len(prompt) - 1) // block_size]:
            if h not in cached:
                break
            hits += 1
        served += hits * block_size
        total += len(prompt)
    return served / max(total, 1)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--decode", type=int, default=24)
    p.add_argument("--profile", default="llama-3.1-8b-h200")
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--rate", type=float, default=20.0, help="arrivals per second (Poisson)")
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--prompt-median", type=int, default=512)
    p.add_argument("--max-prompt", type=int, default=4096)
    p.add_argument("--output-min", type=int, default=16)
    p.add_argument("--output-max", type=int, default=256)
    p.add_argument("--followups", type=float, default=0.3, help="share of requests continuing a conversation")
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--ttft-slo-ms", type=float, default=float("inf"), help="goodput: requests within both SLOs")
    p.add_argument("--tpot-slo-ms", type=float, default=float("inf"))
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--hang-s", type=float, default=120.0)
    p.add_argument("--kv-tokens", type=int, default=65536, help="each worker's KV pool, tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--coordinator-args", default="", help="extra coordinator flags, space separated")
    p.add_argument("--worker-args", default="", help="extra worker flags, space separated (e.g. --kv-events)")
    p.add_argument("--block-size", type=int, default=16, help="the workers' KV block size (for the oracle)")
    p.add_argument("--out", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)

    from pdserve_server.cli.launcher import ServeConfig, start_cluster
    from pdserve_server.cli.models import resolve_model

    work = Path(tempfile.mkdtemp(prefix="cluster-sim-"))
    model = declared_model(resolve_model(None), work / "model")
    cfg = json.loads((model / "config.json").read_text())
    eos = cfg["eos_token_id"]
    eos = frozenset(eos if isinstance(eos, list) else [eos])
    plan = build_requests(a, cfg["vocab_size"], eos)
    worker_args = ["--mock-engine", a.profile, "--mock-speedup", str(a.speedup), "--no-engine-process",
                   "--kv-tokens", str(a.kv_tokens), "--max-num-seqs", "256", "--max-num-batched-tokens", "4096",
                   "--max-model-len", str(a.max_prompt + a.output_max + 16), "--threads", "1",
                   "--connector", "tcp", "--stream-interval", str(a.stream_interval), "--block-size",
                   str(a.block_size), *a.worker_args.split()]
    print(f"starting 1 coordinator + {a.prefill} prefill + {a.decode} decode mock workers ({a.profile}, "
          f"x{a.speedup:g}); {a.rate:g} req/s for {a.duration_s:g} s", flush=True)
    started = time.perf_counter()
    cluster = start_cluster(str(model), "mock", ServeConfig(num_prefill=a.prefill, num_decode=a.decode,
                                                            log_dir=str(work / "logs")), worker_args=worker_args,
                            coordinator_args=a.coordinator_args.split() or None)
    doc = dict(machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                            python=platform.python_version()), args={k: str(v) for k, v in vars(a).items()},
               start_s=time.perf_counter() - started)
    try:
        coord = cluster.processes["coordinator"].pid
        workers = [proc.pid for name, proc in cluster.processes.items() if name != "coordinator"]
        rss = sum(int(Path(f"/proc/{pid}/statm").read_text().split()[1]) for pid in workers + [coord])
        doc["rss_gib"] = rss * os.sysconf("SC_PAGE_SIZE") / 2**30
        before = (cpu_seconds(coord), sum(map(cpu_seconds, workers)))
        stats = asyncio.run(main_async(a, cluster.address, plan))
        after = (cpu_seconds(coord), sum(map(cpu_seconds, workers)))
        stats.update(coord_cpu_s_per_1k_tokens=(after[0] - before[0]) / max(stats["tokens"], 1) * 1e3,
                     coord_core=(after[0] - before[0]) / stats["wall_s"],
                     workers_core=(after[1] - before[1]) / stats["wall_s"])
        stats["prefix_hit_of_oracle"] = stats["prefix_hit"] / stats["oracle_hit"] if stats["oracle_hit"] else None
        doc.update(stats)
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    show = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in doc.items() if k not in ("args", "errors")}
    print(json.dumps(show, indent=1))
    if doc.get("errors"):
        print("first errors:", *doc["errors"][:5], sep="\n  ")
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1))
    return 0 if doc.get("wrong", 1) == doc.get("failed", 1) == doc.get("hung", 1) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
