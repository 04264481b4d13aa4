"""The matrix product used by the attention kernels, with a workaround for Triton's CPU interpreter.

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
def mma(a, b, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a [M, K] @ b [K, N] -> [M, N] fp32."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)
