"""GPU check and timing of the Triton kernels against their references and the device's own ceilings.

Run on a CUDA machine from the repository root:  python bench/kernels_gpu.py [--out results.json]

1. Ceilings, measured in the same run: device-to-device copy bandwidth (bytes read + written over a 2 GiB copy)
   and the bf16 matmul rate (8192^3 on random data).
2. Every kernel against its torch reference on fresh random inputs (relative Frobenius error, NaN check; the
   output buffers of the references are compared after the kernels ran on poisoned caches where applicable).
3. Timings with `triton.testing.do_bench` (median of CUDA-event timings, after warm-up; these include the
   host's launch cost when it exceeds the kernel's) and, for decode, `do_bench_cudagraph` (replayed from a CUDA
   graph: device time alone, as the engine's captured decode steps run it):
   - decode attention, Llama-3-8B shapes (32 q / 8 kv heads, head_dim 128, bf16, block 16): achieved bandwidth
     (K+V+q+out bytes over time) as a fraction of the copy bandwidth, beside
     `F.scaled_dot_product_attention` on the same data laid out contiguously (what it would need without paging)
     and FlashAttention's paged `flash_attn_with_kvcache` if importable. Goal: >= 70% of copy at batch 64 x 2k.
   - decode at batch 1-4 x long contexts, split-K automatic vs forced to 1 (what flash-decoding buys);
   - prefill attention (causal FLOPs 2 * 2 * head_dim per visible (query, key) pair) as a fraction of the matmul
     rate, beside SDPA (is_causal) and FlashAttention's varlen kernel if importable, for whole prompts and for a
     chunk over a cached prefix;
   - KV cache write bandwidth against torch's index_put reference.
Prints a table last; writes everything to --out as JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve_server.kernels import reference as ref  # noqa: E402
from pdserve_server.kernels.triton_cache import write_kv_cache  # noqa: E402
from pdserve_server.kernels.triton_decode import paged_decode_attention  # noqa: E402
from pdserve_server.kernels.triton_prefill import prefill_attention  # noqa: E402

DEV = "cuda"
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16


def bench(fn) -> float:
    """Median milliseconds of fn() (CUDA events, warm-up and repeat budgets in ms)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=100, rep=500, return_mode="median")


def bench_graph(fn) -> float:
    """Median milliseconds of fn() replayed from a CUDA graph: the device time without the host's launch cost
    (what the engine's captured decode steps see, `engine.execution.cuda_graphs`)."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=500, return_mode="median")


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return math.inf
    return float((out.double() - expected.double()).norm() / expected.double().norm())


def _copy_ms(n: int) -> float:
    """ms per copy of n bf16 elements; the buffers are freed on return, before the matmul's."""
    src = torch.randn(n, device=DEV, dtype=DTYPE)
    dst = torch.empty_like(src)
    return bench(lambda: dst.copy_(src))


def ceilings() -> dict:
    n = 1 << 30  # 2 GiB of bf16
    copy_ms = _copy_ms(n)
    a = torch.randn(8192, 8192, device=DEV, dtype=DTYPE)
    b = torch.randn(8192, 8192, device=DEV, dtype=DTYPE)
    mm_ms = bench(lambda: a @ b)
    return dict(copy_gbps=2 * n * 2 / copy_ms / 1e6, matmul_tflops=2 * 8192 ** 3 / mm_ms / 1e9)


def paged_cache(lengths: list[int], extra_blocks: int = 0):
    """Random cache with each sequence's blocks scattered: (k_cache, v_cache, block_tables, context_lens)."""
    nbs = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(nbs) + extra_blocks
    kv = torch.randn(num_blocks, 1, 2, BLOCK, KV_HEADS, HEAD_DIM, device=DEV, dtype=DTYPE)
    perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    tables = torch.zeros(len(lengths), max(nbs), dtype=torch.int32, device=DEV)
    used = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    return kv[:, 0, 0], kv[:, 0, 1], tables, torch.tensor(lengths, dtype=torch.int32, device=DEV)


def dense_kv(k_cache, v_cache, tables, n):
    """Contiguous [B, kv_heads, n, head_dim] K and V (equal lengths) for SDPA / FlashAttention comparisons."""
    nb = -(-n // BLOCK)
    k = k_cache[tables[:, :nb].long()].flatten(1, 2)[:, :n].transpose(1, 2).contiguous()
    v = v_cache[tables[:, :nb].long()].flatten(1, 2)[:, :n].transpose(1, 2).contiguous()
    return k, v


def flash_attn():
    try:
        import flash_attn  # noqa: F401
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        return flash_attn_with_kvcache, flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch: just skip the comparison
        return None


def decode_case(batch: int, ctx: int, copy_gbps: float, splits_one_too: bool) -> dict:
    k_cache, v_cache, tables, lens = paged_cache([ctx] * batch)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=DEV, dtype=DTYPE)
    scale = HEAD_DIM ** -0.5
    row = dict(op="decode", batch=batch, ctx=ctx)
    row["rel_err"] = rel_err(paged_decode_attention(q, k_cache, v_cache, tables, lens, scale),
                             ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale))
    nbytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2 + 2 * q.numel() * 2
    row["triton_ms"] = bench(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale))
    row["triton_gbps"] = nbytes / row["triton_ms"] / 1e6
    row["triton_frac_copy"] = row["triton_gbps"] / copy_gbps
    row["triton_graph_ms"] = bench_graph(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale))
    row["triton_graph_frac_copy"] = nbytes / row["triton_graph_ms"] / 1e6 / copy_gbps
    if splits_one_too:
        row["triton_nosplit_ms"] = bench(
            lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=1))
    k, v = dense_kv(k_cache, v_cache, tables, ctx)
    qs = q[:, :, None, :]  # [B, Hq, 1, D]
    row["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True))
    row["sdpa_frac_copy"] = nbytes / row["sdpa_ms"] / 1e6 / copy_gbps
    row["sdpa_graph_ms"] = bench_graph(lambda: F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True))
    fa = flash_attn()
    if fa is not None:
        try:
            row["flash_ms"] = bench(lambda: fa[0](q[:, None], k_cache, v_cache, cache_seqlens=lens, block_table=tables,
                                                  softmax_scale=scale))
        except Exception as e:  # FA's paged path needs block sizes it supports (multiples of 256 in FA2)
            row["flash_error"] = str(e)[:200]
    return row


