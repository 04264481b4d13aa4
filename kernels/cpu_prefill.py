"""Prefill attention for CPU workers with 16-bit KV caches: blocked matrix products instead of SDPA.

torch's CPU SDPA (its flash kernel) runs a 1024-token causal bf16 prefill of SmolLM2's layer (9 q / 3 kv heads,
head_dim 64) at about 80-120 GFLOP/s on 2 AMD EPYC cores, where the same machine's bf16 GEMM reaches about 700.
It was 60% of a 1024-token prefill step (docs/history/benchmarks.md). Here each sequence's query rows go in blocks of
`block_m`: one batched bf16 GEMM per block for the scores of every query head against the keys the block can see
(the GQA group's heads stacked as rows of one GEMM per KV head), a causal softmax that masks the block's diagonal
square only, and one GEMM with V. Blocks keep the scores [heads, block_m, context] small enough to stay in cache.
The softmax is `causal_softmax` here (torch ops) or its C version from the cpu backend (`CpuKernels`), which reads
the bf16 scores and writes the probabilities in one pass.

A sliding window W (`kernels.reference`: the row at position p sees keys [p - W + 1, p]) bounds the work: a chunk
gathers K/V from the block holding its first row's window start, and a block of query rows multiplies against the
keys from its first row's window start only (at most W + block_m - 1), the softmax also masking the triangle left of
the later rows' windows.

Numerics: the scores come out of the bf16 GEMM rounded to bf16 (fp32 accumulation inside), as HF transformers'
eager attention computes them; SDPA keeps them in fp32. Softmax, its max and sum stay fp32, and the probabilities
are rounded to bf16 before the PV product as FlashAttention does. fp32 caches take the reference (exact parity).
"""
from __future__ import annotations

from typing import Callable

import torch

from pdserve_server.kernels import reference as ref
from pdserve_server.kernels.checks import window_size

# Query rows per block. With the torch softmax, 32 / 64 / 128 took 7.1 / 5.3 / 9.0 ms for a 1024-token layer; with
# the C one, a 1024-token prefill + first token took 523-588 / 468-514 / 456-466 / 459-474 ms at 32 / 64 / 128 / 256
# (2 threads, AMD EPYC): larger blocks pay once the softmax makes no fp32 copies.
BLOCK_M = 64
C_BLOCK_M = 128


def left_of_window(rows: int, end: int, window_start: int, device: torch.device) -> torch.Tensor:
    """[rows, width] bool, True at the keys left of each row's sliding window: row r's window starts at column
    window_start + r, so the hidden keys lie within the first width = clamp(rows - 1 + window_start, 0, end)."""
    width = min(max(rows - 1 + window_start, 0), end)
    cols = torch.arange(width, device=device)
    return cols[None, :] < torch.arange(rows, device=device)[:, None] + window_start


def causal_softmax(scores: torch.Tensor, rows: int, scale: float, window_start: int | None = None) -> torch.Tensor:
    """Probabilities of one query block's scores: softmax(scale * scores) in fp32 over the keys each row sees,
    rounded to the scores' dtype, 0 for the keys it does not see.

    Args:
        scores: [..., end] 16-bit, contiguous; each run of `rows` rows is the block's query rows in order, the last
            seeing all `end` keys and row r the first end - rows + r + 1 (causal within the block's diagonal).
        rows: query rows in the block.
        scale: softmax scale.
        window_start: with a sliding window, row r also hides the keys left of column window_start + r (<= 0 for
            the first rows when the window reaches past key 0); None: no window.

    Returns:
        a tensor shaped and typed as scores (the C version, `CpuKernels.causal_softmax`, writes into scores).
    """
    end = scores.shape[-1]
    tri = torch.ones(rows, rows, dtype=torch.bool, device=scores.device).triu_(1)  # key after the row: hidden
    s = scores.view(-1, rows, end).float()
    s[..., end - rows:].masked_fill_(tri, float("-inf"))
    if window_start is not None:
        hidden = left_of_window(rows, end, window_start, scores.device)
        s[..., :hidden.shape[1]].masked_fill_(hidden, float("-inf"))
    return torch.softmax(s.mul_(scale), -1).to(scores.dtype).view(scores.shape)


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, max_query_len: int | None = None, sliding_window: int | None = 0,
                      softmax: Callable[[torch.Tensor, int, float, int | None], torch.Tensor] = causal_softmax,
                      block_m: int = BLOCK_M) -> torch.Tensor:
    """Causal attention for packed query chunks over cached prefix + new tokens (contract of
    `kernels.reference.prefill_attention`).

    Args:
        query: [num_tokens, num_q_heads, head_dim] bf16/fp16/fp32.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], the query's dtype.
        cu_seqlens_q: [num_seqs + 1] int32 prefix sums of chunk lengths.
        context_lens: [num_seqs] int32 (cached prefix + chunk).
        block_tables: [num_seqs, max_blocks] int32.
        scale: softmax scale.
        max_query_len: unused (the reference's signature).
        sliding_window: W >= 1: the row at absolute position p sees keys [max(0, p - W + 1), p] only (HF's
            sliding-window mask, `kernels.reference`); 0 or None: all keys up to p.
        softmax: `causal_softmax`'s contract; the cpu backend passes its C version.
        block_m: query rows per block (`BLOCK_M`, `C_BLOCK_M`).

    Returns:
        [num_tokens, num_q_heads, head_dim] in the query's dtype.

    Raises:
        ValueError: a negative sliding_window.
    """
    window = window_size(sliding_window)
    if query.dtype == torch.float32:
        return ref.prefill_attention(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                                     sliding_window=window)
    out = torch.empty_like(query)
    _, block_size, kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // kv_heads
    starts = cu_seqlens_q.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        s, e = starts[i], starts[i + 1]
        q_len, prefix = e - s, ctx - (e - s)
        nb = -(-ctx // block_size)
        # Keys from position `base` on (the block holding the chunk's first window start; 0 without a window).
        base = max(0, prefix - window + 1) // block_size * block_size if window else 0
        ids = block_tables[i, base // block_size:nb].long()
        # [kvh, ctx - base, d], contiguous: the GEMMs then read K transposed and V in place, with no copy per block.
        k = torch.index_select(k_cache, 0, ids).view(-1, kv_heads, head_dim)[:ctx - base].transpose(0, 1).contiguous()
        v = torch.index_select(v_cache, 0, ids).view(-1, kv_heads, head_dim)[:ctx - base].transpose(0, 1).contiguous()
        q = query[s:e].view(q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kvh, group, q_len, d]
        o = out[s:e].view(q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        for r0 in range(0, q_len, block_m):
            rows = min(block_m, q_len - r0)
            end = prefix + r0 + rows - base  # keys the block's last row sees, from `base`
            start, window_start = 0, None
            if window:
                first = prefix + r0 - window + 1 - base  # the block's first row's window start, from `base`
                start = max(first, 0)
                if first - start > 1 - rows:  # some row's window starts right of the keys' first column
                    window_start = first - start
            qb = q[:, :, r0:r0 + rows].reshape(kv_heads, group * rows, head_dim)
            # [kvh, group * rows, end - start]
            p = softmax(torch.bmm(qb, k[:, start:end].transpose(1, 2)), rows, scale, window_start)
            o[:, :, r0:r0 + rows] = torch.bmm(p, v[:, start:end]).view(kv_heads, group, rows, head_dim)
    return out
