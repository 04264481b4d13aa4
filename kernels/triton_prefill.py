"""Triton prefill attention over packed variable-length chunks that also reads cached prefix blocks.

Grid: (cdiv(max_query_len, BLOCK_M), num_seqs, num_q_heads). A program takes BLOCK_M query rows of one chunk and
one head, and streams that sequence's K/V from the paged cache in BLOCK_N-token tiles (gathered through the block
table, so cached prefix blocks, earlier chunks and the chunk itself are read alike) with a FlashAttention-2 style
online softmax (Dao 2023) in fp32, log2 domain. Query row j of a chunk of q_len tokens sits at absolute position
context_len - q_len + j and sees keys at positions <= its own (causal); tiles past the last row's position are
never loaded, and whole tiles at or before the first row's position are walked without the mask (SPLIT_MASK).
Programs past a chunk's end do no work (ragged chunks share one launch).

A sliding window W (`kernels.reference`: the row at position p sees keys [p - W + 1, p]) is a plain int argument,
as in the decode kernel. The key loop starts at the block's first row's window start, so a block loads at most
W + BLOCK_M - 1 keys however long the context; whole tiles that every row's window holds still skip the mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve_server.kernels.checks import check, check_attention, check_tensor, window_size
from pdserve_server.kernels.triton_common import attend_paged_tile, dot_mode

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape of the prefill kernel: query rows and key tokens per tile, warps, software-pipeline stages, and
    whether tiles every row of a program sees whole skip the causal mask (SPLIT_MASK)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    split_mask: bool = False


def prefill_config(head_pad: int, dtype: torch.dtype) -> PrefillConfig:
    """The default launch shape for a padded head size and cache dtype.

    Chosen on an H100 (bench/prefill_tune.py, docs/history/benchmarks.md): unmasked whole tiles paid 12-30% in every
    launch shape tried (2026-11-24). For head size 128 in bf16, tiles of 128 x 128 keys on 8 warps measured 7-10%
    faster on 4096-token prompts and on 512-token chunks after a 2048-token prefix, 2-3% slower on 1024-token prompts
    (three runs, 2026-11-26, Triton 3.6), but they spill registers to local memory when Triton 3.9 compiles them for
    sm_90 (255 registers, 24 bytes of stack: tests/kernels/test_kernels_compile.py), so 64 x 64 stays the default
    until a spill-free 128-row variant is measured.
    """
    if head_pad > 128:
        return PrefillConfig(32, 32, split_mask=True)
    return PrefillConfig(64, 64, split_mask=True)


@triton.jit
def _attend_masked(q, m_i, l_i, acc, start, end, q_pos, q_lo, k_ptr, v_ptr, bt_row_ptr, kv_head,
                   stride_k_block, stride_v_block, qk_scale, offs_n, offs_d, d_mask,
                   BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Tiles of keys [start, end), row r seeing keys q_lo[r] <= pos <= q_pos[r] (causal, and its window)."""
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        n_mask = pos < end
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= q_lo[:, None])
        m_i, l_i, acc = attend_paged_tile(
            q, m_i, l_i, acc, k_ptr, v_ptr, bt_row_ptr, pos, n_mask, visible, kv_head,
            stride_k_block, stride_v_block, qk_scale, offs_d, d_mask,
            BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, UPCAST_DOT, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["window", "stride_bt_seq"])  # step-varying ints: see triton_decode._decode_kernel
