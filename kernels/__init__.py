"""Attention and KV-cache ops over the paged KV cache.

Each op has a pure-torch reference (`kernels.reference`) that defines its semantics; Triton kernels with the same
signatures belong beside them. The model runner calls the ops through this module.

Layout shared by all ops (see `engine.kv_cache`):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], one layer's view (may be strided in dim 0)
    block_tables:     [num_seqs, max_blocks_per_seq] int32, physical block ids, padded with 0
    slot_mapping:     [num_tokens] int64, block_id * block_size + offset for each new token
"""
from kernels.reference import paged_decode_attention, prefill_attention, write_kv_cache

__all__ = ["paged_decode_attention", "prefill_attention", "write_kv_cache"]
