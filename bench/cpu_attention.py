"""The C decode attention kernel (`kernels/cpu_decode.c`), build against build, on the engine's cache layout.

Each build is one ISA level of the installed extension (`kernels.cpu_ops.cpu_isas`: the levels this CPU runs, e.g.
`avx512_bf16` and `avx512` with the AVX-512 intrinsics path, `avx2` with the AVX2 one, `base` with the plain loops
the compiler vectorizes), interleaved in one process so that all see the same machine. Two regimes per point:

- `dram`: one pass over all layers, as a decode step does; each layer's K/V (12.6 MB at 64 x 256 tokens, bf16)
  comes from memory. Blocks are placed at random in the cache, as they are after a server has run for a while.
- `cache`: the same layer every time, so K/V stay in the last-level cache: the kernel's compute alone.

Prints ms per layer (best of `--repeats` passes), GB/s of K/V read by the best build, and the ratio of the plainest
build (`base`) to the best.

Usage: python bench/cpu_attention.py [--batches 16,64] [--contexts 256,1024] [--threads 1] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.hostinfo import FLAGS_SHOWN, commit, machine  # noqa: E402
from pdserve_server.engine.hardware import cpu_flags  # noqa: E402
from pdserve_server.kernels.cpu_ops import CpuKernels, cpu_isas, set_cpu_isa  # noqa: E402


def measure(kernels: CpuKernels, isas: list[str], batch: int, context: int, dtype: torch.dtype, layers: int,
            repeats: int, num_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64,
            block_size: int = 16) -> dict:
    """ms per layer for each build in each regime, on a [num_blocks, layers, 2, block_size, kv_heads, head_dim]
    cache (the engine's `KVCache.kv` layout; SmolLM2-135M's head shapes by default)."""
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq + 8
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(num_blocks, layers, 2, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    query = torch.randn(batch, num_heads, head_dim, generator=g).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    scale = head_dim ** -0.5
    best = {(name, regime): float("inf") for name in isas for regime in ("dram", "cache")}
    for _ in range(repeats):
        for name in isas:  # interleaved, so drift hits every build alike
            set_cpu_isa(name)
            for regime in ("dram", "cache"):
                start = time.perf_counter()
                for layer in range(layers):
                    at = layer if regime == "dram" else 0
                    kernels.paged_decode_attention(query, kv[:, at, 0], kv[:, at, 1], tables, lens, scale)
                best[name, regime] = min(best[name, regime], (time.perf_counter() - start) / layers)
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * kv.element_size()
    return {"batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch."),
            "kv_bytes_per_layer": kv_bytes,
            "ms_per_layer": {f"{n}/{r}": s * 1e3 for (n, r), s in best.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--layers", type=int, default=30, help="layers in the cache (SmolLM2-135M: 30)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch (and kernel) threads")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels, isas = CpuKernels.load(), cpu_isas()  # best first
    host = {"machine": machine(), "cpu_flags": sorted(cpu_flags() & FLAGS_SHOWN), "commit": commit(),
            "threads": args.threads}
    print(f"# {host['machine']}; flags {' '.join(host['cpu_flags'])}; commit {host['commit']}; "
          f"{args.threads} thread(s)")
    print("dtype     batch  ctx  regime  " + "  ".join(f"{n:>11} ms" for n in isas) + f"  GB/s ({isas[0]})  ratio")
    rows = []
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                row = measure(kernels, isas, batch, context, dtype, args.layers, args.repeats)
                rows.append(row)
                ms = row["ms_per_layer"]
                for regime in ("dram", "cache"):
                    times = [ms[f"{n}/{regime}"] for n in isas]
                    print(f"{row['dtype']:9} {batch:5} {context:4}  {regime:6}  "
                          + "  ".join(f"{t:14.3f}" for t in times)
                          + f"  {row['kv_bytes_per_layer'] / times[0] / 1e6:13.1f}  {times[-1] / times[0]:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**host, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
