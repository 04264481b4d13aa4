"""The building blocks every architecture shares: RMSNorm, rotary embeddings (plain and Llama-3 scaled), GQA
attention over the paged KV cache and the SiLU-gated MLP.

They match HF transformers' Llama numerics (RMSNorm in fp32, rotate-half RoPE, SiLU-gated MLP); the ops themselves
are the worker's `AttentionOps`, whose torch reference is `kernels.reference`, so that greedy output equals
`generate()` on the same weights. q/k/v and gate/up projections are fused (one matmul instead of three / two); the
strict loader (`engine.models.decoder`) concatenates the checkpoint's tensors.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from pdserve_server.engine.attention import AttentionMetadata
from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.models.interface import Llama3RopeScaling
from pdserve_server.engine.parallel.tensor_parallel import SINGLE, TensorParallel
from pdserve_server.kernels.backends import AttentionOps


class RMSNorm(nn.Module):
    """RMSNorm's weight and eps (Zhang & Sennrich 2019); `AttentionOps.rms_norm` computes it, in fp32 as HF Llama
    does, with the residual add fused in (`DecoderModel.forward`)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Plain RoPE inverse frequencies theta^(-2i/head_dim), i = 0 .. head_dim/2 - 1: [head_dim // 2] float32, the
    same ops as transformers' `_compute_default_rope_parameters` (so the same bits)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama-3 scaling of RoPE inverse frequencies, op for op as transformers' `_compute_llama3_parameters` (so the
    same float32 bits): wavelengths 2*pi/f shorter than original_max_position_embeddings / high_freq_factor keep f,
    those longer than original_max_position_embeddings / low_freq_factor get f / factor, and those in between
    (1 - s) * f / factor + s * f with s = (original_max_position_embeddings / wavelength - low_freq_factor) /
    (high_freq_factor - low_freq_factor). Its attention factor is 1, so cos/sin are not rescaled.

    Args:
        inv_freq: [head_dim // 2] float32, `default_inv_freq`'s.
        scaling: the config's parameters.

    Returns:
        [head_dim // 2] float32, a new tensor.
    """
    factor, old_context_len = scaling.factor, scaling.original_max_position_embeddings
    low_freq_factor, high_freq_factor = scaling.low_freq_factor, scaling.high_freq_factor
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Su et al. 2021, HF Llama convention) with a precomputed cos/sin table; the rotation itself
    is part of `AttentionOps.rotary_and_write_kv`. `llama3` scales the frequencies (`llama3_inv_freq`); None is
    plain RoPE. `inv_freq` ([head_dim // 2] float32) is kept for inspection."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, llama3: Llama3RopeScaling | None = None):
        super().__init__()
        inv_freq = default_inv_freq(head_dim, theta)
        if llama3 is not None:
            inv_freq = llama3_inv_freq(inv_freq, llama3)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)  # [max_positions, head_dim]
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows of the step's positions ([T] int64), each [T, 1, hd] in `dtype`: gathered once per step
        and shared by every layer (gathering them per layer cost 4 ops x layers)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


class Attention(nn.Module):
    """GQA self-attention over the paged KV cache through the worker's `AttentionOps` (Triton, C or torch).

    Biases (HF semantics): `cfg.qkv_bias` on the fused q/k/v projection, before RoPE; `cfg.o_bias` on o_proj.
    `cfg.qk_norm` (Qwen3): each q and k head is RMS-normalised over head_dim (`q_norm` / `k_norm` weights) after
    the projection (and its bias) and before RoPE, as HF's Qwen3Attention does.

    `sliding_window` W >= 1 makes it a sliding-window layer: a query sees its own token and the W - 1 before it (HF's
    `sliding_window_causal_mask_function`, as the ops implement it); 0 is full causal attention.
    """

    def __init__(self, cfg: ModelConfig, ops: AttentionOps, tp: TensorParallel = SINGLE, sliding_window: int = 0):
        super().__init__()
        self.ops, self.tp = ops, tp
        self.sliding_window = sliding_window
        # Tensor parallelism: this rank's heads (q and their kv heads, padded or replicated as `head_split` says);
        # qkv_proj column-, o_proj row-parallel.
        heads = tp.heads(cfg.num_heads, cfg.num_kv_heads)
        self.num_heads, self.num_kv_heads = len(heads.q_heads), len(heads.kv_heads)
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.head_dim ** -0.5
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; rope: the step's (cos, sin) from `RotaryEmbedding.tables`; k_cache/v_cache: this layer's
        [num_blocks, block_size, kv_heads, hd]. Returns [T, hidden].

        Each op here is a kernel launch on a GPU (and a dispatch on a CPU), which at small batches costs more than
        its arithmetic, so q and k are rotated and K/V written in one op, and an all-decode or all-prefill step
        takes the attention op's output as is."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            self._qk_norm(qkv)
        q = self.ops.rotary_and_write_kv(qkv, *rope, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decodes
        decode = prefill = None
        if nd:
            decode = self.ops.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                                     meta.decode_context_lens, self.scale,
                                                     sliding_window=self.sliding_window)
        if meta.num_prefills:
            prefill = self.ops.prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_cu_seqlens,
                                                 meta.prefill_context_lens, meta.prefill_block_tables, self.scale,
                                                 max_query_len=meta.prefill_max_query_len,
                                                 sliding_window=self.sliding_window)
        out = decode if prefill is None else prefill if decode is None else torch.cat((decode, prefill))
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))

    def _qk_norm(self, qkv: torch.Tensor) -> None:
        """Qwen3's q_norm / k_norm (HF Qwen3RMSNorm: fp32, rounded to the input dtype, then the weight) on qkv's q
        and k heads, in place. qkv: [T, heads + 2 * kv_heads, hd] contiguous. Done here rather than in the kernels:
        `AttentionOps.rms_norm` takes rows of head_dim, so every backend's fused rotary + KV-write op is unchanged
        (at the cost of two copies per layer)."""
        h, kv = self.num_heads, self.num_kv_heads
        for norm, heads in ((self.q_norm, slice(0, h)), (self.k_norm, slice(h, h + kv))):
            rows = qkv[:, heads].reshape(-1, self.head_dim)  # [T * n, hd]: the op normalises rows
            qkv[:, heads] = self.ops.rms_norm(rows, norm.weight, norm.eps).view(qkv.shape[0], -1, self.head_dim)


class GatedMLP(nn.Module):
    """SiLU-gated MLP (Shazeer 2020, "GLU variants") with fused gate/up projection, no bias: down(silu(gate(x)) *
    up(x)). x: [T, hidden] -> [T, hidden]; `intermediate_size` is its hidden width (a rank holds 1/tp.size of it).

    Raises:
        ValueError: tp.size does not divide intermediate_size."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: AttentionOps, tp: TensorParallel = SINGLE):
        super().__init__()
        self.ops, self.tp = ops, tp
        local = tp.split(intermediate_size, "intermediate_size")  # gate_up column-, down row-parallel
        self.gate_up_proj = nn.Linear(hidden_size, 2 * local, bias=False)
        self.down_proj = nn.Linear(local, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))))
