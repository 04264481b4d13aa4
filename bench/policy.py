"""Overload with mixed traffic: interactive TTFT and goodput with the scheduling policy on (priorities, fair share
between tenants) against plain first come, first served, on one cluster, with the same arrivals, in one run.

1. Capacity: a closed loop over the mix (`--capacity-concurrency` in flight) measures requests/s.
2. Arrivals: Poisson at `--load` x capacity for `--duration-s`, `--interactive-share` of them interactive (short
   prompt, short answer), the rest batch (long prompt, long answer); the same seeded schedule for every mode.
3. Modes, one after another on the same cluster (each drains before the next):
   - `fcfs`: every request priority 0, one tenant: the engine's order is arrival;
   - `policy`: interactive requests priority 0, tenant "chat"; batch requests priority 1, tenant "batch".
Per mode: interactive TTFT p50/p99 and TPOT p50, batch TTFT p50, goodput (requests/s meeting their class's SLO:
DistServe's metric), completed and failed; then policy / fcfs ratios.

    .venv/bin/python bench/policy.py                 # about 8 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends import RequestResult  # noqa: E402
from hostinfo import commit, machine  # noqa: E402
from prompts import BenchRequest, make_requests  # noqa: E402
from systems import start_pdserve  # noqa: E402

MODES = {"fcfs": {"interactive": (0, ""), "batch": (0, "")},
         "policy": {"interactive": (0, "chat"), "batch": (1, "batch")}}


@dataclass(frozen=True)
class Arrival:
    """One request of the schedule: when it is sent (s from the mode's start), its class and its tokens."""

    at_s: float
    kind: str  # "interactive" or "batch"
    request: BenchRequest


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=None, help="HF directory (default: the packaged SmolLM2-135M)")
    p.add_argument("--topology", default="colocated", choices=("colocated", "disagg"))
    p.add_argument("--worker-args", default="--max-num-seqs 16",
                   help="flags for every worker; the default caps the running batch at the capacity run's "
                        "concurrency, as an operator sizes it for a TPOT objective (with the engine's 64 on 2 cores "
                        "every request joins one slow batch and no TPOT objective holds, policy or not)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--duration-s", type=float, default=60.0, help="seconds of arrivals per mode")
    p.add_argument("--load", type=float, default=2.0, help="offered load, x the measured capacity")
    p.add_argument("--interactive-share", type=float, default=0.2)
    p.add_argument("--interactive-len", default="64,16", help="input,output tokens of an interactive request")
    p.add_argument("--batch-len", default="384,64", help="input,output tokens of a batch request")
    p.add_argument("--capacity-requests", type=int, default=40)
    p.add_argument("--capacity-concurrency", type=int, default=16)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="interactive TTFT SLO")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="TPOT SLO, both classes (default: twice the capacity run's TPOT p50, so it is attainable on "
                        "whatever machine runs this)")
    p.add_argument("--batch-slo-ttft-ms", type=float, default=30000.0, help="batch TTFT SLO")
    p.add_argument("--drain-timeout-s", type=float, default=600.0, help="bound on waiting for a mode's backlog")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="default bench/results/policy-<UTC timestamp>")
    return p.parse_args(argv)


async def send(client, req: BenchRequest, priority: int, tenant: str) -> RequestResult:
    """One streamed request; errors are recorded, not raised."""
    from pdserve import SamplingParams

    res = RequestResult(start=time.perf_counter())
    params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
    try:
        async for chunk in client.generate(req.prompt_ids, params, priority=priority, tenant=tenant):
            if chunk.token_ids:
                res.chunk_times.append(time.perf_counter())
                res.output_tokens += len(chunk.token_ids)
    except Exception as e:  # grpc errors: recorded, the run goes on
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter()
    return res


def mix(tokenizer, args, num: int, rng: random.Random) -> list[tuple[str, BenchRequest]]:
    """num requests, each interactive with probability --interactive-share."""
    il, io = (int(x) for x in args.interactive_len.split(","))
    bl, bo = (int(x) for x in args.batch_len.split(","))
    inter = make_requests(tokenizer, num, il, io, seed=rng.randrange(1 << 30))
    batch = make_requests(tokenizer, num, bl, bo, seed=rng.randrange(1 << 30))
    return [("interactive", inter[i]) if rng.random() < args.interactive_share else ("batch", batch[i])
            for i in range(num)]


