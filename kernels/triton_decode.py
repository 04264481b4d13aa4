"""Triton paged decode attention with split-K (flash-decoding, Dao et al. 2023).

Grid: (num_seqs, num_kv_heads, num_splits). Each program owns one KV head of one sequence and all `group` query
heads that share it (GQA), so every K/V byte is read from memory once per step, and a contiguous slice of the
sequence's context. It walks its slice in tiles of BLOCK_N tokens gathered through the block table (any block
size, power of two or not), keeping an online softmax (Milakov & Gimelshein 2018) in fp32 in the log2 domain.
With one split the program normalises and writes the output; with several, it writes its unnormalised partial
(acc, running max m, running sum l) and a second kernel merges the splits:
    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,   M = max_s m_s.
Splitting lets a batch of few long sequences still fill the GPU; it is chosen on the host without a device sync
(the block table's width bounds the longest context).
A sliding window W (`kernels.reference`) is a plain int argument, not a constexpr, so layers of different windows
(Gemma alternates them) share the compiled kernel, and a CUDA graph captures each layer's launch with its W like
any other scalar, with no host sync. The splits then cover the window [max(0, ctx - W), ctx) only: a long context
costs what the window does.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdserve_server.kernels.checks import check, check_attention, window_size
from pdserve_server.kernels.triton_common import attend_paged_tile, dot_mode

_LOG2E = 1.4426950408889634
# Fewest context tokens worth one split: below this the merge costs more than the parallelism gains.
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 64


# Values that change from step to step are runtime arguments Triton must not specialize on (it compiles a variant per
# value of a constexpr, and per "== 1" / "divisible by 16" of an int): on an H200 each variant compiled in the middle
# of serving stalled its step 0.35-1.75 s (docs/benchmarks.md, step times on one GPU).
@triton.jit(do_not_specialize=["window", "num_splits", "stride_bt_seq"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                   qk_scale, window, num_splits,
                   stride_q_seq, stride_q_head, stride_k_block, stride_v_block, stride_bt_seq,
                   stride_o_seq, stride_o_head,
                   BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                   GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    # The keys this query sees: [lo, ctx), the last `window` of them with a window (window 0: all).
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    # Split lengths are whole tiles so that only the sequence's last tile is ragged.
    split_len = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, ctx)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    for tile in range(start, end, BLOCK_N):  # the tile's first position is always valid: max stays finite
        pos = tile + offs_n
        n_mask = pos < end
        m_i, l_i, acc = attend_paged_tile(
            q, m_i, l_i, acc, k_ptr, v_ptr, bt_ptr + seq * stride_bt_seq, pos, n_mask, n_mask[None, :], kv_head,
            stride_k_block, stride_v_block, qk_scale, offs_d, d_mask,
            BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, UPCAST_DOT, DOT_PRECISION)

    out_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials: acc [S, Hq, num_splits, HEAD_PAD], ml [S, Hq, num_splits, 2] (fp32, contiguous)
        part = (seq * (NUM_KV_HEADS * GROUP) + heads) * num_splits + split  # [GROUP_PAD]
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(part_acc_ptr, part_ml_ptr, out_ptr, num_splits, stride_o_seq, stride_o_head,
                  NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                  SPLITS_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_mask = offs_s < num_splits
    part = (seq * NUM_Q_HEADS + head) * num_splits + offs_s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, 0)  # finite: split 0 always holds the sequence's first tile
    w = tl.exp2(m - m_max)  # empty splits have m = -inf -> weight 0
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per (sequence, KV head) so that about two programs run per SM, but no split is shorter than
    256 tokens (below that the merge costs more than the parallelism gains). Returns 1..64."""
    programs = max(1, num_seqs * num_kv_heads)
    want = math.ceil(2 * num_sms / programs)
    most = max(1, max_context // _MIN_SPLIT_TOKENS)
    return max(1, min(want, most, _MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter on CPU: any value works; this one exercises the split path on long contexts


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = 0, *, num_splits: int | None = None) -> torch.Tensor:
    """Attention for one query token per sequence over its paged context (same contract as `kernels.reference`).

    Args:
        query: [num_seqs, num_q_heads, head_dim] fp32/fp16/bf16, last dim contiguous; num_q_heads is a multiple
            of num_kv_heads.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], the query's dtype, dense within a block.
        block_tables: [num_seqs, max_blocks] int32; max_blocks * block_size must cover every context.
        context_lens: [num_seqs] int32, each >= 1 (the query's own token is already in the cache).
        scale: softmax scale, usually head_dim ** -0.5.
        sliding_window: W >= 1 attends over positions [max(0, context_len - W), context_len) only (HF's
            sliding-window mask: k <= q and q - k < W, `kernels.reference`); 0 or None: the whole context.
        num_splits: split-K factor; None picks one from the batch shape and the window (`choose_num_splits`).

    Returns:
        [num_seqs, num_q_heads, head_dim] in the query's dtype; scores, softmax and accumulation in fp32
        (fp32 inputs use IEEE fp32 dots, not TF32).

    Raises:
        ValueError: a shape, stride, dtype or device mismatch, a negative sliding_window, or num_splits < 1.
    """
    check_attention(query, k_cache, v_cache, block_tables, context_lens, num_seqs=query.shape[0])
    window = window_size(sliding_window)
    device = query.device
    num_seqs, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_splits is None:
        longest = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_seqs, num_kv_heads, min(longest, window) if window else longest,
                                       _num_sms(device))
    check(num_splits >= 1, lambda: f"num_splits must be >= 1, got {num_splits}")

    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_dim))
    upcast, precision = dot_mode(query.dtype)
    if num_splits == 1:
        part_acc = part_ml = out  # unused
    else:
        part_acc = torch.empty(num_seqs, num_q_heads, num_splits, head_pad, dtype=torch.float32, device=device)
        part_ml = torch.empty(num_seqs, num_q_heads, num_splits, 2, dtype=torch.float32, device=device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, context_lens.contiguous(), out, part_acc, part_ml,
        scale * _LOG2E, window, num_splits,
        query.stride(0), query.stride(1), k_cache.stride(0), v_cache.stride(0), block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_N=64 if head_pad <= 128 else 32, SPLIT=num_splits > 1,
        UPCAST_DOT=upcast, DOT_PRECISION=precision)
    if num_splits > 1:
        _merge_kernel[(num_seqs, num_q_heads)](
            part_acc, part_ml, out, num_splits, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            SPLITS_PAD=triton.next_power_of_2(max(num_splits, _MAX_SPLITS)))  # one variant for every count
    return out