def prefill_case(batch: int, q_len: int, prefix: int, matmul_tflops: float) -> dict:
    ctx = prefix + q_len
    k_cache, v_cache, tables, lens = paged_cache([ctx] * batch)
    q = torch.randn(batch * q_len, Q_HEADS, HEAD_DIM, device=DEV, dtype=DTYPE)
    cu = torch.arange(0, batch + 1, device=DEV, dtype=torch.int32) * q_len
    scale = HEAD_DIM ** -0.5
    row = dict(op="prefill", batch=batch, q_len=q_len, prefix=prefix)
    row["rel_err"] = rel_err(prefill_attention(q, k_cache, v_cache, cu, lens, tables, scale, max_query_len=q_len),
                             ref.prefill_attention(q, k_cache, v_cache, cu, lens, tables, scale))
    visible = q_len * prefix + q_len * (q_len + 1) / 2  # causal (query, key) pairs per sequence and head
    flops = 4 * HEAD_DIM * visible * Q_HEADS * batch
    row["triton_ms"] = bench(lambda: prefill_attention(q, k_cache, v_cache, cu, lens, tables, scale,
                                                       max_query_len=q_len))
    row["triton_tflops"] = flops / row["triton_ms"] / 1e9
    row["triton_frac_matmul"] = row["triton_tflops"] / matmul_tflops
    if prefix == 0:  # SDPA's is_causal aligns the diagonal top-left: only comparable without a prefix
        k, v = dense_kv(k_cache, v_cache, tables, ctx)
        qs = q.view(batch, q_len, Q_HEADS, HEAD_DIM).transpose(1, 2)
        row["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale,
                                                                       enable_gqa=True))
        row["sdpa_tflops"] = flops / row["sdpa_ms"] / 1e9
        fa = flash_attn()
        if fa is not None:
            kf = k.transpose(1, 2).reshape(-1, KV_HEADS, HEAD_DIM)
            vf = v.transpose(1, 2).reshape(-1, KV_HEADS, HEAD_DIM)
            row["flash_ms"] = bench(lambda: fa[1](q, kf, vf, cu, cu, q_len, q_len, softmax_scale=scale,
                                                  causal=True))
    return row


def write_case(num_tokens: int, copy_gbps: float) -> dict:
    num_blocks = 4 * num_tokens // BLOCK
    kv = torch.randn(num_blocks, 1, 2, BLOCK, KV_HEADS, HEAD_DIM, device=DEV, dtype=DTYPE)
    expected = kv.clone()
    key = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, device=DEV, dtype=DTYPE)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * BLOCK, device=DEV)[:num_tokens]
    write_kv_cache(key, value, kv[:, 0, 0], kv[:, 0, 1], slots)
    ref.write_kv_cache(key, value, expected[:, 0, 0], expected[:, 0, 1], slots)
    row = dict(op="write_kv", tokens=num_tokens, exact=bool(torch.equal(kv, expected)))
    nbytes = 2 * 2 * key.numel() * 2  # read key+value, write them
    row["triton_ms"] = bench(lambda: write_kv_cache(key, value, kv[:, 0, 0], kv[:, 0, 1], slots))
    row["torch_ms"] = bench(lambda: ref.write_kv_cache(key, value, kv[:, 0, 0], kv[:, 0, 1], slots))
    row["triton_frac_copy"] = nbytes / row["triton_ms"] / 1e6 / copy_gbps
    return row


def main() -> None:
    p = argparse.ArgumentParser(description="GPU check + timing of the Triton kernels")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernels_gpu.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    torch.manual_seed(0)
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                      text=True).stdout.strip() or os.environ.get("PDSERVE_COMMIT", "?"))
    import triton
    info["triton"] = triton.__version__
    info.update(ceilings())
    rows = [decode_case(64, 2048, info["copy_gbps"], False)]
    for batch, ctx in ((1, 8192), (1, 32768), (4, 16384), (16, 4096), (128, 1024)):
        rows.append(decode_case(batch, ctx, info["copy_gbps"], batch < 16))
    for batch, q_len, prefix in ((8, 1024, 0), (2, 4096, 0), (4, 512, 2048)):
        rows.append(prefill_case(batch, q_len, prefix, info["matmul_tflops"]))
    rows.append(write_case(8192, info["copy_gbps"]))
    with open(args.out, "w") as f:
        json.dump(dict(info=info, rows=rows), f, indent=1)
    print(json.dumps(info))
    for r in rows:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
