"""Pure-torch reference implementations of the paged KV cache ops and of a decoder layer's small per-token ops
(RMSNorm, RoPE, SiLU-and-mul), on CPU and any device. They define the semantics the other backends keep.

The attention ops read K/V through block tables straight from the paged cache: no per-request contiguous KV is kept
between steps; a step gathers the blocks it attends over and drops the gather afterwards.

Sliding window (Mistral, Gemma 2/3's local layers): both attention ops take `sliding_window` W, an int per call (0 or
None: full causal attention). With W >= 1 a query at absolute position q sees key position k iff k <= q and
q - k < W: its own token and the W - 1 before it. That is HF transformers' mask (transformers 5.24,
`masking_utils.sliding_window_causal_mask_function`: `causal_mask_function`, kv_idx <= q_idx, and
`sliding_window_overlay`, kv_idx > q_idx - sliding_window, with W the config's `sliding_window` as is).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve_server.kernels.checks import window_size


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values into the paged cache, in place.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], float; rounded to the cache's dtype where it differs
            (`--kv-cache-dtype`: round to nearest even, torch's .to()).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        slot_mapping: [num_tokens] int64; slot = block_id * block_size + offset.
    """
    block_size = k_cache.shape[1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[B, max_blocks] block table -> [B, num_blocks * block_size, kv_heads, head_dim] gathered keys or values.

    index_select rather than advanced indexing: same result, but it copies whole blocks (2.1x faster on CPU for
    64 x 17 blocks of SmolLM2's layer, fp32: 4.2 vs 8.9 ms, bench/step_profile.py's decode at batch 64).
    """
    ids = block_table[:, :num_blocks]
    g = torch.index_select(cache, 0, ids.reshape(-1).long())  # [B * nb, bs, kvh, hd]
    return g.view(ids.shape[0], -1, cache.shape[2], cache.shape[3])


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = 0) -> torch.Tensor:
    """Attention for one query token per sequence over its paged context (GQA aware).

    Args:
        query: [num_seqs, num_q_heads, head_dim]; num_q_heads is a multiple of num_kv_heads.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float, read in the query's dtype (a bf16
            cache under an fp32 query is widened exactly: `--kv-cache-dtype`).
        block_tables: [num_seqs, max_blocks] int32.
        context_lens: [num_seqs] int32, tokens to attend over (including the query's own token, already written).
        scale: softmax scale, usually head_dim ** -0.5.
        sliding_window: W >= 1 attends over the last W tokens only, positions [max(0, context_len - W),
            context_len) (the query sits at context_len - 1; HF's sliding-window mask, see the module docstring);
            0 or None: the whole context.

    Returns:
        [num_seqs, num_q_heads, head_dim] in the query's dtype; softmax and both products accumulate in fp32.

    Raises:
        ValueError: a negative sliding_window.

    fp32 goes through torch's scaled_dot_product_attention (GQA by `enable_gqa`, padding masked): with `_gather`'s
    index_select, 1.9x faster than the earlier advanced-index gather + einsum + softmax on CPU (64 seqs x 272
    tokens, SmolLM2 layer shapes, 1 thread: 38.6 -> 19.9 ms per layer), equal to 3e-7. bf16/fp16 keep the explicit
    fp32 einsum: SDPA on bf16 inputs was 4x faster still (7.3 ms) but rounds the probabilities to bf16 before P.V,
    which moved the tiny model's bf16 greedy output off HF's (tests/engine/test_dtype.py); not adopted until understood.
    """
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    num_blocks = -(-max_len // block_size)
    k = _gather(k_cache, block_tables, num_blocks).to(query.dtype)  # [B, S, kvh, hd]
    v = _gather(v_cache, block_tables, num_blocks).to(query.dtype)
    pos = torch.arange(k.shape[1], device=query.device)
    lens = context_lens[:, None].to(pos.device)
    attend = pos[None, :] < lens  # [B, S], False = padding
    window = window_size(sliding_window)
    if window:
        attend &= pos[None, :] >= lens - window
    if query.dtype == torch.float32:
        out = F.scaled_dot_product_attention(query[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=attend[:, None, None, :], scale=scale, enable_gqa=True)
        return out[:, :, 0, :]
    group = num_q_heads // num_kv_heads
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bshd->bhgs", q, k.float()) * scale  # [B, kvh, g, S]
    scores.masked_fill_(~attend[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgs,bshd->bhgd", probs, v.float())
    return out.reshape(num_seqs, num_q_heads, head_dim).to(query.dtype)


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, max_query_len: int | None = None,
                      sliding_window: int | None = 0) -> torch.Tensor:
    """Causal attention for packed variable-length query chunks over cached prefix + new tokens.

    Sequence i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1] (its newest q_len tokens) and attends over the
    first context_lens[i] tokens of its paged KV (cached prefix, earlier chunks and this chunk, all already
    written to the cache). Query j of a chunk sits at absolute position context_len - q_len + j.

    Args:
        query: [num_tokens, num_q_heads, head_dim].
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], read in the query's dtype.
        cu_seqlens_q: [num_seqs + 1] int32 prefix sums of query lengths.
        context_lens: [num_seqs] int32.
        block_tables: [num_seqs, max_blocks] int32.
        scale: softmax scale.
        max_query_len: longest chunk (a launch-size hint for the Triton kernel; unused here).
        sliding_window: W >= 1: the row at absolute position p sees keys [max(0, p - W + 1), p] only (HF's
            sliding-window mask, see the module docstring); 0 or None: all keys up to p.

    Returns:
        [num_tokens, num_q_heads, head_dim] in the query's dtype.

    Raises:
        ValueError: a negative sliding_window.
    """
    window = window_size(sliding_window)
    out = torch.empty_like(query)
    block_size = k_cache.shape[1]
    starts = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for i, ctx in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        q_len = e - s
        nb = -(-ctx // block_size)
        k = _gather(k_cache, block_tables[i:i + 1], nb)[0, :ctx].to(query.dtype)  # [ctx, kvh, hd]
        v = _gather(v_cache, block_tables[i:i + 1], nb)[0, :ctx].to(query.dtype)
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
        k_pos = torch.arange(ctx, device=query.device)[None, :]
        mask = k_pos <= q_pos[:, None]  # [q_len, ctx]
        if window:
            mask &= k_pos > q_pos[:, None] - window
        o = F.scaled_dot_product_attention(
            query[s:e].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) as HF's LlamaRMSNorm computes it: in fp32, the normalized row rounded to the
    input dtype before the weight multiplies it. With `residual`, first residual += x in place (vLLM's
    fused_add_rms_norm) and the sum is normalized.

    Args:
        x: [T, hidden] float (a row-strided view is fine).
        weight: [hidden], x's dtype.
        eps: added to the mean square.
        residual: None, or [T, hidden] contiguous in x's dtype, updated in place.

    Returns:
        [T, hidden] in x's dtype, a new tensor.
    """
    if residual is not None:
        residual.add_(x)
        x = residual
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotary_embedding(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Su et al. 2021, HF Llama convention): qk * cos + rotate_half(qk) * sin.

    Args:
        qk: [T, heads, head_dim] (q and k heads side by side: RoPE is per head, so one call rotates both).
        cos, sin: [T, 1, head_dim] in qk's dtype, the step's rows of the tables.

    Returns:
        The rotated [T, heads, head_dim]: here a new tensor; other backends may rotate `qk` in place and return it,
        so callers use the result and not `qk`.
    """
    half = qk.shape[-1] // 2
    return qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin


def rotary_and_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        write_kv: Callable[..., None] = write_kv_cache) -> torch.Tensor:
    """RoPE on the q and k heads of the fused q/k/v projection's output, then its k and v heads into the paged cache
    (`rotary_embedding`, then `write_kv_cache`): a layer's steps between its q/k/v projection and its attention.

    Args:
        qkv: [T, num_heads + 2 * num_kv_heads, head_dim]: each token's q heads, k heads, then v heads (num_kv_heads
            is the cache's); rows may be strided.
        cos, sin: [T, 1, head_dim] as `rotary_embedding`'s.
        k_cache, v_cache, slot_mapping: as `write_kv_cache`'s.
        write_kv: the backend's KV write (the Triton backend passes its own).

    Returns:
        The rotated q heads, [T, num_heads, head_dim]: here a new tensor; the C backend rotates `qkv` in place and
        returns a view of it.
    """
    kv_heads = k_cache.shape[2]
    q_heads = qkv.shape[1] - 2 * kv_heads
    qk = rotary_embedding(qkv[:, :q_heads + kv_heads], cos, sin)
    write_kv(qk[:, q_heads:], qkv[:, q_heads + kv_heads:], k_cache, v_cache, slot_mapping)
    return qk[:, :q_heads]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU-gated MLP activation: [T, 2 * I] (gate then up) -> silu(gate) * up, [T, I] in the input's dtype."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up