def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, ctx_ptr, out_ptr, qk_scale, window,
                    stride_q_tok, stride_q_head, stride_k_block, stride_v_block, stride_bt_seq,
                    stride_o_tok, stride_o_head,
                    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                    HEAD_DIM: tl.constexpr,
                    HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT_MASK: tl.constexpr):
    # Heaviest query blocks first (the last rows see the most keys under the causal mask): the grid's tail is then
    # made of short programs, as FlashAttention-2 schedules them.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    ctx = tl.load(ctx_ptr + seq)
    prefix = ctx - q_len

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_PAD)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    # Keys this block can see: up to its last row's position; none when the block lies past the chunk.
    first_row = prefix + m_block * BLOCK_M
    hi = tl.minimum(ctx, first_row + BLOCK_M)
    hi = tl.where(m_block * BLOCK_M < q_len, hi, 0)
    # With a window, from the first row's window start on (window 0: from key 0); row r from q_lo[r] on.
    lo = tl.where(window > 0, tl.maximum(first_row - window + 1, 0), 0)
    q_lo = tl.where(window > 0, q_pos - window + 1, 0)
    # The running max starts finite, not -inf: a window narrower than the block leaves rows that see no key of a
    # tile (all scores -inf), and -inf - -inf would make them NaN. exp2(-FLT_MAX - m) is 0 as exp2(-inf - m) is.
    m_i = tl.full([BLOCK_M], -3.4028234663852886e38, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    bt_row_ptr = bt_ptr + seq * stride_bt_seq
    start = lo
    if SPLIT_MASK:
        # Whole tiles that every row sees skip the mask: at positions <= the block's first row, and with a window
        # >= its last row's window start (hi - window). Masked tiles before them cover [lo, that start).
        full_lo = tl.where(window > 0, tl.maximum(hi - window, 0), 0)
        num_full = tl.maximum(tl.minimum(first_row + 1, hi) - full_lo, 0) // BLOCK_N
        head_end = tl.where(num_full > 0, full_lo, lo)
        m_i, l_i, acc = _attend_masked(
            q, m_i, l_i, acc, lo, head_end, q_pos, q_lo, k_ptr, v_ptr, bt_row_ptr, kv_head,
            stride_k_block, stride_v_block, qk_scale, offs_n, offs_d, d_mask,
            BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, UPCAST_DOT, DOT_PRECISION)
        start = head_end + num_full * BLOCK_N
        for tile in range(head_end, start, BLOCK_N):
            m_i, l_i, acc = attend_paged_tile(
                q, m_i, l_i, acc, k_ptr, v_ptr, bt_row_ptr, tile + offs_n, None, None, kv_head,
                stride_k_block, stride_v_block, qk_scale, offs_d, d_mask,
                BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, UPCAST_DOT, DOT_PRECISION)
    m_i, l_i, acc = _attend_masked(
        q, m_i, l_i, acc, start, hi, q_pos, q_lo, k_ptr, v_ptr, bt_row_ptr, kv_head,
        stride_k_block, stride_v_block, qk_scale, offs_n, offs_d, d_mask,
        BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, UPCAST_DOT, DOT_PRECISION)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows past the chunk: never stored, keep them finite
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, max_query_len: int | None = None, sliding_window: int | None = 0,
                      config: PrefillConfig | None = None) -> torch.Tensor:
    """Causal attention for packed query chunks over cached prefix + new tokens (contract of `kernels.reference`).

    Args:
        query: [num_tokens, num_q_heads, head_dim] fp32/fp16/bf16, last dim contiguous.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], the query's dtype, dense within a block;
            every chunk's K/V already written.
        cu_seqlens_q: [num_seqs + 1] int32 prefix sums of chunk lengths (cu[0] = 0, cu[-1] = num_tokens).
        context_lens: [num_seqs] int32, each >= its chunk length (cached prefix + chunk).
        block_tables: [num_seqs, max_blocks] int32.
        scale: softmax scale.
        max_query_len: longest chunk in tokens, if the caller knows it; None reads it from cu_seqlens_q (one
            device sync).
        sliding_window: W >= 1: the row at absolute position p sees keys [max(0, p - W + 1), p] only (HF's
            sliding-window mask: k <= q and q - k < W, `kernels.reference`); 0 or None: all keys up to p.
        config: launch shape; None takes `prefill_config`'s default for the head size and dtype.

    Returns:
        [num_tokens, num_q_heads, head_dim] in the query's dtype; fp32 softmax and accumulation.

    Raises:
        ValueError: a shape, stride, dtype or device mismatch, or a negative sliding_window.
    """
    window = window_size(sliding_window)
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,), query.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    check(num_seqs >= 0, "cu_seqlens_q must have num_seqs + 1 entries, got shape (0,)")
    check_attention(query, k_cache, v_cache, block_tables, context_lens, num_seqs)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape

    out = torch.empty_like(query)
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    head_pad = max(16, triton.next_power_of_2(head_dim))
    cfg = config or prefill_config(head_pad, query.dtype)
    grid = (triton.cdiv(max_query_len, cfg.block_m), num_seqs, num_q_heads)
    upcast, precision = dot_mode(query.dtype)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, cu_seqlens_q.contiguous(), context_lens.contiguous(), out,
        scale * _LOG2E, window,
        query.stride(0), query.stride(1), k_cache.stride(0), v_cache.stride(0), block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim,
        HEAD_PAD=head_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, UPCAST_DOT=upcast,
        DOT_PRECISION=precision, SPLIT_MASK=cfg.split_mask, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
