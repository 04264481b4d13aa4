"""Launch shapes of the Triton prefill kernel on a CUDA GPU: each `PrefillConfig` checked against the torch reference
and timed, so the default (`kernels.triton_prefill.prefill_config`) is chosen from measurement.

Run on a CUDA machine from the repository root:  python bench/prefill_tune.py [--out prefill_tune.json]

Shapes: Llama-3-8B's (32 q / 8 kv heads, head_dim 128) and SmolLM2-135M's (9 q / 3 kv heads, head_dim 64), bf16,
block 16, K/V blocks scattered in the cache. Cases are `bench/kernels_gpu.py`'s prefill cases: whole prompts and a
chunk over a cached prefix. Achieved rate counts causal FLOPs (4 * head_dim per visible (query, key) pair) and is
printed as a fraction of the bf16 matmul rate measured in the same run. Every config is first checked on ragged
chunks with cached prefixes (relative Frobenius error against `kernels.reference`, bound 2e-2 as in
tests/kernels/test_kernels_triton.py); a config that fails to compile or to match is reported and not timed.
`F.scaled_dot_product_attention` (FlashAttention on Hopper) runs the whole-prompt cases on the same data laid out
contiguously, causal, as the class this kernel is measured against. `--configs` limits the run to some launch
shapes (block_m x block_n x warps x stages, unmasked whole tiles), e.g. `64x64x4x3,128x128x8x3`; `--tag` labels
the run in the JSON (an A/B of two kernel versions on one machine runs this script once per version).
Prints a table last; writes every row to --out as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdserve_server.kernels import reference as ref  # noqa: E402
from pdserve_server.kernels.triton_prefill import PrefillConfig, prefill_attention, prefill_config  # noqa: E402
from kernels_gpu import bench, rel_err  # noqa: E402

DEV = "cuda"
BLOCK = 16
SHAPES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
CASES = ((8, 1024, 0), (2, 4096, 0), (4, 512, 2048))  # (sequences, chunk tokens, cached prefix tokens)
CONFIGS = [PrefillConfig(*c) for c in (  # (block_m, block_n, num_warps, num_stages, split_mask); spills: kernel_report
    (64, 64, 4, 3, False), (64, 64, 4, 3, True), (64, 64, 8, 3, False), (64, 64, 8, 3, True), (64, 128, 8, 3, True),
    (128, 32, 8, 3, True), (128, 64, 8, 3, False), (128, 64, 8, 3, True), (128, 64, 8, 2, True),
    (128, 128, 8, 3, True), (128, 128, 8, 2, True))]


def paged(lengths: list[int], kv_heads: int, head_dim: int, g: torch.Generator):
    """Random bf16 cache with each sequence's blocks scattered: (k_cache, v_cache, block_tables, context_lens)."""
    nbs = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(nbs) + 3
    kv = torch.randn(num_blocks, 2, BLOCK, kv_heads, head_dim, generator=g).to(DEV, torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(len(lengths), max(nbs), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    return kv[:, 0], kv[:, 1], tables.to(DEV), torch.tensor(lengths, dtype=torch.int32, device=DEV)


def max_error(cfg: PrefillConfig, q_heads: int, kv_heads: int, head_dim: int) -> float:
    """Worst relative error over ragged chunks (1 token to several tiles) with and without cached prefixes."""
    g = torch.Generator().manual_seed(0)
    q_lens, prefixes = [1, 17, 200, 333, 64], [0, 5, 0, 700, 128]
    k_cache, v_cache, tables, ctx = paged([q + p for q, p in zip(q_lens, prefixes)], kv_heads, head_dim, g)
    query = torch.randn(sum(q_lens), q_heads, head_dim, generator=g).to(DEV, torch.bfloat16)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(DEV, torch.int32)
    out = prefill_attention(query, k_cache, v_cache, cu, ctx, tables, head_dim ** -0.5, max(q_lens), config=cfg)
    return rel_err(out, ref.prefill_attention(query, k_cache, v_cache, cu, ctx, tables, head_dim ** -0.5))


def time_case(cfg: PrefillConfig, shape: tuple[int, int, int], case: tuple[int, int, int]) -> float:
    """Median ms of one launch on the case (CUDA events, `kernels_gpu.bench`)."""
    (q_heads, kv_heads, head_dim), (batch, q_len, prefix) = shape, case
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache, tables, ctx = paged([prefix + q_len] * batch, kv_heads, head_dim, g)
    query = torch.randn(batch * q_len, q_heads, head_dim, generator=g).to(DEV, torch.bfloat16)
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device=DEV) * q_len
    return bench(lambda: prefill_attention(query, k_cache, v_cache, cu, ctx, tables, head_dim ** -0.5, q_len,
                                           config=cfg))


def sdpa_case(shape: tuple[int, int, int], case: tuple[int, int, int]) -> float | None:
    """Median ms of causal SDPA over the whole-prompt case on contiguous [batch, heads, len, head_dim] bf16 (GQA
    by `enable_gqa`); None for a chunk over a cached prefix (SDPA's causal mask is top-left aligned)."""
    import torch.nn.functional as F

    (q_heads, kv_heads, head_dim), (batch, q_len, prefix) = shape, case
    if prefix:
        return None
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, q_heads, q_len, head_dim, generator=g).to(DEV, torch.bfloat16)
    k = torch.randn(batch, kv_heads, q_len, head_dim, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn_like(k)
    return bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


def parse_configs(text: str) -> list[PrefillConfig]:
    """"64x64x4x3,128x128x8x3" -> launch shapes with unmasked whole tiles; "" -> every shape in CONFIGS."""
    if not text:
        return CONFIGS
    return [PrefillConfig(*map(int, item.split("x")), split_mask=True) for item in text.split(",")]


def matmul_rate() -> float:
    """bf16 TFLOP/s of an 8192^3 matmul on random data (`kernels_gpu.bench`)."""
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / bench(lambda: a @ a) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prefill_tune.json"))
    p.add_argument("--configs", default="", help="launch shapes MxNxWARPSxSTAGES, comma-separated; default all")
    p.add_argument("--tag", default="", help="label for this run in the JSON")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    configs = parse_configs(args.configs)
    matmul_tflops = matmul_rate()
    rows = []
    for name, shape in SHAPES.items():
        head_pad = max(16, 1 << (shape[2] - 1).bit_length())
        default = prefill_config(head_pad, torch.bfloat16)
        sdpa = dict(shape=name, kernel="sdpa")
        for batch, q_len, prefix in CASES:
            ms = sdpa_case(shape, (batch, q_len, prefix))
            if ms is not None:
                tflops = 4 * shape[2] * q_len * (q_len + 1) / 2 * shape[0] * batch / ms / 1e9
                sdpa[f"{batch}x{q_len}+{prefix}"] = dict(ms=ms, tflops=tflops, frac_matmul=tflops / matmul_tflops)
        rows.append(sdpa)
        print(json.dumps(sdpa), flush=True)
        for cfg in configs:
            row = dict(shape=name, **cfg.__dict__, default=cfg == default)
            try:
                row["rel_err"] = max_error(cfg, *shape)
            except Exception as e:  # a launch shape this GPU or Triton cannot build is itself a finding
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            if row.get("rel_err", 1.0) <= 2e-2:
                for case in CASES:
                    batch, q_len, prefix = case
                    ms = time_case(cfg, shape, case)
                    pairs = q_len * prefix + q_len * (q_len + 1) / 2
                    tflops = 4 * shape[2] * pairs * shape[0] * batch / ms / 1e9
                    row[f"{batch}x{q_len}+{prefix}"] = dict(ms=ms, tflops=tflops, frac_matmul=tflops / matmul_tflops)
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), tag=args.tag, triton=triton.__version__,
                       matmul_tflops=matmul_tflops, rows=rows), f, indent=1)
    print(f"{args.tag}: bf16 matmul {matmul_tflops:.0f} TFLOP/s; TFLOP/s per case")
    for r in rows:
        if r.get("kernel") == "sdpa":
            print(f"{r['shape']:<13} SDPA (contiguous, causal)             " + "  ".join(
                f"{r[f'{b}x{q}+{pf}']['tflops']:6.1f}" if f"{b}x{q}+{pf}" in r else "     -" for b, q, pf in CASES))
            continue
        cells = "  ".join(f"{r[f'{b}x{q}+{pf}']['tflops']:6.1f}" if f"{b}x{q}+{pf}" in r else "     -"
                          for b, q, pf in CASES)
        print(f"{r['shape']:<13} m{r['block_m']:<4} n{r['block_n']:<4} w{r['num_warps']} s{r['num_stages']} "
              f"split={int(r['split_mask'])} {'*' if r['default'] else ' '} {cells}  "
              f"{r.get('error', '')[:60] or format(r['rel_err'], '.1e')}")


if __name__ == "__main__":
    main()
