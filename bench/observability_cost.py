"""Observability's cost, interleaved: plain and observed pdserve-disagg clusters take turns on the same load, so
drift of the machine falls on both. Prints each round's output tok/s and the median ratio observed / plain.

    .venv/bin/python bench/observability_cost.py [--rounds 3] [--concurrency 8] [--num-requests 32]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import systems  # noqa: E402
from loadgen import run_level  # noqa: E402
from metrics import Slo, summarize  # noqa: E402
from prompts import make_requests  # noqa: E402


async def one_run(system, requests, concurrency: int) -> float:
    backend = system.make_backend()
    try:
        await backend.run(requests[0])  # warm-up
        results, duration = await run_level(backend, requests, concurrency, 900)
    finally:
        await backend.close()
    row = summarize(results, duration, Slo(2000, 150))
    assert row["failed"] == 0, row
    return row["output_tok_s"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--out", default=None, help="write the rounds as JSON here")
    args = p.parse_args()
    from transformers import AutoTokenizer

    from pdserve_server.cli.models import resolve_model

    model_dir = str(resolve_model(None))
    requests = make_requests(AutoTokenizer.from_pretrained(model_dir), args.num_requests, 128, 32, seed=3)
    rounds = []
    for r in range(args.rounds):
        row = {}
        for observed in (False, True) if r % 2 == 0 else (True, False):  # alternate which goes first
            name = "observed" if observed else "plain"
            system = systems.start_pdserve(name, model_dir, False, 2, None, [], observed=observed)
            try:
                row[name] = asyncio.run(one_run(system, requests, args.concurrency))
            finally:
                system.stop()
        row["ratio"] = row["observed"] / row["plain"]
        rounds.append(row)
        print(f"round {r}: plain {row['plain']:.2f} tok/s, observed {row['observed']:.2f} tok/s, "
              f"ratio {row['ratio']:.3f}", flush=True)
    ratio = statistics.median(r["ratio"] for r in rounds)
    print(f"median observed / plain over {args.rounds} rounds at concurrency {args.concurrency}: {ratio:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rounds": rounds, "median_ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
