"""Pieces shared by the attention kernels: the paged tile step of the online softmax, and the matrix product with
a workaround for Triton's CPU interpreter.

Triton 3.9's interpreter (TRITON_INTERPRET=1, numpy underneath) mis-reads bf16 operands of `tl.dot` as raw
integers (a 16x16 product of N(0,1) values comes out near 2e10), while bf16 loads, stores and casts are right.
Under the interpreter bf16 operands are therefore upcast to fp32 first. That computes the same function as the
GPU path: products of two bf16 values are exact in fp32 and the GPU's bf16 MMA accumulates in fp32 too.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def dot_mode(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST_DOT, DOT_PRECISION) constexprs for a kernel whose dot operands have `dtype`.

    fp32 operands use IEEE fp32 dots (Triton's default would be TF32, ~1e-3 relative error).
    """
    upcast = dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    return upcast, "ieee" if dtype == torch.float32 or upcast else "tf32"


@triton.jit
def mma(a, b, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, acc=None):
    """a [M, K] @ b [K, N] (+ acc [M, N] fp32, accumulated in place by the MMA) -> [M, N] fp32."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_PRECISION)
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def attend_paged_tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_row_ptr, pos, n_mask, visible, kv_head,
                      stride_k_block, stride_v_block, qk_scale, offs_d, d_mask,
                      BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One tile of an online softmax (Milakov & Gimelshein 2018) over keys gathered through a block table.

    q [R, HEAD_PAD] attends to the tile's positions `pos` [N] (valid where n_mask) of one KV head; `visible`
    ([R, N] or [1, N]) masks scores. n_mask and visible None: every position is valid and visible to every row
    (no masking work). m_i, l_i [R] (running max and sum, log2 units) and acc [R, HEAD_PAD] are fp32.
    Probabilities are rounded to the cache dtype before the PV product (as FlashAttention does). A token's heads
    are one dense row of NUM_KV_HEADS * HEAD_DIM elements inside a block. The running max must stay finite: either
    every row sees a position of its first tile, or m_i starts at a finite floor (-FLT_MAX) so that a row that sees
    none (a sliding window narrower than the prefill block) keeps alpha 1 and p 0 instead of NaN. Returns the
    updated (m_i, l_i, acc).
    """
    if n_mask is None:
        block = tl.load(bt_row_ptr + pos // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    else:
        block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    inner = (pos % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
    k = tl.load(k_ptr + block[:, None] * stride_k_block + inner[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    s = mma(q, tl.trans(k), UPCAST_DOT, DOT_PRECISION)  # unscaled: the scale folds into one FMA below
    if visible is not None:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # qk_scale > 0, so max(s) * scale = max(s * scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + block[:, None] * stride_v_block + inner[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = mma(p.to(v.dtype), v, UPCAST_DOT, DOT_PRECISION, acc * alpha[:, None])
    return m_new, l_i, acc
