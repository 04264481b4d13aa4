"""Llama-family decoder (Llama, Mistral, Phi-3, Qwen2, Qwen3) that reads and writes a paged KV cache.

Matches HF transformers' LlamaForCausalLM numerics (RMSNorm in fp32, rotate-half RoPE, SiLU-gated MLP; the ops
themselves are the worker's `AttentionOps`, whose torch reference is `kernels.reference`) so that
greedy output equals `generate()` on the same weights. The architectures differ only in the `ModelConfig` switches
from `engine.models.registry.ArchFlags`: projection biases (`qkv_bias` / `o_bias`; Qwen2 = Llama + q/k/v bias),
per-head q/k RMSNorm (`qk_norm`, Qwen3) and Llama-3 RoPE scaling (`rope_llama3`). q/k/v and gate/up projections are
fused at load time (one matmul instead of three / two).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.models.registry import Llama3RopeScaling
from kernels import AttentionOps


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
    """

    def __init__(self, cfg: ModelConfig, ops: AttentionOps):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
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
                                                     meta.decode_context_lens, self.scale)
        if meta.num_prefills:
            prefill = self.ops.prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_cu_seqlens,
                                                 meta.prefill_context_lens, meta.prefill_block_tables, self.scale,
                                                 max_query_len=meta.prefill_max_query_len)
        out = decode if prefill is None else prefill if decode is None else torch.cat((decode, prefill))
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def _qk_norm(self, qkv: torch.Tensor) -> None:
        """Qwen3's q_norm / k_norm (HF Qwen3RMSNorm: fp32, rounded to the input dtype, then the weight) on qkv's q
        and k heads, in place. qkv: [T, heads + 2 * kv_heads, hd] contiguous. Done here rather than in the kernels:
        `AttentionOps.rms_norm` takes rows of head_dim, so every backend's fused rotary + KV-write op is unchanged
        (at the cost of two copies per layer)."""
        h, kv = self.num_heads, self.num_kv_heads
        for norm, heads in ((self.q_norm, slice(0, h)), (self.k_norm, slice(h, h + kv))):
            rows = qkv[:, heads].reshape(-1, self.head_dim)  # [T * n, hd]: the op normalises rows
            qkv[:, heads] = self.ops.rms_norm(rows, norm.weight, norm.eps).view(qkv.shape[0], -1, self.head_dim)


class MLP(nn.Module):
    """SiLU-gated MLP with fused gate/up projection, no bias. x: [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg: ModelConfig, ops: AttentionOps):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; `DecoderModel.forward` applies it (the residual adds live there)."""

    def __init__(self, cfg: ModelConfig, ops: AttentionOps):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, ops)


