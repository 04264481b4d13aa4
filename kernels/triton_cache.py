"""Triton KV cache write: scatter a step's new keys/values into the paged cache through the slot mapping.

One program per token copies that token's [num_kv_heads * head_dim] K row and V row to
cache[slot // block_size, slot % block_size]. One launch replaces torch's div/sub/index_put sequence (four to six
launches and an int64 index tensor per operand).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_server.kernels.checks import FLOAT_DTYPES, check, check_kv_caches, check_tensor


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_key_t, stride_value_t, stride_kc_block, stride_vc_block,
                     BLOCK_SIZE: tl.constexpr, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    cols = tl.arange(0, ROW_PAD)
    mask = cols < ROW
    # A token's heads are one dense row of ROW elements both in the input and inside a cache block.
    k = tl.load(key_ptr + token.to(tl.int64) * stride_key_t + cols, mask=mask)
    v = tl.load(value_ptr + token.to(tl.int64) * stride_value_t + cols, mask=mask)
    tl.store(k_cache_ptr + block * stride_kc_block + offset * ROW + cols, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vc_block + offset * ROW + cols, v, mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values into the paged cache, in place (same contract as `kernels.reference`).

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], the cache's dtype; each token's heads one dense row
            (a strided dim 0 is fine, e.g. a slice of the fused qkv output).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], dense within a block.
        slot_mapping: [num_tokens] int64; slot = block_id * block_size + offset, each in [0, num_blocks * block_size).

    Raises:
        ValueError: a shape, stride, dtype or device mismatch (slot values are not checked: that would sync).
    """
    device = k_cache.device
    check_kv_caches(k_cache, v_cache, device, (k_cache.dtype,))
    check(k_cache.dtype in FLOAT_DTYPES, lambda: f"unsupported cache dtype {k_cache.dtype}")
    _, _, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, 3, (k_cache.dtype,), device, inner_contiguous=True)
        check(tuple(t.shape[1:]) == (num_kv_heads, head_dim),
              lambda: f"{name} shape {tuple(t.shape)} does not match cache heads x head_dim "
                      f"({num_kv_heads}, {head_dim})")
        check(t.stride(1) == head_dim, lambda: f"{name} heads must be one dense row, got strides {t.stride()}")
    check(key.shape[0] == value.shape[0], lambda: f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,), device)
    check(slot_mapping.shape[0] == key.shape[0],
          lambda: f"slot_mapping shape {tuple(slot_mapping.shape)} != num_tokens {key.shape[0]}")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(),
        key.stride(0), value.stride(0), k_cache.stride(0), v_cache.stride(0),
        BLOCK_SIZE=k_cache.shape[1], ROW=row, ROW_PAD=triton.next_power_of_2(row))
