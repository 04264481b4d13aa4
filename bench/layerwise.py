"""Layer-wise KV streaming on and off, in the same run: the gap between the first token (the prefill worker's) and
the first decode token (the decode worker's), as a client sees it through the coordinator.

Without streaming, that gap is the whole KV transfer (after the first token) plus the decode worker's first step.
With `--kv-layerwise`, each layer's KV leaves while the last prefill chunk computes the next layers, so only the
last layer and the end message remain after the first token. Both modes run on the same machine, model and
prompts, alternating clusters (off, on, off, on, ...) so that drift on a shared VM hits both alike.

For each prompt length (default 512 and 2048 tokens: 1 and 4 prefill chunks of 512) it sends --repeats requests
one at a time, each a fresh random prompt (no prefix-cache hit on either worker), with max_tokens 2, and reports
medians of: the gap (client clock), TTFT, and the transfer time the prefill worker reports (from its first token
to the decode worker's acknowledgement, `Timings.transfer_ms`).

Usage: python bench/layerwise.py [--lengths 512,2048] [--repeats 5] [--rounds 2] [--connector tcp] [--out F.json]
       [--model-dir DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from hostinfo import FLAGS_SHOWN, commit, machine  # noqa: E402


async def _measure(address: str, prompt: list[int]) -> dict:
    """One request; client-side times of the first two tokens and the server's timings."""
    from pdserve import AsyncClient, SamplingParams

    times: list[float] = []
    timings: dict = {}
    async with AsyncClient(address) as client:
        start = time.perf_counter()
        async for chunk in client.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)):
            times.extend([time.perf_counter()] * len(chunk.token_ids))
            if chunk.final is not None:
                timings = chunk.final.timings
    if len(times) < 2:
        raise RuntimeError(f"expected 2 tokens, got {len(times)}")
    return {"ttft_ms": (times[0] - start) * 1e3, "gap_ms": (times[1] - times[0]) * 1e3,
            "transfer_ms": timings.get("transfer_ms", 0.0), "prefill_ms": timings.get("prefill_ms", 0.0)}


def run_mode(model_dir: str, layerwise: bool, lengths: list[int], repeats: int, connector: str, rng: random.Random,
             vocab: int, threads: int) -> dict[int, list[dict]]:
    """Start a disaggregated cluster, measure every length, stop it."""
    from pdserve_server.cli.launcher import ServeConfig, start_cluster

    args = ["--threads", str(threads), "--connector", connector, "--log-level", "WARNING",
            *(["--kv-layerwise"] if layerwise else [])]
    cluster = start_cluster(model_dir, Path(model_dir).name, ServeConfig(), worker_args=args,
                            coordinator_args=["--log-level", "WARNING"])
    try:
        out: dict[int, list[dict]] = {}
        asyncio.run(_measure(cluster.address, [rng.randrange(100, vocab) for _ in range(64)]))  # warm-up
        for n in lengths:
            out[n] = [asyncio.run(_measure(cluster.address, [rng.randrange(100, vocab) for _ in range(n)]))
                      for _ in range(repeats)]
        return out
    finally:
        cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="off/on cluster pairs, alternated")
    ap.add_argument("--connector", default="tcp")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--model-dir", default=None, help="HF-format model directory (default: the packaged model)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from transformers import AutoConfig

    from pdserve_server.cli.models import resolve_model

    model_dir = args.model_dir or str(resolve_model(None))
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(0)
    samples: dict[str, dict[int, list[dict]]] = {"off": {n: [] for n in lengths}, "on": {n: [] for n in lengths}}
    for r in range(args.rounds):
        for mode in ("off", "on"):
            got = run_mode(model_dir, mode == "on", lengths, args.repeats, args.connector, rng, vocab, args.threads)
            for n in lengths:
                samples[mode][n].extend(got[n])
            print(f"round {r + 1}/{args.rounds} layerwise {mode}: " + ", ".join(
                f"{n} tok gap {statistics.median(s['gap_ms'] for s in got[n]):.1f} ms" for n in lengths), flush=True)

    def med(mode: str, n: int, key: str) -> float:
        return statistics.median(s[key] for s in samples[mode][n])

    print(f"\n{args.connector}, {args.threads} torch thread(s) per worker, {args.rounds * args.repeats} requests "
          "per cell, medians (ms)")
    print(f"{'prompt':>7} | {'gap off':>8} {'gap on':>8} {'on/off':>6} | {'xfer off':>8} {'xfer on':>8} | "
          f"{'TTFT off':>8} {'TTFT on':>8}")
    rows = []
    for n in lengths:
        row = {"prompt_tokens": n, **{f"{k}_{m}": med(m, n, k) for k in ("gap_ms", "transfer_ms", "ttft_ms",
                                                                         "prefill_ms") for m in ("off", "on")}}
        rows.append(row)
        print(f"{n:>7} | {row['gap_ms_off']:8.1f} {row['gap_ms_on']:8.1f} {row['gap_ms_on'] / row['gap_ms_off']:6.2f} |"
              f" {row['transfer_ms_off']:8.1f} {row['transfer_ms_on']:8.1f} | {row['ttft_ms_off']:8.1f} "
              f"{row['ttft_ms_on']:8.1f}")
    if args.out:
        from pdserve_server.engine.hardware import cpu_flags

        Path(args.out).write_text(json.dumps({
            "commit": commit(), "date": time.strftime("%Y-%m-%d"), "machine": machine(),
            "cpu_flags": sorted(cpu_flags() & FLAGS_SHOWN), "connector": args.connector, "threads": args.threads,
            "rows": rows, "samples": samples}, indent=1))

if __name__ == "__main__":
    main()