async def capacity(client, requests: list[tuple[str, BenchRequest]], concurrency: int) -> tuple[float, float]:
    """(completed requests/s, TPOT p50 ms) of a closed loop over the mix."""
    queue = list(reversed(requests))
    results: list[RequestResult] = []

    async def loop() -> None:
        while queue:
            kind, req = queue.pop()
            results.append(await send(client, req, 0, ""))
    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    ok = [r for r in results if r.ok and r.output_tokens > 1]
    tpot = [(r.end - r.chunk_times[0]) * 1e3 / (r.output_tokens - 1) for r in ok]
    return sum(r.ok for r in results) / (time.perf_counter() - t0), pct(tpot, 50)


def preemptions(system) -> int:
    """Requests preempted so far, summed over the workers (their pdserve:num_preemptions counters)."""
    total = 0
    for name, url in system.metrics_urls.items():
        if name == "coordinator":
            continue
        with urllib.request.urlopen(url, timeout=10) as r:  # a local worker's /metrics
            for line in r.read().decode().splitlines():
                if line.startswith("pdserve:num_preemptions_total"):
                    total += int(float(line.rsplit(" ", 1)[1]))
    return total


async def run_mode(client, schedule: list[Arrival], mode: str, drain_timeout_s: float) -> list[tuple[str, RequestResult]]:
    """Send the schedule open-loop (each request at its time, whatever is in flight) and wait for all of it."""
    t0 = time.perf_counter()

    async def one(a: Arrival) -> tuple[str, RequestResult]:
        await asyncio.sleep(max(0.0, t0 + a.at_s - time.perf_counter()))
        priority, tenant = MODES[mode][a.kind]
        return a.kind, await send(client, a.request, priority, tenant)

    tasks = [asyncio.create_task(one(a)) for a in schedule]
    horizon = schedule[-1].at_s + drain_timeout_s if schedule else 0.0
    done, pending = await asyncio.wait(tasks, timeout=horizon)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() for t in done]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(results: list[tuple[str, RequestResult]], duration_s: float, args) -> dict[str, float]:
    """Per-class latency and goodput of one mode. Goodput: requests meeting their class's SLO / arrival seconds."""
    out: dict[str, float] = {}
    good_total = 0
    for kind, slo_ttft in (("interactive", args.slo_ttft_ms), ("batch", args.batch_slo_ttft_ms)):
        rs = [r for k, r in results if k == kind]
        ok = [r for r in rs if r.ok]
        ttft = [(r.chunk_times[0] - r.start) * 1e3 for r in ok]
        tpot = [(r.end - r.chunk_times[0]) * 1e3 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        good = sum(1 for r, t in zip(ok, ttft) if t <= slo_ttft and (
            r.output_tokens <= 1 or (r.end - r.chunk_times[0]) * 1e3 / (r.output_tokens - 1) <= args.slo_tpot_ms))
        good_total += good
        out.update({f"{kind}_sent": len(rs), f"{kind}_completed": len(ok), f"{kind}_failed": len(rs) - len(ok),
                    f"{kind}_ttft_p50_ms": pct(ttft, 50), f"{kind}_ttft_p99_ms": pct(ttft, 99),
                    f"{kind}_tpot_p50_ms": pct(tpot, 50), f"{kind}_goodput_req_s": good / duration_s,
                    f"{kind}_slo_attained": good / len(rs) if rs else float("nan")})
    out["goodput_req_s"] = good_total / duration_s
    return out


async def main_async(args, system, tokenizer) -> dict:
    rng = random.Random(args.seed)
    backend = system.make_backend()  # in this loop: gRPC aio channels bind to the loop that creates them
    client = backend.client
    try:
        await capacity(client, mix(tokenizer, args, 4, rng), 2)  # warm-up
        cap, cap_tpot = await capacity(client, mix(tokenizer, args, args.capacity_requests, rng),
                                       args.capacity_concurrency)
        if args.slo_tpot_ms is None:
            args.slo_tpot_ms = 2 * cap_tpot
        rate = args.load * cap
        num = max(1, int(rate * args.duration_s))
        times = np.cumsum(np.random.default_rng(args.seed).exponential(1.0 / rate, num))
        schedule = [Arrival(float(t), kind, req) for t, (kind, req) in zip(times, mix(tokenizer, args, num, rng))]
        print(f"capacity {cap:.2f} req/s (TPOT p50 {cap_tpot:.0f} ms at concurrency {args.capacity_concurrency}); offering {rate:.2f} req/s ({args.load:g}x) for {args.duration_s:g} s: "
              f"{num} requests, {sum(a.kind == 'interactive' for a in schedule)} interactive", flush=True)
        modes, raw = {}, {}
        for mode in MODES:
            t0, before = time.perf_counter(), preemptions(system)
            results = await run_mode(client, schedule, mode, args.drain_timeout_s)
            modes[mode] = summarize(results, float(times[-1]), args)
            modes[mode]["preemptions"] = preemptions(system) - before
            raw[mode] = [{"kind": k, "ok": r.ok, "error": r.error[:200], "output_tokens": r.output_tokens,
                          "ttft_ms": (r.chunk_times[0] - r.start) * 1e3 if r.ok else None,
                          "e2e_ms": (r.end - r.start) * 1e3} for k, r in results]
            print(f"{mode}: {time.perf_counter() - t0:.0f} s, {json.dumps(modes[mode])}", flush=True)
        return {"raw": raw, "capacity_req_s": cap, "capacity_tpot_p50_ms": cap_tpot, "offered_req_s": rate, "num_requests": num, "modes": modes}
    finally:
        await backend.close()


def render(results: dict, args, info: dict) -> str:
    f, p = results["modes"]["fcfs"], results["modes"]["policy"]
    rows = [("interactive TTFT p50 ms", "interactive_ttft_p50_ms"), ("interactive TTFT p99 ms", "interactive_ttft_p99_ms"),
            ("interactive TPOT p50 ms", "interactive_tpot_p50_ms"), ("batch TTFT p50 ms", "batch_ttft_p50_ms"),
            ("batch TPOT p50 ms", "batch_tpot_p50_ms"),
            ("interactive goodput req/s", "interactive_goodput_req_s"), ("goodput req/s (both classes)", "goodput_req_s"),
            ("preemptions (recompute)", "preemptions"),
            ("interactive completed / failed", None), ("batch completed / failed", None)]
    lines = [f"capacity {results['capacity_req_s']:.2f} req/s (TPOT p50 {results['capacity_tpot_p50_ms']:.0f} ms), offered {results['offered_req_s']:.2f} req/s "
             f"({args.load:g}x) for {args.duration_s:g} s, {results['num_requests']} requests; SLOs: interactive TTFT "
             f"<= {args.slo_ttft_ms:g} ms, batch TTFT <= {args.batch_slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:.0f} ms; "
             f"{info}", "",
             "| metric | fcfs | policy | policy / fcfs |", "|---|---:|---:|---:|"]
    for label, key in rows:
        if key is None:
            kind = label.split()[0]
            lines.append(f"| {label} | {f[kind + '_completed']} / {f[kind + '_failed']} | "
                         f"{p[kind + '_completed']} / {p[kind + '_failed']} | |")
            continue
        ratio = p[key] / f[key] if f[key] else float("nan")
        lines.append(f"| {label} | {f[key]:.1f} | {p[key]:.1f} | {ratio:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from pdserve_server.cli.models import resolve_model

    model_dir = str(resolve_model(args.model_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out_dir = Path(args.out_dir or Path(__file__).parent / "results" / time.strftime("policy-%Y%m%dT%H%M%SZ",
                                                                                         time.gmtime()))
    out_dir.mkdir(parents=True, exist_ok=True)
    system = start_pdserve(f"pdserve-{args.topology}", model_dir, args.topology == "colocated", args.threads,
                           str(out_dir), [*args.worker_args.split(), "--metrics-port", "0"],
                           coordinator_args=["--scheduling-policy", "priority"])  # the batch class asks for 1
    try:
        results = asyncio.run(main_async(args, system, tokenizer))
    finally:
        system.stop()
    info = {"machine": machine(), "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    results.update({"args": vars(args), "host": info})
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    table = render(results, args, info)
    (out_dir / "results.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
