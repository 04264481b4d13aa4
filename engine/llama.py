"""Llama-family decoder that reads and writes a paged KV cache.

Matches HF transformers' LlamaForCausalLM numerics (RMSNorm in fp32, rotate-half RoPE, SiLU-gated MLP) so that
greedy output equals `generate()` on the same weights. q/k/v and gate/up projections are fused at load time
(one matmul instead of three / two).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from kernels import AttentionOps


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in fp32 as HF Llama does. x: [T, hidden] -> [T, hidden]."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Su et al. 2021, HF Llama convention) with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)  # [max_positions, head_dim]
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64; q: [T, q_heads, hd]; k: [T, kv_heads, hd]. Returns rotated (q, k)."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """GQA self-attention over the paged KV cache through the worker's `AttentionOps` (Triton or torch)."""

    def __init__(self, cfg: ModelConfig, ops: AttentionOps):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; k_cache/v_cache: this layer's [num_blocks, block_size, kv_heads, hd]. Returns [T, hidden]."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        self.ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self.ops.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                                       meta.decode_context_lens, self.scale)
        if meta.num_prefills:
            out[nd:] = self.ops.prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_cu_seqlens,
                                                  meta.prefill_context_lens, meta.prefill_block_tables, self.scale,
                                                  max_query_len=meta.prefill_max_query_len)
        return self.o_proj(out.view(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: AttentionOps):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class LlamaModel(nn.Module):
    """The decoder stack plus LM head.

    forward() takes one packed step (tokens of many sequences concatenated) and the per-layer paged KV cache
    views; it writes the step's K/V into the cache and returns hidden states. Use `load_weights` to fill it from
    an HF state dict. `ops` are the paged attention ops (`kernels.select_ops`).
    """

    def __init__(self, cfg: ModelConfig, ops: AttentionOps):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: [T] int64. kv_layers[l] = (k_cache, v_cache) of layer l. Returns [T, hidden]."""
        h = self.embed_tokens(input_ids)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_layers):
            h = h + layer.self_attn(layer.input_layernorm(h), positions, self.rope, meta, k_cache, v_cache)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in fp32."""
        return self.lm_head(hidden).float()

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an HF Llama state dict (q/k/v and gate/up separate) into the fused modules.

        Raises:
            KeyError: a required tensor is missing.
            ValueError: a tensor has the wrong shape.
        """
        def take(name: str) -> torch.Tensor:
            return state[name] if name in state else state["model." + name]

        params: dict[str, torch.Tensor] = {
            "embed_tokens.weight": take("embed_tokens.weight"),
            "norm.weight": take("norm.weight"),
        }
        head = state.get("lm_head.weight")
        params["lm_head.weight"] = head if head is not None and not self.cfg.tie_word_embeddings \
            else params["embed_tokens.weight"]
        for i in range(self.cfg.num_layers):
            p = f"layers.{i}."
            params[p + "self_attn.qkv_proj.weight"] = torch.cat(
                [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            params[p + "self_attn.o_proj.weight"] = take(p + "self_attn.o_proj.weight")
            params[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0)
            params[p + "mlp.down_proj.weight"] = take(p + "mlp.down_proj.weight")
            params[p + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
            params[p + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
        own = dict(self.named_parameters())
        for name, tensor in params.items():
            if own[name].shape != tensor.shape:
                raise ValueError(f"{name}: expected shape {tuple(own[name].shape)}, got {tuple(tensor.shape)}")
            with torch.no_grad():
                own[name].copy_(tensor.to(own[name].dtype))
