"""CPU prefill attention: the C kernel (`kernels/cpu_prefill_attention.c`) against what the cpu backend ran before it,
in the same process, on SmolLM2-135M's layer (9 q / 3 kv heads, head_dim 64; `--heads` for others).

- fp32 caches: the C kernel (every build) against `kernels.reference.prefill_attention` (torch's SDPA with an
  explicit causal mask, what fp32 ran before);
- bf16 caches, on a CPU with AVX512_BF16 only: the C kernel against `kernels.cpu_prefill` (blocked GEMMs, the C
  softmax).

Cases: whole prompts and a chunk after a cached prefix, K/V blocks scattered in the cache (as after a server has run
a while). The rate counts causal FLOPs (4 * head_dim per visible (query, key) pair, both sides alike) and is printed
beside the rate of the layer's own linears (`F.linear`, fp32/bf16, the same tokens) measured in the same run: the
share of a prefill layer attention takes is what the ratio steers. Best of `--repeats`; the relative error (Frobenius)
of each C output against the other path's.

Usage: python bench/cpu_prefill_attention.py [--threads 2] [--repeats 5] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.hostinfo import FLAGS_SHOWN, commit, machine  # noqa: E402
from pdserve_server.engine.hardware import cpu_flags  # noqa: E402
from pdserve_server.kernels import cpu_prefill  # noqa: E402
from pdserve_server.kernels import reference as ref  # noqa: E402
from pdserve_server.kernels.cpu_ops import CpuKernels, cpu_isa  # noqa: E402

BLOCK = 16
CASES = ((1, 1000, 0), (16, 100, 0), (1, 512, 488), (8, 512, 0))  # (sequences, chunk tokens, cached prefix tokens)
HIDDEN, INTERMEDIATE = 576, 1536  # SmolLM2-135M: the layer's linears for the baseline rate


def best_ms(fn, repeats: int) -> float:
    """Best wall time of fn() over `repeats` calls after one warm-up, in ms."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def case_inputs(seqs: int, chunk: int, prefix: int, heads: tuple[int, int, int], dtype: torch.dtype):
    """Query [seqs * chunk, hq, d] and paged caches with every sequence's blocks at random places."""
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seqs * 7919 + chunk + prefix)
    ctx = prefix + chunk
    per_seq = -(-ctx // BLOCK)
    num_blocks = seqs * per_seq + 8
    k_cache = torch.randn(num_blocks, BLOCK, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:seqs * per_seq].view(seqs, per_seq).to(torch.int32)
    query = torch.randn(seqs * chunk, hq, d, generator=g).to(dtype)
    cu = (torch.arange(seqs + 1) * chunk).to(torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    return query, k_cache, v_cache, cu, lens, tables


def linears_gflops(tokens: int, dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of one SmolLM2 layer's four linears (qkv, o, gate_up, down) over `tokens` rows."""
    shapes = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    weights = [torch.randn(n, k).to(dtype) for n, k in shapes]
    xs = {k: torch.randn(tokens, k).to(dtype) for k in (HIDDEN, INTERMEDIATE)}
    ms = best_ms(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], repeats)
    return 2 * tokens * sum(n * k for n, k in shapes) / ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads", default="9,3,64", help="q heads, kv heads, head_dim")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads = tuple(int(x) for x in args.heads.split(","))
    kernels = CpuKernels.load()
    flags = cpu_flags()
    dtypes = [torch.float32] + ([torch.bfloat16] if cpu_isa() == "avx512_bf16" else [])
    print(f"# {machine()}; flags {' '.join(f for f in FLAGS_SHOWN if f in flags)}; build {cpu_isa()}; "
          f"commit {commit()}; {args.threads} thread(s); heads {heads}")
    print(f"{'dtype':9} {'seqs':>4} {'chunk':>5} {'prefix':>6} {'C ms':>8} {'before ms':>9} {'C GF/s':>7} "
          f"{'before GF/s':>11} {'speedup':>7} {'linears GF/s':>12} {'rel err':>8}")
    rows = []
    for dtype in dtypes:
        for seqs, chunk, prefix in CASES:
            q, kc, vc, cu, lens, tables = case_inputs(seqs, chunk, prefix, heads, dtype)
            scale = heads[2] ** -0.5
            if dtype == torch.float32:
                def before():
                    return ref.prefill_attention(q, kc, vc, cu, lens, tables, scale)
            else:
                def before():
                    return cpu_prefill.prefill_attention(q, kc, vc, cu, lens, tables, scale,
                                                         softmax=kernels.causal_softmax,
                                                         block_m=cpu_prefill.C_BLOCK_M)

            def ours():
                return kernels.prefill_attention(q, kc, vc, cu, lens, tables, scale)

            out, want = ours().double(), before().double()
            err = float((out - want).norm() / want.norm())
            c_ms, before_ms = best_ms(ours, args.repeats), best_ms(before, args.repeats)
            flops = seqs * 4 * heads[0] * heads[2] * (chunk * prefix + chunk * (chunk + 1) / 2)
            row = {"dtype": str(dtype).removeprefix("torch."), "seqs": seqs, "chunk": chunk, "prefix": prefix,
                   "c_ms": c_ms, "before_ms": before_ms, "c_gflops": flops / c_ms / 1e6,
                   "before_gflops": flops / before_ms / 1e6, "speedup": before_ms / c_ms,
                   "linears_gflops": linears_gflops(seqs * chunk, dtype, args.repeats), "rel_err": err}
            rows.append(row)
            print(f"{row['dtype']:9} {seqs:>4} {chunk:>5} {prefix:>6} {c_ms:>8.2f} {before_ms:>9.2f} "
                  f"{row['c_gflops']:>7.1f} {row['before_gflops']:>11.1f} {row['speedup']:>6.2f}x "
                  f"{row['linears_gflops']:>12.1f} {err:>8.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "commit": commit(), "threads": args.threads, "heads": heads,
                       "build": cpu_isa(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