class DecoderModel(nn.Module):
    """The decoder stack plus LM head, for every model_type in `engine.models.registry` (Llama, Mistral, Qwen2,
    Qwen3).

    forward() takes one packed step (tokens of many sequences concatenated) and the per-layer paged KV cache
    views; it writes the step's K/V into the cache and returns hidden states. Use `load_weights` to fill it from
    an HF state dict. `ops` are the paged attention ops (`kernels.select_ops`).
    """

    def __init__(self, cfg: ModelConfig, ops: AttentionOps):
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_llama3)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
                on_layer_written: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64. kv_layers[l] = (k_cache, v_cache) of layer l. Returns [T, hidden].
        on_layer_written(l) is called as soon as layer l's attention has written the step's K/V (before its MLP),
        for layer-wise KV streaming."""
        # h is the residual stream; each norm adds the previous sublayer's output into it in place first (vLLM's
        # fused_add_rms_norm), the same sums as h = h + sublayer(norm(h)) in fewer ops.
        h = self.embed_tokens(input_ids)
        rope = self.rope.tables(positions, h.dtype)
        rms_norm = self.ops.rms_norm
        norms = [layer.input_layernorm for layer in self.layers] + [self.norm]  # norms[i + 1] follows layer i
        x = rms_norm(h, norms[0].weight, norms[0].eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_layers)):
            attn = layer.self_attn(x, rope, meta, k_cache, v_cache)
            if on_layer_written is not None:
                on_layer_written(i)
            post = layer.post_attention_layernorm
            x = layer.mlp(rms_norm(attn, post.weight, post.eps, h))
            x = rms_norm(x, norms[i + 1].weight, norms[i + 1].eps, h)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in the model's dtype. Not widened to fp32 here: the greedy argmax
        reads bf16 as it is (widening is exact, so the argmax is the same), and only the rows that need fp32
        (penalties, temperature, logprobs) are widened, by the sampler. At 64 rows x 49152 the widening of every row
        was 1.2 ms of a 41 ms bf16 decode step (Intel Xeon VM, 2 threads)."""
        return self.lm_head(hidden)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an HF state dict (q/k/v and gate/up separate; names with or without the `model.` prefix) into the
        fused modules, strictly: every parameter must be supplied and every tensor consumed, so a checkpoint whose
        architecture differs from `cfg` (e.g. Qwen2 q/k/v biases on a bias-free config, Qwen3 q_norm / k_norm
        weights on a config without `qk_norm`) fails instead of loading into wrong numerics. Tolerated leftovers:
        `*.rotary_emb.inv_freq` buffers (RoPE is recomputed) and `lm_head.weight` when `cfg.tie_word_embeddings` (the
        head is the embedding). Nothing is copied unless the whole state dict checks out.

        Raises:
            KeyError: a required tensor is missing (the message names it).
            ValueError: tensors were not consumed (the message lists them, sorted), or a tensor has the wrong shape.
        """
        consumed: set[str] = set()

        def take(name: str) -> torch.Tensor:
            for key in (name, "model." + name):
                if key in state:
                    consumed.add(key)
                    return state[key]
            raise KeyError(f"missing tensor {name!r} (nor 'model.{name}') in the state dict")

        def fused(names: list[str], whole: str) -> torch.Tensor:
            """The checkpoint's own fused tensor `whole` when it has one (Phi-3 stores q/k/v and gate/up fused, in
            our order), else `names` concatenated along dim 0."""
            if whole in state or "model." + whole in state:
                return take(whole)
            return torch.cat([take(n) for n in names], dim=0)

        cfg = self.cfg
        params: dict[str, torch.Tensor] = {
            "embed_tokens.weight": take("embed_tokens.weight"),
            "norm.weight": take("norm.weight"),
        }
        if cfg.tie_word_embeddings:
            params["lm_head.weight"] = params["embed_tokens.weight"]
            if "lm_head.weight" in state:  # saved copy of the embedding
                consumed.add("lm_head.weight")
        else:
            params["lm_head.weight"] = take("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                params[f"{attn}qkv_proj.{kind}"] = fused([f"{attn}{n}_proj.{kind}" for n in "qkv"],
                                                         f"{attn}qkv_proj.{kind}")
            params[attn + "o_proj.weight"] = take(attn + "o_proj.weight")
            if cfg.qk_norm:
                params[attn + "q_norm.weight"] = take(attn + "q_norm.weight")
                params[attn + "k_norm.weight"] = take(attn + "k_norm.weight")
            if cfg.o_bias:
                params[attn + "o_proj.bias"] = take(attn + "o_proj.bias")
            params[mlp + "gate_up_proj.weight"] = fused([mlp + "gate_proj.weight", mlp + "up_proj.weight"],
                                                        mlp + "gate_up_proj.weight")
            params[mlp + "down_proj.weight"] = take(mlp + "down_proj.weight")
            params[p + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
            params[p + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")

        unused = sorted(k for k in state if k not in consumed and not k.endswith("rotary_emb.inv_freq"))
        if unused:
            more = f" and {len(unused) - 10} more" if len(unused) > 10 else ""
            raise ValueError(f"{len(unused)} unused tensor(s) in the state dict (architecture mismatch with "
                             f"{cfg.name!r}?): {', '.join(unused[:10])}{more}")
        own = dict(self.named_parameters())
        if own.keys() != params.keys():  # the loader and the module tree disagree: a bug here, not in the checkpoint
            raise RuntimeError(f"loader/module mismatch: {sorted(own.keys() ^ params.keys())}")
        for name, tensor in params.items():
            if own[name].shape != tensor.shape:
                raise ValueError(f"{name}: expected shape {tuple(own[name].shape)}, got {tuple(tensor.shape)}")
        with torch.no_grad():
            for name, tensor in params.items():
                own[name].copy_(tensor.to(own[name].dtype))
